"""Batched sampling from a causal LM: left-padded prompts, KV cache, stop at EOS.

Returns completion token ids with their lengths and a truncated flag (no EOS before max_new_tokens). The
completion ids are exactly the sampled ids: nothing is re-tokenised downstream, so token boundaries never
shift between rollout and update.

Two engines, the same contract:
- `fast` (default): our own decode loop. Each distinct prompt is prefilled once and its keys/values are
  copied to its G samples (`transformers.generate` prefills every copy); decoding writes into
  preallocated static buffers instead of concatenating a growing cache every token, and attends only to
  their filled part; logits are computed for the last position only and sampled with one uniform per
  row through the CDF (drawing a random number per vocabulary entry, as `multinomial` and the Gumbel or
  exponential tricks do, cost more than a layer of the embedded model); it stops as soon as every row
  has ended. Hand-written because `generate` offers none of this for sampling. Models whose cache is
  not plain full attention (sliding windows, linear attention) keep a growing cache, repeated per sample.
- `hf`: `transformers.generate`, for anything the fast loop does not cover.

Deliberately left out: vLLM/SGLang engines, speculative decoding, continuous batching, compiled decode
steps (compilation takes longer than a whole run of the embedded default on a CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Generation:
    prompt_ids: list[list[int]]  # per prompt row, unpadded
    completion_ids: list[list[int]]  # per row, unpadded, EOS included when emitted
    truncated: list[bool]  # True when no EOS was produced within max_new_tokens
    n_tokens: int  # completion tokens generated in all


def eos_ids(model, tokenizer) -> list[int]:
    """Every token id that ends a completion (generation config's EOS list plus the tokenizer's)."""
    ids = model.generation_config.eos_token_id
    ids = [] if ids is None else ([ids] if isinstance(ids, int) else list(ids))
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def warp_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus), in `transformers`' order and with its tie rules.

    [R, V] -> [R, V] with removed tokens at -inf. At least one token always survives.

    >>> warp_logits(torch.tensor([[0.0, 1.0, 2.0, 3.0]]), top_k=2).isinf().tolist()
    [[True, True, False, False]]
    """
    logits = logits / temperature if temperature != 1.0 else logits
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [R, 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1)  # ascending, [R, V]
        cum = sorted_logits.softmax(-1).cumsum(-1)  # [R, V]
        drop = cum <= 1 - top_p
        drop[..., -1] = False  # keep the most likely token
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits


def sample(logits: torch.Tensor, do_sample: bool, temperature: float = 1.0, top_k: int = 0,
           top_p: float = 1.0) -> torch.Tensor:
    """One token per row from last-position logits [R, V] -> [R] (greedy when not `do_sample`)."""
    if not do_sample:
        return logits.argmax(-1)
    cdf = warp_logits(logits.float(), temperature, top_k, top_p).softmax(-1).cumsum(-1)  # [R, V]
    # inverse-CDF draw: one uniform per row (a draw per vocabulary entry costs more than the model here);
    # the first index whose CDF exceeds u, so a zero-probability token (flat CDF step) is never chosen
    u = torch.rand(cdf.shape[0], 1, device=cdf.device) * cdf[:, -1:]  # [R, 1]
    return torch.searchsorted(cdf, u, right=True).squeeze(-1).clamp_(max=cdf.shape[-1] - 1)  # [R]


