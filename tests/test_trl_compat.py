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


@pytest.mark.slow
def test_a_trl_style_reward_file_trains_through_the_cli_with_the_values_of_a_direct_call(tmp_path):
    """bools, numpy scalars, 0-d tensors, None, an async judge with loop-bound state kept over several steps
    and open-r1's math_verify accuracy reward verbatim (signal-based timeouts, a `solution` column): no
    component error in `docuchat-rl train`, and every traced raw value equals the function called directly
    on that step's completions."""
    import asyncio
    import itertools
    import json

    from docuchat_rl.cli import main
    from docuchat_rl.outputs import read_jsonl
    from rewards.base import _event_loop

    from . import user_rewards as u
    from .conftest import TASK

    rows = [json.loads(x) for x in (TASK / "train.jsonl").read_text().splitlines()[:8]]
    data = tmp_path / "solution.jsonl"
    data.write_text("".join(json.dumps({"question": r["question"], "solution": r["answer"].split("#### ")[-1]})
                            + "\n" for r in rows))
    names = ["long_enough", "numpy_scalars", "zero_d_tensors", "none_on_even", "async_judge", "openr1_accuracy"]
    specs = ", ".join(f"{{name: 'tests.user_rewards:{n}'}}" for n in names)
    out = tmp_path / "run"
    sets = [f"run.output_dir={out}", "run.steps=3", f"data.train={data}", "data.test=null",
            "data.answer_column=solution", "rollout.prompts_per_step=2", "rollout.num_generations=3",
            "rollout.max_new_tokens=16", "logging.progress=false", f"rewards=[{specs}]",
            "rewards.accuracy_component=null"]
    assert main(["train", *[a for s in sets for a in ("--set", s)]]) == 0
    traces = read_jsonl(out / "traces.jsonl")
    assert len(traces) == 3 * 6
    for step, group in itertools.groupby(traces, key=lambda r: r["step"]):
        recs = sorted(group, key=lambda r: (r["group"], r["sample"]))
        completions = [r["completion"] for r in recs]
        solution = [rows[r["prompt_id"]]["answer"].split("#### ")[-1] for r in recs]
        direct = {n: getattr(u, n)(prompts=[r["prompt"] for r in recs], completions=completions, solution=solution)
                  for n in names if n != "async_judge"}
        direct["async_judge"] = asyncio.run_coroutine_threadsafe(  # on the run's own loop, where its queue lives
            u.async_judge([r["prompt"] for r in recs], completions), _event_loop()).result()
        for n in names:
            key = f"tests.user_rewards:{n}"
            got = [r["rewards"][key] for r in recs]
            assert all(c["error"] is None for c in got), (step, n, got)
            want = [None if v is None else float(v) for v in direct[n]]
            assert [c["raw"] for c in got] == pytest.approx(want), (step, n)
