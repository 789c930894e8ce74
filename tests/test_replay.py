"""Replay (a traced completion sampled again by the policy that sampled it) and rescore (traced completions
scored again by today's reward code), on real runs of the embedded model."""

import json
import random
import shutil
import statistics

import pytest

from docuchat_rl.cli import main
from docuchat_rl.config import config_from_dict
from docuchat_rl.outputs import read_jsonl
from docuchat_rl.tools.replay import ReplayError, replay, rescore, run_config, select

from .conftest import ROOT

RUN = ["run.steps=6", "checkpoint.every=2", "checkpoint.keep_last=2", "rollout.prompts_per_step=4",
       "rollout.num_generations=4", "rollout.max_new_tokens=24", "eval.before_and_after=false",
       "logging.progress=false", "run.threads=2"]


def _train(out, *extra):
    args = ["train", "--config", str(ROOT / "config/default.yaml"), "--set", f"run.output_dir={out}"]
    assert main(args + [a for s in [*RUN, *extra] for a in ("--set", s)]) == 0
    return out


@pytest.fixture(scope="module", params=["fast", "hf"])
def run(request, tmp_path_factory):
    """A 6-step run keeping checkpoints 4 and 6 only: steps 1-4 replay from the run's start or checkpoint-4's
    past, step 5 from checkpoint-4, step 6 from checkpoint-4 plus one step run forward."""
    return _train(tmp_path_factory.mktemp(request.param), f"rollout.engine={request.param}")


@pytest.mark.slow
def test_twenty_traced_completions_replay_token_for_token(run):
    traces = read_jsonl(run / "traces.jsonl")
    assert sorted(p.name for p in run.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]
    chosen = random.Random(0).sample(traces, 20)
    assert {t["step"] for t in chosen} & {1, 2, 3} and {t["step"] for t in chosen} & {5, 6}
    said = []
    results = replay(run, chosen, progress=False, say=said.append)
    assert len(results) == 20 and all(r.same for r in results), [r.as_dict() for r in results if not r.same]
    assert [r.ids for r in results] == [t["completion_ids"] for t in sorted(chosen, key=lambda t: t["step"])]
    for r in results:  # the scores now are the traced ones (same reward code, same config)
        assert r.now == {k: c["raw"] for k, c in r.trace["rewards"].items()} and r.total_now == r.trace["total"]
    assert any("from the run's start" in s for s in said) and any("from checkpoint-4" in s for s in said)
    assert any("1 step to run first" in s for s in said)  # step 6: checkpoint-4, then step 5 run forward


@pytest.mark.slow
def test_a_tampered_line_diverges_at_the_tampered_token_with_both_log_probs(run, capsys, monkeypatch):
    import io

    line = next(t for t in read_jsonl(run / "traces.jsonl") if t["step"] == 3 and t["completion_tokens"] > 6)
    line["completion_ids"][5] = (line["completion_ids"][5] + 7) % 100
    (r,) = replay(run, [line], progress=False, say=lambda s: None)
    assert r.diverges_at == 5 and r.ids[:5] == line["completion_ids"][:5]
    assert r.traced_logp < r.new_logp <= 0  # the tampered token is far less likely than the one it samples
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps(line) + "\n"))
    assert main(["replay", str(run), "--stdin"]) == 1  # a divergence is exit 1
    out = capsys.readouterr().out
    assert "diverges at token 5" in out and "0 of 1 completions replayed token for token" in out
    assert main(["replay", str(run), "--where", "step = 5 and correctness.raw = 0", "--limit", "2"]) == 0
    assert "2 of 2 completions replayed token for token" in capsys.readouterr().out  # (an audit filter's lines)


def test_what_cannot_be_replayed_exactly_is_refused_in_one_line_saying_why(run, tmp_path, capsys):
    (line,) = select(run, 3, next(t["prompt_id"] for t in read_jsonl(run / "traces.jsonl") if t["step"] == 3), 0)
    cases = [({"seed": None}, "has no replay coordinate"),
             ({"versions": {**line["versions"], "torch": "1.0.0"}}, "was sampled with torch 1.0.0"),
             ({"adapter_sha256": "0" * 16}, "it is not the policy that sampled step 3")]
    for change, says in cases:
        with pytest.raises(ReplayError, match=says) as e:
            replay(run, [{**line, **change}], progress=False, say=lambda s: None)
        assert "\n" not in str(e.value)
    cut = tmp_path / "cut"  # traces that begin at step 4 (resumed from elsewhere), no checkpoint before step 4
    cut.mkdir()
    shutil.copytree(run / "checkpoint-6", cut / "checkpoint-6")
    (cut / "traces.jsonl").write_text("".join(json.dumps(t) + "\n" for t in read_jsonl(run / "traces.jsonl")
                                              if t["step"] >= 4))
    late = next(t for t in read_jsonl(cut / "traces.jsonl") if t["step"] == 5)
    with pytest.raises(ReplayError, match="the chain back to the policy of step 4 is missing"):
        replay(cut, [late], progress=False, say=lambda s: None)
    assert main(["replay", str(run), "--step", "99", "--prompt-id", "0", "--sample", "0"]) == 2
    assert "no completion of step 99 prompt 0 sample 0" in capsys.readouterr().err