def _filled_static_layer():
    """transformers' StaticLayer, attending only to the positions written so far.

    A StaticLayer hands attention its whole preallocated length (prompt + max_new_tokens) at every
    step, masked; with long completions that is up to twice the keys actually in use. This one returns
    the filled prefix of the same buffers, so a step costs what a growing cache costs, without the
    growing cache's concatenation.
    """
    from transformers.cache_utils import StaticLayer

    class FilledStaticLayer(StaticLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            keys, values = super().update(key_states, value_states, *args, **kwargs)
            n = int(self.cumulative_length)
            return keys[:, :, :n], values[:, :, :n]  # [R, H, filled, D]

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return int(self.cumulative_length) + query_length, 0

    return FilledStaticLayer


def _expanded_cache(model, prefill_cache, repeats: int, max_len: int):
    """The prefill cache with each prompt row repeated `repeats` times: preallocated static buffers of
    `max_len` positions when every layer is plain full attention, else the prefill cache itself, repeated."""
    from transformers import Cache, DynamicCache, StaticCache
    from transformers.cache_utils import DynamicLayer, StaticLayer

    if isinstance(prefill_cache, DynamicCache) and all(type(x) is DynamicLayer for x in prefill_cache.layers):
        layer_types = StaticCache(config=model.config, max_cache_len=max_len).layers  # the model's layer kinds
        if len(layer_types) == len(prefill_cache.layers) and all(type(x) is StaticLayer for x in layer_types):
            filled = _filled_static_layer()
            cache = Cache(layers=[filled(max_cache_len=max_len) for _ in layer_types])
            for i, layer in enumerate(prefill_cache.layers):
                cache.update(layer.keys.repeat_interleave(repeats, 0),  # [R, H, Lp, D]
                             layer.values.repeat_interleave(repeats, 0), i)
            return cache
    prefill_cache.batch_repeat_interleave(repeats)
    return prefill_cache


def _fast_chunk(model, input_ids, attention_mask, *, repeats, max_new_tokens, min_new_tokens, do_sample,
                temperature, top_p, top_k, stop, pad) -> torch.Tensor:
    """Completion ids [U * repeats, <= max_new_tokens] (pad after a row's EOS) for U left-padded prompts."""
    from .batch import position_ids

    u, lp = input_ids.shape
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask),
                use_cache=True, logits_to_keep=1)
    cache = _expanded_cache(model, out.past_key_values, repeats, lp + max_new_tokens)
    logits = out.logits[:, -1].repeat_interleave(repeats, 0)  # [R, V]
    rows = u * repeats
    mask = torch.ones(rows, lp + max_new_tokens, dtype=attention_mask.dtype, device=input_ids.device)
    mask[:, :lp] = attention_mask.repeat_interleave(repeats, 0)  # [R, Lp + N]
    next_pos = attention_mask.sum(1, keepdim=True).repeat_interleave(repeats, 0)  # [R, 1]
    stop_t = torch.tensor(stop, device=input_ids.device)
    done = torch.zeros(rows, dtype=torch.bool, device=input_ids.device)  # [R]
    tokens = []
    for t in range(max_new_tokens):
        if t < min_new_tokens:  # no EOS yet, as transformers' MinNewTokensLengthLogitsProcessor
            logits = logits.index_fill(-1, stop_t, float("-inf"))
        nxt = sample(logits, do_sample, temperature, top_k, top_p).masked_fill(done, pad)  # [R]
        tokens.append(nxt)
        done |= torch.isin(nxt, stop_t)
        if t == max_new_tokens - 1 or bool(done.all()):
            break
        out = model(input_ids=nxt[:, None], attention_mask=mask[:, :lp + t + 1], position_ids=next_pos + t,
                    past_key_values=cache, use_cache=True, logits_to_keep=1)
        logits = out.logits[:, -1]  # [R, V]
    return torch.stack(tokens, 1)  # [R, steps]


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], *, max_new_tokens: int, do_sample: bool,
             temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, batch_size: int = 64,
             num_return_sequences: int = 1, engine: str = "fast", min_new_tokens: int = 0) -> Generation:
    """Sample `num_return_sequences` completions per prompt, rows ordered prompt-major; no EOS before
    `min_new_tokens` (= max_new_tokens gives fixed lengths, for benchmarks)."""
    if engine not in ("fast", "hf"):
        raise ValueError(f"unknown generation engine {engine!r}; valid: fast, hf")
    stop = eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop[0]
    device = next(model.parameters()).device
    all_prompt, all_comp, all_trunc, n_tok = [], [], [], 0
    per_call = max(1, batch_size // num_return_sequences)
    for start in range(0, len(prompts), per_call):
        chunk = prompts[start:start + per_call]
        enc = tokenizer(chunk, return_tensors="pt", padding=True, padding_side="left",
                        add_special_tokens=False).to(device)
        if engine == "fast":
            new = _fast_chunk(model, enc["input_ids"], enc["attention_mask"], repeats=num_return_sequences,
                              max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                              do_sample=do_sample, temperature=temperature,
                              top_p=top_p, top_k=top_k, stop=stop, pad=pad).tolist()
        else:
            kwargs = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, pad_token_id=pad,
                          eos_token_id=stop, num_return_sequences=num_return_sequences)
            if min_new_tokens:
                kwargs.update(min_new_tokens=min_new_tokens)
            if do_sample:
                kwargs.update(temperature=temperature, top_p=top_p, top_k=top_k)
            else:  # silence sampling defaults a model's generation_config may carry
                kwargs.update(temperature=None, top_p=None, top_k=None)
            out = model.generate(**enc, **kwargs)  # [rows * num_return, prompt_len + new]
            new = out[:, enc["input_ids"].shape[1]:].tolist()
        mask = enc["attention_mask"].tolist()
        for r, row in enumerate(new):
            src = r // num_return_sequences
            ids = enc["input_ids"][src][[bool(m) for m in mask[src]]].tolist()
            cut = next((i for i, t in enumerate(row) if t in stop), None)
            comp = row if cut is None else row[:cut + 1]
            all_prompt.append(ids)
            all_comp.append(comp)
            all_trunc.append(cut is None)
            n_tok += len(comp)
    return Generation(all_prompt, all_comp, all_trunc, n_tok)
