"""Batched sampling from a causal LM: left-padded prompts, KV cache, stop at EOS.

Returns completion token ids with their lengths, a truncated flag (no EOS before max_new_tokens) and the
sampler's own log-prob of every token (under the distribution it was drawn from, after temperature,
top-k and top-p). The completion ids are exactly the sampled ids: nothing is re-tokenised downstream, so
token boundaries never shift between rollout and update. Only the processors the caller names shape the
distribution (transformers' own warpers); a model's generation_config adds none. This is the contract
any rollout engine must meet: the trainer compares its log-probs with the sampler's.

Two decode loops, the same contract (which one samples is chosen in decoding.py):
- `fast` (default): our own decode loop. Each distinct prompt is prefilled once and its keys/values are
  copied to its G samples (`transformers.generate` prefills every copy); decoding writes into
  preallocated static buffers instead of concatenating a growing cache every token, and attends only to
  their filled part; logits are computed for the last position only and sampled with one uniform per
  row through the float64 CDF (drawing a random number per vocabulary entry, as `multinomial` and the
  Gumbel or exponential tricks do, costs more than a layer of the embedded model); once a quarter of the
  rows still decoding have ended, they are dropped from the batch and cache (with row seeds, as every
  rollout has, each row's draws are its own, so this changes nothing but the work); it stops as soon as
  every row has ended. Hand-written because `generate` offers none of this for sampling. Llama, Qwen2
  and Mistral (full attention) decode with `grouped_decode.GroupedSteps`, which keeps each prompt's
  keys/values once for its G rows instead of G copies (`rollout.grouped_decode`). Other models run their
  own forward over the static buffers; those whose cache is not plain full attention (sliding windows,
  linear attention) keep a growing cache, repeated per sample.
- `hf`: `transformers.generate`, for anything the fast loop does not cover.

With `cuda_graphs`, the same models decode at static shapes (static_decode.py), which a GPU replays as
one CUDA graph per token.

Deliberately left out: SGLang, speculative decoding, continuous batching, and compiled decode steps
(compilation takes longer than a whole run of the embedded default on a CPU). vLLM is an engine of its
own (vllm_engine.py).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from dataclasses import dataclass

import torch

from ..modeling import (base_model, cache_of, eos_ids, in_compute_context, merged_adapter, position_ids, warpers,
                        with_cache)
from .draw import block_draw
from .decoding import Decoding
from .grouped_decode import GroupedSteps, additive_mask, plain_full_attention, supports
from .static_decode import static_chunk
from .turn_cache import Kept, TurnCache, open_cache

DONE_CHECK_EVERY = 8  # the decode loop asks whether every row has finished every this many tokens


def row_seed(seed: int, step: int, slot: int, sample: int) -> int:
    """The seed of one completion's random stream: a hash of (run seed, step, the prompt's slot among the
    step's sampled prompts, sample index), so what it draws depends on nothing else (not on
    generation_batch_size, nor on how prompts are split between processes)."""
    digest = hashlib.blake2b(f"{seed}/{step}/{slot}/{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)

@dataclass
class Generation:
    """What an engine returns for a batch of prompts: tokens, truncation flags and the sampler's log-probs."""

    prompt_ids: list[list[int]]  # per prompt row, unpadded
    completion_ids: list[list[int]]  # per row, unpadded, EOS included when emitted
    truncated: list[bool]  # True when no EOS was produced within max_new_tokens
    logps: list[list[float]]  # per row: each completion token's log-prob under the distribution it was drawn from
    seconds: float | None = None  # sampled ahead (a fixed lag): the engine's own wall seconds for these rows
    # multi-turn rollouts (multiturn.run_turns): the completion is model and tool tokens
    model_mask: list[list[int]] | None = None  # per row, per completion token: 1 sampled by the model, 0 a tool's
    turns: list[list] | None = None  # per row, its multiturn.Turn records
    conversations: list[list[dict]] | None = None  # per row, the completion as chat messages (TRL's shape)
    environments: list | None = None  # per row, its environment instance (rewards get them as `environments`)
    dropped_groups: tuple[int, ...] = ()  # prompts (of these rows, in order) whose environment failed to reset
    observations: list[str | None] | None = None  # per row, its environment's first observation as appended
    prefill_tokens: int | None = None  # multi-turn: prompt tokens the model was run over, every turn's
    cached_tokens: int | None = None  # multi-turn: prompt tokens taken from kept keys/values (turn_cache.py)


