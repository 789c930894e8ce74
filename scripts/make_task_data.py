"""Write an embedded task (GSM8K-format JSONL) under data/. Deterministic for a seed.

    python scripts/make_task_data.py --out data/task [--seed 1234] [--train 6000] [--test 500]
    python scripts/make_task_data.py --ops 1 1 --out data/task_1op     # one operation per problem
    python scripts/make_task_data.py --ops 1 4 --exclude data/task/test.jsonl --out data/task_1to4  # a curriculum's
    python scripts/make_task_data.py --ops 1 1 --wording varied --out data/task_1op_varied  # many phrasings
    python scripts/make_task_data.py --ops 1 1 --wording unseen_v1 --train 0 --out data/task_1op_unseen  # held out only
    # transfer (docs/generalization.md): held-out sets in another wording and with longer chains
    python scripts/make_task_data.py --wording unseen --train 0 --out data/task_unseen
    python scripts/make_task_data.py --ops 5 6 --train 0 --out data/task_5to6
    python scripts/make_task_data.py --ops 5 6 --wording unseen --train 0 --out data/task_5to6_unseen
    # RL's rows after SFT: final answers only, many wordings, 2-6 operations, no held-out or SFT question
    python scripts/make_task_data.py --ops 2 6 --wording varied --answer-only --out data/task_answers_varied \
        --exclude data/task/train.jsonl data/task/test.jsonl data/task_unseen/test.jsonl \
        data/task_5to6/test.jsonl data/task_5to6_unseen/test.jsonl
    # the same with more constructs (comparisons, fractions and multipliers in words, two sentence orders), no
    # form of them an unseen one
    python scripts/make_task_data.py --ops 2 6 --wording diverse --answer-only --out data/task_answers_diverse \
        --exclude data/task/train.jsonl data/task/test.jsonl data/task_unseen/test.jsonl \
        data/task_5to6/test.jsonl data/task_5to6_unseen/test.jsonl
    # SFT's worked solutions in that wording, 2-4 operations (the transfer recipe's cold start), no held-out
    # question and none of RL's rows
    python scripts/make_task_data.py --seed 4321 --ops 2 4 --wording diverse --train 3000 --test 200 \
        --out data/task_diverse --exclude data/task/train.jsonl data/task/test.jsonl data/task_unseen/test.jsonl \
        data/task_5to6/test.jsonl data/task_5to6_unseen/test.jsonl data/task_answers_diverse/train.jsonl

`--wording` picks the pools a row's words are drawn from (docuchat_rl.synthetic.WORDINGS): plain (the
embedded default's), varied (many per row), unseen (disjoint from both, several sentence forms per operation
and three sentence orders: a held-out set in a wording no training set has; unseen_v1 is its first, smaller
version). `--answer-only` writes each answer as its final `#### N` line only. Questions are compared as
`synthetic.normalized` text (case, spacing and punctuation aside) within a split and against `--exclude`.
A split of 0 rows is not written. `--out` is required and must be a new or empty folder (the embedded task's
folders are rewritten only by naming them after emptying them): nothing a run of this script did not create is
overwritten. Bad arguments are one line (argparse's usage error), before anything is written.
"""

import argparse
import json
from pathlib import Path

from docuchat_rl.synthetic import MAX_OPS, WORDINGS, make_task, write_jsonl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--train", type=int, default=6000)
    ap.add_argument("--test", type=int, default=500)
    ap.add_argument("--out", type=Path, required=True, help="a new or empty folder for train.jsonl, test.jsonl, meta.json")
    ap.add_argument("--ops", type=int, nargs=2, default=(2, 4), metavar=("MIN", "MAX"),
                    help="operations per problem (default: 2 4, the embedded default task)")
    ap.add_argument("--exclude", type=Path, nargs="*", default=[],
                    help="JSONL files whose questions neither split may hold (another task's held-out rows)")
    ap.add_argument("--wording", choices=sorted(WORDINGS), default="plain",
                    help="the pools the rows' words are drawn from (default: plain, the embedded default's)")
    ap.add_argument("--answer-only", action="store_true",
                    help="answers are the final '#### N' line only (no worked solution)")
    a = ap.parse_args()
    check(ap, a)
    exclude = excluded(ap, a.exclude)
    try:
        splits = make_task(a.seed, a.train, a.test, ops=tuple(a.ops), exclude=exclude, wording=a.wording,
                           answer_only=a.answer_only)
    except ValueError as e:
        ap.error(str(e))
    meta = {"seed": a.seed, "generator": "docuchat_rl.synthetic.make_task", "ops": list(a.ops),
            **({"wording": a.wording} if a.wording != "plain" else {}),
            **({"answer_only": True} if a.answer_only else {}),
            **({"exclude": [str(f) for f in a.exclude]} if a.exclude else {})}
    for name, problems in splits.items():
        if not problems:
            continue
        meta[name] = {"rows": len(problems), "sha256": write_jsonl(problems, a.out / f"{name}.jsonl")}
    (a.out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps(meta, indent=2))


def check(ap: argparse.ArgumentParser, a) -> None:
    """Every argument, before anything is made or written (ap.error: one usage line, exit 2)."""
    low, high = a.ops
    if not 1 <= low <= high:
        ap.error(f"--ops {low} {high}: MIN and MAX operations with 1 <= MIN <= MAX")
    if high > MAX_OPS:
        ap.error(f"--ops {low} {high}: at most {MAX_OPS} operations a problem (the generator's longest chain)")
    for name in ("train", "test"):
        if getattr(a, name) < 0:
            ap.error(f"--{name} {getattr(a, name)}: a number of rows, 0 or more")
    if a.train == 0 and a.test == 0:
        ap.error("--train 0 --test 0: nothing to write")
    if a.out.exists() and (not a.out.is_dir() or any(a.out.iterdir())):
        ap.error(f"--out {a.out}: {'a file' if not a.out.is_dir() else 'a folder that holds files'}; name a new or "
                 "empty folder (nothing this script did not create is overwritten)")


def excluded(ap: argparse.ArgumentParser, files: list[Path]) -> set[str]:
    """The questions of the --exclude files; a missing file, a line that is not a JSON row with a question: one
    usage line naming the file and line."""
    out = set()
    for f in files:
        if not f.is_file():
            ap.error(f"--exclude {f}: no such file")
        for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                ap.error(f"--exclude {f}: line {n} is not JSON")
            if not isinstance(row, dict) or not isinstance(row.get("question"), str):
                ap.error(f"--exclude {f}: line {n} has no 'question' text")
            out.add(row["question"])
    return out


if __name__ == "__main__":
    main()
