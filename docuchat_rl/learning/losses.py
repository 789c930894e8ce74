"""Per-token log-probs, KL, clipped surrogate and loss aggregation: generic tensor functions.

Conventions: R rows (completions), T completion positions; `mask` [R, T] is 1.0 on real completion
tokens and 0.0 on padding. Every aggregate divides by a normaliser given by the caller for the WHOLE
minibatch, so summing the losses of its micro-batches gives exactly the minibatch loss (gradient
accumulation changes nothing).

`chunked_token_stats` scores completion positions a chunk at a time from the final hidden states, each
chunk's logits recomputed in the backward (`_ChunkStats`: its gradient written out, no replay of the
forward), so a [rows, T, V] float32 tensor is never held: with a 151,936-token vocabulary, 16 rows x 512
tokens would be 5 GB before the backward.

Deliberately left out: fused lm_head + cross-entropy kernels (Liger/Unsloth-style Triton); chunking in
plain torch gives the same memory bound on every device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..distributed import no_reduce
from ..modeling import warpers


def token_logprobs(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[ids] without materialising the full log-softmax.

    logits [R, T, V], ids [R, T] -> [R, T] (float32)
    """
    logits = logits.float()
    picked = logits.gather(-1, ids.unsqueeze(-1)).squeeze(-1)  # [R, T]
    return picked - torch.logsumexp(logits, dim=-1)  # [R, T]


def token_entropy(logits: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """Entropy of each position's distribution. logits [R, T, V] -> [R, T]

    Differentiable when gradients are on; otherwise (the diagnostic entropy) computed `chunk` positions at
    a time, so its float32 temporaries are [chunk, V], not [R, T, V] each.
    """
    if torch.is_grad_enabled() and logits.requires_grad:
        logp = torch.log_softmax(logits.float(), dim=-1)  # [R, T, V]
        return -(logp.exp() * logp).sum(-1)  # [R, T]
    flat = logits.reshape(-1, logits.shape[-1])  # [N, V]
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)  # [N]
    for start in range(0, flat.shape[0], chunk):
        logp = torch.log_softmax(flat[start:start + chunk].float(), dim=-1)  # [n, V]
        out[start:start + chunk] = -logp.exp().mul_(logp).sum(-1)
    return out.view(logits.shape[:-1])  # [R, T]


FILTERED = -1e30  # a removed token's logit on the trainer's side: its exp() is 0 exactly and, unlike -inf, p * log p
# and the gradient's p * (log p + H) stay 0 instead of NaN


