"""The committed task files are exactly what the generator writes for the recorded seed."""

import hashlib
import json

import pytest

from docuchat_rl.synthetic import make_problem, make_task, write_jsonl

from .conftest import ROOT, TASK


@pytest.mark.parametrize("task", [TASK, ROOT / "data" / "task_1op"], ids=["default", "1op"])
def test_committed_data_matches_the_generator(tmp_path, task):
    meta = json.loads((task / "meta.json").read_text())
    ops = tuple(meta.get("ops", (2, 4)))
    splits = make_task(meta["seed"], meta["train"]["rows"], meta["test"]["rows"], ops=ops)
    for name, problems in splits.items():
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
