"""The fast engine's decode step for Llama-family models: each group's prompt keys/values are read once.

GRPO samples G completions of every prompt. A per-row KV cache holds G copies of each prompt's keys and
values, and every decoded token reads all of them: with ~100-token prompts and 64 rows, a step of the
embedded model reads ~50 MB of mostly identical keys/values in attention (more than the CPU's 32 MB last
cache), and that attention was the largest single operation of a step. Here the prompt's
keys/values are kept once per prompt ([U, KV, Lp, D]) and the completion's per row ([R, KV, N, D]);
attention scores a row's query against its prompt's keys in one batched matmul per prompt (its G rows'
queries together) and against its own completion keys, and takes one softmax over both.

The step is our own loop over the model's decoder layers: the model's own modules for the embedding,
rotary embedding, norms, projections (a LoRA layer, merged or not, is called like any projection) and
MLP; our code for the residual glue and the attention. It also skips the per-call work of the model's
forward (mask building, output records, keyword plumbing). No library offers this: transformers' caches
and attention functions are per row, and vLLM's prefix caching shares prompt blocks in its own engine
only. Measured on 2 CPU cores in the benchmark's training run: rollout -28% with natural EOS, -32% at
fixed length, the same completions (docs/performance.md).

Applies to decoder layers whose structure is Llama's exactly (pre-norm, rotary q/k, full attention,
`x + attn(norm(x))`, `x + mlp(norm(x))`): `LLAMA_LIKE` names them. Deliberately left out (those decode
through the model's own forward): sliding-window and other non-full attention, q/k norms (Qwen3),
soft-capping and scaled embeddings (Gemma), models whose projections are one module (Phi-3's qkv_proj;
`Fused` here joins separate ones for the static step), GPT-2, and sharded weights (FSDP2's
hooks gather a layer's weights in its forward, which this step does not call).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..modeling import base_model

# decoder layers with exactly Llama's structure and rotary/attention conventions (checked in `supports`)
LLAMA_LIKE = ("LlamaDecoderLayer", "Qwen2DecoderLayer", "MistralDecoderLayer")


def rotary_qkv(attn, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, head_dim: int, per_kv: int,
               fused: Fused | None = None):
    """One decode step's q [r, KV, n, D] and k, v [r, KV, 1, D] for normed inputs h [r, 1, hidden], the
    rotary embedding applied to q and k (the models' apply_rotary_pos_emb, per element; cos, sin
    [r, 1, 1, D]). Query heads are grouped by the KV head they read, as the models' repeat_kv orders them.
    `fused`: q, k and v as one matmul (`Fused.of` the three projections)."""
    r = h.shape[0]
    q, k, v = fused(h) if fused is not None else (attn.q_proj(h), attn.k_proj(h), attn.v_proj(h))
    q = q.view(r, -1, per_kv, head_dim)  # [r, KV, n, D]
    k = k.view(r, -1, 1, head_dim)  # [r, KV, 1, D]
    v = v.view(r, -1, 1, head_dim)
    # the models' own rotate_half (the same function in each covered model); imported here, not cached in
    # a functools wrapper, which torch.compile (rollout.compile_decode) traces through with a warning
    from transformers.models.llama.modeling_llama import rotate_half

    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v


class Fused:
    """Several projections that read the same input as one matmul: their weights (and biases) concatenated
    once, the output split back. Built only from layers whose forward is their weight's (a plain Linear, or
    a LoRA layer whose adapter is merged into it); `of` gives None otherwise (an unmerged adapter adds its
    own matmuls)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, sizes: list[int]):
        self.weight, self.bias, self.sizes = weight, bias, sizes  # [sum(sizes), in], [sum(sizes)] or None

    @classmethod
    def of(cls, layers: list) -> Fused | None:
        plain = [_plain_linear(m) for m in layers]
        if any(p is None for p in plain):
            return None
        weight = torch.cat([p.weight for p in plain])  # [sum(out), in]: one copy of these weights
        biases = [p.bias for p in plain]
        bias = None if all(b is None for b in biases) else torch.cat(
            [b if b is not None else p.weight.new_zeros(p.out_features) for b, p in zip(biases, plain)])
        return cls(weight, bias, [p.out_features for p in plain])

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return torch.nn.functional.linear(x, self.weight, self.bias).split(self.sizes, -1)


