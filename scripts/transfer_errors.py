"""Where completions of the synthetic task go wrong: each row read off its worked lines against the gold's
(`docuchat_rl.synthetic.diagnose`): right, a sentence read otherwise (and which way first), or every sentence
read right and a result wrong; split by whether the question says its starting count first.

    docuchat-rl generate --config config/smollm2_transfer.yaml --adapter runs/x/checkpoint-120 \\
        --set data.test=data/task_unseen/test.jsonl --held-out 200 --json > runs/x_unseen.jsonl
    python scripts/transfer_errors.py --gold data/task_unseen/test.jsonl "SFT plain"=runs/a.jsonl x=runs/x_unseen.jsonl

`generate --held-out N` samples the first N rows of data.test in order: its `prompt_id` is the gold file's row.
A report for docs/generalization.md, not a test.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from docuchat_rl.synthetic import diagnose


def report(label: str, completions: Path, gold: list[dict]) -> None:
    kinds: Counter = Counter()
    by_start: dict[bool, Counter] = {True: Counter(), False: Counter()}
    misread: Counter = Counter()
    slipped = 0  # rows with a line whose result is wrong for its own operands, whatever their kind
    for line in completions.read_text().splitlines():
        rec = json.loads(line)
        row = gold[rec["prompt_id"]]
        d = diagnose(row["question"], rec["completion"], row["answer"])
        kinds[d.kind] += 1
        by_start[d.start_first][d.kind] += 1
        misread[d.misread] += d.misread is not None
        slipped += d.slips > 0
    n = sum(kinds.values())
    print(f"{label}: {n} rows; " + ", ".join(f"{k} {kinds[k]} ({100 * kinds[k] / n:.0f}%)"
                                              for k in ("right", "reading", "arithmetic"))
          + f"; {slipped} with a line miscalculated")
    for first, c in by_start.items():
        m = sum(c.values())
        if m:
            print(f"  start said {'first' if first else 'later'}: {m} rows, right {c['right']} "
                  f"({100 * c['right'] / m:.0f}%), reading {c['reading']}, arithmetic {c['arithmetic']}")
    print("  first misread: " + ", ".join(f"{k} {v}" for k, v in misread.most_common(8) if v))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="label=completions.jsonl (docuchat-rl generate --json)")
    ap.add_argument("--gold", type=Path, required=True, help="the JSONL of data.test the completions answer")
    a = ap.parse_args()
    gold = [json.loads(x) for x in a.gold.read_text().splitlines()]
    for run in a.runs:
        label, _, path = run.rpartition("=")
        report(label or path, Path(path), gold)


if __name__ == "__main__":
    main()
