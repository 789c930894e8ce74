"""The policy forward pass that scores completion tokens: per-token log-probs, entropy, hidden states.

A `Batch` row is [left-padded prompt | completion, right-padded]; the completion starts at the same
column in every row, so its logits are the last T+1 positions shifted by one and `logits_to_keep`
spares the prompt positions. Position ids come from the attention mask, exactly as `generate` computed
them for left-padded prompts.

A group's rows usually share one prompt, so the forward can run each distinct prompt once and hand its
keys/values to the rows that have it (`share_prompt`); with prompts longer than completions this is most of
the compute. Rows are matched by their prompt tokens (`RowInfo.prompts`), not by their group: an
environment's per-row first observation gives a group's rows different prompts, and each runs its own.
`logit_chunk` scores a few positions at a time from the last hidden states, never holding [R, T, V].

Completions end at different lengths, and a micro-batch padded to its longest spends most of its work on
padding when a few rows run long (natural EOS: often half the positions). `length_buckets` splits the rows
by completion length into a few forwards, each padded to its own longest (`bucket_rows`: an exact
cut by dynamic programming); with a shared prompt, the prompt still runs once and every bucket reads its
keys/values. The numbers are the same up to float rounding.

Deliberately left out: sequence packing (a varlen attention kernel; on a CPU there is none, and buckets
take most of its gain) and fused (Liger-style) loss kernels; chunking bounds memory without a custom kernel.
"""

from __future__ import annotations

import bisect
import copy
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..modeling import base_model, cache_of, in_compute_context, position_ids, with_cache
from .batch import Batch
from .losses import FILTERED, chunked_token_stats, dropped, kept_floor, token_entropy, token_logprobs


@dataclass
class PolicyOutput:
    """What one forward gives the losses and the critic for a micro-batch."""

    logps: torch.Tensor  # [R, T] log-probs of the completion tokens (with grad if enabled)
    entropy: torch.Tensor | None  # [R, T] no grad
    hidden: torch.Tensor | None  # [R, T, H] last hidden states at the positions that predict each token


BUCKET_COST = 64  # padded positions one more forward is worth (its fixed cost: the model calls, the
# copy of the prompt's keys/values): a cut into buckets must save more padding than this per extra bucket


def bucket_rows(lens: Sequence[int], most: int, cost: int = BUCKET_COST) -> list[list[int]]:
    """Rows grouped into at most `most` buckets by completion length, each to run padded to its own longest:
    the split of the length-sorted rows with the fewest padded positions (a bucket costs rows x its longest,
    plus `cost`), found exactly by dynamic programming over the distinct lengths. Buckets come shortest
    first, each row in its original order. Whatever the lengths, one bucket when `most` is 1.

    >>> bucket_rows([5, 40, 6, 38, 7, 40], most=2)
    [[0, 2, 4], [1, 3, 5]]
    >>> bucket_rows([30, 31, 32, 33], most=4)
    [[0, 1, 2, 3]]
    """
    widths = [max(n, 1) for n in lens]  # a row occupies at least one column
    counts = Counter(widths)
    distinct = sorted(counts)
    w = np.array(distinct, dtype=np.float64)  # [D] distinct widths, ascending
    d = len(w)
    if most <= 1 or d <= 1:
        return [list(range(len(lens)))]
    cum = np.concatenate([[0], np.cumsum([counts[x] for x in distinct])])  # [D + 1] rows up to each width
    span = (cum[None, 1:] - cum[:-1, None]) * w[None, :]  # [D, D]: widths i..j in one bucket, padded to w[j]
    span[np.tril_indices(d, -1)] = np.inf  # (i > j: no such bucket)
    best, starts, totals = span[0], [], [span[0, -1] + cost]  # best[j]: cheapest cover of widths 0..j
    for _ in range(1, min(most, d)):
        cand = best[:-1, None] + span[1:, :]  # [D - 1, D]: buckets up to width i - 1, then widths i..j
        starts.append(cand.argmin(0) + 1)  # [D] where the last bucket starts
        best = cand.min(0)
        totals.append(best[-1] + cost * (len(totals) + 1))
    k, j, cuts = int(np.argmin(totals)), d - 1, []  # (argmin: the fewest buckets among equal costs)
    for start in reversed(starts[:k]):
        cuts.append(int(start[j]))
        j = int(start[j]) - 1
    firsts = [distinct[c] for c in reversed(cuts)]  # the shortest width of every bucket after the first
    out: list[list[int]] = [[] for _ in range(len(firsts) + 1)]
    for row, x in enumerate(widths):
        out[bisect.bisect_right(firsts, x)].append(row)
    return out


