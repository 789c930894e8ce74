"""The fast decode loop against transformers.generate, the sampler against its definition, warpers
against transformers' own, and the sliding-window fallback on a real (tiny, random) Mistral."""

import pytest
import torch

from docuchat_rl.config import DEFAULT_SYSTEM_PROMPT
from docuchat_rl.data import load_examples, render_prompt
from docuchat_rl.modeling import eos_ids, load_model_and_tokenizer, warpers
from docuchat_rl.sampling.draw import DRAW_BLOCK, block_draw
from docuchat_rl.sampling.generation import completion_texts, generate, sample

from .conftest import MODEL, TASK


def _prompts(tok, n):
    rows = load_examples(str(TASK / "test.jsonl"), "test", "question", "answer", limit=n)
    return [render_prompt(tok, r.question, DEFAULT_SYSTEM_PROMPT) for r in rows]


def test_fast_greedy_equals_transformers_generate(tiny):
    model, tok = tiny
    prompts = _prompts(tok, 24)  # different lengths: left padding inside every chunk
    kw = dict(max_new_tokens=40, do_sample=False, batch_size=16)
    hf = generate(model, tok, prompts, loop="hf", **kw)
    fast = generate(model, tok, prompts, loop="fast", **kw)
    assert fast.completion_ids == hf.completion_ids
    assert fast.truncated == hf.truncated and fast.prompt_ids == hf.prompt_ids
    assert any(not t for t in fast.truncated)  # some rows did stop at EOS
    for ids, cut in zip(fast.completion_ids, fast.truncated):
        assert cut or ids[-1] == tok.eos_token_id  # ends at EOS unless truncated
        assert tok.eos_token_id not in ids[:-1]  # nothing after the first EOS is kept


def test_fast_groups_repeat_prompt_major_and_sample_differently(tiny):
    model, tok = tiny
    prompts = _prompts(tok, 3)
    torch.manual_seed(0)
    gen = generate(model, tok, prompts, max_new_tokens=24, do_sample=True, num_return_sequences=4, batch_size=8)
    assert len(gen.completion_ids) == 12
    for r in range(12):  # rows are prompt-major: row r belongs to prompt r // 4
        assert gen.prompt_ids[r] == tok(prompts[r // 4], add_special_tokens=False)["input_ids"]
    assert len({tuple(c) for c in gen.completion_ids[:4]}) > 1  # the group is not 4 copies
    torch.manual_seed(0)
    again = generate(model, tok, prompts, max_new_tokens=24, do_sample=True, num_return_sequences=4, batch_size=8)
    assert again.completion_ids == gen.completion_ids  # seeded: reproducible


def test_sampled_tokens_have_the_model_distribution(tiny):
    """The first sampled token of many rows against the model's own next-token probabilities."""
    model, tok = tiny
    prompt = _prompts(tok, 1)
    enc = tok(prompt, return_tensors="pt", add_special_tokens=False)
    with torch.no_grad():
        logits = model(**enc).logits[0, -1] / 1.3
    torch.manual_seed(1)
    gen = generate(model, tok, prompt, max_new_tokens=1, do_sample=True, temperature=1.3,
                   num_return_sequences=4000, batch_size=4000)
    counts = torch.bincount(torch.tensor([c[0] for c in gen.completion_ids]), minlength=logits.numel())
    freq = counts / counts.sum()
    probs = logits.softmax(-1)
    assert (freq - probs).abs().max() < 0.03  # 4000 draws: sd of a frequency <= 0.008


def test_sampler_is_exact_and_never_picks_excluded_tokens():
    probs = torch.tensor([0.5, 0.0, 0.3, 0.2, 0.0])
    logits = probs.log().expand(200_000, -1)
    torch.manual_seed(0)
    draws = sample(logits, do_sample=True).tokens
    freq = torch.bincount(draws, minlength=5) / draws.numel()
    assert freq[1] == 0 and freq[4] == 0  # zero probability: never, even at the CDF's flat end
    assert torch.allclose(freq, probs, atol=0.005)
    top1 = sample(torch.tensor([[0.1, 2.0, 0.3]]).expand(1000, -1), do_sample=True, processors=warpers(top_k=1))
    assert (top1.tokens == 1).all()
    assert sample(torch.tensor([[0.1, 2.0, 0.3]]), do_sample=False).tokens.tolist() == [1]


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.0, 0, 0.8),
                                                     (1.3, 20, 0.9), (1.0, 1, 0.5)])
