"""Per-token log-probs of the training forward equal those seen during generation and an unpadded loop."""

import pytest
import torch

from docuchat_rl.config import DEFAULT_SYSTEM_PROMPT
from docuchat_rl.data import render_prompt
from docuchat_rl.learning.batch import build_batch
from docuchat_rl.learning.forward import policy_forward

from .conftest import tiny_arch, with_lora


def _prompts(tok):
    qs = ["Ava has 3 apples. Ava buys 4 more apples. How many apples does Ava have now?",
          "Ben has 12 coins. Ben loses 5 coins. Ben ends up with 2 times as many coins. A friend gives "
          "Ben 7 coins. How many coins does Ben have now?"]
    return [render_prompt(tok, q, DEFAULT_SYSTEM_PROMPT) for q in qs]


def test_forward_logps_match_generation_logits_under_left_padding(tiny):
    model, tok = tiny
    prompts = _prompts(tok)
    enc = tok(prompts, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
    assert enc["attention_mask"][0].min() == 0  # the first prompt really is left-padded
    torch.manual_seed(0)
    out = model.generate(**enc, max_new_tokens=12, do_sample=True, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=tok.pad_token_id, eos_token_id=[])
    new = out.sequences[:, enc["input_ids"].shape[1]:]  # [2, 12]
    gen_logps = torch.stack([torch.log_softmax(l.float(), -1).gather(-1, new[:, j:j + 1]).squeeze(-1)
                             for j, l in enumerate(out.logits)], dim=1)  # [2, 12]
    p_ids = [ids[m.bool()].tolist() for ids, m in zip(enc["input_ids"], enc["attention_mask"])]
    batch = build_batch(p_ids, new.tolist(), [0.0, 0.0], [0, 0], tok.pad_token_id)
    with torch.no_grad():
        logps = policy_forward(model, batch).logps
    assert torch.allclose(logps, gen_logps, atol=2e-4), (logps - gen_logps).abs().max()


def test_forward_logps_match_unpadded_reference_loop_and_masks(tiny):
    model, tok = tiny
    p_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in _prompts(tok)]
    c_ids = [tok("<think>\n3 + 4 = 7\n</think>\n<answer>7</answer>", add_special_tokens=False)["input_ids"],
             tok("<think>\n12", add_special_tokens=False)["input_ids"]]
    batch = build_batch(p_ids, c_ids, [1.0, 0.0], [0, 0], tok.pad_token_id)
    assert batch.completion_mask.sum(-1).tolist() == [len(c_ids[0]), len(c_ids[1])]
    with torch.no_grad():
        logps = policy_forward(model, batch).logps  # [2, T]
        for r, (p, c) in enumerate(zip(p_ids, c_ids)):
            ids = torch.tensor([p + c])
            logits = model(input_ids=ids).logits[0, len(p) - 1:-1]  # positions that predict c
            ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c)[:, None]).squeeze(-1)
            assert torch.allclose(logps[r, :len(c)], ref, atol=1e-4)
    # a micro-batch view trims padding columns but keeps the same values
    sub = batch.select(torch.tensor([1]))
    assert sub.completion_mask.shape[1] == len(c_ids[1]) and sub.prompt_width == len(p_ids[1])
    with torch.no_grad():
        assert torch.allclose(policy_forward(model, sub).logps[0], logps[1, :len(c_ids[1])], atol=1e-5)


def test_padding_does_not_change_gradients(tiny):
    """A row's loss gradient is the same alone and beside a longer, padded row."""
    model, tok = tiny
    p_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in _prompts(tok)]
    c_ids = [tok("<answer>7</answer>", add_special_tokens=False)["input_ids"],
             tok("<think>\n12 - 5 = 7\n7 * 2 = 14\n</think>", add_special_tokens=False)["input_ids"]]
    emb = model.get_input_embeddings().weight

    def grad_of_row0(batch):
        model.zero_grad()
        out = policy_forward(model, batch)
        (out.logps[0] * batch.completion_mask[0]).sum().backward()
        return emb.grad.clone()

    both = grad_of_row0(build_batch(p_ids, c_ids, [0, 0], [0, 0], tok.pad_token_id))
    alone = grad_of_row0(build_batch(p_ids[:1], c_ids[:1], [0], [0], tok.pad_token_id))
    model.zero_grad()
    assert torch.allclose(both, alone, atol=1e-5)


