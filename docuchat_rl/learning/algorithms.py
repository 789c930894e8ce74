"""Algorithms: each is an advantage estimator + a loss (+ an optional critic) behind one interface.

The trainer calls every algorithm the same way and never looks at its name:

    algo = get_algorithm_class(cfg.algorithm.name)(cfg.algorithm, hidden_size, reduce, reward_weights)
    algo.needs()                                -> RolloutNeeds: which no-grad passes the learner runs
                                                   before the update (old / reference log-probs, values)
    algo.values(hidden)                         -> the critic's values [R, T] from hidden states [R, T, H]
    algo.advantages(batch)                      -> metrics; fills batch.advantages [R, T]
    algo.loss(policy_output, micro_batch, norm) -> (loss, metrics); `metric_reductions` says how each
                                                   metric combines over micro-batches (default: token mean)
    algo.critic                                 -> None, or a module trained and saved with the adapter
    algo.trace_fields(batch)                    -> per-row values for the traces

An algorithm takes its own section of the config (`config_type`) and what it is handed: the policy's hidden
size (for a critic), `reduce`, which sums a tensor over the processes of a data-parallel run (the identity on one
process), and the reward components' weights in order (`rewards.components`, for normalize_then_sum).

Every policy loss takes the ratio against the proximal policy (`batch.old_logps`: the learner at the
update's start; the policy itself, detached, for one update per rollout) and multiplies each token by
`batch.behaviour_weights` when the learner set them: the truncated or masked ratio pi_prox / pi_sampler
(`rollout.correction`, as TRL's vllm_importance_sampling_* and verl's rollout correction; under
`rollout.async_lag`, decoupled PPO's behaviour weight). An algorithm reads no rollout setting.

Deliberately left out: algorithms that need a separate reward model or a second policy copy in memory.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, ClassVar

import torch

from ..distributed import no_reduce
from .advantages import decoupled_advantages, gae, group_advantages, nstep_returns, whiten
from ..algorithm_configs import ALGORITHMS, A2CConfig, GRPOConfig, PPOConfig, unimplemented
from .batch import Batch
from .forward import PolicyOutput
from .losses import (
    Normalisers,
    aggregate,
    cispo_surrogate,
    clipped_surrogate,
    explained_variance,
    high_entropy_mask,
    k3_kl,
    log_ratio,
    masked_mean,
    off_policy_keep,
    sapo_surrogate,
    value_loss,
    vespo_weights,
)



def register_algorithm(config_type: type):
    """Class decorator: the class that runs the algorithm `config_type` was registered under (its name
    in YAML and logs), attached to that one registry entry (`algorithm_configs.ALGORITHMS`)."""

    def deco(cls: type[Algorithm]) -> type[Algorithm]:
        name = config_type.model_fields["name"].default
        if ALGORITHMS.get(name) is not config_type:
            raise ValueError(f"{config_type.__name__} is not the registered config of algorithm {name!r}")
        if config_type.implementation is not None:
            raise ValueError(f"algorithm {name!r} already has a class ({config_type.implementation.__name__})")
        cls.name, cls.config_type = name, config_type
        config_type.implementation = cls
        return cls

    return deco


def get_algorithm_class(name: str) -> type[Algorithm]:
    """The class registered under `name`; an unknown name fails listing the valid ones, and a config registered
    without a class (never its parent's: algorithm_configs.register_config) says so."""
    if name in ALGORITHMS and ALGORITHMS[name].implementation is None:
        raise KeyError(f"algorithm {name!r} has a config ({ALGORITHMS[name].__name__}) but no class that runs it: "
                       f"decorate one with @register_algorithm({ALGORITHMS[name].__name__})")
    if name not in ALGORITHMS:
        raise KeyError(f"unknown algorithm {name!r}; valid: {', '.join(algorithm_names())}")
    return ALGORITHMS[name].implementation


def algorithm_names() -> list[str]:
    """Every algorithm with a class that runs it, sorted."""
    return sorted(n for n, c in ALGORITHMS.items() if c.implementation is not None)


@dataclass(frozen=True)
class RolloutNeeds:
    """What an algorithm needs computed over the rollout batch before its update (no-grad passes)."""

    old_logps: bool  # the policy's log-probs at the update's start (the proximal policy; a KL in the reward)
    ref_logps: bool  # the reference (adapter-disabled) model's log-probs, for a KL term
    values: bool  # the critic's values at rollout time


class Algorithm:
    """An advantage estimator + a loss (+ a critic); subclasses register with `@register_algorithm`."""

    name: ClassVar[str] = "algorithm"
    config_type: ClassVar[type]
    #: how a loss metric combines over a step's micro-batches: "max", else a token-weighted mean
    metric_reductions: ClassVar[dict[str, str]] = {"sampler/mismatch_max": "max"}
    critic: torch.nn.Module | None = None
    #: the rollout-time log-probs are needed even for a single on-policy update (e.g. KL in the reward)
    needs_rollout_logps: bool = False

    def __init__(self, cfg, hidden_size: int | None = None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] = no_reduce, reward_weights: tuple[float, ...] = ()):
        if not isinstance(cfg, self.config_type):
            raise TypeError(f"{self.name} needs a {self.config_type.__name__}, got {type(cfg).__name__}")
        self.cfg = cfg  # the algorithm's section (config_type)
        self.reduce = reduce  # sums over the processes of a data-parallel run
        self.reward_weights = tuple(reward_weights)  # rewards.components' weights, in order

    @property
    def entropy_grad(self) -> bool:
        """The loss differentiates through the entropy (an entropy bonus)."""
        return self.cfg.ent_coef > 0

    def needs(self) -> RolloutNeeds:
        """The no-grad passes the algorithm itself reads: the rollout-time log-probs when its reward reads
        them (a KL in the reward), reference log-probs when beta > 0, values when there is a critic. (The
        learner adds the proximal log-probs when the policy moves before the last minibatch is scored.)"""
        return RolloutNeeds(old_logps=self.needs_rollout_logps, ref_logps=self.cfg.beta > 0,
                            values=self.critic is not None)

    def values(self, hidden: torch.Tensor) -> torch.Tensor:
        """The critic's value of each position: hidden states [R, T, H] -> [R, T]."""
        if self.critic is None:
            raise TypeError(f"{self.name} has no critic")
        return self.critic(hidden)

    def advantages(self, batch: Batch) -> dict[str, float]:
        """Fill batch.advantages [R, T] (and returns, for a critic) from the rewards; -> metrics."""
        raise NotImplementedError

    def loss(self, out: PolicyOutput, mb: Batch, norm: Normalisers) -> tuple[torch.Tensor, dict[str, float]]:
        """The micro-batch's loss (normalised by the minibatch's `norm`) and its metrics."""
        raise NotImplementedError

    def trace_fields(self, batch: Batch) -> dict[str, list]:
        """Per-row values for the traces: the advantage (mean over the row's tokens)."""
        m = batch.completion_mask
        adv = (batch.advantages * m).sum(-1) / m.sum(-1).clamp(min=1.0)  # [R]
        return {"advantage": adv.tolist()}

    @property
    def kl_loss(self) -> bool:
        """A k3 KL term against the reference goes into the loss (beta > 0, not folded into the reward)."""
        a = self.cfg
        return a.beta > 0 and not getattr(a, "kl_in_reward", False)

    def kl_term(self, out: PolicyOutput, mb: Batch, per_token: torch.Tensor, metrics: dict,
                log_rho: torch.Tensor | None = None) -> torch.Tensor:
        """per_token + beta * k3 KL(pi || ref) when `kl_loss`, with the KL in `metrics`; with `kl_bias_correction`
        each token's KL weighted by the importance ratio exp(log_rho) [r, T] or [r, 1], not detached (TRL's
        use_bias_correction_kl: on-policy the ratio is 1 with the gradient of log pi, so the KL's gradient gains
        KL * grad log pi)."""
        if not self.kl_loss:
            return per_token
        kl = k3_kl(out.logps, mb.ref_logps)  # [r, T]
        metrics["kl"] = masked_mean(kl.detach(), mb.completion_mask).detach()
        if getattr(self.cfg, "kl_bias_correction", False):
            kl = kl * torch.exp(log_rho)  # [r, T]
        return per_token + self.cfg.beta * kl

    def policy_loss(self, out: PolicyOutput, mb: Batch, norm: Normalisers):
        """The clipped surrogate (+ k3 KL when beta > 0), sampler-corrected, aggregated; GRPO and PPO."""
        a, mask = self.cfg, mb.completion_mask
        old = mb.old_logps if mb.old_logps is not None else out.logps.detach()  # mu = 1: ratio is 1
        log_rho = log_ratio(out.logps, old, mask, a.ratio_level)
        per_token, low, high = clipped_surrogate(log_rho, mb.advantages, a.epsilon_low, a.epsilon_high)
        metrics: dict = {}
        if mb.behaviour_weights is not None:  # (pi_prox / pi_sampler, from the learner)
            per_token = per_token * mb.behaviour_weights
        per_token = self.kl_term(out, mb, per_token, metrics, log_rho)
        loss = aggregate(per_token, mask, a.loss_aggregation, norm)
        with torch.no_grad():
            metrics["clip_low"] = masked_mean(low.float(), mask).detach()
            metrics["clip_high"] = masked_mean(high.float(), mask).detach()
            metrics["approx_kl_old"] = masked_mean(k3_kl(old, out.logps), mask).detach()  # (rho - 1) - log rho
            if out.entropy is not None:
                metrics["entropy"] = masked_mean(out.entropy, mask).detach()
        return loss, metrics


