"""scripts/grpo_minimal.py, GRPO on one screen, computes the trainer's first step: the same loss and the same
LoRA gradients on the embedded default, whatever the trainer's speed switches."""

import importlib.util

import pytest
import torch

from docuchat_rl.config import load_config
from docuchat_rl.trainer import Trainer

from .conftest import ROOT


def _script():
    spec = importlib.util.spec_from_file_location("grpo_minimal", ROOT / "scripts" / "grpo_minimal.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_the_one_screen_step_has_the_trainers_loss_and_gradients(tmp_path, monkeypatch):
    sets = ["rollout.prompts_per_step=4", "rollout.max_new_tokens=32", "run.threads=2", "logging.progress=false",
            "eval.before_and_after=false"]
    cfg = load_config(ROOT / "config" / "default.yaml", sets)
    mine = _script().grpo_step(cfg)
    # the trainer's first step with no clipping (max_grad_norm null), its gradients read as the optimizer steps
    trainer = Trainer(load_config(ROOT / "config" / "default.yaml",
                                  [*sets, f"run.output_dir={tmp_path}", "optim.max_grad_norm=null", "run.steps=1"]))
    seen = {}
    step = trainer.learner.optimizer.step

    def record(*a, **k):
        seen.update({n: p.grad.detach().clone() for n, p in trainer.learner.model.named_parameters() if p.requires_grad})
        return step(*a, **k)

    monkeypatch.setattr(trainer.learner.optimizer, "step", record)
    (m,) = trainer.train()
    trainer.close()
    # (the loss at ratio 1 is minus the mean advantage, ~0 after group normalisation: the gradients carry it)
    assert m["loss"] == pytest.approx(mine["loss"], rel=1e-5, abs=1e-7) and m["reward/std"] > 0
    assert seen.keys() == mine["grads"].keys() and len(seen) > 0
    for name, g in mine["grads"].items():
        assert torch.allclose(seen[name], g, rtol=1e-4, atol=1e-7), name
    total = torch.sqrt(sum((g.double() ** 2).sum() for g in mine["grads"].values()))
    assert total > 0 and m["grad_norm"] == pytest.approx(float(total), rel=1e-4)
