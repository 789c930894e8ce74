"""Learning curve of a recipe: held-out greedy accuracy and format rate against steps and wall-clock minutes.

    python scripts/learning_curve.py config/default.yaml --steps 650 --every 50
    python scripts/learning_curve.py config/a2c.yaml config/ppo.yaml --steps 200 --every 25 --budget 15
    python scripts/learning_curve.py config/smollm2.yaml --budget 60 --plot docs/smollm2_learning.png

Runs `docuchat-rl train` for each config (one after the other, never side by side: they would share the
cores), with `eval.every` set, then prints one row per evaluation (step, minutes since the start of
training including the evaluations, accuracy, format rate, gain over the before-training evaluation) and,
per run, the smallest and the last gain reached within `--budget` minutes; `--plot` draws accuracy and
format rate against minutes (one line each per recipe) into a PNG. A recipe's `eval.also` sets (or
`--set "eval.also={unseen: data/task_1op_unseen/test.jsonl}"`) get their own accuracy and gain columns
and dotted lines. The learning targets of the embedded default
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


def curve(out: Path) -> tuple[dict, list[dict]]:
    """(the before-training evaluation, the periodic ones) of a finished run."""
    before = json.loads((out / "eval.json").read_text())["before"]
    rows = [json.loads(line) for line in (out / "eval.jsonl").read_text().splitlines() if line.strip()]
    return before, rows


def plot(results: dict, path: Path, budget: float) -> None:
    """Accuracy and format rate (%) against minutes, the before-training point at minute 0."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9.5, 4))
    for cfg, r in results.items():
        name = Path(cfg).stem
        points = [(0.0, r["before"])] + [(row["minutes"], row) for row in r["curve"]]
        minutes = [m for m, _ in points]
        ax.plot(minutes, [100 * e["accuracy"] for _, e in points], marker="o", label=f"{name}: accuracy")
        for m, row in points[1:]:
            ax.annotate(f"step {row['step']}", (m, 100 * row["accuracy"]), textcoords="offset points",
                        xytext=(0, -14), ha="center", fontsize=7)
        for n in _also(r["before"]):
            ax.plot(minutes, [100 * e[f"{n}/accuracy"] for _, e in points], marker="^", linestyle=":",
                    label=f"{name}: {n} accuracy")
        if all(e.get("format_rate") is not None for _, e in points):
            ax.plot(minutes, [100 * e["format_rate"] for _, e in points], marker="s", linestyle="--",
                    label=f"{name}: format rate")
    if budget <= max(row["minutes"] for r in results.values() for row in r["curve"]):
        ax.axvline(budget, color="grey", linewidth=0.8, label=f"{budget:g} minutes")
    ax.set_xlabel("minutes of training (2 CPU cores, evaluations included)")
    ax.set_ylabel("held-out greedy, %")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8)  # (outside: the lines cross)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("configs", nargs="+", type=Path)
    ap.add_argument("--steps", type=int, default=None, help="run.steps (default: the config's)")
    ap.add_argument("--every", type=int, default=25, help="evaluate every N steps")
    ap.add_argument("--budget", type=float, default=15.0, help="minutes that count for the summary")
    ap.add_argument("--out", type=Path, default=Path("runs/learning_curve"))
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--json", type=Path, default=None, help="also write the curves here")
    ap.add_argument("--plot", type=Path, default=None, help="also draw accuracy and format rate into this PNG")
    ap.add_argument("--reuse", action="store_true", help="read finished runs in --out instead of training")
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
        if not a.reuse:
            print("$", " ".join(cmd), flush=True)
            if subprocess.run(cmd).returncode != 0:
                sys.exit(f"{cfg}: training failed")
        before, rows = curve(out)
        results[str(cfg)] = {"before": before, "curve": rows}

    for cfg, r in results.items():
        before = r["before"]["accuracy"]
        also = _also(r["before"])
        print(f"\n{cfg}: held-out greedy accuracy before training {100 * before:.1f}%, format rate "
              f"{_pct(r['before'].get('format_rate'))}"
              + "".join(f"; {n} {_pct(r['before'][f'{n}/accuracy'])}" for n in also))
        print(f"  {'step':>5} {'minutes':>8} {'accuracy':>9} {'format':>7} {'gain':>7}"
              + "".join(f" {n[:9]:>9} {'gain':>7}" for n in also))
        for row in r["curve"]:
            print(f"  {row['step']:>5} {row['minutes']:>8.2f} {100 * row['accuracy']:>8.1f}% "
                  f"{_pct(row.get('format_rate')):>7} {100 * (row['accuracy'] - before):>+7.1f}"
                  + "".join(f" {_pct(row.get(f'{n}/accuracy')):>9} "
                            f"{_gain(row.get(f'{n}/accuracy'), r['before'][f'{n}/accuracy']):>7}" for n in also))
        inside = [row for row in r["curve"] if row["minutes"] <= a.budget]
        if inside:
            gains = [100 * (row["accuracy"] - before) for row in inside]
            print(f"  within {a.budget:g} minutes: smallest gain {min(gains):+.1f}, last {gains[-1]:+.1f} "
                  f"(step {inside[-1]['step']}, {inside[-1]['minutes']:.1f} min), best {max(gains):+.1f}")
    if a.json:
        a.json.write_text(json.dumps(results, indent=2) + "\n")
    if a.plot:
        plot(results, a.plot, a.budget)
        print(f"wrote {a.plot}")


def _also(evaluation: dict) -> list[str]:
    """The names of eval.also's held-out sets in an evaluation (`<name>/accuracy`)."""
    return sorted(k.split("/")[0] for k in evaluation if k.count("/") == 1 and k.endswith("/accuracy"))


def _gain(x: float | None, start: float) -> str:
    """Points gained over the start ('-' for an evaluation without this set, e.g. a run stopped mid-way)."""
    return "-" if x is None else f"{100 * (x - start):+.1f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


if __name__ == "__main__":
    main()