def _plain_linear(module):
    """The nn.Linear whose forward is `module`'s: itself, or a LoRA layer's base layer when its adapters are
    merged into it (or disabled); None when the module adds anything of its own."""
    if type(module) is torch.nn.Linear:
        return module
    base = getattr(module, "base_layer", None)
    if type(base) is torch.nn.Linear and (getattr(module, "merged", False) or getattr(module, "disable_adapters", False)
                                          or not getattr(module, "active_adapters", None)):
        return base
    return None


def fused_mlp(mlp, gate_up: Fused, x: torch.Tensor) -> torch.Tensor:
    """A Llama-like MLP, down(act(gate(x)) * up(x)), with gate and up as one matmul."""
    gate, up = gate_up(x)
    return mlp.down_proj(mlp.act_fn(gate) * up)


def plain_full_attention(cache) -> bool:
    """Whether a prefill cache is transformers' DynamicCache with a plain full-attention layer in every
    layer (sliding windows and other kinds keep other layer types)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    return isinstance(cache, DynamicCache) and all(type(x) is DynamicLayer for x in cache.layers)


def additive_mask(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A [B, L] 0/1 attention mask as the [B, 1, 1, L] additive mask attention takes (0 or the dtype's min)."""
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(
        mask == 0, torch.finfo(dtype).min)[:, None, None, :]


def covers(model) -> bool:
    """Whether the grouped and static decode steps can decode `model`, read off the model before any prefill:
    Llama-like layers, every layer's attention full by the config (`layer_types`, else no `sliding_window`),
    unsharded weights.

    >>> from transformers import MistralConfig, MistralForCausalLM
    >>> small = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
    ...              num_attention_heads=2, num_key_value_heads=1)
    >>> [covers(MistralForCausalLM(MistralConfig(**small, sliding_window=w))) for w in (None, 4096)]
    [True, False]
    """
    layers = getattr(getattr(base_model(model), "model", None), "layers", None)
    config = base_model(model).config
    types = getattr(config, "layer_types", None)
    full = all(t == "full_attention" for t in types) if types else getattr(config, "sliding_window", None) is None
    return (layers is not None and all(type(x).__name__ in LLAMA_LIKE for x in layers) and full
            and not any(type(p).__name__ == "DTensor" for p in model.parameters()))


def supports(model, prefill_cache) -> bool:
    """Whether the grouped step can decode `model` from this prefill cache: a model it `covers`, and a
    cache of plain full-attention layers."""
    return covers(model) and plain_full_attention(prefill_cache)