def _group_batch(tok, groups):
    """Rows of several groups (prompt i, completions), group ids possibly non-contiguous."""
    prompts = _prompts(tok)
    comps = ["<think>\n3 + 4 = 7\n</think>\n<answer>7</answer>", "<think>\n12 - 5", "<answer>9</answer>",
             "<think>\n3 + 4 = 8\n</think>"]
    order = sorted(range(len(groups)), key=lambda r: groups[r])  # build_batch takes contiguous groups
    p_ids, c_ids, group = [], [], []
    for r in order:
        g = groups[r]
        p_ids.append(tok(prompts[g % 2], add_special_tokens=False)["input_ids"])
        c_ids.append(tok(comps[r % len(comps)], add_special_tokens=False)["input_ids"])
        group.append(g)
    batch = build_batch(p_ids, c_ids, [0.0] * len(groups), group, tok.pad_token_id)
    return batch.select(torch.tensor(sorted(range(len(groups)), key=order.__getitem__)))  # back to `groups` order


def test_shared_prompt_forward_equals_the_plain_forward_values_hidden_and_gradients(tiny):
    model, tok = tiny
    pm = with_lora(model, ["q_proj", "v_proj", "down_proj"])
    try:
        batch = _group_batch(tok, [0, 1, 0, 0, 1, 2, 1])  # groups interleaved; group 2 (prompt 0) alone
        results = []
        for share in (False, True):
            pm.zero_grad()
            out = policy_forward(pm, batch, temperature=0.9, with_entropy=True, with_hidden=True,
                                 share_prompt=share)
            loss = (out.logps * batch.completion_mask).sum() + out.hidden.pow(2).mean()
            loss.backward()
            grads = {n: p.grad.clone() for n, p in pm.named_parameters() if p.grad is not None}
            results.append((out, grads))
        (plain, g0), (shared, g1) = results
        m = batch.completion_mask.bool()
        assert torch.allclose(plain.logps[m], shared.logps[m], atol=1e-5)
        assert torch.allclose(plain.entropy[m], shared.entropy[m], atol=1e-5)
        assert torch.allclose(plain.hidden[m], shared.hidden[m], atol=1e-5)
        assert g0.keys() == g1.keys() and len(g0) == 3 * 4 * 2  # 3 modules x 4 layers x (A, B)
        for n in g0:  # float32 sums in another order: equal to ~1e-6 of the gradient's norm
            assert (g0[n] - g1[n]).norm() <= 2e-5 * g0[n].norm(), n
    finally:
        pm.unload()  # give the session's model back without adapters


def test_shared_prompt_forward_matches_rows_by_their_prompt_tokens_not_their_group(tiny):
    """A group whose rows have different prompts (an environment's per-row first observation) runs each
    row's own prompt; two groups with one prompt share it; either way the numbers are the plain forward's."""
    from docuchat_rl.learning.forward import _shared_prompt_forward, policy_forward

    model, tok = tiny
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in _prompts(tok)]
    comp = tok("<answer>7</answer>", add_special_tokens=False)["input_ids"]
    own = build_batch([prompts[0], prompts[1], prompts[0] + comp[:1]], [comp] * 3, [0.0] * 3, [0, 0, 0],
                      tok.pad_token_id)  # one group, three prompts
    assert own.info.prompts == (0, 1, 2) and _shared_prompt_forward(model, own) is None
    across = _group_batch(tok, [0, 1, 2])  # groups 0 and 2 have the same prompt
    assert across.info.prompts[0] == across.info.prompts[2] != across.info.prompts[1]
    with torch.no_grad():
        for batch in (own, across):
            plain, shared = (policy_forward(model, batch, share_prompt=s) for s in (False, True))
            m = batch.completion_mask.bool()
            assert torch.allclose(plain.logps[m], shared.logps[m], atol=1e-5)
    with torch.no_grad():
        shared = _shared_prompt_forward(model, _group_batch(tok, [0, 0, 1]))  # one part: hidden states [R, T, H]
    assert shared is not None and len(shared) == 1 and shared[0].shape[0] == 3


