"""The fast engine's decode at static shapes, so that a GPU replays each token's step as one CUDA graph.

Decoding a token of a 0.5B model is launch-bound on a GPU: ~24 layers of ~20 kernels, each a few
microseconds of work behind the Python that launches it (28 ms a token measured on one H100 against a
~0.45 ms bandwidth floor: docs/performance.md). A CUDA graph records one step's kernels once and replays
them in one launch, but replays fixed shapes at fixed addresses. So everything a step touches has a
fixed shape here, and the host only moves a counter between replays:
- rows: a bucket (the chunk's rows, then halves as rows finish: B, B/2, B/4, ... down to MIN_BUCKET).
  Finished rows are compacted to the front of the same buffers when the rows still decoding fit the next
  bucket; the slots behind them decode as finished rows (pad in, nothing read out). One graph per bucket.
- keys/values: one buffer [B, KV, P + N, D] per layer, the prompt's right-aligned in its first P
  positions (P: the longest prompt seen, rounded up to PROMPT_BUCKET tokens, so later chunks reuse the
  buffers and graphs; B and P grow only across calls of the same settings, and evaluation frees its
  decoder when it ends: `grown`, `release`), the step's key and value written at P + t with t a device
  tensor; attention reads all P + N positions under a mask that opens one more completion position per step.
- sampling inside the step: the processors, the min-new-tokens ban on the stop tokens, and the inverse-CDF
  draw with each row's own uniform for the position (row_uniforms: the same stream as the dynamic loop).
Between replays the host writes t (one small copy) and, every DONE_CHECK_EVERY tokens, reads `done`.

On a CPU the same step runs eagerly (no graphs there): that is how the tests check it against the dynamic
loop (the same tokens, log-probs to float rounding). Graphs are kept between generate calls on the model,
and captured again when anything they baked in changes: the buffers' shape, the sampling settings, a
weight's storage or the LoRA wrappers' state (with rollout.merge_adapter the merged weights are new
tensors each rollout, so the graphs are captured again unless the allocator hands back the same addresses).

Covers the models `grouped_decode.supports` covers (Llama-like decoder layers, full attention, unsharded
weights); others decode through the dynamic loop, or on a GPU through transformers.generate
(decoding.local_loop). Deliberately left out: the grouped step's one copy of a
prompt's keys per group (here each row holds its prompt's keys: simpler to keep static; the grouped
layout is the next step if attention shows in the GPU profile: it did not, 2% of a token), and graphs of
the prefill (one call per chunk, not launch-bound).

`rollout.compile_decode` runs the step through torch.compile, captured in the same graphs: a graph removes
the launches but not the kernels, and the H200 profile of this step (docs/performance.md, round 3) has
1,177 kernels a token, 47% of its GPU time in small elementwise kernels that inductor fuses. A compilation
costs seconds to minutes, once per row bucket and buffer shape: evaluation's shapes compile once more, and
a decoder rebuilt at shapes already compiled reuses that code (dynamo guards on the tensors' shapes, not
on which decoder holds them: measured on a CPU). Off until a GPU measures it.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, replace

import torch

from ..modeling import base_model
from .draw import block_draw
from .grouped_decode import Fused, additive_mask, fused_mlp, rotary_qkv

MIN_BUCKET = 8  # the smallest row bucket (below it a bucket's graph saves nothing worth a capture)
PROMPT_BUCKET = 64  # prompt positions are allocated in multiples of this many tokens
_DECODERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its StaticDecoder


def buckets(rows: int) -> list[int]:
    """Row buckets from `rows` down: each half the one before (rounded up), down to MIN_BUCKET.

    >>> buckets(64), buckets(20), buckets(5)
    ([64, 32, 16, 8], [20, 10, 8], [5])
    """
    out = [rows]
    while out[-1] > MIN_BUCKET:
        out.append(max(MIN_BUCKET, (out[-1] + 1) // 2))
    return out


@dataclass(frozen=True)
class Shape:
    """What a decoder's buffers and graphs are built for (a change means new ones)."""

    rows: int  # B: the largest row bucket
    prompt: int  # P: prompt positions
    new: int  # N: max new tokens
    sampling: tuple  # do_sample, processors' settings, min_new_tokens, stop ids, pad id
    device: str
    dtype: torch.dtype  # the keys/values' dtype
    compiled: bool = False  # the step through torch.compile (rollout.compile_decode)
    fused: bool = False  # q/k/v and gate/up as one matmul each (rollout.fused_projections)