@dataclass
class Draw:
    tokens: torch.Tensor  # [R] long
    logps: torch.Tensor  # [R] float32: log-prob of each token under the (warped) distribution it was drawn from


def completion_texts(tokenizer, completions: list[list[int]], stop: list[int]) -> list[str]:
    """Each completion's text without the token that ended it: an EOS is special and skipped anyway, a
    model.stop_tokens token ("\n\n") is not, and a reward must not see it."""
    return tokenizer.batch_decode([c[:-1] if c and c[-1] in stop else c for c in completions],
                                  skip_special_tokens=True)


def row_uniforms(seeds: list[int], steps: int, device) -> torch.Tensor:
    """Each row's own stream of uniforms: [R, steps] float64, row r drawn from a generator seeded with
    seeds[r], so a row's draws depend on its seed alone, not on the batch it is sampled in."""
    rows = [torch.rand(steps, generator=torch.Generator().manual_seed(s), dtype=torch.float64) for s in seeds]
    return torch.stack(rows).to(device)  # [R, steps]


def sample(logits: torch.Tensor, do_sample: bool, processors: list | None = None,
           uniforms: torch.Tensor | None = None) -> Draw:
    """One token per row from last-position logits [R, V] (greedy when not `do_sample`), with its log-prob.

    Sampling applies `processors` (see `warpers`) and draws with one uniform per row (`uniforms` [R, 1]
    float64, else from torch's global generator) through the inverse CDF (`block_draw`; a draw per
    vocabulary entry, as `multinomial` and the Gumbel trick do, costs more than a layer of the embedded
    model). The log-prob is the sampler's own: under the warped distribution.
    """
    logits = logits.float()
    if not do_sample:
        tokens = logits.argmax(-1)  # [R]
        return Draw(tokens, torch.log_softmax(logits, -1).gather(-1, tokens[:, None]).squeeze(-1))
    for proc in processors or []:
        logits = proc(None, logits)  # [R, V], removed tokens at -inf
    u = uniforms if uniforms is not None else torch.rand(logits.shape[0], 1, device=logits.device,
                                                          dtype=torch.float64)  # [R, 1]
    tokens, logps = block_draw(logits, u)  # [R, 1] each
    return Draw(tokens.squeeze(-1), logps.squeeze(-1))


@functools.cache
def _filled_static_layer():
    """transformers' StaticLayer, attending only to the positions written so far, its length kept as a
    Python int.

    A StaticLayer hands attention its whole preallocated length (prompt + max_new_tokens) at every
    step, masked; with long completions that is up to twice the keys actually in use. This one returns
    the filled prefix of the same buffers, so a step costs what a growing cache costs, without the
    growing cache's concatenation. Its length is counted on the host (`filled`), never read back from
    the device tensor (reading it would stop the host until the GPU caught up, once per layer per token),
    and new keys and values are written by slice (StaticLayer's tensor counter is not used).
    """
    from transformers.cache_utils import StaticLayer

    class FilledStaticLayer(StaticLayer):
        def __init__(self, max_cache_len: int, **kwargs):
            super().__init__(max_cache_len, **kwargs)
            self.filled = 0  # positions written so far (host-side twin of cumulative_length)

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            start, self.filled = self.filled, self.filled + key_states.shape[-2]
            self.keys[:, :, start:self.filled].copy_(key_states)  # (one copy; no position tensor, no counter)
            self.values[:, :, start:self.filled].copy_(value_states)
            return self.keys[:, :, :self.filled], self.values[:, :, :self.filled]  # [R, H, filled, D]

        def get_mask_sizes(self, query_length: int, *args) -> tuple[int, int]:
            return self.filled + query_length, 0

        def get_seq_length(self) -> int:
            return self.filled

    return FilledStaticLayer


def _is_filled_static(cache) -> bool:
    """Whether `cache` is the preallocated full-attention cache `_expanded_cache` builds."""
    return bool(getattr(cache, "layers", None)) and all(type(x) is _filled_static_layer() for x in cache.layers)