@pytest.mark.parametrize("arch", ["default", "gemma2"])
def test_chunked_entropy_bonus_gradients_equal_the_full_logits_path(tiny, arch):
    """With an entropy bonus (algorithm.ent_coef) the chunked path differentiates the entropy too: the
    written-out gradient -p (z - E[z]) equals autograd's through the whole [R, T, V] logits."""
    base, tok = tiny
    model = base if arch == "default" else tiny_arch(arch, tok)
    pm = with_lora(model, ["q_proj", "v_proj", "lm_head"]).eval()
    try:
        batch = _group_batch(tok, [0, 0, 1, 2])
        m = batch.completion_mask
        grads = []
        for chunk in (0, 5):
            pm.zero_grad()
            out = policy_forward(pm, batch, temperature=1.1, with_entropy=True, entropy_grad=True, logit_chunk=chunk)
            ((out.logps * m).sum() + 0.7 * (out.entropy * m).sum()).backward()
            grads.append({n: p.grad.clone() for n, p in pm.named_parameters() if p.grad is not None})
        assert grads[0].keys() == grads[1].keys() and any("lm_head" in n for n in grads[0])
        for n in grads[0]:
            assert (grads[0][n] - grads[1][n]).norm() <= 1e-5 * grads[0][n].norm() + 1e-8, n
    finally:
        pm.unload()


@pytest.mark.parametrize("arch", ["default", "qwen2", "gemma2", "mistral", "gpt2"])
@pytest.mark.parametrize("share", [False, True], ids=["plain", "shared-prompt"])
def test_chunked_log_probs_equal_the_full_logits_path_with_gradients(tiny, arch, share):
    """logit_chunk scores a few positions at a time from the hidden states (never all [R, T, V] logits):
    log-probs, entropies and LoRA gradients (lm_head included) equal the whole-tensor path."""
    base, tok = tiny
    model = base if arch == "default" else tiny_arch(arch, tok)
    pm = with_lora(model, ["c_attn", "lm_head"] if arch == "gpt2" else ["q_proj", "v_proj", "lm_head"]).eval()
    try:
        batch = _group_batch(tok, [0, 0, 1, 1, 1])
        results = []
        for chunk in (0, 7):  # 7 positions per chunk: chunks cut across rows
            pm.zero_grad()
            out = policy_forward(pm, batch, temperature=0.9, with_entropy=True, share_prompt=share,
                                 logit_chunk=chunk)
            (out.logps * batch.completion_mask).sum().backward()
            results.append((out, {n: p.grad.clone() for n, p in pm.named_parameters() if p.grad is not None}))
        (full, g0), (chunked, g1) = results
        m = batch.completion_mask.bool()
        assert torch.allclose(full.logps[m], chunked.logps[m], atol=1e-5)
        assert torch.allclose(full.entropy[m], chunked.entropy[m], atol=1e-5)
        assert g0.keys() == g1.keys() and any("lm_head" in n for n in g0)
        for n in g0:
            assert (g0[n] - g1[n]).norm() <= 1e-5 * g0[n].norm() + 1e-8, n
    finally:
        pm.unload()


