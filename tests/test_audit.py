"""Audit on hand-written trace files with planted cases and on traces from a real short run."""

import json
import shutil
import subprocess

import pytest

from docuchat_rl.cli import main
from docuchat_rl.tools.audit import AuditError, TraceStore, compare, export, parse_selection


def rec(step, pid, group, sample, correct, fmt, length=20, completion=None, total=None, error=None, **kw):
    comps = {"correctness": {"raw": correct, "weight": 1.0, "weighted": correct, "info": {"gold": "4"},
                             "error": None},
             "format": {"raw": fmt, "weight": 0.2, "weighted": 0.2 * fmt, "info": {}, "error": None}}
    if error is not None:
        comps["flaky"] = {"raw": None, "weight": 1.0, "weighted": None, "info": {}, "error": error}
    r = {"run_id": "r", "step": step, "prompt_id": pid, "group": group, "sample": sample, "used": True,
         "prompt": f"q{pid}", "completion": completion or f"<think>{'x ' * length}</think><answer>4</answer>",
         "gold": "4", "completion_tokens": length, "truncated": False, "rewards": comps,
         "total": total if total is not None else correct + 0.2 * fmt, "total_missing": False, "advantage": 0.0}
    r.update(kw)
    return r


def write(path, records, extra_lines=()):
    lines = [json.dumps(r) for r in records] + list(extra_lines)
    path.write_text("\n".join(lines) + "\n")
    return path


def clean_run(steps=10):
    """Correctness rises with steps; format varies within groups; nothing suspicious."""
    out = []
    for s in range(1, steps + 1):
        for g in range(2):
            for i in range(4):
                correct = 1.0 if i < 1 + (s * 3) // steps else 0.0
                out.append(rec(s, s * 10 + g, g, i, correct, float(i % 2), advantage=correct - 0.5))
    return out


def test_summary_figures(tmp_path):
    p = write(tmp_path / "t.jsonl", clean_run())
    with TraceStore([p]) as store:
        s = store.summary(bins=2)
    assert s["records"] == 80 and s["components"] == ["correctness", "format"]
    first, last = s["bins"]
    assert first["steps"] == [1, 5] and last["steps"] == [6, 10]
    assert first["accuracy"] < last["accuracy"]
    # hand count: steps 1-5, per group correct = 1 + 3s//10 -> 1,1,1,2,2 of 4 -> 7/20
    assert first["accuracy"] == pytest.approx(7 / 20)
    assert first["format"]["share_zero"] == pytest.approx(0.5) and first["format"]["errors"] == 0
    assert first["mean_length"] == 20 and first["truncated_share"] == 0
    assert "format" in s["correlation_with_correctness"]


def test_malformed_lines_are_reported_with_line_numbers_and_skipped(tmp_path):
    p = write(tmp_path / "t.jsonl", clean_run(2), extra_lines=['{"step": 3, "torn', "[1, 2]"])
    with TraceStore([p]) as store:
        assert store.rows == 16
        assert [m["line"] for m in store.malformed] == [17, 18]


@pytest.mark.parametrize("where,reference", [
    # each SQL filter against the same predicate written in Python over the records
    ("correctness.raw == 1 and format.raw == 0",
     lambda r: r["rewards"]["correctness"]["raw"] == 1 and r["rewards"]["format"]["raw"] == 0),
    ("advantage > 0", lambda r: r["advantage"] > 0),
    ("step >= 9", lambda r: r["step"] >= 9),
    ("\"group\" = 1 and sample = 0", lambda r: r["group"] == 1 and r["sample"] == 0),  # "group" is SQL
    ("completion ilike '%answer>4%' and total > 1", lambda r: "answer>4" in r["completion"] and r["total"] > 1),
])
def test_filter_forms(tmp_path, where, reference):
    records = clean_run()
    p = write(tmp_path / "t.jsonl", records)
    expected = sum(map(reference, records))
    assert 0 < expected < len(records)
    with TraceStore([p]) as store:
        assert store.count(where) == expected
        rows = store.select(where, sort="step desc, sample", limit=3)
        assert len(rows) == 3 and rows[0]["step"] >= rows[-1]["step"]


