"""The grouped decode step (each prompt's keys/values kept once for its G rows) against the model's own
forward over a per-row cache, step by step, on tiny random-weight Llama (multi-head and grouped-query,
biased projections), Qwen2 and Mistral (full attention), with rows leaving unevenly; LoRA layers, merged
or not; and the architectures it leaves to the model's forward."""

import pytest
import torch

from docuchat_rl.modeling import position_ids
from docuchat_rl.sampling import grouped_decode
from docuchat_rl.sampling.generation import _ModelSteps, generate

from .conftest import with_lora
from .test_generation import _prompts


def _model(tok, arch: str, dtype=torch.float32):
    import transformers as tf

    torch.manual_seed(0)
    common = dict(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=512, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id)
    if arch == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common, num_key_value_heads=4))
    elif arch == "llama-gqa-bias":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common, num_key_value_heads=2, attention_bias=True,
                                                   mlp_bias=True))
    elif arch == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, num_key_value_heads=2, tie_word_embeddings=True))
    elif arch == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(**common, num_key_value_heads=2, sliding_window=None))
    elif arch == "mistral-window":
        model = tf.MistralForCausalLM(tf.MistralConfig(**common, num_key_value_heads=2, sliding_window=8))
    elif arch == "gemma2":
        model = tf.Gemma2ForCausalLM(tf.Gemma2Config(**common, num_key_value_heads=2, head_dim=16,
                                                     sliding_window=8))
    elif arch == "gpt2":
        model = tf.GPT2LMHeadModel(tf.GPT2Config(vocab_size=len(tok), n_embd=64, n_layer=2, n_head=4,
                                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id))
    else:
        raise ValueError(arch)
    return model.to(dtype).eval()


def _prefill(model, tok, prompts):
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    with torch.no_grad():
        out = model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                    position_ids=position_ids(enc["attention_mask"]), use_cache=True, logits_to_keep=1)
    return out.past_key_values, enc["attention_mask"]


def _step_by_step(model, tok, *, repeats=4, steps=12, drops=None):
    """Both decode steps fed the same tokens; at each step of `drops` ({step: fraction}; default: half the
    rows at step 4, then 30% of the rest at step 8) a random subset of rows leaves, the same for both.
    Returns the two logits lists."""
    drops = {4: 0.5, 8: 0.3} if drops is None else drops
    prompts = _prompts(tok, 3)  # different lengths: left padding
    cache, mask = _prefill(model, tok, prompts)  # (neither step writes into the prefill's tensors)
    assert grouped_decode.supports(model, cache)
    grouped = grouped_decode.GroupedSteps(model, cache, mask, repeats, steps)
    plain = _ModelSteps(model, cache, mask, repeats, steps)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(5, len(tok), (len(prompts) * repeats,), generator=gen)
    out = ([], [])
    with torch.no_grad():
        for t in range(steps):
            if t in drops:
                keep = torch.randperm(tokens.numel(), generator=gen)[:max(1, int(tokens.numel() * (1 - drops[t])))]
                keep = keep.sort().values
                grouped.drop(keep)
                plain.drop(keep)
                tokens = tokens[keep]
            out[0].append(grouped(tokens, t))
            out[1].append(plain(tokens, t))
            tokens = torch.randint(5, len(tok), (tokens.numel(),), generator=gen)
    if drops:  # the prompts kept different numbers of rows: ragged groups on the grid
        left = torch.bincount(grouped.grid // repeats, minlength=len(prompts))
        assert left.min() < left.max()
    return out


@pytest.mark.parametrize("arch", ["llama", "llama-gqa-bias", "qwen2", "mistral"])
def test_grouped_step_gives_the_model_forward_logits_as_rows_leave(tiny, arch):
    _, tok = tiny
    model = _model(tok, arch)
    grouped, plain = _step_by_step(model, tok)
    assert grouped[-1].shape[0] < grouped[0].shape[0]  # rows really left, unevenly across the prompts
    for a, b in zip(grouped, plain):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rope", [{"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                  {"rope_type": "dynamic", "factor": 2.0}])
