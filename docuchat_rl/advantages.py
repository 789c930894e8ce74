"""Advantage estimators: generic tensor functions.

Deliberately left out: RLOO/REINFORCE++ baselines; they are one function each when someone needs them.
"""

from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str, eps: float = 1e-4):
    """GRPO: (r - group mean) / (std + eps), with std per group, over the batch, or none (Dr. GRPO).

    rewards [R] with R = groups * group_size, groups contiguous -> (advantages [R], zero_std [groups])
    std is Bessel-corrected (as torch.std and TRL); a group whose rewards all agree gets advantage 0.
    """
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.float().view(-1, group_size)  # [groups, G]
    centred = r - r.mean(dim=1, keepdim=True)  # [groups, G]
    std = r.std(dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(r[:, :1])  # [groups, 1]
    zero_std = std.squeeze(1) < 1e-8  # [groups]
    if scale == "group":
        adv = centred / (std + eps)
    elif scale == "batch":
        adv = centred / (rewards.float().std() + eps) if rewards.numel() > 1 else centred
    elif scale == "none":
        adv = centred
    else:
        raise ValueError(f"unknown advantage scale {scale!r}; valid: group, batch, none")
    return adv.reshape(-1), zero_std
