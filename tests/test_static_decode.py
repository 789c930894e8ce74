"""The static-shape decode (rollout.cuda_graphs) against the dynamic fast loop: the same completions and
log-probs with the same row seeds, on the embedded default and on tiny random-weight Llama (grouped-query,
biased) and Qwen2, with rows ending at different steps (bucket compaction), min_new_tokens, top-k/top-p,
greedy, LoRA merged or not, buffers reused across calls, and the step compiled (rollout.compile_decode). On
a GPU, the graphs replayed against the same step run eagerly, and compiled."""

import weakref

import pytest
import torch

from docuchat_rl.sampling import static_decode
from docuchat_rl.sampling.generation import generate
from docuchat_rl.sampling.rollout import row_seed

from .conftest import with_lora
from .test_generation import _prompts
from .test_grouped_decode import _model


def _seeds(prompts: int, g: int, step: int = 0) -> list[int]:
    return [row_seed(0, step, p, s) for p in range(prompts) for s in range(g)]


def _same(a, b, atol=1e-5):
    assert a.completion_ids == b.completion_ids and a.truncated == b.truncated
    assert a.prompt_ids == b.prompt_ids
    for x, y in zip(a.logps, b.logps):
        torch.testing.assert_close(torch.tensor(x), torch.tensor(y), atol=atol, rtol=atol)


def test_static_decode_samples_what_the_fast_loop_samples(tiny):
    """The embedded default, natural EOS: rows end at different steps, the buckets shrink (64 -> 8), and
    the completions and log-probs are the dynamic loop's; the decoder's buffers are reused by a second call
    with fewer, shorter prompts (one buffer set per model)."""
    model, tok = tiny
    prompts = _prompts(tok, 8)
    kw = dict(max_new_tokens=48, do_sample=True, num_return_sequences=8, row_seeds=_seeds(8, 8), temperature=0.8,
              top_p=0.95, top_k=50)
    buckets = []
    run = static_decode.StaticDecoder.run
    static_decode.StaticDecoder.run = lambda self, b: (buckets.append(b), run(self, b))[1]
    try:
        static = generate(model, tok, prompts, cuda_graphs=True, **kw)
    finally:
        static_decode.StaticDecoder.run = run
    dynamic = generate(model, tok, prompts, **kw)
    _same(static, dynamic)
    assert len({len(c) for c in static.completion_ids}) > 4  # rows ended at many different steps
    assert buckets[0] == 64 and min(buckets) < 64 and buckets == sorted(buckets, reverse=True)
    decoder = static_decode._DECODERS[model]

    kw2 = dict(kw, num_return_sequences=4, row_seeds=_seeds(3, 4, step=1))
    again = generate(model, tok, prompts[3:6], cuda_graphs=True, **kw2)
    assert static_decode._DECODERS[model] is decoder  # the same buffers (fewer rows, shorter prompts fit)
    _same(again, generate(model, tok, prompts[3:6], **kw2))


