"""Advantage estimators: generic tensor functions.

Deliberately left out: RLOO/REINFORCE++ baselines; they are one function each when someone needs them.
"""

from __future__ import annotations

import torch

from ..distributed import no_reduce


def group_advantages(rewards: torch.Tensor, group: torch.Tensor, scale: str, eps: float = 1e-4,
                     valid: torch.Tensor | None = None, reduce=no_reduce):
    """GRPO: (r - group mean) / (std + eps), with std per group, over the batch, or none (Dr. GRPO).

    rewards [R]; group [R] long, each row's group index (rows need not be contiguous); valid [R] bool,
    False for rows without a reward value (every component None or failed): they are left out of their
    group's mean and std and of the batch std, and get advantage 0. -> (advantages [R], zero_std [groups])
    std is Bessel-corrected (as torch.std and TRL); a group whose valid rewards all agree (or that has
    fewer than 2) gets advantage 0. `reduce` sums a tensor over the processes of a data-parallel run
    (groups never span processes; only the batch std of scale "batch" needs every process's rewards).
    """
    r = rewards.double()  # [R]; float64 sums keep a constant group's residuals at ~1e-17
    ok = torch.ones_like(r, dtype=torch.bool) if valid is None else valid.bool()  # [R]
    n_groups = int(group.max()) + 1 if group.numel() else 0
    w = ok.double()  # [R]
    count = torch.zeros(n_groups, dtype=r.dtype, device=r.device).index_add_(0, group, w)  # [groups]
    total = torch.zeros_like(count).index_add_(0, group, r * w)  # [groups]
    mean = total / count.clamp(min=1.0)  # [groups]
    centred = (r - mean[group]) * w  # [R]
    sq = torch.zeros_like(count).index_add_(0, group, centred ** 2)  # [groups]
    std = (sq / (count - 1).clamp(min=1.0)).sqrt()  # [groups]
    zero_std = (std < 1e-8) | (count < 2)  # [groups]
    if scale == "group":
        adv = centred / (std[group] + eps)
    elif scale == "batch":
        kept = r[ok]
        n, total, sq = reduce(torch.stack([w.sum(), kept.sum(), (kept ** 2).sum()]))  # over all processes
        var = (sq - total ** 2 / n.clamp(min=1.0)) / (n - 1).clamp(min=1.0)  # Bessel, as torch.std
        adv = centred / (var.clamp(min=0.0).sqrt() + eps) if n > 1 else centred
    elif scale == "none":
        adv = centred
    else:
        raise ValueError(f"unknown advantage scale {scale!r}; valid: group, batch, none")
    adv = adv.masked_fill(zero_std[group] | ~ok, 0.0)  # float residuals / eps would leave ~1e-4 noise
    return adv.float(), zero_std


def decoupled_advantages(components: torch.Tensor, weights: torch.Tensor, group: torch.Tensor, eps: float = 1e-4,
                         valid: torch.Tensor | None = None, reduce=no_reduce) -> torch.Tensor:
    """GDPO (multi_objective_aggregation normalize_then_sum): each reward component is scaled within its
    group, (x - group mean) / (group std + eps), over the rows where it has a value; the weighted sum of
    the scaled components is then scaled over the batch of every process, (s - mean) / (std + eps). A
    component without a value in a row, or with fewer than 2 values in its group, adds nothing there.

    components [R, K] raw scores, NaN where none; weights [K]; group [R]; valid [R] bool (rows with any
    value; the others get advantage 0 and stay out of the batch statistics) -> advantages [R]
    """
    x = components.double().reshape(components.shape[0], weights.numel())  # [R, K] (a process may have no rows)
    has = ~torch.isnan(x)  # [R, K]
    w = has.double()
    n_groups = int(group.max()) + 1 if group.numel() else 0
    count = torch.zeros(n_groups, x.shape[1], dtype=x.dtype, device=x.device).index_add_(0, group, w)  # [G, K]
    total = torch.zeros_like(count).index_add_(0, group, torch.nan_to_num(x) * w)  # [G, K]
    centred = (torch.nan_to_num(x) - (total / count.clamp(min=1.0))[group]) * w  # [R, K]
    sq = torch.zeros_like(count).index_add_(0, group, centred ** 2)  # [G, K]
    std = (sq / (count - 1).clamp(min=1.0)).sqrt()  # [G, K]
    scaled = (centred / (std[group] + eps)).masked_fill((count[group] < 2) | ~has, 0.0)  # [R, K]
    summed = (scaled * weights.to(x)).sum(-1)  # [R]
    ok = has.any(-1) if valid is None else valid.bool()  # [R]
    kept = summed[ok]
    n, tot, sq_sum = reduce(torch.stack([ok.double().sum(), kept.sum(), (kept ** 2).sum()]))  # all processes
    mean = tot / n.clamp(min=1.0)
    var = (sq_sum - tot ** 2 / n.clamp(min=1.0)) / (n - 1).clamp(min=1.0)  # Bessel, as torch.std
    adv = (summed - mean) / (var.clamp(min=0.0).sqrt() + eps) if n > 1 else summed - mean
    return adv.masked_fill(~ok, 0.0).float()