def _shared_prompt_forward(model, batch: Batch, parts: list[tuple[list[int] | None, int]] | None = None
                           ) -> list[torch.Tensor] | None:
    """Per part ((rows, width) from `_part_widths`; by default one part of every row), the last hidden states
    [n, width, H] at the positions predicting each completion token, with each distinct prompt of the
    micro-batch run once and its keys/values shared by the rows that have it.

    None when no two rows share a prompt (nothing to save). Gradient-exact: the shared prompt's
    activations receive the summed gradient of every completion that attends to them, as in the
    one-row-per-sequence forward.
    """
    first, inverse = _distinct_index(batch.info.prompts)
    lp = batch.prompt_width
    if len(first) == batch.rows or lp == 0:
        return None
    device = batch.input_ids.device
    first_t = torch.tensor(first).to(device)  # [U]
    decoder = decoder_stack(model)
    p_ids, p_mask = batch.input_ids[first_t, :lp], batch.attention_mask[first_t, :lp]  # [U, Lp]
    head = decoder(input_ids=p_ids, attention_mask=p_mask, position_ids=position_ids(p_mask), use_cache=True)
    positions = position_ids(batch.attention_mask)[:, lp:]  # [R, T]
    parts = parts or _part_widths(batch, None)
    out = []
    for rows, width in parts:
        index = slice(None) if rows is None else torch.tensor(rows).to(device)  # [n]
        prompt_of = inverse if rows is None else [inverse[r] for r in rows]  # [n] each row's prompt
        cache = cache_of(head) if len(parts) == 1 else _own_cache(cache_of(head))
        _select_rows(cache, prompt_of)  # [U, ...] -> [n, ...]
        # completion token 0 is predicted by the prompt's last position, token j > 0 by completion position j-1
        hidden = _spread(head.last_hidden_state[:, -1:], prompt_of)  # [n, 1, H]
        if width > 1:
            tail = decoder(input_ids=batch.completion_ids[index, :width - 1],
                           attention_mask=batch.attention_mask[index, :lp + width - 1],
                           position_ids=positions[index, :width - 1], use_cache=True, **with_cache(decoder, cache))
            hidden = torch.cat([hidden, tail.last_hidden_state], 1)  # [n, T_part, H]
        out.append(hidden)
    return out


def _part_widths(batch: Batch, parts: list[list[int]] | None) -> list[tuple[list[int] | None, int]]:
    """(rows, columns) of each part: the whole width for one part of every row (rows None), else the part's
    longest completion (read from the host's lengths)."""
    if parts is None or len(parts) == 1:
        return [(None, batch.completion_mask.shape[1])]
    lens = batch.info.completion_lens
    return [(rows, max(max(lens[r] for r in rows), 1)) for rows in parts]


def _own_cache(cache):
    """A copy of the prompt's cache for one part: the cache and layer objects copied, the tensors shared (a
    layer replaces its keys and values on update and on row selection, never writes into them)."""
    own = copy.copy(cache)
    own.layers = [copy.copy(layer) for layer in cache.layers]
    return own