def _weights_key(model) -> tuple:
    """What a captured graph baked in of the model: every parameter's storage and the LoRA wrappers'
    state (merged, disabled, active adapters), as a tuple to compare."""
    state = []
    for m in model.modules():
        if hasattr(m, "merged") and hasattr(m, "active_adapters"):
            state.append((m.merged, getattr(m, "disable_adapters", False), tuple(m.active_adapters)))
    return tuple(p.data_ptr() for p in model.parameters()), tuple(state)


class StaticDecoder:
    """Static buffers and per-bucket CUDA graphs of one model's decode step (one per model, reused)."""

    def __init__(self, model, shape: Shape, processors: list, min_new_tokens: int, stop: list[int], pad: int,
                 do_sample: bool):
        lm = base_model(model)
        self.shape = shape  # (no reference to the model itself: _DECODERS' weak key would be kept alive by
        # its own value, and every model that ever decoded here with it)
        self.decoder, self.lm_head = lm.model, lm.get_output_embeddings()
        attn = self.decoder.layers[0].self_attn
        self.head_dim, self.per_kv, self.scaling = attn.head_dim, attn.num_key_value_groups, attn.scaling
        kv = lm.config.num_key_value_heads
        b, p, n, dev = shape.rows, shape.prompt, shape.new, torch.device(shape.device)
        self.processors, self.do_sample, self.min_new, self.pad = processors, do_sample, min_new_tokens, pad
        # zeros, not empty: a masked position's key meets a zero probability, and 0 * NaN would be NaN
        self.keys = [torch.zeros(b, kv, p + n, self.head_dim, dtype=shape.dtype, device=dev)
                     for _ in self.decoder.layers]  # per layer [B, KV, P + N, D]
        self.values = [torch.zeros_like(k) for k in self.keys]
        self.prompt_mask = torch.zeros(b, 1, 1, p, dtype=shape.dtype, device=dev)  # [B, 1, 1, P] additive
        self.positions = torch.zeros(b, 1, dtype=torch.long, device=dev)  # [B, 1]: each row's first new position
        self.tokens_in = torch.full((b,), pad, dtype=torch.long, device=dev)  # [B]: the last drawn token
        self.done = torch.ones(b, dtype=torch.bool, device=dev)  # [B]
        self.uniforms = torch.zeros(b, n + 1, dtype=torch.float64, device=dev)  # [B, N + 1] (+1: the warm-up's)
        self.out_tokens = torch.full((b, n + 1), pad, dtype=torch.long, device=dev)  # [B, N + 1]
        self.out_logps = torch.zeros(b, n + 1, device=dev)  # [B, N + 1]
        self.t = torch.zeros((), dtype=torch.long, device=dev)  # the completion position of tokens_in
        self.qkv: list[Fused] | None = None  # per layer (rollout.fused_projections), when every layer fuses
        self.gate_up: list[Fused] | None = None
        self.fuse()
        self.columns = torch.arange(n, device=dev)  # [N]
        self.stop = torch.tensor(stop, device=dev)  # [S]
        self.ban = torch.zeros(lm.config.vocab_size if self.lm_head is None else self.lm_head.out_features,
                               dtype=torch.bool, device=dev).index_fill_(0, self.stop, True)  # [V]
        self.min_value = torch.finfo(shape.dtype).min
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.weights = _weights_key(model)
        self.graphed = dev.type == "cuda"
        # torch.compile's version of the step: fused kernels (inductor), the same graph capture around them.
        # One compilation per row bucket and shape (b is a Python int, so each bucket's shapes are static); the
        # first call compiles, so on a GPU it happens in the capture's warm-up steps, never under capture.
        # (None without it: `self.step` held here would be a reference cycle, and a decoder let go would keep
        # its buffers until Python's cycle collector ran, for many steps: `free` breaks the compiled one's)
        self._compiled = None
        if shape.compiled:
            import torch._dynamo.config as dynamo

            # every bucket and shape is a compilation of this one function: past dynamo's default of 8 it
            # would run the step eagerly again, saying so only in a warning
            dynamo.recompile_limit = max(dynamo.recompile_limit, 64)
            self._compiled = torch.compile(self.step, dynamic=False)

    def _step(self, b: int) -> None:
        (self._compiled or self.step)(b)

    def free(self) -> None:
        """Let go of the buffers and graphs now, whoever still holds this decoder."""
        self.graphs.clear()
        self.keys = self.values = []
        self.qkv = self.gate_up = self._compiled = None

    def fuse(self) -> None:
        """With shape.fused, each layer's q/k/v and gate/up as one matmul (grouped_decode.Fused: a copy of
        those weights, taken now, from the weights the step will read); none when a layer's projections
        are not plain (an unmerged adapter): the step then calls them one by one."""
        self.qkv = self.gate_up = None
        if not self.shape.fused:
            return
        layers = self.decoder.layers
        qkv = [Fused.of([x.self_attn.q_proj, x.self_attn.k_proj, x.self_attn.v_proj]) for x in layers]
        gate_up = [Fused.of([x.mlp.gate_proj, x.mlp.up_proj]) for x in layers]
        if all(f is not None for f in qkv + gate_up):
            self.qkv, self.gate_up = qkv, gate_up

    # ---- the step: fixed shapes, no host reads, every output written into the buffers ----

    def step(self, b: int) -> None:
        """Decode tokens_in[:b] at completion position t and draw the tokens at t + 1 (into out_*[:, t + 1])."""
        t, n, p = self.t, self.shape.new, self.shape.prompt
        x = self.decoder.embed_tokens(self.tokens_in[:b, None])  # [b, 1, hidden]
        cos, sin = self.decoder.rotary_emb(x, self.positions[:b] + t)  # [b, 1, D] each
        cos, sin = cos[:, :, None], sin[:, :, None]  # [b, 1, 1, D]
        opened = torch.where(self.columns <= t, 0.0, self.min_value).to(self.prompt_mask.dtype)  # [N]
        mask = torch.cat([self.prompt_mask[:b], opened.expand(b, 1, 1, n)], -1)  # [b, 1, 1, P + N]
        where = (p + t).view(1)  # [1]: the buffer position written
        for i, layer in enumerate(self.decoder.layers):
            x = x + self._attention(layer.self_attn, layer.input_layernorm(x), cos, sin, mask, where, i, b)
            h = layer.post_attention_layernorm(x)  # [b, 1, hidden]
            x = x + (fused_mlp(layer.mlp, self.gate_up[i], h) if self.gate_up else layer.mlp(h))  # [b, 1, hidden]
        logits = self.lm_head(self.decoder.norm(x))[:, -1].float()  # [b, V]
        nxt = t + 1
        logits = logits.masked_fill(self.ban & (nxt < self.min_new), float("-inf"))  # no EOS before min_new_tokens
        if self.do_sample:
            for proc in self.processors:
                logits = proc(None, logits)  # [b, V]
            u = self.uniforms[:b].index_select(1, nxt.view(1))  # [b, 1]
            drawn, logp = block_draw(logits, u)  # [b, 1] each (fixed shapes, no host reads: in the graph)
        else:
            drawn = logits.argmax(-1, keepdim=True)  # [b, 1]
            logp = torch.log_softmax(logits, -1).gather(-1, drawn)  # [b, 1]
        drawn = drawn.masked_fill(self.done[:b, None], self.pad)  # [b, 1]
        column = nxt.view(1, 1).expand(b, 1)  # [b, 1]
        self.out_tokens[:b].scatter_(1, column, drawn)
        self.out_logps[:b].scatter_(1, column, logp)
        self.done[:b] |= (drawn == self.stop).any(-1)  # (not isin: its sorting path would read sizes back)
        self.tokens_in[:b].copy_(drawn[:, 0])

    def _attention(self, attn, h, cos, sin, mask, where, i: int, b: int) -> torch.Tensor:
        """One layer's attention output [b, 1, hidden] for normed inputs h [b, 1, hidden]."""
        q, k, v = rotary_qkv(attn, h, cos, sin, self.head_dim, self.per_kv,  # [b, KV, n, D], [b, KV, 1, D] x2
                             self.qkv[i] if self.qkv else None)
        keys, values = self.keys[i][:b], self.values[i][:b]  # [b, KV, P + N, D]
        keys.index_copy_(2, where, k.to(keys.dtype))
        values.index_copy_(2, where, v.to(values.dtype))
        scores = (q.to(keys.dtype) @ keys.mT) * self.scaling + mask  # [b, KV, n, P + N]
        out = scores.softmax(-1, dtype=torch.float32).to(values.dtype) @ values  # [b, KV, n, D]
        return attn.o_proj(out.reshape(b, 1, -1))  # [b, 1, hidden]

    # ---- graphs ----

    def run(self, b: int) -> None:
        """One step over bucket b: the bucket's graph replayed on a GPU (captured at first use), else eagerly."""
        if not self.graphed:
            self._step(b)
            return
        graph = self.graphs.get(b)
        if graph is None:
            graph = self.graphs[b] = self._capture(b)
        graph.replay()

    def _capture(self, b: int):
        """Bucket b's graph. Warm-up steps (cuBLAS and the allocator settle in them) run first on a side
        stream at the last position, whose writes the real steps overwrite before reading (and into the
        extra output column); the rows' state they change (tokens_in, done) is restored after."""
        saved = self.tokens_in[:b].clone(), self.done[:b].clone(), self.t.clone()
        self.t.fill_(self.shape.new - 1)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), _uncached_autocast():
            for _ in range(2):
                self._step(b)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph), _uncached_autocast():  # (a private memory pool per bucket's graph)
            self._step(b)
        self.tokens_in[:b].copy_(saved[0])
        self.done[:b].copy_(saved[1])
        self.t.copy_(saved[2])
        return graph