def _expanded_cache(model, prefill_cache, repeats: int, max_len: int):
    """The prefill cache with each prompt row repeated `repeats` times: preallocated static buffers of
    `max_len` positions when every layer is plain full attention, else the prefill cache itself, repeated."""
    from transformers import Cache, StaticCache
    from transformers.cache_utils import StaticLayer

    if plain_full_attention(prefill_cache):
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


class _ModelSteps:
    """Decode steps through the model's own forward, over the cache `_expanded_cache` builds from the
    prefill (each prompt row repeated G times). The same call and `drop` as `grouped_decode.GroupedSteps`."""

    def __init__(self, model, prefill_cache, attention_mask: torch.Tensor, repeats: int, max_new_tokens: int):
        u, lp = attention_mask.shape
        rows, device = u * repeats, attention_mask.device
        self.model, self.prompt_len = model, lp
        self.cache = _expanded_cache(model, prefill_cache, repeats, lp + max_new_tokens)
        self.droppable = _is_filled_static(self.cache)  # finished rows may leave the batch
        mask = torch.ones(rows, lp + max_new_tokens, dtype=attention_mask.dtype, device=device)
        mask[:, :lp] = attention_mask.repeat_interleave(repeats, 0)  # [R, Lp + N]
        if self.droppable:  # every layer full attention: hand the model its 4D additive mask, built once
            # (transformers would rebuild it from the 2D mask at every step, and a bool mask is slower in SDPA)
            mask = additive_mask(mask, self.cache.layers[0].keys.dtype)  # [R, 1, 1, Lp + N]
        self.mask = mask
        self.next_pos = attention_mask.sum(1, keepdim=True).repeat_interleave(repeats, 0)  # [R, 1]

    def drop(self, keep: torch.Tensor) -> None:
        """Keep only the rows `keep` [r'] (of the rows still decoding), in that order."""
        self.cache.reorder_cache(keep)  # (transformers' own row selection: index_select in every layer)
        self.mask, self.next_pos = self.mask[keep], self.next_pos[keep]

    def row_kv(self, j: int, u: int, fed: int) -> list[tuple[torch.Tensor, ...]]:
        """Per layer: decoding row j's prompt keys and values [H, Lp, D] and its first `fed` completion
        positions' [H, fed, D] (turn_cache.py; a droppable cache only)."""
        lp = self.prompt_len
        return [(x.keys[j, :, :lp], x.values[j, :, :lp], x.keys[j, :, lp:lp + fed], x.values[j, :, lp:lp + fed])
                for x in self.cache.layers]

    def __call__(self, tokens: torch.Tensor, t: int) -> torch.Tensor:
        """Logits [r, V] after tokens [r] at completion position t (0-based) of each row still decoding."""
        out = self.model(input_ids=tokens[:, None], attention_mask=self.mask[..., :self.prompt_len + t + 1],
                         position_ids=self.next_pos + t, use_cache=True, logits_to_keep=1,
                         **with_cache(self.model, self.cache))
        return out.logits[:, -1]


