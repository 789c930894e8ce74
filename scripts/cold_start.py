"""Cold start against RL alone: chains of `docuchat-rl sft` and `docuchat-rl train` on one recipe, each stage's
held-out numbers against the minutes spent so far.

    python scripts/cold_start.py config/smollm2_tools_sft.yaml --chain sft train --set run.steps=60
    python scripts/cold_start.py config/default.yaml --chain train --set run.steps=200 --out runs/cs_rl
    python scripts/cold_start.py config/default.yaml --chain train sft-traces train \\
        --set run.steps=100 --out runs/cs_star

Stages run one after the other in `--out` (never side by side: they would share the cores): `sft` (the recipe's
sft section), `train` (RL: from the previous stage's adapter when there is one, else from the recipe's own
start), `sft-traces` (one round of SFT on the previous `train` stage's correct completions, `sft.source: traces`
with `--where`). Minutes are wall-clock from the chain's start, evaluations and loading included. Prints one row
per evaluation: the stage, minutes, held-out accuracy and each eval.also set's. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def run(args: list[str]) -> None:
    print("$ " + " ".join(args), file=sys.stderr, flush=True)
    done = subprocess.run(args)
    if done.returncode:
        sys.exit(f"stage failed (exit {done.returncode}): {' '.join(args)}")


def accuracies(report: dict) -> dict:
    return {k: v for k, v in report.items() if k == "accuracy" or k.endswith("/accuracy")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("--chain", nargs="+", choices=["sft", "train", "sft-traces"], required=True)
    ap.add_argument("--out", default=None, help="the chain's folder (default: runs/cold_start/<config name>)")
    ap.add_argument("--where", default="correctness.raw == 1", help="sft-traces: the completions learned")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="key=value for every stage")
    ap.add_argument("--sft-set", action="append", default=[], help="key=value for the sft stages only")
    a = ap.parse_args()
    out = Path(a.out or f"runs/cold_start/{Path(a.config).stem}")
    out.mkdir(parents=True, exist_ok=True)
    start, previous, last_train, rows = time.perf_counter(), None, None, []
    for k, stage in enumerate(a.chain):
        folder = out / f"{k}-{stage}"
        sets = [f"run.output_dir={folder}" + ("" if stage == "train" else "-rl"), "run.overwrite=true", *a.sets]
        if stage == "train":
            # (from the previous stage's adapter, or the recipe's own start; an sft section's start is the
            # sft.output_dir of this recipe, which a chain names itself)
            sets += ["sft=null", *([f"lora.init_from={previous}"] if previous else [])]
            cmd, written = ["docuchat-rl", "train"], folder
        else:
            sets += [f"sft.output_dir={folder}", *a.sft_set]
            if stage == "sft-traces":
                sets += ["sft.source=traces", f"sft.path={last_train}", f"sft.where={a.where}"]
            if previous:
                sets.append(f"lora.init_from={previous}")
            cmd, written = ["docuchat-rl", "sft"], folder
        run([*cmd, "--config", a.config, *[x for s in sets for x in ("--set", s)]])
        minutes = (time.perf_counter() - start) / 60
        report = json.loads((written / "eval.json").read_text())
        if k == 0:
            rows.append(("start", 0.0, accuracies(report["before"])))
        rows.append((stage, minutes, accuracies(report["after"])))
        previous = written
        if stage == "train":
            last_train = written
    names = sorted({n for _, _, r in rows for n in r})
    print("| stage | minutes | " + " | ".join(names) + " |")
    print("|---|---|" + "---|" * len(names))
    for stage, minutes, r in rows:
        print(f"| {stage} | {minutes:.1f} | " + " | ".join(f"{100 * r[n]:.0f}%" if r.get(n) is not None else ""
                                                           for n in names) + " |")


if __name__ == "__main__":
    main()