def _uncached_autocast():
    """The autocast in force (bf16-mixed's), with its weight-cast cache off: a cast cached during capture
    would be freed memory at replay (PyTorch's rule for autocast under CUDA graphs)."""
    import contextlib

    if not torch.is_autocast_enabled("cuda"):
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=torch.get_autocast_dtype("cuda"), cache_enabled=False)


def decoder_for(model, shape: Shape, **settings) -> StaticDecoder:
    """The model's StaticDecoder for `shape`: the one it has when its shape still matches (its graphs
    dropped if the weights they baked in changed), else a new one (the old buffers and graphs released first:
    the caller holds no reference to the old decoder, so both never take memory at once)."""
    current = _DECODERS.get(model)
    if current is not None and current.shape == shape:
        weights = _weights_key(model)
        if current.weights != weights:  # new weights (a merged adapter, a reload): the same buffers, new graphs
            current.graphs.clear()
            current.weights = weights
            current.fuse()
        return current
    del current
    release(model)
    decoder = _DECODERS[model] = StaticDecoder(model, shape, **settings)
    return decoder


def release(model) -> None:
    """Free the model's static buffers and graphs (evaluation's decoder, whose shape a training rollout never
    reuses: its greedy step and longer completions make a new one anyway). Nothing if it has none."""
    decoder = _DECODERS.pop(model, None)
    if decoder is not None:
        decoder.free()


