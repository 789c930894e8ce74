"""Keys and values kept between turns (sampling/turn_cache.py): a later turn prefills only its new tokens and
samples what a whole prefill of the conversation samples (the same tokens, log-probs to float rounding), on
tiny real architectures and on conversations of a model that calls tools (a tool, a per-row first observation,
greedy and top-k/top-p); a run killed (-9) between the turns of a step resumes to the uninterrupted run."""

import os
import signal
import subprocess
import sys

import pytest
import torch

from docuchat_rl.config import ConfigError, load_config
from docuchat_rl.outputs import read_jsonl
from docuchat_rl.sampling.decoding import Decoding
from docuchat_rl.sampling.generation import generate
from docuchat_rl.sampling.turn_cache import TurnCache, turn_cache
from docuchat_rl.trainer import Trainer

from .conftest import ROOT, tiny_arch
from .test_trainer import FAST, cfg_for, untimed

# what float32 rounding between one batched prefill and one-token decode steps moves a sampled token's
# log-prob by (measured: up to 1.1e-5 over these tests' tokens; the trainer's teacher-forced forward differs
# from either by up to 2e-3, tests/test_multiturn.py)
ROUNDING = 3e-5


def _two_turns(model, tok, keep: bool, grouped: bool, do_sample: bool = True):
    """Turn 0 of 2 prompts x 3 rows, then each row continued with its own appended tokens (of different
    lengths, as tool results are): (the second turn's Generation, the turn cache's counts, the rows' prompts)."""
    d = Decoding(max_new_tokens=12, num_return_sequences=3, do_sample=do_sample, temperature=0.9, top_k=30,
                 top_p=0.95, grouped_decode=grouped, batch_size=64)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
               for q in ("What is 2 + 3?", "Tom has 4 pens and buys 7 more. How many pens?")]
    seeds = list(range(40, 46))
    with turn_cache(keep) as cache:
        first = generate(model, tok, prompts, d, row_seeds=seeds)
        appended = [tok(f"<tool_response>{'7' * (1 + 3 * r)}</tool_response>", add_special_tokens=False)["input_ids"]
                    for r in range(6)]
        rows = [p + c + a for p, c, a in zip(first.prompt_ids, first.completion_ids, appended)]
        second = generate(model, tok, rows, d.with_(num_return_sequences=1), row_seeds=[s + 100 for s in seeds])
        held = sum(map(len, cache.entries.values()))  # (the first turn's entries went; the second's are held)
    assert held == (6 if cache.reused else 0)
    return first, second, (cache.prefilled, cache.reused), rows, appended


@pytest.mark.parametrize("arch,grouped,keeps", [("llama", True, True), ("llama", False, True), ("qwen2", True, True),
                                                ("gpt2", False, True), ("gemma2", False, False),
                                                ("mistral", True, False)])
def test_a_kept_turn_samples_what_a_whole_prefill_samples(tiny, arch, grouped, keeps):
    """The second turn from kept keys/values: the same tokens and log-probs as prefilling the whole row, and
    only each row's new tokens prefilled (its last sampled token and what was appended). Models whose cache
    is not plain full attention (Gemma2's and this Mistral's sliding windows) prefill whole, unchanged."""
    _, tok = tiny
    model = tiny_arch(arch, tok).eval()
    _, whole, (full, none), rows, _ = _two_turns(model, tok, keep=False, grouped=grouped)
    first, kept, (prefilled, reused), _, appended = _two_turns(model, tok, keep=True, grouped=grouped)
    assert none == 0 and kept.completion_ids == whole.completion_ids
    assert max(abs(a - b) for x, y in zip(kept.logps, whole.logps) for a, b in zip(x, y)) <= ROUNDING
    prompts = sum(len(p) for p in first.prompt_ids[::3])  # (turn 0 prefills each prompt once for its 3 rows)
    assert full == prompts + sum(map(len, rows))
    if keeps:
        assert prefilled == prompts + sum(1 + len(a) for a in appended)
        assert reused == sum(len(r) - 1 - len(a) for r, a in zip(rows, appended))
    else:
        assert (prefilled, reused) == (full, 0)