def test_buffers_grow_only_within_one_setting_and_evaluation_frees_its_own(tiny):
    """A decoder is reused, grown, by calls of the same settings only: a sampled rollout after a greedy
    evaluation of more rows, longer prompts and more tokens gets buffers of its own rows and prompt (not the
    evaluation's) and the dynamic loop's completions; a replaced decoder is freed at once (no reference cycle
    keeps it for the cycle collector); `evaluate` leaves the model holding no decoder; a model let go is freed."""
    from docuchat_rl.config import load_config
    from docuchat_rl.evaluation import evaluate

    from .conftest import ROOT

    model, tok = tiny
    long = [p + " Think about it carefully, step by step." * 12 for p in _prompts(tok, 6)]
    generate(model, tok, long, cuda_graphs=True, do_sample=False, max_new_tokens=24)
    held = static_decode._DECODERS[model].shape
    assert held.rows == 6 and held.prompt > static_decode.PROMPT_BUCKET

    prompts = _prompts(tok, 2)
    kw = dict(max_new_tokens=12, do_sample=True, num_return_sequences=2, row_seeds=_seeds(2, 2))
    sampled = generate(model, tok, prompts, cuda_graphs=True, **kw)
    shape = static_decode._DECODERS[model].shape
    longest = max(len(p) for p in sampled.prompt_ids)
    assert shape.rows == 4 and shape.prompt == -(-longest // static_decode.PROMPT_BUCKET) * static_decode.PROMPT_BUCKET
    assert shape.prompt < held.prompt
    _same(sampled, generate(model, tok, prompts, **kw))
    decoder = static_decode._DECODERS[model]
    generate(model, tok, prompts[:1], cuda_graphs=True, **dict(kw, row_seeds=_seeds(1, 2)))
    assert static_decode._DECODERS[model] is decoder  # (the same settings, fewer rows: the same buffers)

    gone = weakref.ref(decoder)
    del decoder
    built = []
    init = static_decode.StaticDecoder.__init__
    static_decode.StaticDecoder.__init__ = lambda self, m, shape, **k: (built.append(shape), init(self, m, shape, **k))[1]
    try:
        cfg = load_config(ROOT / "config" / "default.yaml", ["eval.limit=3", "eval.max_new_tokens=8",
                                                              "rollout.cuda_graphs=true"])
        evaluate(model, tok, cfg)
    finally:
        static_decode.StaticDecoder.__init__ = init
    assert built and model not in static_decode._DECODERS  # (evaluation decoded statically, then let go)
    assert gone() is None  # the replaced decoder was freed when replaced, not at a later cycle collection

    fresh = _model(tok, "qwen2")  # a model let go is freed with its decoder (the weak key is not held by its value)
    generate(fresh, tok, prompts, cuda_graphs=True, do_sample=False, max_new_tokens=4)
    assert fresh in static_decode._DECODERS
    dropped = weakref.ref(fresh)
    del fresh
    assert dropped() is None


@pytest.mark.parametrize("arch", ["llama-gqa-bias", "qwen2"])
def test_static_decode_on_real_architectures_with_min_new_tokens_and_greedy(tiny, arch):
    _, tok = tiny
    model = _model(tok, arch)
    prompts = _prompts(tok, 3)  # different lengths: left padding
    for kw in (dict(do_sample=True, row_seeds=_seeds(3, 4), temperature=1.3, min_new_tokens=5),
               dict(do_sample=False)):
        kw = dict(kw, max_new_tokens=20, num_return_sequences=4)
        _same(generate(model, tok, prompts, cuda_graphs=True, **kw), generate(model, tok, prompts, **kw))
    assert model in static_decode._DECODERS  # (the static step ran)
    sampled = generate(model, tok, prompts, cuda_graphs=True, do_sample=True, row_seeds=_seeds(3, 4),
                       max_new_tokens=20, num_return_sequences=4, min_new_tokens=5)
    assert min(len(c) for c in sampled.completion_ids) >= 5


def test_static_decode_runs_lora_merged_or_not_and_sees_new_weights(tiny):
    """With LoRA layers (unmerged) and merged, the static step samples what the dynamic loop samples; after
    the adapter's weights change in place, it samples the new policy (nothing stale baked in)."""
    from docuchat_rl.modeling import merged_adapter

    _, tok = tiny
    model = with_lora(_model(tok, "llama-gqa-bias"), ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                      "up_proj", "down_proj"]).eval()
    prompts = _prompts(tok, 2)
    kw = dict(max_new_tokens=16, do_sample=True, num_return_sequences=4, row_seeds=_seeds(2, 4))
    before = generate(model, tok, prompts, cuda_graphs=True, **kw)
    _same(before, generate(model, tok, prompts, **kw))
    with merged_adapter(model):
        _same(generate(model, tok, prompts, cuda_graphs=True, **kw), before, atol=1e-4)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.add_(0.5)
    after = generate(model, tok, prompts, cuda_graphs=True, **kw)
    _same(after, generate(model, tok, prompts, **kw))
    assert max(abs(a - b) for x, y in zip(after.logps, before.logps) for a, b in zip(x, y)) > 1e-3


