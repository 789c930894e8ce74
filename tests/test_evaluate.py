"""Held-out evaluation on the committed tiny model: the rewards get the same inputs as in training,
accuracy is the accuracy component on greedy completions, pass@k leaves the caller's random stream alone."""

import json

import pytest
import torch

from docuchat_rl.config import load_config
from docuchat_rl.data import load_examples
from docuchat_rl.evaluation import evaluate

from .conftest import ROOT, TASK


def _data(tmp_path):
    path = tmp_path / "levels.jsonl"
    rows = [{"question": f"Ava has {i} apples. Ava buys 2 more apples. How many apples does Ava have now?",
             "answer": f"#### {i + 2}", "level": i} for i in range(1, 7)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_data_set_columns_and_prompt_id_reach_the_rewards_in_eval(tiny, tmp_path):
    path = _data(tmp_path)
    cfg = load_config(ROOT / "config" / "default.yaml", [
        f"data.test={path}", "eval.max_new_tokens=8",
        "rewards=[{name: correctness}, {name: 'tests.user_rewards:uses_level', weight: 0.0}]"])
    out = evaluate(*tiny, cfg)
    assert out["rows"] == 6
    assert out["tests.user_rewards:uses_level/mean"] == pytest.approx(3.5)  # mean of levels 1..6, none failed


def test_accuracy_is_the_accuracy_component_on_greedy_completions(tiny):
    model, tok = tiny
    cfg = load_config(ROOT / "config" / "default.yaml", ["eval.limit=24", "eval.max_new_tokens=96"])
    rows = load_examples(str(TASK / "test.jsonl"), "test", "question", "answer", limit=24)
    first = evaluate(model, tok, cfg, rows)
    assert first["accuracy"] == first["correctness/mean"] and 0.0 <= first["accuracy"] <= 1.0
    assert first["format_rate"] == first["format/mean"]
    again = evaluate(model, tok, cfg, rows)  # greedy: the same numbers again
    assert {k: v for k, v in again.items() if k != "seconds"} == {k: v for k, v in first.items() if k != "seconds"}


def test_pass_at_k_does_not_move_the_callers_random_stream(tiny):
    model, tok = tiny
    cfg = load_config(ROOT / "config" / "default.yaml", ["eval.limit=6", "eval.pass_k=4", "eval.max_new_tokens=48"])
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    out = evaluate(model, tok, cfg)
    assert torch.equal(torch.rand(3), expected)
    assert 0.0 <= out["pass@1"] <= out["pass@4"] <= 1.0


def test_an_extra_held_out_set_that_is_missing_or_lacks_its_column_fails_naming_it(tmp_path):
    from docuchat_rl.data import DataError
    from docuchat_rl.evaluation import also_sets

    with pytest.raises(DataError, match="nope/test.jsonl"):
        also_sets(load_config(None, [f"eval.also={{unseen: {tmp_path}/nope/test.jsonl}}"]))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "Ava has 2 apples.", "answer": "#### 2"}) + "\n")
    with pytest.raises(DataError, match="question"):
        also_sets(load_config(None, [f"eval.also={{unseen: {bad}}}"]))
    sets = also_sets(load_config(None, ["eval.limit=3", f"eval.also={{unseen: {ROOT}/data/task_1op_unseen/test.jsonl}}"]))
    assert list(sets) == ["unseen"] and len(sets["unseen"]) == 3


def test_pass_at_1_pass_at_k_and_their_intervals_against_a_hand_computed_case():
    """Three prompts, four samples each: 6 of 12 samples right (pass@1 0.5), two prompts with a right one (pass@4
    2/3). Wilson's interval by hand: centre (p + z^2/2n) / (1 + z^2/n), half-width z sqrt(p(1-p)/n + z^2/4n^2)
    / (1 + z^2/n), z 1.96, n 3 prompts: [0.1253, 0.8747] and [0.2077, 0.9385]. Newcombe's difference interval:
    his published examples (56/70 - 48/80: 0.0524 to 0.3339; 9/10 - 3/10: 0.1705 to 0.8090)."""
    from docuchat_rl.evaluation import compare, difference, intervals, sampled

    out = sampled([[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]])
    assert out == {"pass@1": 0.5, "pass@1/rows": 3, "pass@4": pytest.approx(2 / 3, abs=1e-6), "pass@4/rows": 3}
    ci = intervals(out, 3)
    assert ci["pass@1/ci95"] == pytest.approx([0.1253, 0.8747], abs=1e-4)
    assert ci["pass@4/ci95"] == pytest.approx([0.2077, 0.9385], abs=1e-4)
    assert difference(56 / 70, 70, 48 / 80, 80) == pytest.approx((0.2, 0.0524, 0.3339), abs=1e-4)
    assert difference(9 / 10, 10, 3 / 10, 10) == pytest.approx((0.6, 0.1705, 0.8090), abs=1e-4)
    change = compare({"rows": 70, "accuracy": 56 / 70, "unseen/rows": 10, "unseen/accuracy": 0.5},
                     {"rows": 80, "accuracy": 48 / 80, "unseen/rows": 10, "unseen/accuracy": 0.4})
    assert change["accuracy"]["beyond_noise"] and not change["unseen/accuracy"]["beyond_noise"]
    assert change["accuracy"]["ci95"] == pytest.approx([0.0524, 0.3339], abs=1e-4)


