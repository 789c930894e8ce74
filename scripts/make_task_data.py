"""Write an embedded task (GSM8K-format JSONL) under data/. Deterministic for a seed.

    python scripts/make_task_data.py [--seed 1234] [--train 6000] [--test 500] [--out data/task]
    python scripts/make_task_data.py --ops 1 1 --out data/task_1op     # one operation per problem
    python scripts/make_task_data.py --ops 1 4 --exclude data/task/test.jsonl --out data/task_1to4  # a curriculum's
"""

import argparse
import json
from pathlib import Path

from docuchat_rl.synthetic import make_task, write_jsonl


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
    a = ap.parse_args()
    exclude = {json.loads(line)["question"] for f in a.exclude for line in f.read_text().splitlines() if line.strip()}
    splits = make_task(a.seed, a.train, a.test, ops=tuple(a.ops), exclude=exclude)
    meta = {"seed": a.seed, "generator": "docuchat_rl.synthetic.make_task", "ops": list(a.ops),
            **({"exclude": [str(f) for f in a.exclude]} if a.exclude else {})}
    for name, problems in splits.items():
        meta[name] = {"rows": len(problems), "sha256": write_jsonl(problems, a.out / f"{name}.jsonl")}
    (a.out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps(meta, indent=2))


if __name__ == "__main__":
    main()