@register_algorithm(GRPOConfig)
class GRPO(Algorithm):
    """Group-relative advantages, the same for every token of a completion; no critic. Rows without a
    reward value are left out of their group's baseline and get advantage 0.

    The loss is TRL 1.16's family, one knob at a time (each checked against TRL's own code in
    tests/test_trl_losses.py): the per-token objective (`surrogate`: clip with the optional two-sided
    `delta`, cispo, sapo, vespo), then the off-policy sequence mask, the high-entropy token mask, the
    sampler correction (vespo folds it into its sequence weight instead), the KL term, the aggregation,
    and the entropy bonus. Deliberate differences from TRL, each tested: cispo caps the ratio at
    1 + epsilon_high (TRL: at epsilon_high, so TRL's 5.0 is 4.0 here); the off-policy mask reads the
    sampler's own log-probs (TRL reads them only under vLLM, else the rollout policy's, which makes the
    mask a no-op on one update per rollout); the entropy quantile is taken over this process's
    micro-batch (TRL: over every process's); with that mask on, the entropy bonus is divided by the
    minibatch's tokens, not the kept ones, so its size does not depend on the micro-batch.
    """

    def advantages(self, batch: Batch) -> dict[str, float]:
        """Each row's reward against its group's (or, decoupled, each component's against its group's)."""
        a = self.cfg
        adv, zero_std = group_advantages(batch.rewards, batch.group, a.scale, a.std_epsilon,
                                         valid=batch.reward_valid, reduce=self.reduce)  # [R], [groups]
        if a.multi_objective_aggregation == "normalize_then_sum":
            weights = torch.tensor(self.reward_weights)  # [K]
            adv = decoupled_advantages(batch.component_rewards, weights, batch.group, a.std_epsilon,
                                       valid=batch.reward_valid, reduce=self.reduce)  # [R]
        batch.advantages = adv.unsqueeze(-1) * batch.completion_mask  # [R, T]
        n, zero = self.reduce(torch.tensor([float(zero_std.numel()), float(zero_std.sum())]))
        return {"zero_std_frac": float(zero / n.clamp(min=1.0))}

    def loss(self, out: PolicyOutput, mb: Batch, norm: Normalisers):
        """The configured surrogate, then the masks, sampler weights, KL, aggregation and entropy bonus."""
        a, mask, adv = self.cfg, mb.completion_mask, mb.advantages
        old = mb.old_logps if mb.old_logps is not None else out.logps.detach()  # mu = 1: ratio is 1
        log_rho = log_ratio(out.logps, old, mask, a.ratio_level)  # [r, T] or [r, 1]
        weights, metrics = mb.behaviour_weights, {}  # (pi_prox / pi_sampler, from the learner)
        row_adv = (adv * mask).sum(-1, keepdim=True)  # [r, 1]: the sign of each row's advantage
        if a.surrogate == "clip":
            per_token, low, high = clipped_surrogate(log_rho, adv, a.epsilon_low, a.epsilon_high, a.delta)
            metrics["clip_low"] = masked_mean(low.float(), mask).detach()
            metrics["clip_high"] = masked_mean(high.float(), mask).detach()
        elif a.surrogate == "cispo":
            per_token, capped = cispo_surrogate(log_rho, out.logps, adv, 1.0 + a.epsilon_high)
            metrics["cispo_capped"] = masked_mean(capped.float(), mask).detach()
        elif a.surrogate == "sapo":
            per_token = sapo_surrogate(log_rho, adv, a.sapo_temperature_pos, a.sapo_temperature_neg)
        else:  # vespo (the config's Literal admits nothing else)
            log_sampler = None if weights is None else torch.log(weights.clamp(min=1e-8))
            phi = vespo_weights(out.logps.detach() - old, row_adv, mask, log_sampler, a.vespo_k_pos,
                                a.vespo_lambda_pos, a.vespo_k_neg, a.vespo_lambda_neg)  # [r, 1]
            per_token = -phi * adv * out.logps  # [r, T]
            metrics["vespo/phi_mean"] = masked_mean(phi.expand_as(mask), mask).detach()
            weights = None  # folded into phi
        if a.off_policy_mask_threshold is not None:
            keep = off_policy_keep(row_adv, out.logps, mb.sampler_logps, mask, a.off_policy_mask_threshold)  # [r, 1]
            per_token = per_token * keep
            metrics["off_policy_masked"] = masked_mean(1.0 - keep.expand_as(mask), mask).detach()
        trained = mask
        if a.top_entropy_quantile < 1.0:
            trained = high_entropy_mask(out.entropy, mask, a.top_entropy_quantile)  # [r, T]
            per_token = per_token * trained
        if weights is not None:
            per_token = per_token * weights
        per_token = self.kl_term(out, mb, per_token, metrics, log_rho)
        loss = aggregate(per_token, mask, a.loss_aggregation, norm)
        if a.ent_coef > 0:  # the mean token entropy, whatever the aggregation (as TRL's entropy_coef)
            loss = loss - a.ent_coef * aggregate(out.entropy, trained, "dapo", norm)
        with torch.no_grad():
            metrics["approx_kl_old"] = masked_mean(k3_kl(old, out.logps), mask).detach()
            if out.entropy is not None:
                metrics["entropy"] = masked_mean(out.entropy, mask).detach()
        return loss, metrics


