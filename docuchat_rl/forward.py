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


def _shared_prompt_forward(model, batch: Batch):
    """Last hidden states [R, T, H] at the positions predicting each completion token, with each distinct
    prompt of the micro-batch run once and its keys/values shared by the rows of its group.

    None when no two rows share a group (nothing to save). Gradient-exact: the shared prompt's
    activations receive the summed gradient of every completion that attends to them, as in the
    one-row-per-sequence forward.
    """
    first, inverse = _group_index(batch.info.groups)
    lp, t = batch.prompt_width, batch.completion_mask.shape[1]
    if len(first) == batch.rows or lp == 0:
        return None
    first, inverse = (torch.tensor(x).to(batch.input_ids.device) for x in (first, inverse))  # [U], [R]
    decoder = _decoder(model)
    p_ids, p_mask = batch.input_ids[first, :lp], batch.attention_mask[first, :lp]  # [U, Lp]
    head = decoder(input_ids=p_ids, attention_mask=p_mask, position_ids=position_ids(p_mask), use_cache=True)
    cache = head.past_key_values
    _select_rows(cache, inverse)  # [U, ...] -> [R, ...]
    # completion token 0 is predicted by the prompt's last position, token j > 0 by completion position j-1
    hidden = head.last_hidden_state[:, -1:].index_select(0, inverse)  # [R, 1, H]
    if t > 1:
        tail = decoder(input_ids=batch.completion_ids[:, :t - 1], attention_mask=batch.attention_mask[:, :lp + t - 1],
                       position_ids=position_ids(batch.attention_mask)[:, lp:lp + t - 1], past_key_values=cache,
                       use_cache=True)
        hidden = torch.cat([hidden, tail.last_hidden_state], 1)  # [R, T, H]
    return hidden


def _decoder(model):
    """The decoder stack under the output head (transformers' `base_model`: Llama's `model`, GPT-2's
    `transformer`): it returns the last hidden state only, where `output_hidden_states` would keep every
    layer's alive. LoRA layers live inside it, so adapters (and `disable_adapter`) apply as in the full model."""
    return base_model(model).base_model


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


def _group_index(groups: tuple[int, ...]) -> tuple[list[int], list[int]]:
    """(first row of each distinct group [U], each row's position among them [R]), from the host's groups.

    >>> _group_index((4, 4, 1, 4, 1))
    ([0, 2], [0, 0, 1, 0, 1])
    """
    position: dict[int, int] = {}
    first = []
    for row, g in enumerate(groups):
        if g not in position:
            position[g] = len(first)
            first.append(row)
    return first, [position[g] for g in groups]


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
    hidden = _shared_prompt_forward(model, batch) if share_prompt else None
    if hidden is None:
        out = _decoder(model)(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                              position_ids=position_ids(batch.attention_mask), use_cache=False)
        hidden = out.last_hidden_state[:, -t - 1:-1, :]  # [R, T, H]: position j predicts completion token j
    head = output_head(model)
    if logit_chunk > 0:
        logps, entropy = chunked_token_stats(head, hidden, batch.completion_ids, temperature, logit_chunk,
                                             with_entropy, entropy_grad)
        return PolicyOutput(logps, entropy, hidden if with_hidden else None)
    # the sampler divides float32 logits by the temperature: so does the trainer (bf16 division is off by ~0.01)
    logits = head(hidden).float() / temperature  # [R, T, V]
    logps = token_logprobs(logits, batch.completion_ids)  # [R, T]
    entropy = None
    if with_entropy or entropy_grad:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = token_entropy(logits)  # [R, T]
    return PolicyOutput(logps, entropy, hidden if with_hidden else None)
