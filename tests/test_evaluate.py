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
    assert 0.0 <= out["mean@4"] <= out["pass@4"] <= 1.0


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
