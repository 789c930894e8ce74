"""TRL's GRPO quick start, as a TRL user brings it: `reward_len` as written in TRL's docs, on the default recipe.

    python scripts/trl_quickstart.py --steps 40

Runs `docuchat-rl train` on `config/default.yaml` with this file's `reward_len` as the only reward (named
by file path, `scripts/trl_quickstart.py:reward_len`, as a user names their own file) and prints the mean
completion length in characters and the mean reward per window of steps, read from the run's traces.
The target is TRL's: the mean length moves toward 20 characters. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def reward_len(completions, **kwargs):
    """TRL's quick-start reward, verbatim: completions near 20 characters."""
    return [-abs(20 - len(completion)) for completion in completions]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--window", type=int, default=5, help="steps per printed row")
    ap.add_argument("--out", type=Path, default=Path("runs/trl_quickstart"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    a = ap.parse_args()
    sets = [f"run.steps={a.steps}", f"run.output_dir={a.out}", "data.test=null", "eval.every=null", "checkpoint.every=1000",
            "rewards=[{name: 'scripts/trl_quickstart.py:reward_len'}]", "rewards.accuracy_component=null", *a.set]
    if a.out.exists():
        import shutil

        shutil.rmtree(a.out)
    cmd = [sys.executable, "-m", "docuchat_rl", "train", "--config", "config/default.yaml",
           *[x for s in sets for x in ("--set", s)]]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    traces = [json.loads(line) for line in (a.out / "traces.jsonl").read_text().splitlines() if line.strip()]
    print(f"{'steps':>9} {'mean chars':>11} {'|chars - 20|':>13} {'reward':>8}")
    for lo in range(1, a.steps + 1, a.window):
        rows = [r for r in traces if lo <= r["step"] < lo + a.window]
        chars = [len(r["completion"]) for r in rows]
        print(f"{lo:>4}-{lo + a.window - 1:<4} {sum(chars) / len(chars):>11.1f} "
              f"{sum(abs(c - 20) for c in chars) / len(chars):>13.1f} {sum(r['total'] for r in rows) / len(rows):>8.2f}")


if __name__ == "__main__":
    main()