def gae(rewards: torch.Tensor, values: torch.Tensor, dones: torch.Tensor, next_value: torch.Tensor,
        gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over segments of T steps, N at a time.

    rewards, values, dones [N, T]; dones[:, t] = 1 when the episode ended with step t's action;
    next_value [N] = V of the state after the segment's last step (ignored where that step was done).
        delta_t = r_t + gamma * V_{t+1} * (1 - done_t) - V_t,   A_t = delta_t + gamma * lam * (1 - done_t) * A_{t+1}
    -> (advantages [N, T], returns = advantages + values [N, T])
    """
    n, t_len = rewards.shape
    adv = torch.zeros_like(rewards, dtype=torch.float32)  # [N, T]
    last = torch.zeros(n, dtype=torch.float32, device=rewards.device)  # A_{t+1}
    nxt = next_value.float()  # V_{t+1}
    for t in reversed(range(t_len)):
        alive = 1.0 - dones[:, t].float()
        delta = rewards[:, t] + gamma * nxt * alive - values[:, t]
        last = delta + gamma * lam * alive * last
        adv[:, t] = last
        nxt = values[:, t].float()
    return adv, adv + values


def nstep_returns(rewards: torch.Tensor, values: torch.Tensor, dones: torch.Tensor, next_value: torch.Tensor,
                  gamma: float, n: int | None = None) -> torch.Tensor:
    """n-step discounted returns, bootstrapped from the critic, with dones cutting the sum.

    R_t = sum_{k<m} gamma^k r_{t+k} + gamma^m V_{t+m}, where the window stops after n steps, at the end
    of the segment (bootstrapping from next_value there), or at a done (no bootstrap). n=None runs to the
    segment's end: the classic A2C recursion R_t = r_t + gamma * R_{t+1} * (1 - done_t), R_T = next_value.
    rewards, values, dones [N, T]; next_value [N] -> returns [N, T]
    """
    n_rows, t_len = rewards.shape
    if n is None or n >= t_len:
        out = torch.zeros_like(rewards, dtype=torch.float32)  # [N, T]
        running = next_value.float()  # [N]
        for t in reversed(range(t_len)):
            running = rewards[:, t] + gamma * running * (1.0 - dones[:, t].float())
            out[:, t] = running
        return out
    dev = rewards.device
    steps = torch.arange(t_len, device=dev)
    m = (t_len - steps).clamp(max=n)  # [T] window length: n, or up to the segment end
    r_ext = torch.cat([rewards.float(), torch.zeros(n_rows, n, device=dev)], 1)  # [N, T + n]
    d_ext = torch.cat([dones.float(), torch.ones(n_rows, n, device=dev)], 1)  # [N, T + n]
    v_ext = torch.cat([values.float(), next_value.float().unsqueeze(1)], 1)  # [N, T + 1]: V_T = next_value
    out = torch.zeros(n_rows, t_len, device=dev)  # [N, T]
    alive = torch.ones(n_rows, t_len, device=dev)  # no done so far inside the window
    alive_at = [alive]
    for k in range(n):
        out += (gamma ** k) * alive * r_ext[:, k:k + t_len]
        alive = alive * (1.0 - d_ext[:, k:k + t_len])
        alive_at.append(alive)
    alive_m = torch.stack(alive_at).gather(0, m.view(1, 1, -1).expand(1, n_rows, t_len)).squeeze(0)  # [N, T]
    boot = v_ext.gather(1, (steps + m).unsqueeze(0).expand(n_rows, t_len))  # [N, T] V_{t+m}
    return out + (gamma ** m.float()) * alive_m * boot


def whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8, reduce=no_reduce) -> torch.Tensor:
    """(x - mean) / std over the masked entries (advantage whitening); masked-out entries become 0.
    `reduce` sums over the processes of a data-parallel run, so mean and std are the whole batch's."""
    n, total = reduce(torch.stack([mask.sum(), (x * mask).sum()]))
    n = n.clamp(min=1.0)
    mean = total / n
    var = reduce((((x - mean) * mask) ** 2).sum()) / (n - 1).clamp(min=1.0)
    return (x - mean) / (var.sqrt() + eps) * mask
