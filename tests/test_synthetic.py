"""The committed task files are exactly what the generator writes for the recorded seed."""

import hashlib
import json
import re
from collections import Counter

import pytest

from docuchat_rl.synthetic import WORDINGS, make_problem, make_task, write_jsonl

from .conftest import ROOT, TASK


TASKS = ("1op", "1op_varied", "1op_unseen", "1to4", "unseen", "5to6", "5to6_unseen", "answers_varied",
         "answers_diverse", "diverse")


@pytest.mark.parametrize("task", [TASK, *(ROOT / "data" / f"task_{t}" for t in TASKS)], ids=["default", *TASKS])
def test_committed_data_matches_the_generator(tmp_path, task):
    meta = json.loads((task / "meta.json").read_text())
    ops = tuple(meta.get("ops", (2, 4)))
    exclude = {json.loads(line)["question"] for f in meta.get("exclude", [])
               for line in (ROOT / f).read_text().splitlines()}
    splits = make_task(meta["seed"], meta.get("train", {}).get("rows", 0), meta["test"]["rows"], ops=ops,
                       wording=meta.get("wording", "plain"), exclude=exclude,
                       answer_only=meta.get("answer_only", False))
    for name, problems in splits.items():
        if name not in meta:  # (a held-out-only set)
            assert not problems
            continue
        digest = write_jsonl(problems, tmp_path / f"{name}.jsonl")
        assert digest == meta[name]["sha256"]
        assert hashlib.sha256((task / f"{name}.jsonl").read_bytes()).hexdigest() == digest
        if meta.get("answer_only"):  # (the final answer only: no worked solution to learn)
            assert all(p.answer == f"#### {p.value}" for p in problems)
        else:
            assert all(ops[0] <= p.answer.count("<<") <= ops[1] for p in problems)


def test_no_held_out_question_is_in_any_training_split():
    """Every committed test split against every committed training split, questions compared as normalized
    text (case, spacing, punctuation aside): a held-out row a recipe trains on measures recall."""
    from docuchat_rl.data import normalized

    def questions(f):
        return {normalized(json.loads(line)["question"]) for line in f.read_text().splitlines()}

    held = {f: questions(f) for f in (ROOT / "data").glob("task*/test.jsonl")}
    trained = {f: questions(f) for f in (ROOT / "data").glob("task*/train.jsonl")}
    assert len(held) >= 9 and len(trained) >= 5
    for h, hq in held.items():
        for t, tq in trained.items():
            assert not hq & tq, (h.parent.name, t.parent.name, len(hq & tq))


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
    return {*w.names, *w.items, *w.forms()}


def _form_pattern(form: str) -> re.Pattern:
    """A sentence form as the sentences it writes: its slots filled by any name, number, object or word."""
    parts = re.split(r"(\{\w+\})", form)
    names = "|".join(re.escape(n) for w in WORDINGS.values() for n in w.names)
    slot = {"{name}": f"(?:{names})", "{n}": r"\d+", "{v}": r"\d+", "{x}": r"\w+", "{frac}": r"[\w ]+",
            "{times}": r"\w+", "{times_verb}": r"\w+"}
    return re.compile("".join(slot.get(p, re.escape(p)) for p in parts), re.IGNORECASE)


@pytest.mark.parametrize("ops", [(2, 4), (5, 6)])
def test_unseen_rows_use_no_sentence_form_of_the_training_wordings(ops):
    """Every unseen problem's sentences are written with unseen forms only (its template ids), and no sentence
    of one is a sentence a plain or varied form could write (with any name, number or object in its slots)."""
    import random

    training = WORDINGS["plain"].forms() | WORDINGS["varied"].forms() | WORDINGS["diverse"].forms()
    assert not WORDINGS["unseen"].forms() & training
    patterns = [_form_pattern(f) for f in training]
    rng = random.Random(11)
    orders = set()
    for _ in range(400):
        p = make_problem(rng, ops, "unseen")
        *forms, order = p.forms
        orders.add(order)
        assert set(forms) <= WORDINGS["unseen"].forms()
        for sentence in re.split(r"(?<=[.?])(?<!Mr\.)(?<!Ms\.)\s+", p.question):
            assert not any(pat.fullmatch(sentence) for pat in patterns), sentence
    assert orders == {"story", "question_first", "start_last"}


@pytest.mark.parametrize("name", ["unseen", "unseen_v1"])
def test_unseen_wording_shares_no_name_object_or_sentence_with_the_training_wordings(name):
    unseen = _words(WORDINGS[name])
    assert not unseen & (_words(WORDINGS["plain"]) | _words(WORDINGS["varied"]) | _words(WORDINGS["diverse"]))
    assert _words(WORDINGS["plain"]) < _words(WORDINGS["varied"]) < _words(WORDINGS["diverse"])  # (each grows the last)
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