@pytest.mark.parametrize("where,message", [
    ("nosuch > 1", "bad --where expression 'nosuch > 1'.*Fields: run_id"),
    ("correctness.raw ==", "bad --where expression"),
    ("1=1); drop table traces; select (1", "single expression"),
    ("__import__('os').system('true')", "bad --where expression"),  # never Python
    ("read_csv('/etc/passwd') is not null", "bad --where expression"),  # no file access
])
def test_bad_expressions_are_clear_errors(tmp_path, where, message):
    p = write(tmp_path / "t.jsonl", clean_run(2))
    with TraceStore([p]) as store:
        with pytest.raises(AuditError, match=message):
            store.select(where)
        assert store.count() == 16  # nothing was dropped


def fired(findings):
    return {f.check for f in findings if f.fired}


def test_detectors_quiet_on_a_clean_run(tmp_path):
    p = write(tmp_path / "t.jsonl", clean_run())
    with TraceStore([p]) as store:
        assert fired(store.detect(bins=2)) == set()


def test_detector_format_up_correctness_down(tmp_path):
    recs = [rec(s, s, 0, i, 1.0 if (s <= 5 and i < 2) else 0.0, 0.0 if s <= 5 else 1.0)
            for s in range(1, 11) for i in range(4)]
    with TraceStore([write(tmp_path / "t.jsonl", recs)]) as store:
        found = {f.check: f for f in store.detect(bins=2)}
    assert found["format_up_correctness_down"].fired and found["format_up_correctness_down"].examples


@pytest.mark.parametrize("lengths,check", [((40, 5), "length_collapse"), ((10, 60), "length_growth")])
def test_detector_length(tmp_path, lengths, check):
    recs = [rec(s, s, 0, i, 1.0 if s > 5 else 0.0, 1.0, length=lengths[0] if s <= 5 else lengths[1])
            for s in range(1, 11) for i in range(2)]
    with TraceStore([write(tmp_path / "t.jsonl", recs)]) as store:
        assert check in fired(store.detect(bins=2))


def test_detector_repetition_creep(tmp_path):
    recs = [rec(s, s, 0, i, 1.0, 1.0, completion=("the answer is four " * 8) if s > 5 else
                f"<think>{s} plus {i} makes a new number here</think>") for s in range(1, 11) for i in range(2)]
    with TraceStore([write(tmp_path / "t.jsonl", recs)]) as store:
        found = {f.check: f for f in store.detect(bins=2)}
    assert found["repetition_creep"].fired and found["repetition_creep"].examples[0]["repeated_share"] > 0.5


def test_detector_no_signal_and_erroring(tmp_path):
    recs = [rec(s, s, 0, i, float(i % 2), 1.0, error="TimeoutError: exceeded" if i == 0 else None)
            for s in range(1, 5) for i in range(4)]
    with TraceStore([write(tmp_path / "t.jsonl", recs)]) as store:
        found = {f.check: f for f in store.detect(bins=2)}
    assert found["no_signal:format"].fired  # format is 1.0 everywhere: no advantage signal
    assert not found["no_signal:correctness"].fired
    assert found["erroring:flaky"].fired and found["erroring:flaky"].examples[0]["count"] == 4
    assert not found["erroring:correctness"].fired


def test_compare_two_step_ranges_and_two_runs(tmp_path):
    a = [rec(1, p, 0, 0, 1.0 if p < 3 else 0.0, 1.0) for p in range(6)]
    b = [rec(9, p, 0, 0, 1.0 if p in (0, 4, 5) else 0.0, 1.0) for p in range(6)]
    write(tmp_path / "a.jsonl", a)
    write(tmp_path / "b.jsonl", b)
    result = compare(str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl"))
    assert (result["correct_to_wrong"], result["wrong_to_correct"]) == (2, 2)
    assert {e["prompt_id"] for e in result["examples_correct_to_wrong"]} == {1, 2}
    write(tmp_path / "both.jsonl", a + b)
    same = compare(f"{tmp_path / 'both.jsonl'}@1", f"{tmp_path / 'both.jsonl'}@2-9")
    assert same["correct_to_wrong"] == 2 and same["prompts_in_both"] == 6
    assert parse_selection("runs/x@3-7") == ("runs/x", (3, 7)) and parse_selection("r@4") == ("r", (4, 4))


def test_export_jsonl_and_csv(tmp_path):
    p = write(tmp_path / "t.jsonl", clean_run(2))
    with TraceStore([p]) as store:
        rows = store.select("correctness.raw = 1")
    export(rows, tmp_path / "sel.jsonl")
    back = [json.loads(l) for l in (tmp_path / "sel.jsonl").read_text().splitlines()]
    assert len(back) == len(rows) and back[0]["correctness"]["raw"] == 1.0
    assert back[0]["correctness"]["info"] == {"gold": "4"}  # an object, not JSON text inside JSON
    export(rows, tmp_path / "sel.csv")
    import csv

    with open(tmp_path / "sel.csv") as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows) and json.loads(table[0]["correctness"])["raw"] == 1.0
    with pytest.raises(AuditError, match=".jsonl or .csv"):
        export(rows, tmp_path / "sel.txt")