class ValueHead(torch.nn.Module):
    """V(s_t) from the policy's last hidden state at the position that predicts token t.

    Shares the LoRA backbone: the value loss trains the adapter too (scaled by vf_coef). Orthogonal
    init with a small gain, as in the standard PPO recipes, so initial values are near 0.
    """

    def __init__(self, hidden_size: int, gain: float):
        super().__init__()
        self.v = torch.nn.Linear(hidden_size, 1)
        torch.nn.init.orthogonal_(self.v.weight, gain=gain)
        torch.nn.init.zeros_(self.v.bias)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.v(hidden.float()).squeeze(-1)  # [R, T, H] -> [R, T]


def token_rewards(batch: Batch, beta: float, kl_in_reward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The token MDP: the sequence reward on the last completion token, optionally minus beta * KL per
    token (k1: log pi_old - log pi_ref). -> (rewards [R, T], dones [R, T], 1 at the last token)"""
    mask = batch.completion_mask
    cols = torch.arange(1, mask.shape[1] + 1, device=mask.device)  # [T]
    last = ((mask > 0) * cols).amax(-1).sub(1).clamp(min=0)  # [R]: the last trained token (a multi-turn
    # completion's mask has holes at its tool tokens, so the mask's sum is not the last index)
    dones = torch.zeros_like(mask)
    dones[torch.arange(batch.rows), last] = 1.0
    rewards = dones * batch.rewards.unsqueeze(-1)  # [R, T]  (a row without a reward value carries 0 here;
    # ActorCritic.advantages gives it advantage 0 and no value target)
    if kl_in_reward and beta > 0:
        rewards = rewards - beta * (batch.old_logps - batch.ref_logps) * mask
    return rewards, dones


class ActorCritic(Algorithm):
    """Shared parts of PPO and A2C: the value head (the trainer fills batch.values from it at rollout
    time), token rewards, returns and whitened advantages, and the critic's loss terms."""

    def __init__(self, cfg, hidden_size: int | None = None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] = no_reduce, reward_weights: tuple[float, ...] = ()):
        super().__init__(cfg, hidden_size, reduce, reward_weights)
        self.critic = ValueHead(hidden_size, cfg.critic_gain)

    @property
    def needs_rollout_logps(self) -> bool:
        return self.cfg.kl_in_reward and self.cfg.beta > 0

    def returns_and_advantages(self, batch: Batch, rewards, dones) -> tuple[torch.Tensor, torch.Tensor]:
        """(advantages [R, T], returns [R, T]) from token rewards and dones and batch.values."""
        raise NotImplementedError

    def _over_model_tokens(self, batch: Batch, rewards, dones) -> tuple[torch.Tensor, torch.Tensor]:
        """returns_and_advantages over each row's model tokens only, as if its tool tokens were not there (a
        tool result is the environment's move, not a step of the policy: no discount, no critic value across
        it): every row's trained tokens moved to its front in order, the recursion run, the results put back."""
        order = torch.sort((batch.completion_mask <= 0).to(torch.int8), dim=1, stable=True).indices  # [R, T]
        adv, ret = self.returns_and_advantages(replace(batch, values=batch.values.gather(1, order)),
                                               rewards.gather(1, order), dones.gather(1, order))
        return torch.empty_like(adv).scatter_(1, order, adv), torch.empty_like(ret).scatter_(1, order, ret)

    def advantages(self, batch: Batch) -> dict[str, float]:
        """Token rewards -> the subclass's advantages and returns (whitened if asked), and value metrics."""
        a = self.cfg
        valid = batch.reward_valid.float().unsqueeze(-1)  # [R, 1]: rows without a reward value drop out
        mask = batch.completion_mask * valid  # [R, T]
        rewards, dones = token_rewards(batch, a.beta, a.kl_in_reward)
        if any(batch.info.tool_tokens or ()):  # multi-turn: tool tokens are no actions; the recursion skips them
            adv, ret = self._over_model_tokens(batch, rewards, dones)
        else:
            adv, ret = self.returns_and_advantages(batch, rewards, dones)
        batch.returns = ret * mask + batch.values * (batch.completion_mask - mask)  # no value error where invalid
        batch.advantages = whiten(adv, mask, reduce=self.reduce) if a.whiten_advantages else adv * mask
        v, r = batch.values, batch.returns
        n, sv, sr, err = self.reduce(torch.stack([  # whole-batch sums, over every process
            mask.sum(), (v * mask).sum(), (r * mask).sum(), ((v - r) ** 2 * mask).sum()]))
        n = n.clamp(min=1.0)
        return {"value/mean": float(sv / n), "value/error": float(err / n), "return/mean": float(sr / n),
                "value/explained_variance": explained_variance(v, r, mask, self.reduce)}

    def critic_terms(self, out: PolicyOutput, mb: Batch, norm: Normalisers, clip: float | None):
        """vf_coef * value loss - ent_coef * entropy, aggregated like the policy loss, and metrics."""
        a, mask = self.cfg, mb.completion_mask
        values = self.values(out.hidden)  # [r, T]
        per_token = value_loss(values, mb.values, mb.returns, clip)  # [r, T]
        total = a.vf_coef * aggregate(per_token, mask, a.loss_aggregation, norm)
        if a.ent_coef > 0:
            total = total - a.ent_coef * aggregate(out.entropy, mask, a.loss_aggregation, norm)
        return total, {"value_loss": masked_mean(per_token.detach(), mask).detach()}

    def trace_fields(self, batch: Batch) -> dict[str, list]:
        fields = super().trace_fields(batch)
        fields["value"] = batch.values[:, 0].tolist()  # V(prompt): the critic's expected reward
        return fields


