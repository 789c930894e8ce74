"""The transfer table of docs/generalization.md: evaluations (`docuchat-rl eval --out FILE`) side by side, every
held-out set's greedy accuracy and sampled pass@1 with its 95% interval, and each row's difference from the
first (the baseline) with Newcombe's interval.

    python scripts/transfer_table.py "SFT alone, 60 min"=runs/a.json "SFT then GRPO"=runs/b.json [--minutes 60 58]

A row per evaluation, a column per set (the recipe's data.test first, then each eval.also set). A benchmark's
report, not a test.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from docuchat_rl.evaluation import difference


def cell(result: dict, prefix: str, key: str) -> str:
    value, ci = result.get(f"{prefix}{key}"), result.get(f"{prefix}{key}/ci95")
    if value is None:
        return "-"
    return f"{100 * value:.1f}% [{100 * ci[0]:.0f}, {100 * ci[1]:.0f}]" if ci else f"{100 * value:.1f}%"


def delta(result: dict, base: dict, prefix: str, key: str) -> str:
    new, old = result.get(f"{prefix}{key}"), base.get(f"{prefix}{key}")
    if new is None or old is None:
        return ""
    d, lo, hi = difference(new, result[f"{prefix}rows"], old, base[f"{prefix}rows"])
    return f" ({100 * d:+.1f} [{100 * lo:+.0f}, {100 * hi:+.0f}])"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("runs", nargs="+", help="label=eval.json")
    ap.add_argument("--minutes", nargs="*", type=float, default=[], help="minutes of steps per run, in order")
    ap.add_argument("--key", default="accuracy", help="accuracy (greedy) or pass@1 (sampled)")
    a = ap.parse_args()
    rows = [(label, json.loads(Path(path).read_text())) for label, path in (r.split("=", 1) for r in a.runs)]
    first = rows[0][1]
    sets = [""] + [k[: -len("/rows")] + "/" for k in first if k.endswith("/rows")]
    names = ["held-out" if s == "" else s.rstrip("/") for s in sets]
    head = ["run", *(["minutes"] if a.minutes else []), *names]
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for i, (label, result) in enumerate(rows):
        cells = [cell(result, s, a.key) + (delta(result, first, s, a.key) if i else "") for s in sets]
        minutes = [f"{a.minutes[i]:g}"] if a.minutes else []
        print("| " + " | ".join([label, *minutes, *cells]) + " |")
    counts = ", ".join(f"{n} {first.get(s + 'rows')}" for n, s in zip(names, sets))
    print(f"\n({a.key}; prompts: {counts}; brackets: 95% intervals, Wilson for a value, Newcombe for a "
          "difference from the first row)")


if __name__ == "__main__":
    main()
