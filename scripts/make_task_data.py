"""Write the embedded default task (GSM8K-format JSONL) under data/task/. Deterministic for a seed.

    python scripts/make_task_data.py [--seed 1234] [--train 6000] [--test 500] [--out data/task]
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
    a = ap.parse_args()
    splits = make_task(a.seed, a.train, a.test)
    meta = {"seed": a.seed, "generator": "docuchat_rl.synthetic.make_task"}
    for name, problems in splits.items():
        meta[name] = {"rows": len(problems), "sha256": write_jsonl(problems, a.out / f"{name}.jsonl")}
    (a.out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps(meta, indent=2))


if __name__ == "__main__":
    main()
