"""The learner's pieces that need no model: each metric's reduction over micro-batches, and which
no-grad passes each algorithm asks the learner for."""

import pytest

from docuchat_rl.config import load_config
from docuchat_rl.distributed import Dist
from docuchat_rl.learning.algorithms import get_algorithm_class
from docuchat_rl.learning.learner import MetricAccumulator, rollout_passes


def test_metrics_are_token_weighted_means_unless_the_algorithm_names_a_max():
    acc = MetricAccumulator({"sampler/mismatch_max": "max"})
    acc.add({"clip_low": 0.5, "sampler/mismatch_max": 0.25}, weight=3.0)
    acc.add({"clip_low": 0.0, "sampler/mismatch_max": 0.75}, weight=1.0)
    out = acc.result(Dist())
    assert out["clip_low"] == pytest.approx((0.5 * 3 + 0.0 * 1) / 4)
    assert out["sampler/mismatch_max"] == 0.75  # a maximum, not a mean (which would be 0.375)


def test_a_metric_named_max_is_averaged_unless_declared():
    acc = MetricAccumulator({})
    acc.add({"value_max": 1.0}, 1.0)
    acc.add({"value_max": 3.0}, 1.0)
    assert acc.result(Dist())["value_max"] == 2.0  # the reduction comes from the declaration, not the name


@pytest.mark.parametrize("sets, old, ref, values", [
    ([], False, False, False),  # GRPO, mu 1, one minibatch: the ratio is 1, no pass at all
    (["algorithm.num_iterations=2"], True, False, False),
    (["optim.minibatch_size=32"], True, False, False),  # the policy moves before the second minibatch
    (["algorithm.beta=0.04"], False, True, False),
    (["algorithm.name=ppo"], False, False, True),
    (["algorithm.name=ppo", "algorithm.beta=0.1", "algorithm.kl_in_reward=true"], True, True, True),
    (["algorithm.name=a2c", "algorithm.beta=0.1"], False, True, True),
])
def test_each_algorithm_asks_for_the_passes_it_reads(sets, old, ref, values):
    cfg = load_config(None, sets)
    updates = cfg.algorithm.num_iterations * (cfg.rollout.batch_rows // cfg.minibatch_rows)
    needs = rollout_passes(get_algorithm_class(cfg.algorithm.name)(cfg.algorithm, 8), updates)
    assert (needs.old_logps, needs.ref_logps, needs.values) == (old, ref, values)
    lagged_cfg = load_config(None, [*sets, "rollout.async_lag=1"])
    lagged = rollout_passes(get_algorithm_class(cfg.algorithm.name)(lagged_cfg.algorithm, 8), updates)
    assert lagged == needs  # (a fixed lag adds no pass: the proximal policy is the learner's, as without one)


def test_a_step_with_activation_checkpointing_equals_one_without(tmp_path):
    """The whole update (shared-prompt forward off under checkpointing, which drops the KV cache it needs):
    the same loss, gradient norm and metrics."""
    from docuchat_rl.trainer import Trainer

    from .conftest import ROOT

    runs = {}
    for on in (False, True):
        cfg = load_config(ROOT / "config/default.yaml", [
            f"run.output_dir={tmp_path / str(on)}", "run.steps=1", "rollout.prompts_per_step=2",
            "rollout.num_generations=4", "rollout.max_new_tokens=16", "logging.progress=false",
            "eval.before_and_after=false", f"model.gradient_checkpointing={on}"])
        t = Trainer(cfg)
        (runs[on],) = t.train()
        t.close()
    for key in ("loss", "grad_norm", "entropy", "clip_low", "sampler/mismatch_mean"):
        assert runs[True][key] == pytest.approx(runs[False][key], rel=1e-4, abs=1e-6), key