def test_length_buckets_are_the_cheapest_cut_of_the_sorted_rows():
    """bucket_rows against every way of cutting the length-sorted rows into at most `most` runs."""
    import itertools
    import random

    from docuchat_rl.learning.forward import bucket_rows

    def cost(buckets, lens, extra):
        return sum(len(b) * max(max(lens[r], 1) for r in b) + extra for b in buckets)

    rng = random.Random(0)
    for _ in range(200):
        lens = [rng.choice([0, 1, 2, 5, 9, 30, 31, 64]) for _ in range(rng.randint(1, 9))]
        most, extra = rng.randint(1, 4), rng.choice([0, 8, 32, 200])
        got = bucket_rows(lens, most, extra)
        assert sorted(r for b in got for r in b) == list(range(len(lens))) and len(got) <= most
        assert all(b == sorted(b) for b in got)  # each bucket keeps the rows' order
        widths = sorted({max(n, 1) for n in lens})
        best = min(cost([[r for r, n in enumerate(lens) if lo <= max(n, 1) <= hi] for lo, hi in runs], lens, extra)
                   for k in range(min(most, len(widths)))
                   for cuts in itertools.combinations(range(1, len(widths)), k)
                   for runs in [list(zip([widths[0]] + [widths[c] for c in cuts],
                                         [widths[c - 1] for c in cuts] + [widths[-1]]))])
        assert cost(got, lens, extra) == best, (lens, most, extra, got)
    assert bucket_rows([3, 60, 3, 60], most=1) == [[0, 1, 2, 3]]


def _ragged_batch(tok):
    """Rows of three groups whose completions run from 2 to ~60 tokens: a forward split by length."""
    prompts = _prompts(tok)
    short, long = "<answer>7</answer>", "<think>\n" + "3 + 4 = 7\n" * 8 + "</think>\n<answer>7</answer>"
    rows = [(0, long), (0, short), (0, "<think>"), (1, short), (1, long), (1, long[:40]), (2, short), (2, long)]
    p_ids = [tok(prompts[g % 2], add_special_tokens=False)["input_ids"] for g, _ in rows]
    c_ids = [tok(c, add_special_tokens=False)["input_ids"] for _, c in rows]
    return build_batch(p_ids, c_ids, [0.0] * len(rows), [g for g, _ in rows], tok.pad_token_id)


@pytest.mark.parametrize("arch", ["default", "qwen2", "gemma2", "mistral", "gpt2"])
@pytest.mark.parametrize("share", [False, True], ids=["plain", "shared-prompt"])
def test_length_buckets_give_the_one_forward_values_hidden_and_gradients(tiny, arch, share):
    """Split by completion length (each bucket padded to its own longest, the shared prompt still run once):
    log-probs, entropies, hidden states and LoRA gradients equal one forward padded to the longest row;
    Mistral's sliding window (8 < the prompt) and Gemma2's soft-capping included."""
    base, tok = tiny
    model = base if arch == "default" else tiny_arch(arch, tok)
    pm = with_lora(model, ["c_attn"] if arch == "gpt2" else ["q_proj", "v_proj", "down_proj"]).eval()
    calls = []
    hook = pm.get_base_model().base_model.register_forward_pre_hook(lambda *a: calls.append(1))
    try:
        batch = _ragged_batch(tok)
        results = []
        for buckets in (1, 4):
            pm.zero_grad()
            calls.clear()
            out = policy_forward(pm, batch, temperature=0.9, with_entropy=True, with_hidden=True,
                                 share_prompt=share, length_buckets=buckets)
            n_calls = len(calls)
            loss = (out.logps * batch.completion_mask).sum() + (out.hidden * batch.completion_mask[..., None]).pow(2).mean()
            loss.backward()
            grads = {n: p.grad.clone() for n, p in pm.named_parameters() if p.grad is not None}
            results.append((out, grads, n_calls))
        (one, g0, calls0), (split, g1, calls1) = results
        assert calls1 > calls0  # really split: more decoder calls
        assert one.logps.shape == split.logps.shape == batch.completion_mask.shape
        m = batch.completion_mask.bool()
        assert torch.allclose(one.logps[m], split.logps[m], atol=1e-5)
        assert torch.allclose(one.entropy[m], split.entropy[m], atol=1e-5)
        assert torch.allclose(one.hidden[m], split.hidden[m], atol=1e-5)
        assert g0.keys() == g1.keys() and len(g0) > 0
        for n in g0:
            assert (g0[n] - g1[n]).norm() <= 1e-5 * g0[n].norm() + 1e-8, n
    finally:
        hook.remove()
        pm.unload()


