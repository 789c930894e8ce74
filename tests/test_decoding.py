"""The engine choice and the decode settings as one object (sampling/decoding.py): every setting comes from the
rollout, a step's sampling and the decode loop it hands the same object to agree, and a merged adapter is
undone after each call."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from docuchat_rl.config import load_config
from docuchat_rl.distributed import Dist
from docuchat_rl.sampling.decoding import Decoding
from docuchat_rl.sampling.engines import EngineContext, LocalEngine, sample_rows
from docuchat_rl.sampling.generation import generate

from .conftest import tiny_arch

# Decoding's field -> the rollout setting it is made from (the others a caller sets: greedy, eval's sizes)
FROM_ROLLOUT = {"max_new_tokens": "max_new_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                "batch_size": "generation_batch_size", "num_return_sequences": "num_generations",
                "min_new_tokens": "min_new_tokens", "grouped_decode": "grouped_decode", "cuda_graphs": "cuda_graphs",
                "compile_decode": "compile_decode", "fused_projections": "fused_projections",
                "merge_adapter": "merge_adapter"}


def test_every_decode_setting_comes_from_the_rollout():
    """A field added to Decoding without a rollout setting behind it (or a caller's reason) fails here."""
    sets = ["rollout.max_new_tokens=17", "rollout.temperature=0.7", "rollout.top_p=0.9", "rollout.top_k=5",
            "rollout.generation_batch_size=12", "rollout.num_generations=3", "rollout.min_new_tokens=2",
            "rollout.prompts_per_step=4", "rollout.grouped_decode=false", "rollout.merge_adapter=false",
            "rollout.cuda_graphs=true", "rollout.compile_decode=true", "rollout.fused_projections=true"]
    r = load_config(None, sets).for_device("cpu").rollout
    d = Decoding.of(r)
    assert {f.name for f in dataclasses.fields(Decoding)} == {*FROM_ROLLOUT, "do_sample", "loop"}
    assert {k: getattr(d, k) for k in FROM_ROLLOUT} == {k: getattr(r, v) for k, v in FROM_ROLLOUT.items()}
    assert (d.do_sample, d.loop) == (True, "fast")
    greedy = Decoding.of(r, do_sample=False, batch_size=3)
    assert (greedy.do_sample, greedy.batch_size, greedy.top_k) == (False, 3, 5)
    with pytest.raises(TypeError):
        Decoding.of(r, temprature=0.5)  # (a misspelt setting is an error, not ignored)


def test_a_step_through_the_engine_equals_the_collectors_own_call(tiny):
    """LocalEngine (what a run builds) and a Collector without an engine (sample_rows on the model it is handed)
    make the same Decoding, so the same seeds give the same tokens and log-probs; a second turn too."""
    model, tok = tiny
    cfg = load_config(None, ["rollout.num_generations=2", "rollout.max_new_tokens=12"]).for_device("cpu")
    engine = LocalEngine(EngineContext(cfg, tok, model, Dist()))
    prompts, seeds = ["What is 2 + 2?", "Ann has 3 cats."], [11, 12, 13, 14]
    a = engine.generate(prompts, seeds, version=0)
    b = sample_rows(model, tok, Decoding.of(cfg.rollout, model), prompts, seeds)
    assert a.completion_ids == b.completion_ids and a.logps == b.logps
    ids = [p + c for p, c in zip(b.prompt_ids, b.completion_ids)]
    turn = engine.continue_rows(ids, seeds, version=0, step=None, max_new_tokens=5)
    assert all(len(c) <= 5 for c in turn.completion_ids) and len(turn.completion_ids) == len(ids)


def test_fields_change_a_decoding_for_one_call(tiny):
    model, tok = tiny
    base = Decoding(max_new_tokens=20, do_sample=False)
    short = generate(model, tok, ["What is 2 + 2?"], base, max_new_tokens=3)
    assert len(short.completion_ids[0]) <= 3
    assert generate(model, tok, ["What is 2 + 2?"], base).completion_ids[0][:3] == short.completion_ids[0]
    with pytest.raises(TypeError):
        generate(model, tok, ["x"], do_sample=False)  # (no decoding and no max_new_tokens: nothing says how long)


def test_a_merged_adapter_is_restored_after_the_call(tiny):
    """merge_adapter folds the LoRA into the weights for the call only: the same greedy tokens as unmerged,
    and every base weight the same Parameter, bit for bit, afterwards; with the adapter disabled it merges
    nothing (the base model's tokens)."""
    from docuchat_rl.modeling import build_lora

    _, tok = tiny
    cfg = load_config(None, ["lora.r=4"])
    model = build_lora(tiny_arch("qwen2", tok), cfg.lora)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)  # (peft starts B at zero: a delta that changes the tokens)
    from peft.tuners.lora import LoraLayer

    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    calls = []
    hooks = [m.register_forward_hook(lambda *_: calls.append(1)) for m in model.modules() if isinstance(m, LoraLayer)]
    d = Decoding(max_new_tokens=8, do_sample=False)
    merged = generate(model, tok, ["What is 2 + 2?"], d, merge_adapter=True)
    assert calls == []  # (merged: the LoRA layers stepped out of the model for the call)
    plain = generate(model, tok, ["What is 2 + 2?"], d)
    assert calls  # (unmerged: every projection's LoRA layer ran)
    for h in hooks:
        h.remove()
    with model.disable_adapter():
        base = generate(model, tok, ["What is 2 + 2?"], d)
        base_merged = generate(model, tok, ["What is 2 + 2?"], d, merge_adapter=True)  # (nothing to merge: the
        # adapter is off, and a merge of the active adapters would bring it back)
    assert merged.completion_ids == plain.completion_ids != base.completion_ids == base_merged.completion_ids
    after = dict(model.named_parameters())
    assert all(after[n] is p and torch.equal(p, copy) for n, (p, copy) in before.items())