def test_greedy_turns_from_kept_keys_values_are_the_same(tiny):
    _, tok = tiny
    model = tiny_arch("qwen2", tok).eval()
    _, whole, _, _, _ = _two_turns(model, tok, keep=False, grouped=True, do_sample=False)
    _, kept, (_, reused), _, _ = _two_turns(model, tok, keep=True, grouped=True, do_sample=False)
    assert reused > 0 and kept.completion_ids == whole.completion_ids


def test_a_kept_row_is_taken_once_and_only_as_a_strict_prefix():
    c = TurnCache()
    layers = [(torch.zeros(1, 3, 2), torch.zeros(1, 3, 2))]
    c.put([1, 2, 3], layers)
    assert c.take([1, 2, 3]) is None  # (nothing would be left to prefill for the next logits)
    assert c.take([1, 2, 4, 5]) is None
    assert c.take([1, 2, 3, 9]).length == 3
    assert c.take([1, 2, 3, 9]) is None  # taken: each row continues once
    off = TurnCache(keep=False)
    off.put([1, 2], layers)
    assert off.take([1, 2, 3]) is None


def _conversations(taught, keep: bool, sets=(), environment=None):
    """A step's conversations through the collector's multi-turn sampling (MultiTurn.sample) with the taught
    model."""
    from docuchat_rl.data import load_split
    from docuchat_rl.modeling import eos_ids, load_model_and_tokenizer
    from docuchat_rl.sampling.multiturn import multiturn_from_config
    from docuchat_rl.sampling.rollout import sample_rows

    tools = ["rollout.tools=[]", f"rollout.environment_factory={environment}"] if environment else []
    cfg = load_config(None, [f"model.name_or_path={taught}", "rollout.tools=[tests.tool_envs.add]",
                             "rollout.tool_protocol=text", "rollout.max_new_tokens=192", "rollout.num_generations=4",
                             f"rollout.turn_cache={str(keep).lower()}", *tools, *sets]).for_device("cpu")
    if environment:
        cfg = cfg.model_copy(update={"rewards": load_config(None, [
            "rewards=[{name: correctness}, {name: environment}]"]).rewards})
    model, tok = load_model_and_tokenizer(str(taught), dtype="float32", device="cpu")
    multi = multiturn_from_config(cfg, tok, stop_ids=eos_ids(model, tok))
    examples = load_split(cfg.data, "train")[:2]
    texts = [multi.prompt_text(e) for e in examples]
    seeds = list(range(300, 308))
    d = Decoding.of(cfg.rollout, model)
    return multi.sample([0, 1], examples, seeds, lambda _: sample_rows(model, tok, d, texts, seeds),
                        lambda ids, s, n: sample_rows(model, tok, d, ids, s, turn_tokens=n))


def _untimed(turns):
    from dataclasses import asdict

    return [[{**asdict(t), "calls": [{**asdict(c), "seconds": 0} for c in t.calls]} for t in row] for row in turns]


@pytest.mark.parametrize("sets,environment", [
    ((), None),
    (("rollout.temperature=0.8", "rollout.top_k=20", "rollout.top_p=0.9"), None),
    (("rollout.grouped_decode=false",), None),
    ((), "tests.tool_envs.RandomStart"),  # (each row's own first observation: its first turn goes through `more`)
])
def test_conversations_from_kept_keys_values_are_todays_and_prefill_only_new_tokens(taught, sets, environment):
    if environment:
        from tests.tool_envs import RandomStart

        RandomStart.made = 0
    whole = _conversations(taught, False, sets, environment)
    if environment:
        RandomStart.made = 0
    kept = _conversations(taught, True, sets, environment)
    assert any(len(t) > 1 for t in whole.turns), "the taught model made no call that ran"
    assert kept.completion_ids == whole.completion_ids and _untimed(kept.turns) == _untimed(whole.turns)
    assert max(abs(a - b) for x, y in zip(kept.logps, whole.logps) for a, b in zip(x, y)) <= ROUNDING
    # whole: every turn prefills its row's whole conversation; kept: the first turn's prompts, then per later
    # turn the last sampled token and the tool tokens
    later = [(r, k) for r, turns in enumerate(whole.turns) for k in range(1, len(turns))]
    first = (sum(map(len, whole.prompt_ids)) if environment else sum(map(len, whole.prompt_ids[::4])))
    at = [[0] for _ in whole.turns]
    for r, turns in enumerate(whole.turns):
        for t in turns:
            at[r].append(at[r][-1] + t.model_tokens + t.env_tokens)
    assert whole.prefill_tokens == first + sum(len(whole.prompt_ids[r]) + at[r][k] for r, k in later)
    assert kept.prefill_tokens == first + sum(1 + whole.turns[r][k - 1].env_tokens for r, k in later)
    assert kept.prefill_tokens + kept.cached_tokens == whole.prefill_tokens