def test_rescore_with_the_same_config_changes_nothing(run):
    result = rescore(run)
    traces = read_jsonl(run / "traces.jsonl")
    assert len(result.lines) == len(traces) and result.changed == []
    for new, old in zip(result.lines, traces):
        assert new["total"] == old["total"] and new["advantage"] == pytest.approx(old["advantage"], abs=1e-6)


def test_rescore_with_a_changed_weight_gives_the_hand_computed_totals_and_advantages(run, tmp_path, capsys):
    cfg = config_from_dict(run_config(run), ["rewards.components.1.weight=0.7"])
    result = rescore(run, cfg)
    traces = read_jsonl(run / "traces.jsonl")
    by_group: dict = {}
    for t in traces:
        by_group.setdefault((t["step"], t["group"]), []).append(t)
    for new, old in zip(result.lines, traces):
        c, f = old["rewards"]["correctness"]["raw"], old["rewards"]["format"]["raw"]
        assert new["total"] == pytest.approx(1.0 * c + 0.7 * f)
        mates = [1.0 * m["rewards"]["correctness"]["raw"] + 0.7 * m["rewards"]["format"]["raw"]
                 for m in by_group[(old["step"], old["group"])]]
        sd = statistics.stdev(mates)
        want = 0.0 if sd < 1e-8 else (new["total"] - statistics.mean(mates)) / (sd + 1e-4)
        assert new["advantage"] == pytest.approx(want, abs=1e-5)
        assert new["before"]["total"] == old["total"]
    assert result.changed and all(abs(x["total"] - x["before"]["total"]) > 1e-9 or
                                  x["advantage"] != x["before"]["advantage"] for x in result.changed)
    out = tmp_path / "rescored.jsonl"
    assert main(["rescore", str(run), "--set", "rewards.components.1.weight=0.7", "--out", str(out)]) == 0
    shown = capsys.readouterr().out
    assert f"{len(result.changed)} of {len(traces)} completions would be judged differently" in shown
    assert len(read_jsonl(out)) == len(traces)
    assert main(["audit", str(out), "--where", "format.weight = 0.7", "--json"]) == 0  # the audit reads it
    assert len(json.loads(capsys.readouterr().out)) == 10
    page = tmp_path / "report.html"
    assert main(["audit", str(out), "--html", str(page)]) == 0
    html = page.read_text()
    assert f"{len(result.changed)} completions judged differently" in html and "total before" in html


@pytest.mark.parametrize("change,says", [
    ({"completion_ids": [5, "x"]}, "field completion_ids holds a list of other than integers"),
    ({"completion_ids": [-1]}, "field completion_ids is not a list of token ids"),
    ({"completion_ids": [10 ** 9]}, "completion_ids holds a token id beyond the model's vocabulary of"),
    ({"step": 0}, "field step is 0, not a trace's step"),
    ({"seed": 1.5}, "field seed holds float, expected bigint"),
    ({"seed": -3}, "field seed is -3, not a trace's non-negative integer"),
    ({"total": "high"}, "field total holds str, expected double"),
    ({"prompt": None}, "field prompt is missing"),
])
def test_a_hand_edited_line_on_standard_input_is_one_line_not_a_traceback(run, capsys, monkeypatch, change, says):
    import io

    line = read_jsonl(run / "traces.jsonl")[0]
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps({**line, **change}) + "\n"))
    assert main(["replay", str(run), "--stdin"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("docuchat-rl: error: step ") and says in err


def test_rescore_with_strict_rewards_and_a_failing_one_is_one_line(run, capsys):
    assert main(["rescore", str(run), "--set", "rewards=[{name: correctness}, {name: 'tests.user_rewards:raises'}]",
                 "--set", "rewards.strict=true"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("docuchat-rl: error: reward 'tests.user_rewards:raises' failed") and "\n" not in err
    assert err.endswith("(rewards.strict is on)")  # (no checkpoint is mentioned: rescore writes none)


def test_a_full_disk_while_rescore_writes_says_so_without_promising_a_checkpoint(run, tmp_path):
    import subprocess
    import sys

    code = ("import resource, signal, sys\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (2000, 2000))\n"
            "from docuchat_rl.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    out = tmp_path / "rescored.jsonl"
    done = subprocess.run([sys.executable, "-c", code, "rescore", str(run), "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.strip().splitlines()[-1] == f"docuchat-rl: error: could not write ({out}): File too large"


def test_rescore_skips_what_is_not_a_trace_line_and_says_how_many(run, tmp_path, capsys):
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    lines = read_jsonl(copy / "traces.jsonl")
    with open(copy / "traces.jsonl", "a") as f:
        f.write(json.dumps({**lines[0], "step": "three"}) + "\n" + '{"step": 7, "torn')
    assert main(["rescore", str(copy)]) == 0
    captured = capsys.readouterr()
    assert (f"docuchat-rl: warning: skipped 2 lines of {copy} that are not trace lines (first: line "
            f"{len(lines) + 2}: not a JSON object)") in captured.err
    assert f"0 of {len(lines)} completions would be judged differently" in captured.out