def decoder_stack(model):
    """The decoder stack under the output head (transformers' `base_model`: Llama's `model`, GPT-2's
    `transformer`): it returns the last hidden state only, where `output_hidden_states` would keep every
    layer's alive. LoRA layers live inside it, so adapters (and `disable_adapter`) apply as in the full model."""
    return base_model(model).base_model


def _select_rows(cache, rows: list[int]) -> None:
    """Cache rows `rows` in place ([U, ...] -> [len(rows), ...]; by `_spread` when every layer is a plain
    growing one: its backward is several times faster on a CPU than the index_put with accumulation of
    `batch_select_indices`' advanced indexing)."""
    from transformers.cache_utils import DynamicLayer

    if not all(type(layer) is DynamicLayer for layer in cache.layers):
        cache.batch_select_indices(torch.tensor(rows).to(cache.layers[0].keys.device))
        return
    for layer in cache.layers:
        layer.keys = _spread(layer.keys, rows)  # [R, H, Lp, D]
        layer.values = _spread(layer.values, rows)


class _TakeRows(torch.autograd.Function):
    """x [U, ...] -> x[index] [n, ...], as index_select, with a backward that makes the incoming gradient
    contiguous before its index_add: the gradient reaching a prompt's keys is a slice of the cache's
    concatenation, and torch's CPU index_add is about 5x slower on such a strided view (it was 8% of the
    CPU time of an update of the embedded default; now it is not among the update's top operations)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(index)
        ctx.rows = x.shape[0]
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (index,) = ctx.saved_tensors
        return grad.new_zeros(ctx.rows, *grad.shape[1:]).index_add_(0, index, grad.contiguous()), None


def _spread(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows] for x [U, ...] (`_TakeRows`).

    >>> _spread(torch.tensor([10, 20, 30]), [0, 0, 2]).tolist()
    [10, 10, 30]
    """
    return _TakeRows.apply(x, torch.tensor(rows).to(x.device))