@pytest.mark.parametrize("arch", ["llama-gqa-bias", "qwen2"])
def test_fused_projections_sample_what_the_fast_loop_samples_merged_or_plain_and_fall_back_unmerged(tiny, arch):
    """rollout.fused_projections: q/k/v as one matmul and gate/up as one (biases included: Qwen2's q/k/v have
    them) samples the dynamic loop's tokens and log-probs on the plain model and with the adapter merged
    (its weights read fresh after they change); with unmerged LoRA layers the step calls them one by one."""
    from docuchat_rl.modeling import merged_adapter

    _, tok = tiny
    model = _model(tok, arch)
    prompts = _prompts(tok, 3)
    kw = dict(max_new_tokens=20, do_sample=True, num_return_sequences=4, row_seeds=_seeds(3, 4), temperature=1.2)
    _same(generate(model, tok, prompts, cuda_graphs=True, fused_projections=True, **kw), generate(model, tok, prompts, **kw))
    decoder = static_decode._DECODERS[model]
    assert decoder.qkv is not None and len(decoder.gate_up) == len(model.model.layers)
    assert decoder.qkv[0].weight.shape[0] == sum(m.out_features for m in (
        model.model.layers[0].self_attn.q_proj, model.model.layers[0].self_attn.k_proj,
        model.model.layers[0].self_attn.v_proj))
    lora = with_lora(model, ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"]).eval()
    unmerged = generate(lora, tok, prompts, cuda_graphs=True, fused_projections=True, **kw)
    assert static_decode._DECODERS[lora].qkv is None  # (unmerged adapters: the projections one by one)
    _same(unmerged, generate(lora, tok, prompts, **kw))
    with merged_adapter(lora):
        merged = generate(lora, tok, prompts, cuda_graphs=True, fused_projections=True, **kw)
        assert static_decode._DECODERS[lora].qkv is not None
    _same(merged, unmerged, atol=1e-4)


def test_models_the_static_step_does_not_cover_decode_as_before(tiny):
    _, tok = tiny
    model = _model(tok, "gemma2")
    prompts = _prompts(tok, 2)
    kw = dict(max_new_tokens=8, do_sample=True, num_return_sequences=2, row_seeds=_seeds(2, 2))
    assert generate(model, tok, prompts, cuda_graphs=True, **kw).completion_ids == \
        generate(model, tok, prompts, **kw).completion_ids
    assert model not in static_decode._DECODERS


def test_the_compiled_static_step_samples_what_the_fast_loop_samples(tiny):
    """rollout.compile_decode: the step through torch.compile (inductor's fused kernels; on a CPU, C++) gives the
    dynamic loop's completions and log-probs, sampled and greedy, rows ending at different steps."""
    from torch._dynamo.utils import counters

    _, tok = tiny
    model = _model(tok, "qwen2")
    prompts = _prompts(tok, 2)
    traced = counters["stats"]["unique_graphs"]
    for kw in (dict(do_sample=True, row_seeds=_seeds(2, 4), temperature=1.3, top_p=0.9), dict(do_sample=False)):
        kw = dict(kw, max_new_tokens=12, num_return_sequences=4)
        compiled = generate(model, tok, prompts, cuda_graphs=True, compile_decode=True, **kw)
        assert static_decode._DECODERS[model].shape.compiled
        _same(compiled, generate(model, tok, prompts, **kw), atol=1e-4)
    assert counters["stats"]["unique_graphs"] > traced  # (dynamo compiled the step: it did not run it eagerly)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU (scripts/gpu_checklist.sh runs this)")
def test_cuda_graphs_replay_what_the_step_computes_eagerly():
    """On a GPU: the captured graphs (one per bucket) give the dynamic loop's completions, are captured once
    per bucket across calls, and a bf16-autocast model's graphs (autocast's cast cache off) sample too."""
    from docuchat_rl.modeling import load_model_and_tokenizer

    from .conftest import MODEL

    model, tok = load_model_and_tokenizer(str(MODEL), dtype="float32", device="cuda")
    prompts = _prompts(tok, 8)
    kw = dict(max_new_tokens=48, do_sample=True, num_return_sequences=8, row_seeds=_seeds(8, 8), temperature=0.8)
    graphed = generate(model, tok, prompts, cuda_graphs=True, **kw)
    decoder = static_decode._DECODERS[model]
    captured = dict(decoder.graphs)
    assert captured
    _same(graphed, generate(model, tok, prompts, **kw), atol=1e-4)
    again = generate(model, tok, prompts, cuda_graphs=True, **kw)
    assert again.completion_ids == graphed.completion_ids
    assert all(decoder.graphs[b] is g for b, g in captured.items())  # replayed, not captured again
    mixed, _ = load_model_and_tokenizer(str(MODEL), dtype="bf16-mixed", device="cuda")
    graphed = generate(mixed, tok, prompts, cuda_graphs=True, **kw)
    assert static_decode._DECODERS[mixed].graphs
    same = sum(a == b for a, b in zip(graphed.completion_ids, generate(mixed, tok, prompts, **kw).completion_ids))
    assert same >= 0.8 * len(graphed.completion_ids)  # (bf16: the two attention layouts round differently)
    fused = generate(model, tok, prompts, cuda_graphs=True, compile_decode=True, **kw)  # (compiled, then captured)
    assert static_decode._DECODERS[model].shape.compiled and static_decode._DECODERS[model].graphs
    _same(fused, again, atol=1e-4)


def test_the_gpu_checklist_reports_each_stage_and_refuses_unknown_ones(tmp_path):
    """scripts/gpu_checklist.sh (its whole dry run takes ~5 minutes on a CPU: run by hand): a stage's output
    lands in the report as it ends, a stage that does not fit the time left is skipped saying so, an unknown
    stage is refused."""
    import os
    import subprocess

    from .conftest import ROOT

    report = tmp_path / "r.md"
    env = {k: v for k, v in os.environ.items() if k != "OUT"}  # (the device tool's $OUT: the checklist copies its
    # report there, and when the checklist runs this test on a GPU machine, this test's report would come back too)
    done = subprocess.run(["bash", "scripts/gpu_checklist.sh", "--dry-run", "--only", "env tests", "--minutes", "1",
                           "--report", str(report)], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    text = report.read_text()
    assert "## env" in text and "imports: ok" in text and "exit 0" in text
    assert "## tests\n\nskipped:" in text  # (240 s wanted, under a minute left)
    bad = subprocess.run(["bash", "scripts/gpu_checklist.sh", "--dry-run", "--only", "nope"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "unknown stage nope" in bad.stderr