def _fast_chunk(model, input_ids, attention_mask, *, repeats, max_new_tokens, min_new_tokens, do_sample,
                processors, stop, pad, uniforms=None, lockstep=None,
                grouped: bool = True, static: bool = False, compiled: bool = False, fused: bool = False,
                kept: list[Kept | None] | None = None, keep_to: TurnCache | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Completion ids [U * repeats, <= max_new_tokens] (pad after a row's EOS) for U left-padded prompts,
    and the sampler's log-prob of each [same shape]. With `lockstep` (sharded weights) decoding goes on
    while any process still has a row to finish. `grouped`: decode with `grouped_decode.GroupedSteps`
    where the model is one it covers; `static`: with `static_decode.static_chunk` (CUDA graphs on a GPU),
    its step compiled by torch.compile when `compiled`, its projections fused when `fused`. `kept`: per
    prompt, the keys/values of its first ids (turn_cache.py; only those after them are prefilled);
    `keep_to`: the TurnCache each row's keys/values go to as it stops decoding (where the decode can)."""
    prompts = None  # each prompt's ids, unpadded (the keys of the rows kept for their next turn)
    if keep_to is not None:
        prompts = [row[m.bool()].tolist() for row, m in zip(input_ids, attention_mask)]
    out, attention_mask = _prefill(model, input_ids, attention_mask, kept)
    if static and lockstep is None and supports(model, cache_of(out)):
        return static_chunk(model, cache_of(out), out.logits[:, -1], attention_mask, repeats=repeats,
                            max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens, do_sample=do_sample,
                            processors=processors, stop=stop, pad=pad, uniforms=uniforms, sample=sample,
                            done_check_every=DONE_CHECK_EVERY, compiled=compiled, fused=fused)
    kind = GroupedSteps if grouped and lockstep is None and supports(model, cache_of(out)) else _ModelSteps
    decode = kind(model, cache_of(out), attention_mask, repeats, max_new_tokens)
    logits = out.logits[:, -1].repeat_interleave(repeats, 0)  # [R, V]
    rows = input_ids.shape[0] * repeats
    stop_t = torch.tensor(stop, device=input_ids.device)
    done = torch.zeros(rows, dtype=torch.bool, device=input_ids.device)  # [r]: of the rows still decoding
    tokens = torch.full((rows, max_new_tokens), pad, dtype=torch.long, device=input_ids.device)  # [R, N]
    logps = torch.zeros(rows, max_new_tokens, device=input_ids.device)  # [R, N]
    alive = None  # [r]: the rows still decoding, once finished ones were dropped (None: every row)
    compact = lockstep is None and decode.droppable
    keeper = _Keeper(keep_to, decode, attention_mask, prompts, repeats, stop) if keep_to and compact else None
    steps = 0
    for t in range(max_new_tokens):
        if t < min_new_tokens:  # no EOS yet, as transformers' MinNewTokensLengthLogitsProcessor
            logits = logits.index_fill(-1, stop_t, float("-inf"))
        draw = sample(logits, do_sample, processors, None if uniforms is None else uniforms[:, t:t + 1])
        nxt = draw.tokens.masked_fill(done, pad)  # [r]
        where = slice(None) if alive is None else alive
        tokens[where, t], logps[where, t], steps = nxt, draw.logps, t + 1
        done |= torch.isin(nxt, stop_t)
        if t == max_new_tokens - 1:
            break
        if (t + 1) % DONE_CHECK_EVERY == 0 or lockstep:  # (reading `done` waits for the device: not every token)
            finished = int(done.sum())
            going = finished < done.numel()
            if not (lockstep(going) if lockstep else going):
                break
            if compact and finished * 4 >= done.numel():  # a quarter or more have ended: decode without them
                if keeper is not None:  # (the rows leaving hand their keys/values to the turn cache first)
                    keeper.rows(done.nonzero().squeeze(-1).tolist(), alive, tokens)
                going_on = (~done).nonzero().squeeze(-1)  # [r']
                alive = going_on if alive is None else alive[going_on]
                decode.drop(going_on)
                done, nxt = done[going_on], nxt[going_on]
                uniforms = None if uniforms is None else uniforms[going_on]
        logits = decode(nxt, t)  # [r, V]
    if keeper is not None:
        keeper.rows(list(range(done.numel())), alive, tokens[:, :steps])
    return tokens[:, :steps], logps[:, :steps]  # [R, steps], [R, steps]


def _prefill(model, input_ids, attention_mask, kept: list[Kept | None] | None):
    """(the prefill's output, the attention mask [U, L'] its cache is read with): the model over the prompts
    [U, L] (left-padded), or, where `kept` holds a prompt's first ids' keys/values (turn_cache.py), over the
    rest of each prompt only, the kept keys/values left-padded to the longest before them."""
    if not kept or not any(kept):
        return model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids(attention_mask),
                     use_cache=True, logits_to_keep=1), attention_mask
    from transformers import DynamicCache

    lengths = attention_mask.sum(1).tolist()
    reused = [k.length if k else 0 for k in kept]
    new = [n - p for n, p in zip(lengths, reused)]  # (>= 1 each: TurnCache.take leaves a token)
    width_kept, width_new = max(reused), max(new)
    cols = torch.arange(width_kept + width_new, device=input_ids.device)  # [L']
    edge = torch.tensor([width_kept - p for p in reused], device=input_ids.device)  # [U]
    starts = torch.tensor([width_kept + width_new - n for n in new], device=input_ids.device)  # [U]
    mask = ((cols >= edge[:, None]) & (cols < width_kept)) | (cols >= starts[:, None])  # [U, L']
    mask = mask.to(attention_mask.dtype)
    cache = DynamicCache(config=model.config)
    first = next(k for k in kept if k)
    for i, (k0, _) in enumerate(first.layers):
        keys = k0.new_zeros(len(kept), k0.shape[0], width_kept, k0.shape[-1])  # [U, KV, Lk, D]
        values = torch.zeros_like(keys)
        for u, k in enumerate(kept):
            if k:
                keys[u, :, width_kept - k.length:] = k.layers[i][0]
                values[u, :, width_kept - k.length:] = k.layers[i][1]
        cache.update(keys, values, i)
    out = model(input_ids=input_ids[:, -width_new:], attention_mask=mask,  # [U, Ln] of each prompt's last ids
                position_ids=position_ids(mask)[:, width_kept:], use_cache=True, logits_to_keep=1,
                **with_cache(model, cache))
    return out, mask


class _Keeper:
    """Hands each row's keys/values to a TurnCache as the row stops decoding: its prompt's (the positions the
    attention mask holds) and its completion's up to the last token it fed (the token that ended it never
    went through the model), keyed by those ids."""

    def __init__(self, to: TurnCache, decode, attention_mask: torch.Tensor, prompts: list[list[int]], repeats: int,
                 stop: list[int]):
        self.to, self.decode, self.prompts, self.g, self.stop = to, decode, prompts, repeats, set(stop)
        self.positions = [m.nonzero().squeeze(-1) for m in attention_mask]  # per prompt [its length]

    def rows(self, now: list[int], alive: torch.Tensor | None, tokens: torch.Tensor) -> None:
        """Keep rows `now` (indices among the rows still decoding; `alive` maps them to output rows)."""
        if not now:
            return
        where = now if alive is None else alive[now].tolist()
        for j, row in zip(now, where):
            ids = tokens[row].tolist()
            fed = next((t for t, x in enumerate(ids) if x in self.stop), len(ids) - 1)
            u = row // self.g
            kv = [(pk.index_select(1, self.positions[u]), pv.index_select(1, self.positions[u]), k, v)
                  for pk, pv, k, v in self.decode.row_kv(j, u, fed)]
            self.to.put(self.prompts[u] + ids[:fed], [(torch.cat([pk, k], 1), torch.cat([pv, v], 1))
                                                     for pk, pv, k, v in kv])


@contextlib.contextmanager
def _plain_generation_config(model):
    """`generate` fills every processor setting left unset from the model's generation_config (a
    Qwen2.5-Instruct checkpoint ships repetition_penalty 1.05 and top_k 20), so that config would add
    processors the trainer never scores. Swap in one holding only the special tokens for the call."""
    from transformers import GenerationConfig

    target = base_model(model)
    original = target.generation_config
    target.generation_config = GenerationConfig(eos_token_id=original.eos_token_id,
                                                bos_token_id=original.bos_token_id,
                                                pad_token_id=original.pad_token_id)
    try:
        yield
    finally:
        target.generation_config = original


def generate(model, tokenizer, prompts: list[str] | list[list[int]], decoding: Decoding | None = None, *,
             row_seeds: list[int] | None = None, lockstep=None, **fields) -> Generation:
    """Sample `decoding.num_return_sequences` completions per prompt, rows ordered prompt-major, with
    `decoding`'s settings (decoding.py; `fields`: Decoding's fields, changed or, without `decoding`, all of
    them). No EOS before `min_new_tokens` (= max_new_tokens gives fixed lengths, for benchmarks). Only
    temperature, top-k and top-p shape the distribution, whatever the model's generation_config says. With
    `row_seeds` (one per output row) every row draws from its own random stream, so what a row samples does
    not depend on batch_size or on which other rows share its batch (up to float rounding of the logits).

    `lockstep(flag) -> bool` (whether the flag holds on any process) makes every process run the same
    number of model calls, as sharded weights demand: decoding continues while any process decodes, and
    a process out of prompts runs a greedy one-token placeholder prompt (it draws no random numbers)
    until the others are done. The fast loop's switches: `grouped_decode` decodes the models
    `grouped_decode.py` covers with its step, which reads each prompt's keys/values once for its G rows;
    `cuda_graphs` decodes them at static shapes (static_decode.py), replayed as CUDA graphs on a GPU,
    `compile_decode` that static step compiled by torch.compile, `fused_projections` its q/k/v and gate/up
    as one matmul each (grouped_decode.Fused). `merge_adapter`: the LoRA folded into the weights for the
    call (modeling.merged_adapter)."""
    d = decoding.with_(**fields) if decoding is not None else Decoding(**fields)
    with merged_adapter(model) if d.merge_adapter else contextlib.nullcontext():  # (outside the compute
        # context: the merge's own arithmetic is float32, not autocast's)
        return _generate(model, tokenizer, prompts, d, row_seeds, lockstep)


@torch.no_grad()
@in_compute_context
def _generate(model, tokenizer, prompts, d: Decoding, row_seeds, lockstep) -> Generation:
    loop, max_new_tokens, min_new_tokens, do_sample = d.loop, d.max_new_tokens, d.min_new_tokens, d.do_sample
    num_return_sequences, batch_size = d.num_return_sequences, d.batch_size
    stop = eos_ids(model, tokenizer)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop[0]
    device = next(model.parameters()).device
    processors = warpers(d.temperature, d.top_k, d.top_p) if do_sample else []
    out = Generation([], [], [], [])
    per_call = max(1, batch_size // num_return_sequences)
    if row_seeds is not None and len(row_seeds) != len(prompts) * num_return_sequences:
        raise ValueError(f"{len(row_seeds)} row seeds for {len(prompts) * num_return_sequences} rows")
    starts = list(range(0, len(prompts), per_call))
    turns = open_cache()  # a multi-turn call's kept keys/values (turn_cache.py), where this loop can use them
    keeps = turns if turns is not None and turns.keep and loop == "fast" and not d.cuda_graphs and not lockstep else None
    taken = None  # per prompt, its kept keys/values (a later turn's rows: token ids)
    if keeps is not None and prompts and not isinstance(prompts[0], str):
        taken = [keeps.take(list(p)) for p in prompts]
        keeps.entries.clear()  # (the rows not continued now ended at their last turn: nothing takes them later)
    k = 0
    while lockstep(k < len(starts)) if lockstep else k < len(starts):
        if k >= len(starts):  # out of prompts: join the other processes' model calls
            k += 1
            placeholder = torch.tensor([[pad]], device=device)
            if loop == "fast":
                _fast_chunk(model, placeholder, torch.ones_like(placeholder), repeats=1,
                            max_new_tokens=max_new_tokens, min_new_tokens=0, do_sample=False, processors=[],
                            stop=stop, pad=pad, lockstep=lockstep)
            else:
                _hf_chunk(model, {"input_ids": placeholder, "attention_mask": torch.ones_like(placeholder)},
                          do_sample=False, max_new_tokens=max_new_tokens, min_new_tokens=0, num_return_sequences=1,
                          processors=[], stop=stop, pad=pad, synced=True)
            continue
        start = starts[k]
        k += 1
        chunk = prompts[start:start + per_call]
        enc = _encode(tokenizer, chunk, pad, device)
        kept = taken[start:start + per_call] if taken is not None else None
        if turns is not None:  # (token-id rows are counted on the host; texts once per chunk from the mask)
            reused = sum(x.length for x in kept if x) if kept else 0
            given = sum(map(len, chunk)) if not isinstance(chunk[0], str) else int(enc["attention_mask"].sum())
            turns.prefilled += given - reused
            turns.reused += reused
        uniforms = None
        if row_seeds is not None and do_sample:
            first = start * num_return_sequences
            uniforms = row_uniforms(row_seeds[first:first + len(chunk) * num_return_sequences], max_new_tokens, device)
        if loop == "fast":
            new, logps = _fast_chunk(model, enc["input_ids"], enc["attention_mask"], repeats=num_return_sequences,
                                     max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens,
                                     do_sample=do_sample, processors=processors, stop=stop, pad=pad,
                                     uniforms=uniforms, lockstep=lockstep, grouped=d.grouped_decode,
                                     static=d.cuda_graphs, compiled=d.compile_decode, fused=d.fused_projections,
                                     kept=kept, keep_to=keeps)
        else:
            new, logps = _hf_chunk(model, enc, do_sample=do_sample, max_new_tokens=max_new_tokens,
                                   min_new_tokens=min_new_tokens, num_return_sequences=num_return_sequences,
                                   processors=processors, stop=stop, pad=pad, uniforms=uniforms,
                                   synced=lockstep is not None)
        new, logps, mask = new.tolist(), logps.tolist(), enc["attention_mask"].tolist()
        for r, row in enumerate(new):
            src = r // num_return_sequences
            cut = next((i for i, t in enumerate(row) if t in stop), None)
            n = len(row) if cut is None else cut + 1
            out.prompt_ids.append(enc["input_ids"][src][[bool(m) for m in mask[src]]].tolist())
            out.completion_ids.append(row[:n])
            out.logps.append(logps[r][:n])
            out.truncated.append(cut is None)
    return out


def _encode(tokenizer, chunk: list[str] | list[list[int]], pad: int, device) -> dict[str, torch.Tensor]:
    """Left-padded input_ids and attention_mask [U, L] of prompt texts or of token ids (a multi-turn
    conversation so far, never re-tokenised)."""
    if chunk and not isinstance(chunk[0], str):
        width = max(map(len, chunk))
        ids = torch.tensor([[pad] * (width - len(c)) + list(c) for c in chunk], dtype=torch.long)  # [U, L]
        mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in chunk], dtype=torch.long)  # [U, L]
        return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}
    return tokenizer(chunk, return_tensors="pt", padding=True, padding_side="left",
                     add_special_tokens=False).to(device)