class GroupedSteps:
    """Decode steps over U prompts with G rows each (rows prompt-major, as `generate` orders them).

    Call it with the tokens just drawn (one per row still decoding) and their completion index t to get
    the next logits; `drop(keep)` removes finished rows. Rows keep their slot in the U x G grid (`grid`),
    so a group's rows are scored against its prompt together however many of them are left.

    A token's step is mostly fixed per-operation cost at small sizes (4 prompts x 4 rows of the embedded
    model: ~500 dispatched operations a token, against ~0.5 ms of matmuls in ~2 ms), so the step calls as
    little as it can (`_Layer`): a projection whose forward is its weight's (plain, or a LoRA layer merged
    into it) is one `F.linear` on that weight, not the module and peft's wrapper around it; a float32 Llama
    RMSNorm is `F.rms_norm` (the same numbers, one call); the rotary embedding's cos/sin come from one
    table made at the first step by the model's own rotary module, and rotate_half(x) * sin is
    `roll(x) * signed_sin` (the same products); the prompt's scores take the scale and mask in one
    `baddbmm`, and the completion's read the key/value buffers as 3D views (no copy of the keys a token).
    Anything else (an unmerged LoRA layer, another norm, a dynamic rotary embedding) is called as the model
    calls it. Measured in docs/performance.md.
    """

    droppable = True  # finished rows may leave the batch

    def __init__(self, model, prefill_cache, attention_mask: torch.Tensor, repeats: int, max_new_tokens: int):
        lm = base_model(model)
        self.decoder, self.lm_head = lm.model, _direct(lm.get_output_embeddings())
        attn = self.decoder.layers[0].self_attn
        self.groups, self.repeats = attention_mask.shape[0], repeats  # U, G
        self.head_dim, self.per_kv = attn.head_dim, attn.num_key_value_groups  # D, n (query heads per KV head)
        self.scaling = attn.scaling
        # keys and values are kept in the dtype attention multiplies in: under autocast (bf16-mixed) the
        # float32 keys the rotary embedding leaves would otherwise be cast anew by every step's matmuls
        device = attention_mask.device.type
        self.compute = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        cast = (lambda x: x.to(self.compute)) if self.compute else (lambda x: x)
        self.kv_dtype = prefill_cache.layers[0].keys.dtype  # (the model's own: what a turn cache keeps)
        self.prompt_keys = [cast(layer.keys).contiguous() for layer in prefill_cache.layers]  # per layer [U, KV, Lp, D]
        self.prompt_values = [cast(layer.values).contiguous() for layer in prefill_cache.layers]
        first = self.prompt_keys[0]
        u, kv, lp = first.shape[:3]
        self.kv = kv
        # the same, as the batched matmuls read them: per layer [U KV, Lp, D] (views)
        self.grid_keys = [k.view(u * kv, lp, self.head_dim) for k in self.prompt_keys]
        self.grid_values = [v.view(u * kv, lp, self.head_dim) for v in self.prompt_values]
        rows = u * repeats
        self.keys = [first.new_empty(rows, kv, max_new_tokens, self.head_dim) for _ in self.prompt_keys]
        self.values = [first.new_empty(rows, kv, max_new_tokens, self.head_dim) for _ in self.prompt_keys]
        self.prompt_mask = additive_mask(attention_mask, first.dtype)  # [U, 1, 1, Lp]
        width = repeats * self.per_kv  # G n: a prompt's query rows per KV head on the grid
        self.grid_mask = self.prompt_mask.expand(u, kv, width, lp).reshape(u * kv, width, lp)  # [U KV, G n, Lp]
        self.next_pos = attention_mask.sum(1, keepdim=True).repeat_interleave(repeats, 0)  # [R, 1]
        self.grid: torch.Tensor | None = None  # [r]: each row's slot in the U x G grid (None: every row)
        self.filled = 0  # completion positions written so far
        self.layers = [_Layer(layer) for layer in self.decoder.layers]
        self.norm = _norm(self.decoder.norm)
        self.table_length = int(self.next_pos.max()) + max_new_tokens  # positions the rotary table covers
        self.rotary: _RotaryTable | None = None  # made at the first step (None after it: asked each token)
        self.rotary_asked = False  # whether the first step has made the table (or found it cannot)

    def drop(self, keep: torch.Tensor) -> None:
        """Keep only the rows `keep` [r'] (of the rows still decoding), in that order."""
        self.grid = keep if self.grid is None else self.grid[keep]
        self.next_pos = self.next_pos[keep]
        n, filled = keep.numel(), self.filled
        for bufs in (self.keys, self.values):
            for i, buf in enumerate(bufs):
                bufs[i] = buf[:n]  # the kept rows move to the front of the same buffer (no new allocation)
                bufs[i][:, :, :filled].copy_(buf[:, :, :filled].index_select(0, keep))

    def row_kv(self, j: int, u: int, fed: int) -> list[tuple[torch.Tensor, ...]]:
        """Per layer: decoding row j's prompt (prompt u) keys and values [KV, Lp, D] and its first `fed`
        completion positions' [KV, fed, D] (turn_cache.py)."""
        d = self.kv_dtype
        return [(pk[u].to(d), pv[u].to(d), k[j, :, :fed].to(d), v[j, :, :fed].to(d))
                for pk, pv, k, v in zip(self.prompt_keys, self.prompt_values, self.keys, self.values)]

    def __call__(self, tokens: torch.Tensor, t: int) -> torch.Tensor:
        """Logits [r, V] after tokens [r] at completion position t (0-based) of each row still decoding."""
        self.filled = t + 1  # (this step writes position t of every layer's buffers)
        x = self.decoder.embed_tokens(tokens)  # [r, hidden]
        if not self.rotary_asked:  # the first step: the table, from these hidden states (the rotary module
            # returns cos/sin in their dtype, which bf16-mixed makes float32 over bfloat16 weights)
            self.rotary = _RotaryTable.of(self.decoder.rotary_emb, x, self.table_length)
            self.rotary_asked = True
        pos = self.next_pos[:, 0] + t  # [r]
        if self.rotary is not None:
            cos, sin = self.rotary.cos[pos], self.rotary.signed_sin[pos]  # [r, D] each
        else:  # (a rotary embedding whose numbers depend on the positions asked together: asked each token)
            cos, sin = self.decoder.rotary_emb(x, pos[:, None])  # [r, 1, D] each
            cos, sin = cos[:, 0], _signed(sin[:, 0])
        cos, sin = cos[:, None], sin[:, None]  # [r, 1, D]: over the heads
        for i, layer in enumerate(self.layers):
            x = x + self._attention(layer, layer.norm_in(x), cos, sin, i, t)  # [r, hidden]
            x = x + layer.mlp(layer.norm_post(x))
        return self.lm_head(self.norm(x))  # [r, V]

    def _attention(self, layer: _Layer, h, cos, sin, i: int, t: int) -> torch.Tensor:
        """One layer's attention output [r, hidden] for normed inputs h [r, hidden]."""
        r, d, n, kv = h.shape[0], self.head_dim, self.per_kv, self.kv
        half = d // 2
        q, k = layer.q(h).view(r, kv * n, d), layer.k(h).view(r, kv, d)  # [r, H, D], [r, KV, D]
        q = q * cos + q.roll(half, -1) * sin  # the models' apply_rotary_pos_emb: x cos + rotate_half(x) sin
        k = k * cos + k.roll(half, -1) * sin
        if self.compute:  # (cast once here, not by each of the matmuls below)
            q = q.to(self.compute)
        keys, values = self.keys[i], self.values[i]  # [r, KV, N, D]
        keys[:, :, t].copy_(k)
        values[:, :, t].copy_(layer.v(h).view(r, kv, d))
        width = keys.shape[2]
        keys3 = keys.view(r * kv, width, d)[:, :t + 1]  # [r KV, t + 1, D]: views, no copy
        values3 = values.view(r * kv, width, d)[:, :t + 1]
        q = q.view(r, kv, n, d)
        u, lp = self.groups, self.prompt_mask.shape[-1]
        grid_q = self._to_grid(q).reshape(u * kv, -1, d)  # [U KV, G n, D]
        prompt = torch.baddbmm(self.grid_mask, grid_q, self.grid_keys[i].mT, alpha=self.scaling)  # [U KV, G n, Lp]
        own = torch.bmm(q.view(r * kv, n, d), keys3.mT).mul_(self.scaling).view(r, kv, n, t + 1)
        scores = torch.cat([self._from_grid(prompt.view(u, kv, -1, lp)), own], -1)  # [r, KV, n, Lp + t + 1]
        probs = scores.softmax(-1, dtype=torch.float32)
        if probs.dtype != keys.dtype:
            probs = probs.to(keys.dtype)
        grid_p = self._to_grid(probs[..., :lp]).reshape(u * kv, -1, lp)  # [U KV, G n, Lp]
        from_prompt = self._from_grid((grid_p @ self.grid_values[i]).view(u, kv, -1, d))  # [r, KV, n, D]
        out = torch.baddbmm(from_prompt.reshape(r * kv, n, d), probs[..., lp:].reshape(r * kv, n, t + 1),
                            values3)  # [r KV, n, D]
        return layer.o(out.view(r, -1))  # [r, hidden]

    def _to_grid(self, x: torch.Tensor) -> torch.Tensor:
        """Rows [r, KV, n, W] -> each prompt's G rows side by side [U, KV, G n, W] (zeros for dropped rows)."""
        u, g = self.groups, self.repeats
        if self.grid is not None:
            x = x.new_zeros(u * g, *x.shape[1:]).index_copy_(0, self.grid, x)  # [U G, KV, n, W]
        kv, n, w = x.shape[1:]
        return x.view(u, g, kv, n, w).transpose(1, 2).reshape(u, kv, g * n, w)

    def _from_grid(self, y: torch.Tensor) -> torch.Tensor:
        """[U, KV, G n, W] -> rows [r, KV, n, W] (the rows still decoding)."""
        u, g = self.groups, self.repeats
        kv, w = y.shape[1], y.shape[-1]
        rows = y.view(u, kv, g, -1, w).transpose(1, 2).reshape(u * g, kv, -1, w)  # [U G, KV, n, W]
        return rows if self.grid is None else rows.index_select(0, self.grid)