@register_algorithm(PPOConfig)
class PPO(ActorCritic):
    """PPO on the token MDP: GAE(gamma, lambda), clipped surrogate, clipped value loss, entropy bonus.

    `algorithm.num_iterations` is the number of PPO epochs over the rollout's minibatches.
    """

    def returns_and_advantages(self, batch, rewards, dones):
        a = self.cfg
        return gae(rewards, batch.values, dones, torch.zeros(batch.rows, device=rewards.device), a.gamma, a.lam)

    def loss(self, out: PolicyOutput, mb: Batch, norm: Normalisers):
        policy, metrics = self.policy_loss(out, mb, norm)
        critic, cm = self.critic_terms(out, mb, norm, self.cfg.vf_clip)
        return policy + critic, {**metrics, **cm}


@register_algorithm(A2CConfig)
class A2C(ActorCritic):
    """Synchronous advantage actor-critic: n-step returns bootstrapped from the critic, A = R - V,
    loss = -A * log pi (+ beta * k3 KL) - ent_coef * H + vf_coef * 0.5 * (R - V)^2; no ratio, no
    clipping, one update."""

    def returns_and_advantages(self, batch, rewards, dones):
        """n-step returns bootstrapped from the critic's values; advantage = return - value."""
        a = self.cfg
        ret = nstep_returns(rewards, batch.values, dones, torch.zeros(batch.rows, device=rewards.device),
                            a.gamma, a.n_steps)
        return ret - batch.values, ret

    def loss(self, out: PolicyOutput, mb: Batch, norm: Normalisers):
        """-A * log pi (sampler-corrected, + KL) plus the critic's terms; no ratio."""
        a, mask = self.cfg, mb.completion_mask
        metrics: dict = {}
        per_token = -mb.advantages * out.logps  # [r, T]
        if mb.behaviour_weights is not None:  # (a fixed lag's samples, or rollout.correction: pi / pi_sampler)
            per_token = per_token * mb.behaviour_weights
        policy = aggregate(self.kl_term(out, mb, per_token, metrics), mask, a.loss_aggregation, norm)
        critic, cm = self.critic_terms(out, mb, norm, None)
        metrics.update(cm)
        if out.entropy is not None:
            metrics["entropy"] = masked_mean(out.entropy.detach(), mask).detach()
        return policy + critic, metrics


def check_implemented() -> None:
    """Every registered algorithm config has its class (called once the built-in algorithms are defined, below):
    a config without one is refused at import, never run as another algorithm."""
    missing = unimplemented()
    if missing:
        raise ImportError(f"algorithm config{'s' * (len(missing) > 1)} without a class that runs "
                          f"{'them' if len(missing) > 1 else 'it'}: {', '.join(missing)} (decorate the class with "
                          "@register_algorithm(TheConfig))")


check_implemented()
