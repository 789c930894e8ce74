"""Our rewards plug into trl.GRPOTrainer as reward functions, through TRL's own reward machinery."""

import pytest
import torch

from rewards import build_reward

from .conftest import MODEL


@pytest.mark.slow
def test_rewards_run_inside_trl_grpo_trainer(tmp_path):
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    data = Dataset.from_list([{"prompt": f"What is {i} + 1?", "answer": f"#### {i + 1}"} for i in range(4)])
    rewards = [build_reward("correctness"), build_reward("format"), build_reward("length", {
        "shape": "overlong", "max_len": 8, "cache": 4})]  # length reads TRL's completion_ids column
    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=4,
                      num_generations=4, max_completion_length=8, max_steps=1, report_to="none",
                      logging_steps=1, save_strategy="no", activation_checkpointing=False)
    trainer = GRPOTrainer(model=str(MODEL), reward_funcs=rewards, args=args, train_dataset=data)
    trainer.train()
    logged = {k for rec in trainer.state.log_history for k in rec}
    for name in ("correctness", "format", "length"):
        assert any(name in k for k in logged), (name, logged)
    assert torch.isfinite(torch.tensor([v for rec in trainer.state.log_history for k, v in rec.items()
                                        if "rewards/" in k and isinstance(v, float)])).all()
