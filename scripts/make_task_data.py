"""Write an embedded task (GSM8K-format JSONL) under data/. Deterministic for a seed.

    python scripts/make_task_data.py [--seed 1234] [--train 6000] [--test 500] [--out data/task]
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
A split of 0 rows is not written.
"""

import argparse
import json
from pathlib import Path

from docuchat_rl.synthetic import WORDINGS, make_task, write_jsonl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--train", type=int, default=6000)
    ap.add_argument("--test", type=int, default=500)
    ap.add_argument("--out", type=Path, default=Path("data/task"))
    ap.add_argument("--ops", type=int, nargs=2, default=(2, 4), metavar=("MIN", "MAX"),
                    help="operations per problem (default: 2 4, the embedded default task)")
    ap.add_argument("--exclude", type=Path, nargs="*", default=[],
                    help="JSONL files whose questions neither split may hold (another task's held-out rows)")
    ap.add_argument("--wording", choices=sorted(WORDINGS), default="plain",
                    help="the pools the rows' words are drawn from (default: plain, the embedded default's)")
    ap.add_argument("--answer-only", action="store_true",
                    help="answers are the final '#### N' line only (no worked solution)")
    a = ap.parse_args()
    exclude = {json.loads(line)["question"] for f in a.exclude for line in f.read_text().splitlines() if line.strip()}
    splits = make_task(a.seed, a.train, a.test, ops=tuple(a.ops), exclude=exclude, wording=a.wording,
                       answer_only=a.answer_only)
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


if __name__ == "__main__":
    main()