def test_a_value_missing_counts_the_same_in_every_figure_and_its_n():
    """A sample or row whose accuracy reward gave no value (None) is left out of greedy accuracy, pass@1 and
    pass@k alike, and out of each one's n (its interval's); pass@1 never scores it as 0."""
    from docuchat_rl.evaluation import compare, intervals, sampled

    out = sampled([[1, None], [None, None], [0, 0], [0, 1]])
    assert (out["pass@1"], out["pass@1/rows"], out["pass@2"], out["pass@2/rows"]) == (0.4, 3, pytest.approx(2 / 3,
                                                                                                             abs=1e-6), 3)
    out.update({"rows": 4, "accuracy": 0.5, "accuracy/rows": 2})
    ci = intervals(out, 4)
    from docuchat_rl.evaluation import wilson

    assert ci["accuracy/ci95"] == list(wilson(0.5, 2)) and ci["pass@2/ci95"] == list(wilson(out["pass@2"], 3))
    change = compare(out, {**out, "accuracy": 0.0, "accuracy/rows": 4})
    assert change["accuracy"]["ci95"] == pytest.approx(compare({"rows": 2, "accuracy": 0.5},
                                                               {"rows": 4, "accuracy": 0.0})["accuracy"]["ci95"])


def test_every_set_reports_its_rows_and_intervals_and_eval_against_says_the_difference(tmp_path):
    """eval with pass@k: each set (data.test and every eval.also set) has its n, greedy accuracy, pass@1 at the
    rollout's temperature and pass@k, each with a Wilson interval; --against an earlier evaluation gives each
    number's difference with its interval."""
    import subprocess
    import sys

    sets = ["--set", "eval.limit=8", "--set", "eval.pass_k=2", "--set", "eval.max_new_tokens=32",
            "--set", "eval.also={unseen: data/task_unseen/test.jsonl}"]
    first = tmp_path / "first.json"
    run = subprocess.run([sys.executable, "-m", "docuchat_rl", "eval", *sets, "--out", str(first)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-1500:]
    out = json.loads(first.read_text())
    for prefix in ("", "unseen/"):
        assert out[f"{prefix}rows"] == 8 and out[f"{prefix}sampled_temperature"] == 1.0
        for key in ("accuracy", "pass@1", "pass@2"):
            lo, hi = out[f"{prefix}{key}/ci95"]
            assert 0.0 <= lo <= out[f"{prefix}{key}"] <= hi <= 1.0
    again = subprocess.run([sys.executable, "-m", "docuchat_rl", "eval", *sets, "--against", str(first)], cwd=ROOT,
                           capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-1500:]
    against = json.loads(again.stdout)["against"]
    assert against["accuracy"]["difference"] == 0.0 and not against["accuracy"]["beyond_noise"]
    assert set(against) >= {"accuracy", "pass@1", "pass@2", "unseen/accuracy", "unseen/pass@2"}
    bad = subprocess.run([sys.executable, "-m", "docuchat_rl", "eval", *sets, "--against", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=600)
    assert bad.returncode == 2 and "--against" in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    other = tmp_path / "other.json"  # (an evaluation of other rows, length and temperature: refused, each named)
    other.write_text(json.dumps({**out, "max_new_tokens": 64, "sampled_temperature": 0.7, "unseen/set": "0" * 16}))
    refused = subprocess.run([sys.executable, "-m", "docuchat_rl", "eval", *sets, "--against", str(other)], cwd=ROOT,
                             capture_output=True, text=True, timeout=600)
    said = refused.stderr.strip()
    assert refused.returncode == 2 and len(said.splitlines()) == 1 and refused.stdout == "", said
    assert "max_new_tokens 32 here, 64 there" in said and "sampled_temperature 1.0 here, 0.7 there" in said
    assert "unseen/set" in said


def test_held_out_prompts_that_do_not_fit_the_models_context_are_refused_before_anything_is_generated(tiny):
    """As training's: a held-out prompt whose completion of eval.max_new_tokens would pass the model's positions
    (512 here) is one line naming the set and the row, never scored past them."""
    from docuchat_rl.config import load_config
    from docuchat_rl.data import DataError, load_split
    from docuchat_rl.evaluation import evaluate

    model, tok = tiny
    cfg = load_config(None, ["eval.limit=2", "eval.max_new_tokens=480"])
    with pytest.raises(DataError, match=r"^data.test: row 0 has a prompt of \d+ tokens, and the model's context of 512"):
        evaluate(model, tok, cfg, load_split(cfg.data, "test", 2))


def test_pass_k_beyond_what_one_generate_call_holds_is_refused_at_load():
    from docuchat_rl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"eval.pass_k \(1000\) is more than eval.batch_size \(128\)"):
        load_config(None, ["eval.pass_k=1000"])
    with pytest.raises(ConfigError, match="eval.pass_k"):
        load_config(None, ["eval.pass_k=1000000", "eval.batch_size=2000000"])
    assert load_config(None, ["eval.pass_k=256", "eval.batch_size=256"]).eval.pass_k == 256