def test_turn_cache_applies_to_multi_turn_rollouts_only():
    with pytest.raises(ConfigError, match="rollout.turn_cache applies to multi-turn"):
        load_config(None, ["rollout.turn_cache=false"])


@pytest.mark.slow
def test_a_run_killed_between_the_turns_of_a_step_resumes_to_the_uninterrupted_run(tmp_path, taught):
    """kill -9 from inside a tool call of step 2 (kept keys/values in memory, the step half sampled): the
    resumed run's traces and adapter are the uninterrupted run's."""
    sets = [f"model.name_or_path={taught}", "rollout.tools=[tests.tool_kill.add]", "rollout.tool_protocol=text",
            "rollout.max_new_tokens=192", "run.steps=3", "checkpoint.every=1"]
    full = Trainer(cfg_for(tmp_path / "full", *sets))
    full.train()
    full.close()
    metrics = read_jsonl(tmp_path / "full" / "metrics.jsonl")  # (what each step prefilled, what it was spared)
    assert all(m["rollout/prefill_tokens"] > 0 for m in metrics) and any(m["rollout/cached_tokens"] for m in metrics)
    traces = read_jsonl(tmp_path / "full" / "traces.jsonl")
    for m in metrics:  # tokens/s counts what the model sampled, not the tool results in its completions
        model = sum(t["model_tokens"] for r in traces if r["step"] == m["step"] for t in r["turns"])
        assert m["rollout_tokens_per_s"] * m["time/rollout"] == pytest.approx(model)
    assert sum(t["model_tokens"] for r in traces for t in r["turns"]) < sum(r["completion_tokens"] for r in traces)
    ran_in_step_1 = sum(c["error"] is None for r in read_jsonl(tmp_path / "full" / "traces.jsonl") if r["step"] == 1
                        for t in r["turns"] for c in t["calls"])  # (a call with bad arguments never enters add)
    out = tmp_path / "cut"
    cmd = [sys.executable, "-m", "docuchat_rl", "train", "--config", str(ROOT / "config" / "default.yaml"),
           *[a for s in [*FAST, *sets, f"run.output_dir={out}"] for a in ("--set", s)]]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "DOCUCHAT_TEST_KILL_AT_CALL": str(ran_in_step_1 + 1)})
    assert done.returncode == -signal.SIGKILL, done.stderr[-2000:]
    assert (out / "checkpoint-1").is_dir()
    assert {r["step"] for r in read_jsonl(out / "traces.jsonl")} == {1}
    cut = Trainer(cfg_for(out, *sets), resume="latest")
    cut.train()
    cut.close()
    a, b = (untimed(read_jsonl(tmp_path / d / "traces.jsonl")) for d in ("full", "cut"))
    drop = lambda rows: [{k: v for k, v in r.items() if k != "turns"} for r in rows]  # noqa: E731 (calls' seconds)
    assert any(len(r["turns"]) > 1 for r in a if r["step"] == 2)
    assert drop(a) == drop(b)
    from safetensors.torch import load_file

    x, y = (load_file(tmp_path / d / "checkpoint-3" / "adapter_model.safetensors") for d in ("full", "cut"))
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