class _LogpRecorder:
    """A last logits processor for `generate`: keeps the processed distribution of the current step and,
    one step later (when the drawn token is in input_ids), the drawn token's log-prob. Holds one
    [rows, V] tensor at a time, where `output_scores` would keep every step's (gigabytes at V = 150k).
    With per-row `uniforms` [rows, steps] it draws the token itself (our inverse-CDF draw) and leaves
    only that token possible, so generate's own multinomial returns it."""

    def __init__(self, prompt_len: int, uniforms: torch.Tensor | None = None):
        self.prompt_len, self.last, self.logps, self.uniforms = prompt_len, None, [], uniforms

    def _take(self, tokens: torch.Tensor) -> None:
        self.logps.append(self.last.gather(-1, tokens[:, None]).squeeze(-1))  # [rows]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.last is not None:
            self._take(input_ids[:, -1])
        self.last = torch.log_softmax(scores.float(), -1)  # [rows, V]
        if self.uniforms is None:
            return scores
        t = input_ids.shape[1] - self.prompt_len
        token, _ = block_draw(self.last, self.uniforms[:, t:t + 1])  # [rows, 1]
        return torch.full_like(scores, float("-inf")).scatter(-1, token, 0.0)

    def finish(self, new: torch.Tensor) -> torch.Tensor:
        """The log-probs [rows, steps] of the new ids [rows, steps]."""
        if self.last is not None and len(self.logps) < new.shape[1]:
            self._take(new[:, len(self.logps)])
        return torch.stack(self.logps, 1) if self.logps else new.new_zeros(new.shape, dtype=torch.float32)


