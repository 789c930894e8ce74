"""The policy forward pass that scores completion tokens: per-token log-probs, entropy, hidden states.

A `Batch` row is [left-padded prompt | completion, right-padded]; the completion starts at the same
column in every row, so its logits are the last T+1 positions shifted by one and `logits_to_keep`
spares the prompt positions. Position ids come from the attention mask, exactly as `generate` computed
them for left-padded prompts.

A group's rows share one prompt, so the forward can run each prompt once and hand its keys/values to the
group's completions (`share_prompt`); with prompts longer than completions this is most of the compute.
`logit_chunk` scores a few positions at a time from the last hidden states, never holding [R, T, V].

Deliberately left out: sequence packing and fused (Liger-style) loss kernels; chunking bounds memory
without a custom kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .batch import Batch
from .losses import chunked_token_stats, token_entropy, token_logprobs
from .modeling import base_model


@dataclass
class PolicyOutput:
    """What one forward gives the losses and the critic for a micro-batch."""

    logps: torch.Tensor  # [R, T] log-probs of the completion tokens (with grad if enabled)
    entropy: torch.Tensor | None  # [R, T] no grad
    hidden: torch.Tensor | None  # [R, T, H] last hidden states at the positions that predict each token


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only (left padding does not shift them). [R, L] -> [R, L]"""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def _shared_prompt_forward(model, batch: Batch, with_hidden: bool, with_logits: bool = True):
    """Logits [R, T, V] (None unless `with_logits`) and last hidden states [R, T, H] (None unless
    `with_hidden`) predicting each completion token, with each distinct prompt of the micro-batch run
    once and its keys/values shared by the rows of its group.

    None when no two rows share a group (nothing to save). Gradient-exact: the shared prompt's
    activations receive the summed gradient of every completion that attends to them, as in the
    one-row-per-sequence forward.
    """
    first, inverse = _group_index(batch.group)
    if first.numel() == batch.rows:
        return None
    lp, t = batch.prompt_width, batch.completion_mask.shape[1]
    if lp == 0:
        return None
    p_ids, p_mask = batch.input_ids[first, :lp], batch.attention_mask[first, :lp]  # [U, Lp]
    head = model(input_ids=p_ids, attention_mask=p_mask, position_ids=position_ids(p_mask), use_cache=True,
                 logits_to_keep=1, output_hidden_states=with_hidden)
    cache = head.past_key_values
    _select_rows(cache, inverse)  # [U, ...] -> [R, ...]
    tail = model(input_ids=batch.completion_ids[:, :t - 1], attention_mask=batch.attention_mask[:, :lp + t - 1],
                 position_ids=position_ids(batch.attention_mask)[:, lp:lp + t - 1], past_key_values=cache,
                 use_cache=True, output_hidden_states=with_hidden,
                 **({} if with_logits else {"logits_to_keep": 1})) if t > 1 else None
    # completion token 0 is predicted by the prompt's last position, token j > 0 by completion position j-1
    logits = None
    if with_logits:
        logits = head.logits[:, -1:].index_select(0, inverse)  # [R, 1, V]
        if tail is not None:
            logits = torch.cat([logits, tail.logits], 1)  # [R, T, V]
    hidden = None
    if with_hidden:
        hidden = head.hidden_states[-1][:, -1:].index_select(0, inverse)  # [R, 1, H]
        if tail is not None:
            hidden = torch.cat([hidden, tail.hidden_states[-1]], 1)  # [R, T, H]
    return logits, hidden


def _select_rows(cache, rows: torch.Tensor) -> None:
    """Cache rows `rows` in place. index_select, whose backward (index_add) is several times faster on a
    CPU than the advanced indexing of `batch_select_indices` (index_put with accumulation)."""
    from transformers.cache_utils import DynamicLayer

    if not all(type(layer) is DynamicLayer for layer in cache.layers):
        cache.batch_select_indices(rows)
        return
    for layer in cache.layers:
        layer.keys = layer.keys.index_select(0, rows)  # [R, H, Lp, D]
        layer.values = layer.values.index_select(0, rows)


def _group_index(group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(first row of each distinct group [U], each row's position among them [R])."""
    uniq, inverse = torch.unique(group, return_inverse=True)  # [U], [R]
    first = torch.full((uniq.numel(),), group.numel(), dtype=torch.long, device=group.device)
    first.scatter_reduce_(0, inverse, torch.arange(group.numel(), device=group.device), reduce="amin")
    return first, inverse


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


def policy_forward(model, batch: Batch, temperature: float = 1.0, with_entropy: bool = False,
                   with_hidden: bool = False, entropy_grad: bool = False,
                   share_prompt: bool = False, logit_chunk: int = 0) -> PolicyOutput:
    """Log-probs of each completion token under `model`; logits only for completion positions.

    `share_prompt` runs each group's prompt once (rows of a group have the same prompt) and reuses its
    keys/values for the group's completions: the same numbers up to float rounding, with G times less
    prompt compute. `logit_chunk` > 0 scores that many positions at a time from the last hidden states
    (`losses.chunked_token_stats`), never holding the micro-batch's [R, T, V] logits. The entropy is a
    diagnostic (no grad) unless `entropy_grad`, for losses with an entropy bonus.
    """
    t = batch.completion_mask.shape[1]
    chunked = logit_chunk > 0
    shared = (_shared_prompt_forward(model, batch, with_hidden or chunked, with_logits=not chunked)
              if share_prompt else None)
    if shared is not None:
        logits, hidden = shared
    else:
        out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                    position_ids=position_ids(batch.attention_mask), logits_to_keep=1 if chunked else t + 1,
                    output_hidden_states=with_hidden or chunked, use_cache=False)
        logits = None if chunked else out.logits[:, :-1, :]  # [R, T, V]: position j predicts completion token j
        hidden = out.hidden_states[-1][:, -t - 1:-1, :] if with_hidden or chunked else None  # [R, T, H]
    if chunked:
        logps, entropy = chunked_token_stats(output_head(model), hidden, batch.completion_ids, temperature,
                                             logit_chunk, with_entropy, entropy_grad)
        return PolicyOutput(logps, entropy, hidden if with_hidden else None)
    logits = logits / temperature  # [R, T, V]
    logps = token_logprobs(logits, batch.completion_ids)  # [R, T]
    entropy = None
    if with_entropy or entropy_grad:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = token_entropy(logits)  # [R, T]
    return PolicyOutput(logps, entropy, hidden)