def test_sampler_log_probs_are_those_of_the_warped_distribution(temperature, top_k, top_p):
    """The log-prob the sampler returns is the drawn token's under transformers' warpers, and only
    tokens those warpers keep are drawn."""
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    ref = logits.clone()
    if temperature != 1.0:
        ref = TemperatureLogitsWarper(temperature)(None, ref)
    if top_k:
        ref = TopKLogitsWarper(top_k)(None, ref)
    if top_p < 1.0:
        ref = TopPLogitsWarper(top_p)(None, ref)
    ref_logp = torch.log_softmax(ref, -1)
    for _ in range(20):
        draw = sample(logits, do_sample=True, processors=warpers(temperature, top_k, top_p))
        assert torch.isfinite(ref[torch.arange(6), draw.tokens]).all()  # a kept token
        assert torch.allclose(draw.logps, ref_logp[torch.arange(6), draw.tokens], atol=1e-5)


@pytest.mark.parametrize("head", [0.99, 0.9999])
def test_sampler_gives_every_token_of_a_150k_vocabulary_its_own_probability(head):
    """V = 151,936 with `head` of the mass on one token: each tail token (6.6e-8 or 6.6e-10, at or below
    one float32 step of a CDF near 1) must own a draw interval of exactly its probability: the midpoint of
    each token's exact interval draws that token (tried on the blocks' edges and 1,024 tail tokens)."""
    v = 151_936
    q = (1 - head) / (v - 1)
    logits = torch.full((1, v), float(torch.tensor(q, dtype=torch.float64).log()), dtype=torch.float64)
    logits[0, 0] = torch.tensor(head, dtype=torch.float64).log()
    probs = logits.softmax(-1)  # float64
    idx = torch.arange(v, dtype=torch.float64)
    mids = torch.where(idx == 0, torch.tensor(head / 2, dtype=torch.float64), head + (idx - 0.5) * q)  # [V]
    # every token reachable in its own exact interval: the head, the first and last tokens of blocks 0, 1 and
    # the last (where the two levels meet), and 1,024 tail tokens at random (a draw reads the whole row)
    edges = [t for b in (0, 1, v // DRAW_BLOCK) for t in (b * DRAW_BLOCK - 1, b * DRAW_BLOCK, b * DRAW_BLOCK + 1)]
    picked = torch.cat([torch.tensor([t for t in edges if 0 <= t < v]),
                        torch.randint(1, v, (1024,), generator=torch.Generator().manual_seed(0)), torch.tensor([v - 1])])
    for part in picked.split(256):
        assert torch.equal(block_draw(logits.float().expand(len(part), v), mids[part, None])[0][:, 0], part)
    # what a float32 CDF (the previous sampler) does: tail steps of 0 or one ulp instead of q
    cdf32 = probs.float().cumsum(-1)[0]
    step = (cdf32[1:] - cdf32[:-1]).double()  # [V - 1]
    assert ((step - q).abs() / q).max() > 0.5  # some tail token's probability is off by more than 50%


def _whole_cdf_draw(logits: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """The reference: a float64 softmax and cumulative sum over the whole vocabulary, the first token whose
    cumulative probability exceeds u (the sampler's draw before round 4)."""
    probs = logits.double().softmax(-1)  # [R, V]
    cdf = probs.cumsum(-1)  # [R, V]
    return torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=probs.shape[-1] - 1)  # [R, 1]


@pytest.mark.parametrize("v", [544, 1_024, 49_152, 151_936])  # (544: the embedded model's, one padded block)
def test_the_block_draw_draws_the_whole_vocabularys_float64_cdf_tokens_from_the_same_uniforms(v):
    """Logits as a model's (a peaked head, a long tail), plain, with top-k / top-p removing tokens: 6,144 draws
    each, every one the token the whole-vocabulary float64 inverse CDF draws from the same uniform, its
    log-prob that token's float64 log-probability; a distribution of one possible token always draws it."""
    from docuchat_rl.modeling import warpers

    g = torch.Generator().manual_seed(v)
    for processors in ([], warpers(1.0, 50, 1.0), warpers(0.7, 0, 0.9)):
        logits = torch.randn(64, v, generator=g) * 3  # [64, V]
        logits[:, :8] += 6  # (a head of a few likely tokens)
        for proc in processors:
            logits = proc(None, logits)
        probs = logits.double().softmax(-1)  # [64, V] the reference: the whole CDF in float64
        cdf = probs.cumsum(-1)
        for _ in range(32):
            u = torch.rand(64, 1, generator=g, dtype=torch.float64)
            token, logp = block_draw(logits, u)
            assert torch.equal(token, torch.searchsorted(cdf, u * cdf[:, -1:], right=True))
            assert torch.allclose(logp.double(), probs.gather(-1, token).log(), atol=1e-6)
    one = torch.full((2, v), float("-inf"))
    one[:, v // 2] = 0.0
    assert block_draw(one, torch.tensor([[0.0], [0.999999]], dtype=torch.float64))[0].flatten().tolist() == [v // 2] * 2


def test_sliding_window_model_falls_back_to_a_growing_cache_and_matches(tiny):
    """A model whose cache is not plain full attention (sliding window) takes the repeated dynamic cache;
    greedy output still equals transformers.generate."""
    from transformers import MistralConfig, MistralForCausalLM

    _, tok = tiny
    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, sliding_window=8,
                        max_position_embeddings=512, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = MistralForCausalLM(cfg).eval()
    prompts = _prompts(tok, 4)
    with torch.no_grad():
        cache = model(**tok(prompts[:1], return_tensors="pt"), use_cache=True).past_key_values
    assert type(cache.layers[0]).__name__ == "DynamicSlidingWindowLayer"  # really the fallback path
    fast = generate(model, tok, prompts, loop="fast", max_new_tokens=12, do_sample=False, num_return_sequences=2)
    hf = generate(model, tok, [p for p in prompts for _ in range(2)], loop="hf", max_new_tokens=12,
                  do_sample=False)
    assert fast.completion_ids == hf.completion_ids


def test_unknown_decode_loop_is_refused(tiny):
    model, tok = tiny
    with pytest.raises(ValueError, match="unknown decode loop 'sglang'; valid: fast, hf"):
        generate(model, tok, ["x"], max_new_tokens=1, do_sample=False, loop="sglang")


@pytest.mark.parametrize("engine", ["fast", "hf"])
def test_min_new_tokens_gives_fixed_lengths(tiny, engine):
    model, tok = tiny
    prompts = _prompts(tok, 2)
    free = generate(model, tok, prompts, max_new_tokens=60, do_sample=False, loop=engine)
    assert any(len(c) < 60 for c in free.completion_ids)  # it would stop early on its own
    fixed = generate(model, tok, prompts, max_new_tokens=60, min_new_tokens=60, do_sample=True,
                     num_return_sequences=2, loop=engine)
    assert all(len(c) == 60 for c in fixed.completion_ids)
    assert all(tok.eos_token_id not in c[:-1] for c in fixed.completion_ids)


@pytest.mark.parametrize("engine", ["fast", "hf"])
def test_a_stop_token_ends_a_completion_where_it_is_first_drawn_and_is_not_in_its_text(tiny, engine):
    model, tok = tiny
    prompts = _prompts(tok, 6)
    kw = dict(max_new_tokens=40, do_sample=False, loop=engine)
    free = generate(model, tok, prompts, **kw)
    # a token the model writes mid-completion, whose text is that one token again: made a stop
    row, stop_id = next((r, t) for r, c in enumerate(free.completion_ids) for t in c[2:-1]
                        if tok.encode(tok.decode([t]), add_special_tokens=False) == [t])
    stopped, stok = load_model_and_tokenizer(str(MODEL), "float32", "cpu", stop_tokens=[tok.decode([stop_id])])
    stops = eos_ids(stopped, stok)
    assert stop_id in stops
    got = generate(stopped, stok, prompts, **kw)
    cut_rows = 0
    for before, after, truncated in zip(free.completion_ids, got.completion_ids, got.truncated):
        first = next((i for i, t in enumerate(before) if t == stop_id), None)
        if first is None:
            assert after == before
        else:
            cut_rows += 1
            assert after == before[:first + 1] and not truncated
    assert cut_rows >= 1
    texts = completion_texts(stok, got.completion_ids, stops)
    assert texts[row] == tok.decode(got.completion_ids[row][:-1], skip_special_tokens=True)
    assert texts[row] != tok.decode(got.completion_ids[row], skip_special_tokens=True)  # (the stop's text is gone)


@pytest.mark.parametrize("engine", ["fast", "hf"])
def test_only_the_configured_processors_shape_the_distribution(tiny, engine):
    """A model's generation_config (Qwen2.5-Instruct ships repetition_penalty and top_k) must not add
    processors: greedy output is the plain argmax path, and the sampler's log-probs are the model's."""
    from docuchat_rl.learning.batch import build_batch
    from docuchat_rl.learning.forward import policy_forward

    model, tok = tiny
    prompts = _prompts(tok, 4)
    plain = generate(model, tok, prompts, loop=engine, max_new_tokens=30, do_sample=False)
    gc = model.generation_config
    saved = (gc.repetition_penalty, gc.top_k, gc.no_repeat_ngram_size)
    gc.repetition_penalty, gc.top_k, gc.no_repeat_ngram_size = 1.5, 3, 2
    try:
        greedy = generate(model, tok, prompts, loop=engine, max_new_tokens=30, do_sample=False)
        torch.manual_seed(0)
        sampled = generate(model, tok, prompts, loop=engine, max_new_tokens=30, do_sample=True,
                           num_return_sequences=2, temperature=0.9)
    finally:
        gc.repetition_penalty, gc.top_k, gc.no_repeat_ngram_size = saved
    assert greedy.completion_ids == plain.completion_ids
    batch = build_batch(sampled.prompt_ids, sampled.completion_ids, [0.0] * 8, [0, 0, 1, 1, 2, 2, 3, 3],
                        tok.pad_token_id, sampler_logps=sampled.logps)
    with torch.no_grad():
        scored = policy_forward(model, batch, temperature=0.9).logps  # [R, T]
    m = batch.completion_mask.bool()
    assert (scored[m] - batch.sampler_logps[m]).abs().max() < 1e-4


@pytest.mark.parametrize("engine", ["fast", "hf"])
@pytest.mark.parametrize("top_k,top_p", [(5, 1.0), (0, 0.8), (8, 0.9)])
def test_on_policy_the_trainer_scores_what_the_sampler_drew_from_under_top_k_and_top_p(tiny, engine, top_k, top_p):
    """rollout.top_k / top_p: the trainer's log-probs are the sampler's (ratio 1 on-policy, whole logits and
    chunked); scored over the full softmax instead they were lower by log(kept mass), a bias of every ratio."""
    from docuchat_rl.learning.batch import build_batch
    from docuchat_rl.learning.forward import policy_forward

    model, tok = tiny
    sampled = generate(model, tok, _prompts(tok, 3), loop=engine, max_new_tokens=24, do_sample=True,
                       num_return_sequences=2, temperature=0.9, top_k=top_k, top_p=top_p, row_seeds=list(range(6)))
    batch = build_batch(sampled.prompt_ids, sampled.completion_ids, [0.0] * 6, [0, 0, 1, 1, 2, 2],
                        tok.pad_token_id, sampler_logps=sampled.logps)
    m = batch.completion_mask.bool()
    with torch.no_grad():
        for chunk in (0, 5):
            scored = policy_forward(model, batch, temperature=0.9, top_k=top_k, top_p=top_p, logit_chunk=chunk)
            ratio = (scored.logps - batch.sampler_logps).exp()[m]
            assert (ratio - 1).abs().max() < 1e-4, (ratio - 1).abs().max()
        full = policy_forward(model, batch, temperature=0.9).logps
    assert (full - batch.sampler_logps)[m].mean() < -0.01  # the bias the truncation removes


def test_row_seeds_make_each_row_independent_of_batching_and_engine(tiny):
    """With one random stream per row, a row draws the same completion whatever the batch size, whichever
    rows share its batch, and in either engine."""
    from docuchat_rl.sampling.rollout import row_seed

    model, tok = tiny
    prompts = _prompts(tok, 6)
    seeds = [row_seed(0, 1, p, s) for p in range(6) for s in range(3)]
    kw = dict(max_new_tokens=32, do_sample=True, num_return_sequences=3, temperature=1.0, top_k=20)
    big = generate(model, tok, prompts, batch_size=64, row_seeds=seeds, **kw)
    small = generate(model, tok, prompts, batch_size=6, row_seeds=seeds, **kw)
    assert small.completion_ids == big.completion_ids
    alone = generate(model, tok, prompts[4:5], batch_size=64, row_seeds=seeds[12:15], **kw)  # other rows gone
    assert alone.completion_ids == big.completion_ids[12:15]
    hf = generate(model, tok, prompts, batch_size=18, row_seeds=seeds, loop="hf", **kw)
    assert hf.completion_ids == big.completion_ids
    assert len({tuple(c) for c in big.completion_ids}) > 6  # really sampled


@pytest.mark.parametrize("grouped", [True, False])
def test_finished_rows_leave_the_decode_batch_and_every_row_samples_as_before(tiny, grouped):
    """Once a quarter of the rows have ended, the fast loop decodes without them: its later steps
    get fewer rows, and every row's completion and log-probs are what transformers.generate draws with the
    same row seeds. Both decode steps: the grouped one (rows of a prompt leave its group unevenly) and
    the model's own forward."""
    from docuchat_rl.sampling.rollout import row_seed

    model, tok = tiny
    prompts = _prompts(tok, 8)
    seeds = [row_seed(0, 2, p, s) for p in range(8) for s in range(4)]
    kw = dict(max_new_tokens=64, do_sample=True, num_return_sequences=4, batch_size=32, row_seeds=seeds)
    rows_per_call = []  # the embedding sees every model call and every grouped step
    handle = model.get_input_embeddings().register_forward_hook(
        lambda mod, args, out: rows_per_call.append(args[0].shape[0]))
    try:
        fast = generate(model, tok, prompts, grouped_decode=grouped, **kw)
    finally:
        handle.remove()
    decode = rows_per_call[1:]  # (the first call is the prefill of the 8 distinct prompts)
    assert decode[0] == 32 and min(decode) < 32 and decode == sorted(decode, reverse=True)
    lengths = sorted(len(c) for c in fast.completion_ids)
    assert lengths[0] < lengths[-1]  # rows really ended at different steps
    hf = generate(model, tok, prompts, loop="hf", **kw)
    assert fast.completion_ids == hf.completion_ids and fast.truncated == hf.truncated
    for a, b in zip(fast.logps, hf.logps):
        assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("engine", ["fast", "hf"])
def test_generation_builds_no_autograd_graph(tiny, engine):
    """Sampling runs without gradients whatever the decode loop, even on a model with trainable parameters."""
    model, tok = tiny
    seen = []
    handle = model.register_forward_hook(lambda mod, args, out: seen.append(torch.is_grad_enabled()))
    try:
        generate(model, tok, ["What is 2 + 2?"], max_new_tokens=3, do_sample=True, loop=engine)
    finally:
        handle.remove()
    assert seen and not any(seen)
