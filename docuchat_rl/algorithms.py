"""Algorithms: each is an advantage estimator + a loss (+ an optional critic) behind one interface.

The trainer calls every algorithm the same way and never looks at its name:

    algo = get_algorithm_class(cfg.algorithm.name)(cfg, hidden_size)
    algo.advantages(batch)                      -> metrics; fills batch.advantages [R, T]
    algo.loss(policy_output, micro_batch, norm) -> (loss, metrics)
    algo.critic                                 -> None, or a module trained and saved with the adapter
    algo.trace_fields(batch)                    -> per-row values for the traces

Deliberately left out: algorithms that need a separate reward model or a second policy copy in memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar

import torch

from .advantages import group_advantages
from .batch import Batch, PolicyOutput
from .losses import Norm, aggregate, clipped_surrogate, k3_kl, log_ratio, masked_mean

if TYPE_CHECKING:
    from .config import Config

_ALGORITHMS: dict[str, type[Algorithm]] = {}


def register_algorithm(name: str):
    def deco(cls: type[Algorithm]) -> type[Algorithm]:
        if name in _ALGORITHMS:
            raise ValueError(f"algorithm {name!r} is already registered")
        cls.name = name
        _ALGORITHMS[name] = cls
        return cls

    return deco


def get_algorithm_class(name: str) -> type[Algorithm]:
    if name not in _ALGORITHMS:
        raise KeyError(f"unknown algorithm {name!r}; valid: {', '.join(sorted(_ALGORITHMS))}")
    return _ALGORITHMS[name]


def algorithm_names() -> list[str]:
    return sorted(_ALGORITHMS)


class Algorithm:
    name: ClassVar[str] = "algorithm"
    critic: torch.nn.Module | None = None

    def __init__(self, cfg: Config, hidden_size: int | None = None):
        self.cfg = cfg

    @classmethod
    def check_config(cls, cfg: Config) -> str | None:
        """One line naming the key at fault when this algorithm cannot run with `cfg`, else None."""
        return None

    def advantages(self, batch: Batch) -> dict[str, float]:
        raise NotImplementedError

    def loss(self, out: PolicyOutput, mb: Batch, norm: Norm) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError

    def trace_fields(self, batch: Batch) -> dict[str, list]:
        """Per-row values for the traces: the advantage (mean over the row's tokens)."""
        m = batch.completion_mask
        adv = (batch.advantages * m).sum(-1) / m.sum(-1).clamp(min=1.0)  # [R]
        return {"advantage": adv.tolist()}

    def policy_loss(self, out: PolicyOutput, mb: Batch, norm: Norm):
        """The clipped surrogate (+ k3 KL when beta > 0), aggregated; shared by GRPO and PPO."""
        a, mask = self.cfg.algorithm, mb.completion_mask
        old = mb.old_logps if mb.old_logps is not None else out.logps.detach()  # mu = 1: ratio is 1
        log_rho = log_ratio(out.logps, old, mask, a.ratio_level)
        per_token, low, high = clipped_surrogate(log_rho, mb.advantages, a.epsilon_low, a.epsilon_high)
        metrics: dict[str, float] = {}
        if a.beta > 0:
            kl = k3_kl(out.logps, mb.ref_logps)  # [r, T]
            per_token = per_token + a.beta * kl
            metrics["kl"] = float(masked_mean(kl.detach(), mask))
        loss = aggregate(per_token, mask, a.loss_aggregation, norm)
        with torch.no_grad():
            metrics["clip_low"] = float(masked_mean(low.float(), mask))
            metrics["clip_high"] = float(masked_mean(high.float(), mask))
            metrics["approx_kl_old"] = float(masked_mean(k3_kl(out.logps, old), mask))
            if out.entropy is not None:
                metrics["entropy"] = float(masked_mean(out.entropy, mask))
        return loss, metrics


@register_algorithm("grpo")
class GRPO(Algorithm):
    """Group-relative advantages, the same for every token of a completion; no critic."""

    @classmethod
    def check_config(cls, cfg: Config) -> str | None:
        if cfg.rollout.num_generations < 2:
            return ("config key 'rollout.num_generations': grpo compares completions within a group, "
                    f"so it needs at least 2 (got {cfg.rollout.num_generations})")
        return None

    def advantages(self, batch: Batch) -> dict[str, float]:
        a = self.cfg.algorithm
        adv, zero_std = group_advantages(batch.rewards, self.cfg.rollout.num_generations, a.scale,
                                         a.std_epsilon)  # [R], [groups]
        batch.advantages = adv.unsqueeze(-1) * batch.completion_mask  # [R, T]
        return {"zero_std_frac": float(zero_std.float().mean())}

    def loss(self, out: PolicyOutput, mb: Batch, norm: Norm):
        return self.policy_loss(out, mb, norm)