def _distinct_index(keys: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """(first row of each distinct prompt [U], each row's position among them [R]), from the host's keys.

    >>> _distinct_index((4, 4, 1, 4, 1))
    ([0, 2], [0, 0, 1, 0, 1])
    """
    position: dict[int, int] = {}
    first = []
    for row, g in enumerate(keys):
        if g not in position:
            position[g] = len(first)
            first.append(row)
    return first, [position[g] for g in keys]


def output_head(model):
    """hidden [n, H] -> logits [n, V] exactly as the model's forward computes them from its last hidden
    state: the output layer (with its LoRA, if targeted), then the logit scaling or soft-capping some
    architectures apply (Gemma2's final_logit_softcapping, Cohere's logit_scale, Granite's logits_scaling)."""
    base = base_model(model)
    lm_head, cfg = base.get_output_embeddings(), base.config
    cap = getattr(cfg, "final_logit_softcapping", None)
    scale = getattr(cfg, "logit_scale", None)
    divide = getattr(cfg, "logits_scaling", None)

    def head(h: torch.Tensor) -> torch.Tensor:
        logits = lm_head(h)
        if scale is not None:
            logits = logits * scale
        if divide is not None:
            logits = logits / divide
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    return head


def _plain_forward(model, batch: Batch) -> torch.Tensor:
    """Last hidden states [R, T, H] at the positions predicting each completion token, one sequence a row."""
    t = batch.completion_mask.shape[1]
    out = decoder_stack(model)(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                          position_ids=position_ids(batch.attention_mask), use_cache=False)
    return out.last_hidden_state[:, -t - 1:-1, :]  # [R, T, H]: position j predicts completion token j


def _token_stats(head, hidden: torch.Tensor, ids: torch.Tensor, temperature: float, logit_chunk: int,
                 with_entropy: bool, entropy_grad: bool, top_k: int = 0,
                 top_p: float = 1.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(log-probs [R, T], entropy [R, T] or None) of `ids` [R, T] from the hidden states [R, T, H], under the
    sampler's temperature and top-k / top-p truncation (`losses.kept_floor`)."""
    if logit_chunk > 0:
        return chunked_token_stats(head, hidden, ids, temperature, logit_chunk, with_entropy, entropy_grad,
                                   top_k, top_p)
    # the sampler divides float32 logits by the temperature: so does the trainer (bf16 division is off by ~0.01)
    logits = head(hidden).float() / temperature  # [R, T, V]
    floor = kept_floor(logits.detach().flatten(0, 1), top_k, top_p)  # [R*T] or None
    if floor is not None:
        drop = dropped(logits.detach().flatten(0, 1), floor, ids.flatten())  # [R*T, V]
        logits = logits.masked_fill(drop.view(logits.shape), FILTERED)  # [R, T, V]
    logps = token_logprobs(logits, ids)  # [R, T]
    entropy = None
    if with_entropy or entropy_grad:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = token_entropy(logits)  # [R, T]
    return logps, entropy


def _stitch(pieces: list[torch.Tensor], order: torch.Tensor, t: int) -> torch.Tensor:
    """Per-part [n, T_part, ...] tensors -> [R, t, ...] in row order (`order`: each row's place among the
    parts' rows), zero past each part's width. Differentiable."""
    padded = [torch.cat([p, p.new_zeros(p.shape[0], t - p.shape[1], *p.shape[2:])], 1) for p in pieces]
    return torch.cat(padded).index_select(0, order)  # [R, t, ...]


@in_compute_context
def policy_forward(model, batch: Batch, temperature: float = 1.0, with_entropy: bool = False,
                   with_hidden: bool = False, entropy_grad: bool = False,
                   share_prompt: bool = False, logit_chunk: int = 0, length_buckets: int = 1,
                   top_k: int = 0, top_p: float = 1.0) -> PolicyOutput:
    """Log-probs of each completion token under `model`; logits only for completion positions. `temperature`,
    `top_k` and `top_p` are the sampler's: the log-probs (and entropy) are those of the distribution the
    sampler drew from, truncated and renormalised (`losses.kept_floor`).

    `share_prompt` runs each distinct prompt once and reuses its keys/values for the completions of the
    rows that have it: the same numbers up to float rounding, with G times less
    prompt compute. `length_buckets` > 1 splits the rows by completion length into up to that many
    forwards, each padded only to its own longest (positions past a row's bucket come back as 0; the
    completion mask covers none of them). `logit_chunk` > 0 scores that many positions at a time from the
    last hidden states (`losses.chunked_token_stats`), never holding the micro-batch's [R, T, V] logits.
    The entropy is a diagnostic (no grad) unless `entropy_grad`, for losses with an entropy bonus.
    """
    parts = bucket_rows(batch.info.completion_lens, length_buckets)
    widths = _part_widths(batch, parts)
    hiddens = _shared_prompt_forward(model, batch, widths) if share_prompt else None
    if hiddens is None:
        hiddens = [_plain_forward(model, batch if rows is None else batch.select(rows)) for rows, _ in widths]
    head = output_head(model)
    stats = [_token_stats(head, h, batch.completion_ids[slice(None) if rows is None else rows, :w], temperature,
                          logit_chunk, with_entropy, entropy_grad, top_k, top_p) for h, (rows, w) in zip(hiddens, widths)]
    if len(parts) == 1:
        (logps, entropy), hidden = stats[0], hiddens[0]
        return PolicyOutput(logps, entropy, hidden if with_hidden else None)
    t = batch.completion_mask.shape[1]
    order = torch.tensor(np.argsort(np.concatenate(parts), kind="stable")).to(batch.input_ids.device)  # [R]
    logps = _stitch([p for p, _ in stats], order, t)  # [R, T]
    entropy = None if stats[0][1] is None else _stitch([e for _, e in stats], order, t)  # [R, T]
    return PolicyOutput(logps, entropy, _stitch(hiddens, order, t) if with_hidden else None)