def test_diagnose_reads_generated_completions_as_right_misread_or_miscalculated():
    """Generated problems in every wording and order: the gold answer diagnoses as right; the same lines with one
    operation swapped as a reading error naming that swap; with only the last result wrong, as arithmetic with
    one slip; a start_last row says its start later (unless a number before it
    happens to equal it)."""
    import random

    from docuchat_rl.synthetic import diagnose, worked_steps

    rng = random.Random(11)
    orders = Counter()
    for wording in ("plain", "varied", "diverse", "unseen"):
        for _ in range(150):
            p = make_problem(rng, (2, 5), wording)
            order, steps = p.forms[-1], worked_steps(p.answer)
            orders[order] += 1
            plain = "\n".join(f"{s.a} {s.op} {s.b} = {s.result}" for s in steps)
            assert diagnose(p.question, p.answer, p.answer).kind == "right"
            assert diagnose(p.question, f"{plain}\n#### {p.value}", p.answer).kind == "right"
            # one operation read otherwise (the second: the first sets the start)
            k = 1
            other = next(op for op in "+-*/" if op != steps[k].op)
            swapped = [*steps[:k], steps[k].__class__(steps[k].a, other, steps[k].b, steps[k].result), *steps[k + 1:]]
            text = "\n".join(f"{s.a} {s.op} {s.b} = {s.result}" for s in swapped) + f"\n#### {p.value + 1}"
            d = diagnose(p.question, text, p.answer)
            assert (d.kind, d.misread) == ("reading", f"{steps[k].op} read as {other}")
            # every sentence read right, the last result off by one
            last = steps[-1]
            wrong = "\n".join(f"{s.a} {s.op} {s.b} = {s.result}" for s in steps[:-1])
            wrong += f"\n{last.a} {last.op} {last.b} = {last.result + 1}\n#### {last.result + 1}"
            d = diagnose(p.question, wrong, p.answer)
            assert (d.kind, d.slips) == ("arithmetic", 1)
            # a start read from the wrong number
            d = diagnose(p.question, f"{steps[0].a + 1} + 1 = {steps[0].a + 2}\n#### 0", p.answer)
            assert (d.kind, d.misread) == ("reading", "start value") or p.value == 0
            first_number = int(re.findall(r"\d+", p.question)[0])
            assert d.start_first == (first_number == steps[0].a)
            if order in ("story", "recap"):
                assert d.start_first
    assert orders["start_last"] > 20  # (and a start_last row's first number is an operand, not the start)


def test_a_two_stage_recipe_trains_rl_on_answer_only_rows_its_sft_stage_never_saw():
    """A recipe whose sft.path names other rows than RL's data.train (the transfer chain): RL's rows have final
    answers only, and none of their questions is one of the SFT rows' (RL on rows the SFT stage learned would
    measure recall, not what RL adds)."""
    from docuchat_rl.config import load_config
    from docuchat_rl.data import normalized

    def questions(f):
        return {normalized(json.loads(line)["question"]) for line in f.read_text().splitlines()}

    checked = []
    for path in sorted((ROOT / "config").glob("*.yaml")):
        cfg = load_config(path)
        if cfg.sft is None or not cfg.sft.path or cfg.sft.path == cfg.data.train:
            continue
        rl, sft = ROOT / cfg.data.train, ROOT / cfg.sft.path
        assert json.loads((rl.parent / "meta.json").read_text()).get("answer_only"), (path.name, cfg.data.train)
        assert not questions(rl) & questions(sft), path.name
        checked.append(path.name)
    assert "smollm2_transfer.yaml" in checked


@pytest.mark.parametrize("argv,said", [
    ([], "the following arguments are required: --out"),
    (["--ops", "4", "2"], "--ops 4 2: MIN and MAX"),
    (["--ops", "0", "0"], "--ops 0 0: MIN and MAX"),
    (["--train", "-3"], "--train -3: a number of rows"),
    (["--exclude", "nope.jsonl"], "--exclude nope.jsonl: no such file"),
    (["--exclude", "columnless.jsonl"], "--exclude columnless.jsonl: line 1 has no 'question' text"),
    (["--out", "taken"], "--out taken: a folder that holds files"),
    (["--out", "a_file"], "--out a_file: a file"),
])
def test_the_task_script_writes_only_where_it_is_told_and_refuses_bad_arguments_in_one_line(tmp_path, argv, said):
    """scripts/make_task_data.py: --out is required and must be a new or empty folder (never the embedded task by
    default); every bad argument is one usage line (exit 2), and nothing is written."""
    import subprocess
    import sys

    (tmp_path / "columnless.jsonl").write_text(json.dumps({"prompt": "Q"}) + "\n")
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "mine.txt").write_text("keep")
    (tmp_path / "a_file").write_text("keep")
    before = sorted(p.name for p in tmp_path.rglob("*"))
    if "--out" not in argv and argv:
        argv = [*argv, "--out", "new"]
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_task_data.py"), "--train", "5", "--test", "3",
                           *argv], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and said in done.stderr.strip().splitlines()[-1], done.stderr[-500:]
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # (nothing written, nothing changed)
    ok = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_task_data.py"), "--train", "5", "--test", "3",
                         "--out", "fresh"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and len((tmp_path / "fresh" / "train.jsonl").read_text().splitlines()) == 5