def test_bf16_log_probs_divide_float32_logits_by_the_temperature_as_the_sampler_does(tiny):
    """In bfloat16 the trainer's log-probs are those of the model's own bf16 logits divided in float32 (the
    sampler's arithmetic, generation.sample); a bf16 division would be off by ~1e-2 nats."""
    import copy

    from docuchat_rl.learning.losses import token_logprobs

    model, tok = tiny
    m16 = copy.deepcopy(model).to(torch.bfloat16)
    batch = _group_batch(tok, [0, 1, 2, 0])
    t, mask = batch.completion_mask.shape[1], batch.completion_mask.bool()
    with torch.no_grad():
        logits = m16(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                     position_ids=(batch.attention_mask.cumsum(-1) - 1).clamp(min=0)).logits[:, -t - 1:-1]  # bf16
        for temperature in (0.7, 1.3):
            ref = token_logprobs(logits.float() / temperature, batch.completion_ids)  # [R, T]
            for chunk in (0, 16):
                out = policy_forward(m16, batch, temperature=temperature, logit_chunk=chunk)
                assert (out.logps - ref)[mask].abs().max() < 1e-4, (temperature, chunk)


def test_activation_checkpointing_gives_the_same_log_probs_and_gradients(tiny):
    """transformers' gradient checkpointing (non-reentrant, peft's input-grad hook) recomputes each layer in
    the backward: the same numbers, less memory (scripts/logit_memory.py --checkpointing measures it)."""
    model, tok = tiny
    pm = with_lora(model, ["q_proj", "v_proj", "down_proj"])
    try:
        batch = _group_batch(tok, [0, 1, 0, 2])
        results = []
        pm.train()
        for on in (False, True):
            if on:
                pm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
                pm.enable_input_require_grads()
            pm.zero_grad()
            out = policy_forward(pm, batch, temperature=0.9)
            (out.logps * batch.completion_mask).sum().backward()
            results.append((out.logps.detach(), {n: p.grad.clone() for n, p in pm.named_parameters()
                                                 if p.grad is not None}))
        (a, ga), (b, gb) = results
        assert torch.allclose(a, b, atol=1e-6) and ga.keys() == gb.keys() and len(ga) == 3 * 4 * 2
        for n in ga:
            assert torch.allclose(ga[n], gb[n], rtol=1e-5, atol=1e-7), n
    finally:
        pm.gradient_checkpointing_disable()
        pm.eval()
        pm.unload()


def test_scoring_never_asks_the_model_for_every_layers_hidden_states(tiny):
    """`output_hidden_states` keeps every layer's hidden states alive (in the no-grad passes too); the forward
    takes the decoder's last hidden state instead, chunked or not, with or without the critic's."""
    model, tok = tiny
    asked = []
    hooks = [m.register_forward_pre_hook(lambda mod, args, kw: asked.append(kw.get("output_hidden_states")),
                                         with_kwargs=True) for m in (model, model.model)]
    try:
        batch = _group_batch(tok, [0, 1, 0])
        with torch.no_grad():
            for chunk in (0, 8):
                for hidden in (False, True):
                    for share in (False, True):
                        out = policy_forward(model, batch, logit_chunk=chunk, with_hidden=hidden, share_prompt=share,
                                             with_entropy=True)
                        assert (out.hidden is not None) == hidden
    finally:
        for h in hooks:
            h.remove()
    assert asked and not any(asked)


def test_the_chunked_no_grad_entropy_equals_the_differentiable_one():
    from docuchat_rl.learning.losses import token_entropy

    logits = torch.randn(3, 700, 50, dtype=torch.float64) * 3  # [R, T, V], more positions than one chunk
    with torch.no_grad():
        chunked = token_entropy(logits)
    whole = token_entropy(logits.clone().requires_grad_(True))
    assert torch.allclose(chunked, whole.detach(), atol=1e-5)
