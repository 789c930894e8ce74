"""Learning curve of a recipe: held-out greedy accuracy against steps and wall-clock minutes.

    python scripts/learning_curve.py config/default.yaml --steps 650 --every 50
    python scripts/learning_curve.py config/a2c.yaml config/ppo.yaml --steps 200 --every 25 --budget 15

Runs `docuchat-rl train` for each config (one after the other, never side by side: they would share the
cores), with `eval.every` set, then prints one row per evaluation (step, minutes since the start of
training including the evaluations, accuracy, gain over the before-training evaluation) and, per run, the
smallest and the last gain reached within `--budget` minutes. The learning targets of the embedded default
(GRPO +20 points, PPO and A2C +10 points within 15 minutes on 2 cores) are checked with this script; they
are a benchmark, not a test. Extra `--set key=value` overrides go to every run.
Each run goes to `--out`/<config name>, replacing an earlier curve there.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path


def curve(out: Path) -> tuple[float, list[dict]]:
    before = json.loads((out / "eval.json").read_text())["before"]["accuracy"]
    rows = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines() if line.strip()]
    return before, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="+", type=Path)
    ap.add_argument("--steps", type=int, default=None, help="run.steps (default: the config's)")
    ap.add_argument("--every", type=int, default=25, help="evaluate every N steps")
    ap.add_argument("--budget", type=float, default=15.0, help="minutes that count for the summary")
    ap.add_argument("--out", type=Path, default=Path("runs/learning_curve"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--json", type=Path, default=None, help="also write the curves here")
    a = ap.parse_args()

    results = {}
    for cfg in a.configs:
        out = a.out / cfg.stem
        # (this interpreter's docuchat-rl: run from .venv-vllm/bin/python, the vLLM engine's environment)
        cmd = [sys.executable, "-m", "docuchat_rl", "train", "--config", str(cfg), "--set", f"run.output_dir={out}",
               "--set", f"eval.every={a.every}", "--set", "eval.before_and_after=true",
               "--set", "run.overwrite=true"]  # the folder is this script's own: replace an earlier curve
        cmd += ["--set", f"run.steps={a.steps}"] if a.steps else []
        for kv in a.set:
            cmd += ["--set", kv]
        print("$", " ".join(cmd), flush=True)
        if subprocess.run(cmd).returncode != 0:
            sys.exit(f"{cfg}: training failed")
        before, rows = curve(out)
        results[str(cfg)] = {"before": before, "curve": rows}

    for cfg, r in results.items():
        before = r["before"]
        print(f"\n{cfg}: held-out greedy accuracy before training {100 * before:.1f}%")
        print(f"  {'step':>5} {'minutes':>8} {'accuracy':>9} {'gain':>7}")
        for row in r["curve"]:
            print(f"  {row['step']:>5} {row['minutes']:>8.2f} {100 * row['accuracy']:>8.1f}% "
                  f"{100 * (row['accuracy'] - before):>+7.1f}")
        inside = [row for row in r["curve"] if row["minutes"] <= a.budget]
        if inside:
            gains = [100 * (row["accuracy"] - before) for row in inside]
            print(f"  within {a.budget:g} minutes: smallest gain {min(gains):+.1f}, last {gains[-1]:+.1f} "
                  f"(step {inside[-1]['step']}, {inside[-1]['minutes']:.1f} min), best {max(gains):+.1f}")
    if a.json:
        a.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
