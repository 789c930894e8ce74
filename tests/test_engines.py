"""The engines behind one interface (sampling/engines.py): the registry, the name a config asks for, and an
engine with versions of its own (a fixed lag's worker) sampling what the learner's model samples with the
same adapter in it."""

from __future__ import annotations

import pytest

from .conftest import MODEL, ROOT


def test_every_engine_is_registered_by_the_name_a_config_asks_for():
    from docuchat_rl.config import load_config
    from docuchat_rl.sampling.decoding import local_loop, rollout_engine
    from docuchat_rl.sampling.engines import ELSEWHERE, ENGINES, Engine, get_engine_class, register_engine

    assert {"fast", "hf", "vllm", "vllm-server"} <= {*ENGINES, *ELSEWHERE}
    cases = {(): ("fast", "fast"), ("rollout.engine=hf",): ("hf", "hf"), ("rollout.engine=vllm",): ("vllm", "fast"),
             ("rollout.engine=vllm", "rollout.vllm.mode=server", "rollout.vllm.server_base_url=http://h:1"):
             ("vllm-server", "fast")}
    for sets, (name, loop) in cases.items():
        r = load_config(ROOT / "config" / "default.yaml", list(sets)).rollout
        with pytest.raises(ValueError, match=r"rollout\.(engine|cuda_graphs) is still auto: decide the config for the"):
            local_loop(r)  # (the loop depends on the device's switches: never guessed from an undecided config)
        if r.engine == "auto":
            with pytest.raises(ValueError, match="rollout.engine is still auto: decide the config for the device"):
                rollout_engine(r)
        r = load_config(ROOT / "config" / "default.yaml", list(sets)).for_device("cpu").rollout  # (auto decided)
        assert rollout_engine(r) == name and issubclass(get_engine_class(name), Engine)
        assert local_loop(r) == loop  # (evaluation, generate and chat sample in this process)
    with pytest.raises(KeyError, match=r"unknown engine 'sglang'; valid: fast, hf, vllm, vllm-server"):
        get_engine_class("sglang")

    class Other(Engine):
        pass

    with pytest.raises(ValueError, match=r"engine 'fast' already has a class \(LocalEngine\)"):
        register_engine("fast")(Other)
    assert ENGINES["fast"].__name__ == "LocalEngine"


def test_an_engine_with_versions_of_its_own_samples_what_the_learners_model_samples(tmp_path):
    """LocalEngine without a learner model (a fixed lag's worker) builds its own copy and puts the version it
    is asked for into it: the same completions and log-probs as the learner's model with that adapter in;
    versions before keep_from are dropped."""
    import torch
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    from docuchat_rl.config import load_config
    from docuchat_rl.distributed import Dist
    from docuchat_rl.modeling import build_lora, load_model_and_tokenizer
    from docuchat_rl.sampling.engines import EngineContext, LocalEngine

    cfg = load_config(ROOT / "config" / "default.yaml", ["model.dtype=float32", "model.device=cpu",
                                                          "rollout.num_generations=3"]).for_device("cpu")
    model, tok = load_model_and_tokenizer(str(MODEL), "float32", "cpu")
    model = build_lora(model, cfg.lora).eval()
    torch.manual_seed(3)
    state = {k: torch.randn_like(t) * 0.1 for k, t in get_peft_model_state_dict(model).items()}
    with torch.no_grad():
        set_peft_model_state_dict(model, state)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
               for q in ("What is 3 + 4?", "Tom has 9 pens and gives away 2. How many are left?")]
    seeds = list(range(100, 106))
    learner = LocalEngine(EngineContext(cfg, tok, model, Dist()))
    learner.begin_step(model, 0)
    want = learner.generate(prompts, seeds, 0)

    own = LocalEngine(EngineContext(cfg, None, None, Dist()))
    assert own.owns_versions and not learner.owns_versions
    own.add_version(0, {k: torch.zeros_like(t) for k, t in state.items()}, keep_from=0)
    own.add_version(1, state, keep_from=1)
    assert sorted(own.versions) == [1]
    got = own.generate(prompts, seeds, 1)
    assert got.completion_ids == want.completion_ids
    for a, b in zip(got.logps, want.logps):
        assert a == pytest.approx(b, abs=1e-5)