def _direct(module):
    """`module` as the step calls it: F.linear on its weight when its forward is just that (`_plain_linear`),
    else the module itself."""
    plain = _plain_linear(module)
    if plain is None:
        return module
    weight, bias = plain.weight, plain.bias
    return lambda x: F.linear(x, weight, bias)


RMS_NORMS = ("LlamaRMSNorm", "Qwen2RMSNorm", "MistralRMSNorm")  # weight * x rsqrt(mean(x^2) + eps), in float32


def _norm(module):
    """`module` as the step calls it: `F.rms_norm` for a float32 RMSNorm of the covered models (the same
    numbers: checked in tests/test_grouped_decode.py), else the module (its own casts in lower precisions)."""
    weight = getattr(module, "weight", None)
    if type(module).__name__ not in RMS_NORMS or weight is None or weight.dtype != torch.float32:
        return module
    eps, shape = module.variance_epsilon, tuple(weight.shape)
    return lambda x: (module(x) if x.dtype != torch.float32 or torch.is_autocast_enabled(x.device.type)
                      else F.rms_norm(x, shape, weight, eps))


class _Layer:
    """One decoder layer's pieces as the step calls them (`_direct`, `_norm`)."""

    def __init__(self, layer):
        attn, mlp = layer.self_attn, layer.mlp
        self.q, self.k, self.v, self.o = (_direct(m) for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj))
        self.norm_in, self.norm_post = _norm(layer.input_layernorm), _norm(layer.post_attention_layernorm)
        gate, up, down = (_direct(m) for m in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        act = mlp.act_fn
        self.mlp = lambda x: down(act(gate(x)) * up(x))  # the models' MLP forward


def _signed(sin: torch.Tensor) -> torch.Tensor:
    """sin [..., D] with its first half negated: rotate_half(x) * sin == x.roll(D / 2, -1) * _signed(sin)
    (rotate_half(x) is cat(-x2, x1), the roll cat(x2, x1): the same products, the sign moved)."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], -1)


class _RotaryTable:
    """cos and signed sin [P, D] of positions 0..P-1, from the model's own rotary module in one call (its
    numbers per position do not depend on the other positions asked: position x inv_freq, elementwise)."""

    STATIC = ("default", "linear", "llama3", "yarn")  # rope types whose frequencies do not depend on the length

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self.cos, self.signed_sin = cos, _signed(sin)  # [P, D] each

    @classmethod
    def of(cls, rotary, like: torch.Tensor, positions: int) -> _RotaryTable | None:
        """The table for `positions` positions, or None for a rotary embedding whose frequencies change with
        the length asked (dynamic NTK, longrope: asked each token instead)."""
        if getattr(rotary, "rope_type", "default") not in cls.STATIC:
            return None
        cos, sin = rotary(like, torch.arange(positions, device=like.device)[None])  # [1, P, D] each
        return cls(cos[0], sin[0])
