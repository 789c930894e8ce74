"""Algorithms against hand-computed cases: the registry, GRPO's group baseline, the policy loss's KL and
approx-KL estimators, A2C's KL term, and the sampler correction (importance weights and their metrics)."""

import math

import pytest
import torch

from docuchat_rl.config import load_config
from docuchat_rl.learning.algorithms import GRPO, algorithm_names, get_algorithm_class
from docuchat_rl.learning.batch import build_batch
from docuchat_rl.learning.forward import PolicyOutput
from docuchat_rl.learning.losses import MISMATCH_THRESHOLD, Normalisers, behaviour_correction, sampler_weights


def _batch(rewards, group, sampler_logps, valid=None):
    """Rows of one-token prompts and completions of the given lengths (len of each sampler_logps row)."""
    comps = [[7] * len(s) for s in sampler_logps]
    return build_batch([[5]] * len(comps), comps, rewards, group, 0, sampler_logps=sampler_logps,
                       reward_valid=valid)


def _out(logps):
    return PolicyOutput(torch.tensor(logps, requires_grad=True), None, None)


def _norm(batch):
    return Normalisers(rows=batch.rows, tokens=float(batch.completion_mask.sum()), max_new_tokens=4)


def test_registry_names_and_config_types():
    assert algorithm_names() == ["a2c", "grpo", "ppo"]
    with pytest.raises(KeyError, match="unknown algorithm 'reinforce'; valid: a2c, grpo, ppo"):
        get_algorithm_class("reinforce")
    for name in algorithm_names():
        assert get_algorithm_class(name).config_type.model_fields["name"].default == name
    with pytest.raises(TypeError, match="grpo needs a GRPOConfig, got PPOConfig"):
        GRPO(load_config(None, ["algorithm.name=ppo", "rollout.num_generations=1"]).algorithm)


def test_one_registry_holds_each_name_its_config_and_its_class():
    from typing import Literal

    from docuchat_rl.algorithm_configs import ALGORITHMS, GRPOConfig
    from docuchat_rl.learning.algorithms import Algorithm, register_algorithm

    assert {n: c.implementation for n, c in ALGORITHMS.items()} == {n: get_algorithm_class(n) for n in ALGORITHMS}
    with pytest.raises(ValueError, match="already has a class"):  # a second class for grpo
        register_algorithm(GRPOConfig)(type("Other", (Algorithm,), {}))

    class Unregistered(GRPOConfig):
        name: Literal["reinforce"] = "reinforce"

    with pytest.raises(ValueError, match="not the registered config of algorithm 'reinforce'"):
        register_algorithm(Unregistered)(type("Reinforce", (Algorithm,), {}))


def test_a_config_derived_from_another_runs_only_with_a_class_of_its_own():
    """RLOOConfig(GRPOConfig) registered without its class: never GRPO's (the implementation is each config's own),
    so get_algorithm_class says what is missing and the import-time check refuses it; with its decorated class it
    runs that class. (The registry is left as it was.)"""
    from typing import Literal

    from docuchat_rl.algorithm_configs import ALGORITHMS, GRPOConfig, register_config
    from docuchat_rl.learning.algorithms import GRPO, check_implemented, register_algorithm

    @register_config
    class RLOOConfig(GRPOConfig):
        name: Literal["rloo_sketch"] = "rloo_sketch"

    try:
        assert RLOOConfig.implementation is None and GRPOConfig.implementation is GRPO
        with pytest.raises(KeyError, match="algorithm 'rloo_sketch' has a config \\(RLOOConfig\\) but no class"):
            get_algorithm_class("rloo_sketch")
        with pytest.raises(ImportError, match="without a class that runs it: rloo_sketch \\(RLOOConfig\\)"):
            check_implemented()

        @register_algorithm(RLOOConfig)
        class RLOO(GRPO):
            pass

        assert get_algorithm_class("rloo_sketch") is RLOO and get_algorithm_class("grpo") is GRPO
        check_implemented()
    finally:
        del ALGORITHMS["rloo_sketch"]


def test_grpo_advantages_use_the_batch_groups_and_skip_rows_without_reward():
    cfg = load_config(None, ["rollout.num_generations=3", "rollout.prompts_per_step=2"])
    batch = _batch([1.0, 0.0, 0.0, 0.0, 1.0, 1.0], [0, 0, 0, 1, 1, 1], [[0.0, 0.0]] * 6,
                   valid=[True, True, True, False, True, True])
    metrics = GRPO(cfg.algorithm).advantages(batch)
    adv = batch.advantages[:, 0]
    assert adv[:3].tolist() == pytest.approx([2 / 3 / (math.sqrt(1 / 3) + 1e-4), -1 / 3 / (math.sqrt(1 / 3) + 1e-4),
                                              -1 / 3 / (math.sqrt(1 / 3) + 1e-4)], rel=1e-5)
    assert adv[3:].tolist() == [0.0, 0.0, 0.0]  # the missing row is out; the other two agree: no signal
    assert metrics["zero_std_frac"] == 0.5
    assert torch.equal(batch.advantages[:, 1], batch.advantages[:, 0])  # one value for every token