def kept_floor(z: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor | None:
    """The smallest logit the sampler's top-k / top-p keeps in each row, by the sampler's own warpers
    (transformers' TopK/TopPLogitsWarper, `modeling.warpers`) on the temperature-scaled logits; None when
    neither truncates. z [n, V] -> [n]. The sampler draws from that truncated, renormalised distribution
    (and vLLM reports it, `processed_logprobs`), so the trainer scores the same one: scored over the full
    softmax, every ratio and mismatch against the sampler would carry log(kept mass), a bias, not noise."""
    if top_k <= 0 and top_p >= 1.0:
        return None
    kept = z
    for warp in warpers(1.0, top_k, top_p):
        kept = warp(None, kept)  # [n, V], removed at -inf
    return kept.masked_fill(kept.isneginf(), float("inf")).amin(-1)  # [n]


def dropped(z: torch.Tensor, floor: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The tokens below their row's floor [n, V] bool, the drawn token never among them (where the trainer's
    logits put it a rounding error below the floor the sampler's kept it; its log-prob stays finite).
    z [n, V], floor [n], ids [n]"""
    drop = z < floor[:, None]  # [n, V]
    return drop.scatter_(-1, ids[:, None], False)


class _ChunkStats(torch.autograd.Function):
    """Log-probs (and entropies) of one chunk of positions from their final hidden states, with a written-out
    backward: the chunk's logits are recomputed from the hidden states (never kept between the passes) and
    their gradient is built from the log-normaliser saved in the forward,

        d logp_t / dz = onehot(t) - p        d H / dz = -p * (z - E_p[z]) = -p * (log p + H)        p = exp(z - lse)

    Activation checkpointing (the way it was done before) replays the whole forward in the backward: the
    logsumexp, the diagnostic entropy and a gather whose backward scatters into a fresh [n, V] of zeros,
    then autograd's own pass of logsumexp's backward: about twice the passes over [n, V] float32 that this
    makes (with V = 49,152 these passes were a third of an update of SmolLM2-135M on a CPU). Hand-written
    because no library offers it outside CUDA (Liger's fused linear cross-entropy is a Triton kernel).

    Under the sampler's top-k / top-p (`kept_floor`) the logits below each row's floor are FILTERED in both
    passes (the floor saved, so both drop the same tokens): log-probs, entropy and gradient are those of the
    truncated distribution, zero gradient on the dropped logits.

    forward(hidden [n, H], ids [n], head, temperature, want_entropy, entropy_grad, top_k, top_p)
    -> (logps [n] float32, entropy [n] float32, or empty when not wanted)
    """

    @staticmethod
    def forward(ctx, hidden, ids, head, temperature: float, want_entropy: bool, entropy_grad: bool,
                top_k: int = 0, top_p: float = 1.0):
        device = hidden.device.type
        ctx.autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        with torch.no_grad():
            z = head(hidden).float() / temperature  # [n, V]; the sampler divides float32 logits too
            floor = kept_floor(z, top_k, top_p)  # [n] or None
            if floor is not None:
                z.masked_fill_(dropped(z, floor, ids), FILTERED)
            lse = torch.logsumexp(z, -1)  # [n]
            logps = z.gather(-1, ids[:, None]).squeeze(-1) - lse  # [n]
            entropy = z.new_zeros(0)
            if want_entropy:
                logp = z.sub_(lse[:, None])  # [n, V] (z is not needed again)
                entropy = -torch.linalg.vecdot(logp.exp(), logp)  # [n]: -sum p log p, no cancellation when small
        ctx.head, ctx.temperature, ctx.truncated = head, temperature, floor is not None
        ctx.save_for_backward(hidden, ids, lse, entropy, floor if floor is not None else lse.new_zeros(0))
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy)
        ctx.set_materialize_grads(False)
        return logps, entropy

    @staticmethod
    def backward(ctx, g_logps, g_entropy):
        hidden, ids, lse, entropy, floor = ctx.saved_tensors
        h = hidden.detach().requires_grad_(True)
        enabled, dtype = ctx.autocast
        with torch.enable_grad(), torch.autocast(h.device.type, dtype=dtype, enabled=enabled):
            z = ctx.head(h).float() / ctx.temperature  # [n, V], recomputed with its graph to h (and the head)
        with torch.no_grad():
            logp = z.detach() - lse[:, None]  # [n, V]
            if ctx.truncated:  # (the dropped logits get no gradient: p is 0 there)
                logp.masked_fill_(dropped(z.detach(), floor, ids), FILTERED)
            g_logps = torch.zeros_like(lse) if g_logps is None else g_logps
            coef = -g_logps[:, None]  # [n, 1]
            if g_entropy is not None and g_entropy.numel():
                coef = coef - g_entropy[:, None] * (logp + entropy[:, None])  # [n, V]: -g - g_H (log p + H)
            grad_z = logp.exp_().mul_(coef)  # [n, V]: p * coef
            grad_z.scatter_add_(-1, ids[:, None], g_logps[:, None])  # + onehot(t) * g
        z.backward(grad_z)
        return h.grad, None, None, None, None, None, None, None


def chunked_token_stats(head, hidden: torch.Tensor, ids: torch.Tensor, temperature: float, chunk: int,
                        with_entropy: bool, entropy_grad: bool, top_k: int = 0,
                        top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-token log-probs (and entropies) of `ids` from final hidden states, `chunk` positions at a time.

    head: hidden [n, H] -> logits [n, V] (the model's output layer); hidden [R, T, H]; ids [R, T]
    -> (logps [R, T] float32, entropy [R, T] or None). Each chunk is a `_ChunkStats`: only one chunk's
    [chunk, V] logits exist at a time, in the forward and in the backward; the gradients equal those of the
    whole-tensor path up to float summation order.
    """
    r, t, h = hidden.shape
    flat_h, flat_ids = hidden.reshape(r * t, h), ids.reshape(r * t)  # [N, H], [N]
    want_entropy = with_entropy or entropy_grad
    grad_entropy = entropy_grad and torch.is_grad_enabled()
    pieces = [_ChunkStats.apply(flat_h[a:a + chunk], flat_ids[a:a + chunk], head, temperature, want_entropy,
                                grad_entropy, top_k, top_p) for a in range(0, r * t, chunk)]
    logps = torch.cat([p[0] for p in pieces]).view(r, t)  # [R, T]
    entropy = torch.cat([p[1] for p in pieces]).view(r, t) if want_entropy else None  # [R, T]
    return logps, entropy


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """k3 estimator of KL(pi || ref) per token for tokens sampled from pi: exp(ref - pi) - (ref - pi) - 1,
    >= 0, 0 when equal. [R, T]

    For tokens sampled from pi_old, KL(pi_old || pi) is `k3_kl(old, new)` = (rho - 1) - log rho with
    rho = pi / pi_old; `k3_kl(new, old)` would estimate a chi-square-like divergence instead.
    """
    d = ref_logps - logps  # [R, T]
    return torch.exp(d) - d - 1.0


def sampler_weights(logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor, mode: str,
                    low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Importance weights pi_train / pi_sampler correcting for tokens drawn from another distribution
    (top-k/top-p truncation, another engine's numerics), no grad.

    mode: token_truncate (each token's ratio clamped to [low, high]), token_mask (tokens outside get 0),
    sequence_truncate / sequence_mask (the same on the sequence ratio exp(sum of token log-ratios),
    applied to every token of the row). logps, sampler_logps, mask [R, T]
    -> (weights [R, T], capped [R, T] bool: where the ratio fell outside [low, high])
    """
    log_w = (logps.detach() - sampler_logps) * mask  # [R, T]
    if mode.startswith("sequence"):
        log_w = log_w.sum(-1, keepdim=True).expand_as(mask)  # [R, T]
    w = log_w.clamp(max=80.0).exp()  # [R, T]; exp(80) is already far outside any cap
    capped = ((w < low) | (w > high)) & (mask > 0)
    if mode.endswith("truncate"):
        w = w.clamp(low, high)
    elif mode.endswith("mask"):
        w = w.masked_fill(capped, 0.0)
    else:
        raise ValueError(f"unknown correction mode {mode!r}; valid: token_truncate, token_mask, "
                         "sequence_truncate, sequence_mask")
    return w * mask, capped


MISMATCH_THRESHOLD = 0.01  # nats: `sampler/mismatch_share` counts tokens whose |log pi_train - log pi_sampler| exceeds it


def behaviour_correction(prox_logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor, mode: str | None,
                         low: float, high: float, current_logps: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """The sampler's side of an update, once: how far the proximal policy (the learner at the update's start,
    whose ratio the loss clips) is from the policy that sampled, and the importance weights pi_prox /
    pi_sampler (`sampler_weights` in `mode`; None: no weights). With a fixed lag this is decoupled PPO's
    behaviour weight; synchronous, it corrects the sampler's numerics and truncation.

    prox_logps, sampler_logps, mask [r, T]; `current_logps` [r, T] (a fixed lag): the learner now, for the
    KL(sampler || learner) metric -> (weights [r, T] or None, metrics as 0-dim tensors)
    """
    diff = (prox_logps.detach() - sampler_logps).abs() * mask  # [r, T]
    metrics = {"sampler/mismatch_mean": masked_mean(diff, mask).detach(),
               "sampler/mismatch_max": diff.max() if diff.numel() else diff.new_zeros(()),
               "sampler/mismatch_share": masked_mean((diff > MISMATCH_THRESHOLD).float(), mask).detach()}
    if current_logps is not None:
        metrics["async/kl_sampler_learner"] = masked_mean(k3_kl(sampler_logps, current_logps.detach()), mask).detach()
    if mode is None:
        return None, metrics
    w, capped = sampler_weights(prox_logps, sampler_logps, mask, mode, low, high)
    metrics["sampler/capped_share"] = masked_mean(capped.float(), mask).detach()
    metrics["sampler/weight_mean"] = masked_mean(w, mask).detach()
    return w, metrics


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


@dataclass(frozen=True)
class Normalisers:
    """The loss normalisers of the whole minibatch a micro-batch belongs to."""

    rows: int  # completions in the minibatch
    tokens: float  # real completion tokens in the minibatch
    max_new_tokens: int  # the configured completion length (Dr. GRPO's constant)


def aggregate(per_token: torch.Tensor, mask: torch.Tensor, mode: str, norm: Normalisers) -> torch.Tensor:
    """Reduce a per-token loss [R, T] to a scalar, as one micro-batch's share of the minibatch loss.

    grpo: mean over sequences of each sequence's token mean; dapo: mean over all tokens; dr_grpo: token
    sum / (rows * max_new_tokens); luspo: mean over sequences of each sequence's token sum (a sequence
    weighs by its length). bnpo is dapo here: TRL's bnpo is the token mean of each process's micro-batch
    (so it changes with the micro-batch size) and its dapo the token mean of the whole batch; every
    aggregate here is normalised over the whole minibatch of all processes, so the two coincide.
    """
    masked = per_token * mask  # [R, T]
    if mode == "grpo":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / norm.rows
    if mode in ("dapo", "bnpo"):
        return masked.sum() / max(norm.tokens, 1.0)
    if mode == "dr_grpo":
        return masked.sum() / (norm.rows * norm.max_new_tokens)
    if mode == "luspo":
        return masked.sum() / norm.rows
    raise ValueError(f"unknown loss aggregation {mode!r}; valid: grpo, dapo, bnpo, dr_grpo, luspo")


def log_ratio(logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor, level: str) -> torch.Tensor:
    """log(pi/pi_old) per token [R, T], or per sequence (GSPO) as the masked token mean [R, 1]."""
    lr = logps - old_logps  # [R, T]
    if level == "token":
        return lr
    if level == "sequence":
        return ((lr * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)  # [R, 1]
    raise ValueError(f"unknown ratio level {level!r}; valid: token, sequence")


def clipped_surrogate(log_rho: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float,
                      delta: float | None = None):
    """PPO's pessimistic clipped objective as a per-token loss, and where each clip side is active.
    `delta` (two-sided clipping, INTELLECT-2) also caps the unclipped ratio, which bounds the loss of a
    negative-advantage token whose ratio has grown large.

    log_rho [R, T] or [R, 1]; adv [R, T] -> (loss [R, T], low_clipped [R, T], high_clipped [R, T])
    """
    rho = torch.exp(log_rho)  # [R, T] or [R, 1]
    clipped = torch.clamp(rho, 1.0 - eps_low, 1.0 + eps_high)
    capped = rho if delta is None else rho.clamp(max=delta)
    loss = -torch.min(capped * adv, clipped * adv)  # [R, T]
    low = (rho < 1.0 - eps_low) & (adv < 0)  # the clip binds on the low side
    high = (rho > 1.0 + eps_high) & (adv > 0)
    return loss, low.expand_as(loss), high.expand_as(loss)


def cispo_surrogate(log_rho: torch.Tensor, logps: torch.Tensor, adv: torch.Tensor, cap: float):
    """CISPO (MiniMax-M1): -sg(min(rho, cap)) * A * log pi. The ratio is a detached weight, so a token
    whose ratio passed the cap still gets a gradient (the clipped surrogate gives it none).

    log_rho [R, T] or [R, 1]; logps, adv [R, T] -> (loss [R, T], capped [R, T]: cap binding with A > 0)
    """
    rho = torch.exp(log_rho)
    loss = -rho.clamp(max=cap).detach() * adv * logps  # [R, T]
    return loss, ((rho > cap) & (adv > 0)).expand_as(loss)


def sapo_surrogate(log_rho: torch.Tensor, adv: torch.Tensor, t_pos: float, t_neg: float) -> torch.Tensor:
    """SAPO: a soft gate instead of a hard clip, -sigmoid(tau (rho - 1)) * 4 / tau * A, with tau by the
    advantage's sign; its gradient is A * rho * sech^2(tau (rho - 1) / 2), 1 at rho = 1, fading off-policy.

    log_rho [R, T] or [R, 1]; adv [R, T] -> loss [R, T]
    """
    tau = torch.where(adv > 0, t_pos, t_neg)  # [R, T]
    return -torch.sigmoid(tau * (torch.exp(log_rho) - 1.0)) * 4.0 / tau * adv


def vespo_weights(token_log_rho: torch.Tensor, row_adv: torch.Tensor, mask: torch.Tensor,
                  log_sampler_weights: torch.Tensor | None, k_pos: float, lam_pos: float, k_neg: float,
                  lam_neg: float) -> torch.Tensor:
    """VESPO's gamma weight of each sequence, phi(w) = exp(lam) * w^k * exp(-lam w) (phi(1) = 1), from the
    sequence ratio w = exp(sum of token log-ratios) (times the sampler correction when given), k and lam
    by the sign of the row's advantage; detached, computed in log space, clamps as the paper's code.

    token_log_rho, mask [R, T]; row_adv [R, 1]; log_sampler_weights [R, T] or None -> phi [R, 1]
    """
    with torch.no_grad():
        floor = math.log(1e-8)
        seq = (token_log_rho.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)  # [R, 1]
        if log_sampler_weights is not None:
            seq = seq + (log_sampler_weights.clamp(floor, 20.0) * mask).sum(-1, keepdim=True)
        log_w = seq.clamp(floor, 20.0)  # [R, 1]
        nonneg = row_adv >= 0
        k = torch.where(nonneg, k_pos, k_neg)
        lam = torch.where(nonneg, lam_pos, lam_neg).clamp(min=1e-4)
        phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))  # [R, 1]
        return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def off_policy_keep(row_adv: torch.Tensor, logps: torch.Tensor, sampler_logps: torch.Tensor, mask: torch.Tensor,
                    threshold: float) -> torch.Tensor:
    """DeepSeek-V3.2's off-policy sequence mask: keep a row when its advantage is >= 0 or its mean
    per-token KL(sampler || policy), estimated as log pi_sampler - log pi, is at most `threshold`.

    row_adv [R, 1]; logps, sampler_logps, mask [R, T] -> keep [R, 1] float (1 keep, 0 drop)
    """
    kl = ((sampler_logps - logps.detach()) * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1.0)
    return ((row_adv >= 0) | (kl <= threshold)).to(mask.dtype)  # [R, 1]


def high_entropy_mask(entropy: torch.Tensor, mask: torch.Tensor, keep: float) -> torch.Tensor:
    """The tokens whose entropy is at or above the (1 - keep) quantile of the real tokens' entropies
    ("Beyond the 80/20 rule": train on the forking tokens). entropy, mask [R, T] -> float [R, T]"""
    real = entropy.detach()[mask.bool()].float()  # [N]
    if real.numel() == 0:
        return torch.zeros_like(mask)
    cut = torch.quantile(real, 1.0 - keep)
    return ((entropy.detach() >= cut) & mask.bool()).to(mask.dtype)  # [R, T]


def value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor,
               clip: float | None) -> torch.Tensor:
    """Per-token critic loss 0.5 * (V - R)^2, or PPO's clipped form when `clip` is set:
    0.5 * max((V - R)^2, (V_old + clip(V - V_old, -clip, clip) - R)^2).  All [R, T] -> [R, T]
    """
    unclipped = (values - returns) ** 2
    if clip is None:
        return 0.5 * unclipped
    clipped = (old_values + torch.clamp(values - old_values, -clip, clip) - returns) ** 2
    return 0.5 * torch.max(unclipped, clipped)


def explained_variance(pred: torch.Tensor, target: torch.Tensor, mask: torch.Tensor, reduce=no_reduce) -> float:
    """1 - Var(target - pred) / Var(target) over the masked entries (1 = perfect, 0 = no better than the
    mean); `reduce` sums over the processes of a data-parallel run."""
    d = target - pred
    n, st, st2, sd, sd2 = reduce(torch.stack([mask.sum(), (target * mask).sum(), (target ** 2 * mask).sum(),
                                              (d * mask).sum(), (d ** 2 * mask).sum()]))
    n = n.clamp(min=1.0)
    var_t, var_d = st2 / n - (st / n) ** 2, sd2 / n - (sd / n) ** 2
    return float("nan") if var_t <= 0 else float(1.0 - var_d / var_t)
