"""The committed task files are exactly what the generator writes for the recorded seed."""

import hashlib
import json

import pytest

from docuchat_rl.synthetic import WORDINGS, make_problem, make_task, write_jsonl

from .conftest import ROOT, TASK


@pytest.mark.parametrize("task", [TASK, *(ROOT / "data" / f"task_{t}" for t in ("1op", "1op_varied", "1op_unseen"))],
                         ids=["default", "1op", "1op-varied", "1op-unseen"])
def test_committed_data_matches_the_generator(tmp_path, task):
    meta = json.loads((task / "meta.json").read_text())
    ops = tuple(meta.get("ops", (2, 4)))
    splits = make_task(meta["seed"], meta.get("train", {}).get("rows", 0), meta["test"]["rows"], ops=ops,
                       wording=meta.get("wording", "plain"))
    for name, problems in splits.items():
        if name not in meta:  # (a held-out-only set)
            assert not problems
            continue
        digest = write_jsonl(problems, tmp_path / f"{name}.jsonl")
        assert digest == meta[name]["sha256"]
        assert hashlib.sha256((task / f"{name}.jsonl").read_bytes()).hexdigest() == digest
        assert all(ops[0] <= p.answer.count("<<") <= ops[1] for p in problems)


def test_splits_are_disjoint_and_sized():
    rows = {n: [json.loads(l) for l in open(TASK / f"{n}.jsonl")] for n in ("train", "test")}
    assert len(rows["train"]) >= 3000 and len(rows["test"]) >= 500
    assert not {r["question"] for r in rows["train"]} & {r["question"] for r in rows["test"]}


def test_problems_are_gsm8k_format_with_2_to_4_integer_steps():
    import random

    rng = random.Random(7)
    for _ in range(300):
        p = make_problem(rng)
        steps = p.answer.split("\n")[:-1]
        assert 2 <= len(steps) <= 4 and p.answer.endswith(f"#### {p.value}")
        for line in steps:  # each annotated step really computes its result
            expr, result = line.split("<<")[1].split(">>")[0].split("=")
            assert eval(expr.replace("/", "//")) == int(result) >= 0  # noqa: S307 (our own generated text)


def _words(w) -> set[str]:
    """Every name, object and sentence template of a wording."""
    return {*w.names, *w.items, *w.openings, *w.questions, *(p for ps in w.phrases.values() for p in ps)}


def test_unseen_wording_shares_no_name_object_or_sentence_with_the_training_wordings():
    unseen = _words(WORDINGS["unseen"])
    assert not unseen & (_words(WORDINGS["plain"]) | _words(WORDINGS["varied"]))
    assert _words(WORDINGS["plain"]) < _words(WORDINGS["varied"])  # varied grows the plain pools
    rows = [json.loads(line) for line in (ROOT / "data" / "task_1op_unseen" / "test.jsonl").open()]
    trained = {json.loads(line)["question"].split(".")[0].split()[0]
               for t in ("task_1op", "task_1op_varied") for line in (ROOT / "data" / t / "train.jsonl").open()}
    assert not {r["question"].split()[0] for r in rows} & trained  # no opening word a training row starts with


@pytest.mark.parametrize("wording", sorted(WORDINGS))
def test_every_wording_writes_correct_steps_and_fills_every_slot(wording):
    import random

    rng = random.Random(3)
    for _ in range(200):
        p = make_problem(rng, (1, 3), wording)
        assert "{" not in p.question and p.question[0].isupper()
        assert 1 <= p.answer.count("<<") <= 3 and p.answer.endswith(f"#### {p.value}")
        for line in p.answer.split("\n")[:-1]:
            expr, result = line.split("<<")[1].split(">>")[0].split("=")
            assert eval(expr.replace("/", "//")) == int(result) >= 0  # noqa: S307 (our own generated text)