def test_grouped_step_follows_a_scaled_rotary_embedding(tiny, rope):
    """A scaled rotary embedding: llama3's (static: read from the table made before the first token) and
    dynamic NTK (its frequencies change with the positions asked: asked each token) give the model forward's
    logits, the prompts' positions past the dynamic one's original length."""
    import transformers as tf

    _, tok = tiny
    torch.manual_seed(0)
    config = tf.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                            rope_parameters={"rope_theta": 10000.0, **rope}, eos_token_id=tok.eos_token_id,
                            pad_token_id=tok.pad_token_id)
    model = tf.LlamaForCausalLM(config).eval()
    table = grouped_decode._RotaryTable.of(model.model.rotary_emb, model.model.embed_tokens.weight, 8)
    assert (table is None) == (rope["rope_type"] == "dynamic")
    grouped, plain = _step_by_step(model, tok)
    for a, b in zip(grouped, plain):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_the_steps_rms_norm_and_rotary_table_are_the_models_numbers(tiny, arch):
    """The step's shortcuts give the model's own numbers bit for bit: `F.rms_norm` for its float32 RMSNorm
    (a bfloat16 one is the module itself), and the rotary table's cos and signed sine at each position
    against the model's rotary module asked for those positions, rotate_half(x) sin as roll(x) signed sin."""
    from transformers.models.llama.modeling_llama import rotate_half

    _, tok = tiny
    model = _model(tok, arch)
    norm = model.model.layers[0].input_layernorm
    norm.weight.data.normal_()
    x = torch.randn(7, 64) * 3
    assert torch.equal(grouped_decode._norm(norm)(x), norm(x))
    bf16_norm = _model(tok, arch, torch.bfloat16).model.norm
    assert grouped_decode._norm(bf16_norm) is bf16_norm  # (its own casts: called as the model calls it)
    rotary, like = model.model.rotary_emb, model.model.embed_tokens.weight
    table = grouped_decode._RotaryTable.of(rotary, like, 300)
    positions = torch.tensor([[0], [5], [137], [299]])  # [r, 1]
    cos, sin = rotary(like, positions)  # [r, 1, D]
    assert torch.equal(table.cos[positions[:, 0]], cos[:, 0])
    q = torch.randn(4, 3, cos.shape[-1])  # [r, heads, D]
    signed = table.signed_sin[positions[:, 0]][:, None]
    assert torch.equal(q.roll(q.shape[-1] // 2, -1) * signed, rotate_half(q) * sin)


def test_grouped_step_in_bf16_is_as_close_to_float32_as_the_model_forward(tiny):
    """In bf16 the grouped attention (bf16 matmuls, float32 softmax) is as accurate as the model's own
    SDPA forward: both measured against the float32 model's log-probs (measured: 6.6e-4 vs 6.5e-4 mean
    |delta log p| on this Llama)."""
    _, tok = tiny
    reference = _step_by_step(_model(tok, "llama"), tok, drops={})[1]
    grouped, plain = _step_by_step(_model(tok, "llama", torch.bfloat16), tok, drops={})

    def error(logits):
        return torch.stack([(a.float().log_softmax(-1) - r.log_softmax(-1)).abs().mean()
                            for a, r in zip(logits, reference)]).mean()

    assert grouped[0].dtype == torch.bfloat16
    assert error(grouped) < 1.25 * error(plain)


@pytest.mark.parametrize("dtype", ["float32", "bf16-mixed"])
def test_grouped_steps_rotary_numbers_are_the_model_forwards(tiny, dtype):
    """The rotary table holds, bit for bit and in the same dtype, the cos/sin the model's forward hands its
    layers at each position: float32 under bf16-mixed too (the rotary module returns the dtype of the hidden
    states it is given: the embedding's output, which bf16-mixed makes float32 over bfloat16 weights; a
    bfloat16 table there put the sampler's log-probs 50% further from the trainer's)."""
    from docuchat_rl.modeling import compute_context, enable_mixed

    _, tok = tiny
    model = _model(tok, "llama", torch.float32 if dtype == "float32" else torch.bfloat16)
    if dtype == "bf16-mixed":
        enable_mixed(model)
    seen = []
    model.model.rotary_emb.register_forward_hook(lambda module, args, out: seen.append(out))
    with torch.no_grad(), compute_context(model):
        cache, mask = _prefill(model, tok, _prompts(tok, 2))
        steps = grouped_decode.GroupedSteps(model, cache, mask, 2, 8)
        steps(torch.full((4,), 7), 0)  # (the table is made at the first step)
        positions = torch.arange(5, 40)[None]  # [1, P]
        model(input_ids=torch.full((1, 35), 7), position_ids=positions)
    cos, sin = seen[-1]  # [1, P, D] each
    assert cos.dtype == steps.rotary.cos.dtype == (torch.float32 if dtype == "bf16-mixed" else model.dtype)
    assert torch.equal(steps.rotary.cos[positions[0]], cos[0])
    assert torch.equal(steps.rotary.signed_sin[positions[0]], grouped_decode._signed(sin[0]))


def test_grouped_step_runs_lora_layers_merged_or_not(tiny):
    """With peft LoRA layers in the tree (rollout.merge_adapter false) the step calls them like any
    projection; with them merged it runs the merged base layers. Both give the model forward's logits."""
    from docuchat_rl.modeling import merged_adapter

    _, tok = tiny
    model = with_lora(_model(tok, "llama-gqa-bias"), ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                      "up_proj", "down_proj"]).eval()
    unmerged = _step_by_step(model, tok)
    with merged_adapter(model):
        merged = _step_by_step(model, tok)
    for (a, b), (c, d) in zip(zip(*unmerged), zip(*merged)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(c, d, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(a, c, atol=1e-4, rtol=1e-4)  # the LoRA delta is really there in both
    with torch.no_grad(), model.disable_adapter():
        base = _step_by_step(model, tok)[0]
    assert max((a - b).abs().max() for a, b in zip(unmerged[0], base)) > 1e-3


@pytest.mark.parametrize("arch", ["mistral-window", "gemma2", "gpt2"])
def test_other_architectures_decode_through_the_model_forward(tiny, arch):
    """Sliding windows, Gemma2 and GPT-2 are not covered: `generate` decodes them with the model's own
    forward (its top-level forward runs once per token), and the output is the same with the switch off."""
    _, tok = tiny
    model = _model(tok, arch)
    prompts = _prompts(tok, 2)
    cache, _ = _prefill(model, tok, prompts)
    assert not grouped_decode.supports(model, cache)
    calls = []
    handle = model.register_forward_hook(lambda *a: calls.append(1))
    try:
        on = generate(model, tok, prompts, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                      num_return_sequences=2)
    finally:
        handle.remove()
    assert len(calls) == 6  # the prefill and 5 decode steps through the model's forward
    off = generate(model, tok, prompts, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                   num_return_sequences=2, grouped_decode=False)
    assert on.completion_ids == off.completion_ids


def test_grouped_sampling_draws_the_same_completions_as_the_model_forward(tiny):
    """End to end on the default model with natural EOS: the same row seeds give the same completions
    with the grouped step (one model forward per chunk: the prefill) as through the model's forward."""
    from docuchat_rl.sampling.rollout import row_seed

    model, tok = tiny
    prompts = _prompts(tok, 4)
    seeds = [row_seed(0, 3, p, s) for p in range(4) for s in range(4)]
    kw = dict(max_new_tokens=48, do_sample=True, num_return_sequences=4, row_seeds=seeds, temperature=0.8,
              top_p=0.95)
    calls = []
    handle = model.register_forward_hook(lambda *a: calls.append(1))
    try:
        grouped = generate(model, tok, prompts, **kw)
    finally:
        handle.remove()
    assert calls == [1]
    plain = generate(model, tok, prompts, grouped_decode=False, **kw)
    assert grouped.completion_ids == plain.completion_ids and grouped.truncated == plain.truncated
    assert len({len(c) for c in grouped.completion_ids}) > 1  # rows ended at different steps
    for a, b in zip(grouped.logps, plain.logps):
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=1e-5)


def test_grouped_decode_applies_to_the_fast_loop_only():
    from docuchat_rl.config import load_config

    from .conftest import ROOT

    with pytest.raises(ValueError, match="grouped_decode applies to our fast decode loop .* not to rollout.engine hf"):
        load_config(ROOT / "config/default.yaml", ["rollout.engine=hf", "rollout.grouped_decode=true"])
    assert load_config(ROOT / "config/default.yaml", ["rollout.grouped_decode=false"]).rollout.grouped_decode is False


@pytest.mark.parametrize("arch", ["llama", "llama-gqa-bias", "qwen2", "mistral", "mistral-window", "gemma2", "gpt2"])
def test_covers_reads_from_the_model_what_supports_reads_from_a_prefill(tiny, arch):
    """`covers` decides before any prefill (on a GPU, whether rollout.cuda_graphs decodes a model or hands it
    to transformers.generate); it must agree with `supports`, which the decode loop asks after the prefill."""
    _, tok = tiny
    model = _model(tok, arch)
    cache, _ = _prefill(model, tok, _prompts(tok, 2))
    assert grouped_decode.covers(model) == grouped_decode.supports(model, cache)
    assert grouped_decode.covers(model) == (arch in ("llama", "llama-gqa-bias", "qwen2", "mistral"))


@pytest.mark.parametrize("arch,on_gpu", [("qwen2", "fast"), ("mistral", "fast"), ("mistral-window", "hf"),
                                         ("gemma2", "hf"), ("gpt2", "hf")])
def test_a_gpu_hands_what_cuda_graphs_do_not_cover_to_transformers_generate(tiny, arch, on_gpu):
    """rollout.cuda_graphs is on on GPUs: a model its static decode covers decodes in the fast loop, any other
    through transformers.generate (the dynamic loop is slow there); on a CPU nothing changes."""
    from docuchat_rl.config import load_config
    from docuchat_rl.sampling.decoding import local_loop

    _, tok = tiny
    model = _model(tok, arch)
    r = load_config(None, []).for_device("cuda").rollout  # (auto: the fast loop with cuda_graphs)
    assert (r.engine, r.cuda_graphs) == ("fast", True)
    assert local_loop(r, model, lockstep=False, device_type="cuda") == on_gpu
    assert local_loop(r, model, lockstep=True, device_type="cuda") == "hf"
    assert local_loop(r, model, lockstep=False, device_type="cpu") == "fast"
    assert local_loop(r.model_copy(update={"cuda_graphs": False}), model, device_type="cuda") == "fast"