def test_cli_summary_filter_and_html(tmp_path, capsys):
    p = write(tmp_path / "t.jsonl", clean_run())
    assert main(["audit", str(p), "--bins", "2"]) == 0
    out = capsys.readouterr().out
    assert "80 records" in out and "format_up_correctness_down" in out
    assert main(["audit", str(p), "--where", "correctness.raw == 1", "--limit", "2"]) == 0
    assert "showing 2 of" in capsys.readouterr().out
    assert main(["audit", str(p), "--where", "oops >"]) == 2
    html = tmp_path / "r.html"
    assert main(["audit", str(p), "--html", str(html)]) == 0
    page = html.read_text()
    assert page.count("data:image/png;base64,") == 5  # 2 components + reward, length, truncated
    assert "format_up_correctness_down" in page and "<table>" in page and "http" not in page.split("<body>")[1]


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


@pytest.mark.skipif(CHROMIUM is None, reason="no Chromium on this machine (apt-get install chromium)")
def test_html_report_renders_in_headless_chromium(tmp_path):
    p = write(tmp_path / "t.jsonl", clean_run())
    html = tmp_path / "r.html"
    assert main(["audit", str(p), "--html", str(html)]) == 0
    shot = tmp_path / "shot.png"
    dom = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                          "--disable-background-networking", "--disable-component-update", "--disable-sync",
                          f"--user-data-dir={tmp_path / 'profile'}", "--dump-dom", html.as_uri()],
                         capture_output=True, text=True, timeout=120).stdout
    assert "Detectors" in dom and dom.count("<img") == 5
    subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp_path / 'profile2'}", f"--screenshot={shot}", "--window-size=1200,1600",
                    html.as_uri()], capture_output=True, timeout=120)
    assert shot.exists() and shot.stat().st_size > 10_000  # a real rendered page, not blank