def grown(shape: Shape, held: Shape | None) -> Shape:
    """`shape` with the rows and prompt positions of the decoder the model holds (`held`) where those are
    larger and everything else is equal, so that later chunks of one rollout reuse its buffers and graphs.
    A decoder of other settings (evaluation's greedy 256 tokens beside training's sampled 96) is rebuilt
    anyway: growing to its rows and prompts would only hold memory (on one H200, SmolLM2's recipe decoded
    its 32 rows in buffers of evaluation's 100, 2026-11-28).

    >>> a = Shape(32, 192, 96, (True,), "cpu", torch.float32)
    >>> same = replace(a, rows=100, prompt=448)
    >>> evaluation = replace(a, rows=100, prompt=448, new=256, sampling=(False,))
    >>> [(s.rows, s.prompt) for s in (grown(a, same), grown(a, evaluation), grown(a, None))]
    [(100, 448), (32, 192), (32, 192)]
    """
    if held is None or replace(held, rows=shape.rows, prompt=shape.prompt) != shape:
        return shape
    return replace(shape, rows=max(shape.rows, held.rows), prompt=max(shape.prompt, held.prompt))


def static_chunk(model, prefill_cache, first_logits: torch.Tensor, attention_mask: torch.Tensor, *, repeats: int,
                 max_new_tokens: int, min_new_tokens: int, do_sample: bool, processors: list, stop: list[int],
                 pad: int, uniforms: torch.Tensor | None, sample, done_check_every: int, compiled: bool = False,
                 fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """`generation._fast_chunk`'s decode at static shapes: completion ids and log-probs [U * repeats, steps]
    after the prefill (its cache and last logits [U, V]). `sample` is generation.sample, for the first token
    (drawn from the prefill's logits, outside the graph, as the dynamic loop draws it); `compiled`: the step
    through torch.compile; `fused`: its projections fused (StaticDecoder)."""
    u, lp = attention_mask.shape
    rows, n, device = u * repeats, max_new_tokens, attention_mask.device
    compute = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else None
    dtype = compute or prefill_cache.layers[0].keys.dtype
    sampling = (do_sample, tuple((type(p).__name__, tuple(sorted(vars(p).items()))) for p in processors),
                min_new_tokens, tuple(stop), pad)
    prompt = -(-lp // PROMPT_BUCKET) * PROMPT_BUCKET
    # the buffers only grow while the settings stay: fewer rows or a shorter prompt fit in the decoder held
    held = _DECODERS.get(model)
    shape = grown(Shape(rows, prompt, n, sampling, str(device), dtype, compiled, fused),
                  None if held is None else held.shape)
    prompt = shape.prompt
    del held  # (decoder_for frees a decoder of another shape before making this one)
    dec = decoder_for(model, shape, processors=processors, min_new_tokens=min_new_tokens, stop=stop, pad=pad,
                      do_sample=do_sample)

    # the chunk's rows into the buffers' first `rows` slots; the slots after them stay finished
    start = prompt - lp
    for i, layer in enumerate(prefill_cache.layers):
        dec.keys[i][:rows, :, start:prompt].copy_(layer.keys.repeat_interleave(repeats, 0))  # [R, KV, Lp, D]
        dec.values[i][:rows, :, start:prompt].copy_(layer.values.repeat_interleave(repeats, 0))
    full = torch.zeros(rows, prompt, dtype=attention_mask.dtype, device=device)  # [R, P]
    full[:, start:] = attention_mask.repeat_interleave(repeats, 0)
    dec.prompt_mask[:rows].copy_(additive_mask(full, dtype))
    dec.positions[:rows].copy_(attention_mask.sum(1, keepdim=True).repeat_interleave(repeats, 0))
    dec.done.fill_(True)
    dec.done[:rows] = False
    dec.out_tokens.fill_(pad)
    if uniforms is None and do_sample:  # (no row seeds: the global generator's uniforms, drawn up front)
        uniforms = torch.rand(rows, n, dtype=torch.float64, device=device)
    if uniforms is not None:
        dec.uniforms[:rows, :n].copy_(uniforms)

    # the first token, from the prefill's logits (outside the graph)
    logits = first_logits.repeat_interleave(repeats, 0)  # [R, V]
    if min_new_tokens > 0:
        logits = logits.index_fill(-1, dec.stop, float("-inf"))
    draw = sample(logits, do_sample, processors, None if uniforms is None else uniforms[:, :1])
    dec.out_tokens[:rows, 0], dec.out_logps[:rows, 0] = draw.tokens, draw.logps
    dec.done[:rows] |= torch.isin(draw.tokens, dec.stop)
    dec.tokens_in[:rows].copy_(draw.tokens)

    sizes = [s for s in buckets(shape.rows) if s >= rows]
    b = sizes[-1]  # the smallest bucket the chunk's rows fit
    sizes = [s for s in buckets(shape.rows) if s <= b]
    slots = torch.full((b,), -1, dtype=torch.long, device=device)  # [b]: each slot's output row (-1: none)
    slots[:rows] = torch.arange(rows, device=device)
    tokens = torch.full((rows, n), pad, dtype=torch.long, device=device)  # [R, N]
    logps = torch.zeros(rows, n, device=device)  # [R, N]
    steps = 1
    for t in range(n - 1):
        if (t + 1) % done_check_every == 0:  # (reading `done` waits for the device: not every token)
            alive = int((~dec.done[:b]).sum())
            if alive == 0:
                break
            smaller = [s for s in sizes if s < b and s >= alive]
            if smaller:
                b, slots = _compact(dec, b, smaller[-1], slots, tokens, logps)
        dec.t.fill_(t)
        dec.run(b)
        steps = t + 2
    _flush(dec, b, slots, tokens, logps)
    return tokens[:, :steps], logps[:, :steps]


def _flush(dec: StaticDecoder, b: int, slots: torch.Tensor, tokens: torch.Tensor, logps: torch.Tensor) -> None:
    """Copy the output of bucket b's rows that hold a chunk row into tokens/logps [R, N]."""
    n = tokens.shape[1]
    held = (slots >= 0).nonzero().squeeze(-1)  # [h]
    tokens.index_copy_(0, slots[held], dec.out_tokens[:b, :n][held])
    logps.index_copy_(0, slots[held], dec.out_logps[:b, :n][held])


def _compact(dec: StaticDecoder, b: int, smaller: int, slots, tokens, logps) -> tuple[int, torch.Tensor]:
    """Move the rows of bucket b still decoding to the front of the buffers (bucket `smaller`), after writing
    every row's output so far; the slots behind them become finished rows."""
    _flush(dec, b, slots, tokens, logps)
    keep = (~dec.done[:b]).nonzero().squeeze(-1)  # [k]
    k = keep.numel()
    for buf in (*dec.keys, *dec.values, dec.prompt_mask, dec.positions, dec.tokens_in, dec.done, dec.uniforms,
                dec.out_tokens, dec.out_logps):
        buf[:k] = buf[:b].index_select(0, keep)
    dec.done[k:smaller] = True
    moved = torch.full((smaller,), -1, dtype=torch.long, device=slots.device)
    moved[:k] = slots[keep]
    return smaller, moved