def _hf_chunk(model, enc, *, do_sample, max_new_tokens, min_new_tokens, num_return_sequences, processors,
              stop, pad, uniforms=None, synced=False) -> tuple[torch.Tensor, torch.Tensor]:
    """`transformers.generate` with only our processors: new ids [rows, steps] and the sampler's log-probs
    (log-softmax of the processed scores at each drawn token) [rows, steps]. The warpers go in as custom
    processors (generate puts custom ones before its own, so the recorder could not follow its warpers)."""
    from transformers import LogitsProcessorList

    recorder = _LogpRecorder(enc["input_ids"].shape[1], uniforms)
    kwargs = dict(max_new_tokens=max_new_tokens, do_sample=do_sample, pad_token_id=pad, eos_token_id=stop,
                  num_return_sequences=num_return_sequences, temperature=None, top_p=None, top_k=None,
                  logits_processor=LogitsProcessorList([*processors, recorder]))
    if min_new_tokens:
        kwargs.update(min_new_tokens=min_new_tokens)
    if synced:  # sharded weights: generate's own lockstep (it decodes until every process is done)
        kwargs.update(synced_gpus=True)
    with _plain_generation_config(model):
        out = model.generate(**enc, **kwargs)  # [rows, prompt_len + steps]
    new = out[:, enc["input_ids"].shape[1]:]  # [rows, steps]
    return new, recorder.finish(new)
