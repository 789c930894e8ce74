"""Batched sampling from a causal LM: left-padded prompts, KV cache, stop at EOS.

Returns completion token ids with their lengths and a truncated flag (no EOS before max_new_tokens). The
completion ids are exactly the sampled ids: nothing is re-tokenised downstream, so token boundaries never
shift between rollout and update.

Deliberately left out: vLLM/SGLang engines and speculative decoding; `transformers.generate` is the one
code path for every model here.
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


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], *, max_new_tokens: int, do_sample: bool,
             temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, batch_size: int = 64,
             num_return_sequences: int = 1) -> Generation:
    """Sample `num_return_sequences` completions per prompt, rows ordered prompt-major."""
    stop = eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop[0]
    device = next(model.parameters()).device
    all_prompt, all_comp, all_trunc, n_tok = [], [], [], 0
    per_call = max(1, batch_size // num_return_sequences)
    for start in range(0, len(prompts), per_call):
        chunk = prompts[start:start + per_call]
        enc = tokenizer(chunk, return_tensors="pt", padding=True, padding_side="left",
                        add_special_tokens=False).to(device)
        kwargs = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, pad_token_id=pad,
                      eos_token_id=stop, num_return_sequences=num_return_sequences)
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