def test_approx_kl_old_is_the_kl_estimator_for_samples_of_the_old_policy():
    """approx_kl_old = mean of (rho - 1) - log rho over tokens, rho = pi / pi_old (not 1/rho + log rho - 1)."""
    cfg = load_config(None, ["rollout.num_generations=2", "rollout.prompts_per_step=1"])
    batch = _batch([1.0, 0.0], [0, 0], [[-1.0, -2.0], [-0.5, -0.7]])
    old = torch.tensor([[-1.0, -2.0], [-0.5, -0.7]])
    new = [[0.0, -1.5], [-0.5, 0.8]]  # log rho = 1, 0.5, 0, 1.5
    batch.old_logps, batch.advantages = old, torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    _, metrics = GRPO(cfg.algorithm).policy_loss(_out(new), batch, _norm(batch))
    log_rho = torch.tensor(new) - old
    expected = float((log_rho.exp() - 1 - log_rho).mean())
    assert metrics["approx_kl_old"] == pytest.approx(expected, rel=1e-5)
    wrong = float(((-log_rho).exp() - 1 + log_rho).mean())  # the chi-square-like estimate used before
    assert abs(expected - wrong) > 0.1


def test_a2c_applies_the_k3_kl_term_when_beta_is_set():
    """beta > 0 without kl_in_reward: the A2C loss gains beta * k3(pi || ref), aggregated like the policy."""
    rows = ["rollout.num_generations=1", "rollout.prompts_per_step=2"]
    batch = _batch([1.0, 0.0], [0, 1], [[-1.0, -2.0], [-0.5, -0.7]])
    batch.advantages = torch.tensor([[0.5, 0.5], [-0.5, -0.5]])
    batch.values, batch.returns = torch.zeros(2, 2), torch.zeros(2, 2)
    batch.ref_logps = torch.tensor([[-1.2, -1.0], [-0.5, -1.5]])
    logps = [[-1.0, -2.0], [-0.5, -0.7]]
    hidden = torch.zeros(2, 2, 8)
    losses = {}
    for beta in (0.0, 0.1):
        algo = get_algorithm_class("a2c")(load_config(None, ["algorithm.name=a2c", f"algorithm.beta={beta}", *rows]).algorithm, 8)
        out = PolicyOutput(torch.tensor(logps, requires_grad=True), None, hidden)
        losses[beta], metrics = algo.loss(out, batch, _norm(batch))
    d = batch.ref_logps - torch.tensor(logps)
    k3 = d.exp() - d - 1  # [2, 2]
    expected_kl = float((k3.mean(-1)).mean())  # grpo aggregation: mean over rows of token means
    assert float((losses[0.1] - losses[0.0]).detach()) == pytest.approx(0.1 * expected_kl, rel=1e-5)
    assert metrics["kl"] == pytest.approx(float(k3.mean()), rel=1e-5)