@pytest.mark.slow
def test_audit_on_a_real_short_run(tmp_path, capsys):
    from docuchat_rl.config import load_config
    from docuchat_rl.trainer import Trainer

    from .conftest import ROOT

    cfg = load_config(ROOT / "config/default.yaml", [f"run.output_dir={tmp_path}", "run.steps=2",
                                                       "rollout.prompts_per_step=2", "rollout.num_generations=4",
                                                       "rollout.max_new_tokens=24", "logging.progress=false",
                                                       "eval.before_and_after=false"])
    t = Trainer(cfg)
    t.train()
    t.close()
    with (tmp_path / "traces.jsonl").open("a") as f:
        f.write('{"step": 3, "torn')  # a run killed mid-write
    with TraceStore([tmp_path]) as store:
        assert store.rows == 16 and store.malformed[0]["line"] == 17
        assert store.count("correctness.raw is not null and format.weight = 0.2") == 16
        s = store.summary(bins=2)
        assert [b["steps"] for b in s["bins"]] == [[1, 1], [2, 2]]
    assert main(["audit", str(tmp_path), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["summary"]["records"] == 16 and data["malformed"][0]["line"] == 17


def test_detector_truncated(tmp_path):
    recs = [rec(s, s, 0, i, float(i % 2), 1.0, truncated=s > 5 or i == 0) for s in range(1, 11) for i in range(4)]
    with TraceStore([write(tmp_path / "t.jsonl", recs)]) as store:
        found = {f.check: f for f in store.detect(bins=2)}
    assert found["truncated"].fired and found["truncated"].examples and all(
        e["step"] > 5 for e in found["truncated"].examples)
    recs = [rec(s, s, 0, i, float(i % 2), 1.0, truncated=i == 0) for s in range(1, 11) for i in range(4)]
    with TraceStore([write(tmp_path / "t2.jsonl", recs)]) as store:
        assert "truncated" not in fired(store.detect(bins=2))  # a quarter cut: not said


def test_detector_zero_spread_over_the_totals(tmp_path):
    """Every component varies across the run, but within each group of steps 3-6 the totals agree:
    the per-component no_signal checks stay quiet, zero_spread fires and names the dead steps."""
    recs = []
    for s in range(1, 7):
        for i in range(4):
            c, f = (float(i % 2), float(i % 2)) if s <= 2 else (float(s % 2), 1.0)
            recs.append(rec(s, s, 0, i, c, f))
    with TraceStore([write(tmp_path / "t.jsonl", recs)]) as store:
        found = {f.check: f for f in store.detect(bins=2, no_signal_share=0.6)}
    z = found["zero_spread"]
    assert z.fired and "4 of 6 groups" in z.detail and "4 of 6 steps had no group with a spread" in z.detail
    assert z.trace is not None and z.trace["step"] in (3, 4, 5, 6) and set(z.trace) >= {"completion", "correctness"}
    with TraceStore([write(tmp_path / "ok.jsonl", clean_run())]) as store:
        assert not {f.check: f for f in store.detect(bins=2)}["zero_spread"].fired


def test_html_report_shows_the_eval_curve_and_a_trace_beside_each_fired_detector(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    recs = [rec(s, s, 0, i, float(i % 2), 1.0, error="TimeoutError: exceeded" if i == 0 else None)
            for s in range(1, 5) for i in range(4)]
    write(run / "traces.jsonl", recs)
    (run / "eval.jsonl").write_text("".join(json.dumps({"step": s, "minutes": 0.1 * s, "accuracy": 0.1 * s,
                                                        "format_rate": 0.5}) + "\n" for s in (0, 2, 4)) + "{cut")
    html = tmp_path / "r.html"
    assert main(["audit", str(run), "--bins", "2", "--html", str(html)]) == 0
    page = html.read_text()
    assert "held-out accuracy" in page and "held-out format_rate" in page and "held-out minutes" not in page
    fired_blocks = page.split("class='finding fired'")[1:]
    assert len(fired_blocks) >= 2  # erroring:flaky and no_signal:format
    for block in fired_blocks:
        block = block.split("class='finding")[0]
        assert "an example and its trace" in block and "<th>contribution</th>" in block
    assert "TimeoutError: exceeded" in page


@pytest.mark.parametrize("field,value,why", [
    ("step", "three", "field step holds varchar, expected bigint"),
    ("total", "high", "field total holds varchar, expected double"),
    ("prompt_id", 1.5, "field prompt_id holds double, expected bigint"),  # (a cast would round it into a row id)
    ("used", "yes", "field used holds varchar, expected boolean"),
    ("completion_ids", [1, "x"], "field completion_ids holds a list of other than integers"),
    ("rewards", "all good", "field rewards is not an object"),
    ("correctness", {"raw": "1", "weight": 1.0, "weighted": 1.0}, "reward component correctness is not an object of "
                                                                   "numbers (raw, weight, weighted)"),
])
def test_a_line_whose_field_has_the_wrong_type_is_skipped_with_its_reason_not_a_traceback(tmp_path, capsys, field,
                                                                                         value, why):
    lines = clean_run(2)
    if field == "correctness":
        lines[3]["rewards"]["correctness"] = value
    else:
        lines[3][field] = value
    p = write(tmp_path / "t.jsonl", lines)
    with TraceStore([p]) as store:
        assert store.rows == len(lines) - 1
        assert [(m["line"], m["why"]) for m in store.malformed] == [(4, why)]
        assert store.count("step >= 1") == len(lines) - 1
    assert main(["audit", str(p), "--where", "step > 0"]) == 0
    assert main(["audit", str(p)]) == 0
    assert f"skipped malformed line 4 of {p} ({why}" in capsys.readouterr().out.replace("\n", " ").replace("  ", " ")


def _tool_turns(text, result, error=None, answer="<answer>4</answer>"):
    call = {"name": "calculate", "arguments": {"expression": "2 + 2"}, "result": result, "error": error,
            "result_tokens": 1, "truncated": False, "seconds": 0.01}
    return [{"model_tokens": 20, "text": text + '<tool_call>{"name": "calculate"}</tool_call>', "calls": [call],
             "env_tokens": 12, "ended": "tools"},
            {"model_tokens": 5, "text": answer, "calls": [], "env_tokens": 0, "ended": "answer"}]


def test_tool_columns_filters_and_detectors(tmp_path):
    """Multi-turn lines: tool_calls, tool_errors and the model's own words as columns; failing calls and
    right answers copied from a tool result with no reasoning are said, reasoned ones are not."""
    def line(s, i, turns):
        r = rec(s, s, 0, i, 1.0, 1.0, turns=turns)
        r["rewards"]["correctness"]["info"]["extracted"] = "4"
        return r

    copied = [line(s, i, _tool_turns("", "4")) for s in range(1, 5) for i in range(4)]
    reasoned = [line(s, i, _tool_turns("Two apples and two more make four apples in all. ", "4"))
                for s in range(1, 5) for i in range(4)]
    failing = [line(s, i, _tool_turns("Let me add them. ", "Error: TypeError: bad", "TypeError: bad"))
               for s in range(1, 5) for i in range(4)]
    with TraceStore([write(tmp_path / "c.jsonl", copied)]) as store:
        assert store.count("tool_calls = 1 AND tool_errors = 0") == 16
        found = {f.check: f for f in store.detect(bins=2)}
        assert found["tool_answer_copied"].fired and not found["tool_errors"].fired
        assert found["tool_answer_copied"].examples and found["tool_answer_copied"].trace["turns"]
    with TraceStore([write(tmp_path / "r.jsonl", reasoned)]) as store:
        assert store.select("tool_calls > 0", limit=1)[0]["reasoning"].startswith("Two apples")
        assert not fired(store.detect(bins=2)) & {"tool_answer_copied", "tool_errors"}
    with TraceStore([write(tmp_path / "f.jsonl", failing)]) as store:
        assert store.count("tool_errors > 0") == 16
        assert "tool_errors" in fired(store.detect(bins=2))
    dropping = [line(s, i, _tool_turns("Let me add. ", "4") if s <= 2 else
                     [{"model_tokens": 5, "text": "#### 4", "calls": [], "env_tokens": 0, "ended": "answer"}])
                for s in range(1, 5) for i in range(4)]
    with TraceStore([write(tmp_path / "d.jsonl", dropping)]) as store:
        found = {f.check: f for f in store.detect(bins=2)}
        assert found["tool_use_dropped"].fired and "100.0% -> 0.0%" in found["tool_use_dropped"].detail
    with TraceStore([write(tmp_path / "r2.jsonl", reasoned)]) as store:
        assert not {f.check: f for f in store.detect(bins=2)}["tool_use_dropped"].fired
    with TraceStore([write(tmp_path / "single.jsonl", clean_run(2))]) as store:  # single-turn: no tool checks
        assert store.count("tool_calls = 0") == store.rows
        assert not {f.check for f in store.detect(bins=2)} & {"tool_answer_copied", "tool_errors", "tool_use_dropped"}


@pytest.mark.parametrize("other", ["metrics", "eval", "trainer_state"])
def test_a_file_that_is_not_traces_is_refused_by_the_audit_and_rescore_naming_why(tmp_path, other):
    """A run's other JSON files are objects too: each is said to be no trace file, never summarised as
    records without components."""
    from docuchat_rl.errors import ReplayError
    from docuchat_rl.tools.replay import rescore

    lines = {"metrics": [{"step": 1, "reward/mean": 0.5, "loss": 0.1}],
             "eval": [{"rows": 8, "accuracy": 0.5, "format_rate": 1.0}],
             "trainer_state": [{"global_step": 3, "data": {"epoch": 0, "position": 8}}]}[other]
    path = write(tmp_path / f"{other}.jsonl", lines)
    with pytest.raises(AuditError, match=rf"{other}.jsonl: no trace lines \(1 lines skipped; line 1: field \w+ is "
                                         "missing: not a trace line\\)"):
        TraceStore([path])
    from docuchat_rl.config import load_config

    with pytest.raises(ReplayError, match="no trace lines"):
        rescore(path, load_config(None))
    write(path, [*lines, rec(1, 0, 0, 0, 1.0, 1.0)])  # one trace line among them: read, the other skipped
    with TraceStore([path]) as store:
        assert store.rows == 1 and len(store.malformed) == 1