@pytest.mark.parametrize("mode", ["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_sampler_weights_against_a_hand_computation(mode):
    train = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.1, -3.0]])
    sampler = torch.tensor([[-1.0, -3.0, 0.0], [-0.4, -0.1, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    w, capped = sampler_weights(train, sampler, mask, mode, 0.5, 2.0)
    if mode.startswith("token"):
        ratio = torch.tensor([[1.0, math.e, 1.0], [math.exp(-0.1), 1.0, 1.0]])
    else:  # the sequence ratio exp(sum of token log-ratios) on every token of the row
        ratio = torch.tensor([[math.e] * 3, [math.exp(-0.1)] * 3])
    out = (ratio < 0.5) | (ratio > 2.0)
    expected = ratio.clamp(0.5, 2.0) if mode.endswith("truncate") else ratio.masked_fill(out, 0.0)
    assert torch.allclose(w, expected * mask, atol=1e-6)
    assert torch.equal(capped, out & (mask > 0))


def test_the_behaviour_correction_logs_the_mismatch_and_the_loss_weights_tokens_with_it():
    base = ["rollout.num_generations=2", "rollout.prompts_per_step=1"]
    batch = _batch([1.0, 0.0], [0, 0], [[-1.0, -2.0], [-0.5, -0.2]])
    batch.advantages = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    trainer = torch.tensor([[-1.0, -2.5], [-0.5, -0.2]])  # token (0, 1): the sampler thought it 0.5 nats likelier
    none, plain = behaviour_correction(trainer, batch.sampler_logps, batch.completion_mask, None, 0.0, 2.0)
    assert none is None and plain["sampler/mismatch_max"] == pytest.approx(0.5)
    assert plain["sampler/mismatch_mean"] == pytest.approx(0.5 / 4)
    assert plain["sampler/mismatch_share"] == pytest.approx(1 / 4) and 0.5 > MISMATCH_THRESHOLD
    assert "sampler/capped_share" not in plain and "async/kl_sampler_learner" not in plain
    batch.behaviour_weights, corrected = behaviour_correction(trainer, batch.sampler_logps, batch.completion_mask,
                                                              "token_mask", 0.7, 2.0)
    assert corrected["sampler/capped_share"] == pytest.approx(1 / 4)  # exp(-0.5) = 0.61 < 0.7: masked
    loss, _ = GRPO(load_config(None, base).algorithm).policy_loss(_out(trainer.tolist()), batch, _norm(batch))
    # at mu = 1 the ratio is 1, so the loss is -mean over rows of the mean of A * w over tokens
    assert float(loss.detach()) == pytest.approx(-((1.0 + 0.0) / 2 + (-1.0 - 1.0) / 2) / 2, rel=1e-6)


@pytest.mark.parametrize("algorithm", ["grpo", "ppo", "a2c"])
def test_a_lagged_token_is_weighted_once_by_the_behaviour_ratio(algorithm):
    """A token the learner finds 1.105 times likelier than the sampler did: its gradient coefficient is 1.105
    x the uncorrected one under a fixed lag with rollout.correction, not 1.221 (the weight used to come on
    top of a ratio already taken against the sampler); A2C, which has no ratio, is corrected the same way."""
    sets = [f"algorithm.name={algorithm}", "rollout.num_generations=2", "rollout.prompts_per_step=1",
            "rollout.async_lag=1", "rollout.correction=token_truncate"]
    cfg = load_config(None, sets)
    algo = get_algorithm_class(algorithm)(cfg.algorithm, 8)
    learner_now = [[-1.0, -2.0], [-0.5, -0.2]]
    batch = _batch([1.0, 0.0], [0, 0], [[-1.0 - math.log(1.105), -2.0], [-0.5, -0.2]])  # the sampler's
    batch.advantages = torch.tensor([[1.0, 1.0], [-1.0, -1.0]])
    if algo.critic is not None:
        batch.values = batch.returns = torch.zeros(2, 2)
    grads = {}
    for corrected in (False, True):
        out = PolicyOutput(torch.tensor(learner_now, requires_grad=True), None, torch.zeros(2, 2, 8))
        weights, m = behaviour_correction(out.logps.detach(), batch.sampler_logps, batch.completion_mask,
                                          "token_truncate", 0.0, 2.0, current_logps=out.logps)
        batch.behaviour_weights = weights if corrected else None
        loss, _ = (algo.policy_loss if algorithm != "a2c" else algo.loss)(out, batch, _norm(batch))
        loss.backward()
        grads[corrected] = out.logps.grad.clone()
    assert float(grads[True][0, 0] / grads[False][0, 0]) == pytest.approx(1.105, rel=1e-5)
    assert float(grads[True][1, 1] / grads[False][1, 1]) == pytest.approx(1.0, rel=1e-6)
    assert m["async/kl_sampler_learner"] > 0


def test_actor_critic_value_statistics_against_a_hand_computation():
    """value/mean, return/mean and value/error are masked means over the batch's completion tokens."""
    cfg = load_config(None, ["algorithm.name=ppo", "rollout.num_generations=1", "rollout.prompts_per_step=2",
                             "algorithm.gamma=1.0", "algorithm.lam=1.0"])
    algo = get_algorithm_class("ppo")(cfg.algorithm, 8)
    batch = _batch([0.5, -0.25], [0, 1], [[-1.0, -1.0, -1.0], [-1.0]])
    batch.values = torch.tensor([[0.1, -0.2, 0.3], [0.05, 0.0, 0.0]]) * batch.completion_mask
    m = algo.advantages(batch)
    mask = batch.completion_mask.bool()
    # gamma = lam = 1: every token's return is its row's reward
    returns = torch.tensor([[0.5, 0.5, 0.5], [-0.25, 0.0, 0.0]])
    assert torch.allclose(batch.returns[mask], returns[mask])
    assert m["value/mean"] == pytest.approx(float(batch.values[mask].mean()), abs=1e-6)  # 0.0625, below 1
    assert m["return/mean"] == pytest.approx(float(returns[mask].mean()), abs=1e-6)
    assert m["value/error"] == pytest.approx(float(((batch.values - returns)[mask] ** 2).mean()), abs=1e-6)
