"""Seconds per training step with 1, 2, ... processes (data-parallel, torchrun), same global batch.

    python scripts/scale_out.py --processes 1 2 --steps 12
    python scripts/scale_out.py --processes 1 2 4 --set rollout.prompts_per_step=16 --threads 1
    python scripts/scale_out.py --processes 2 --accelerate-config config/accelerate/fsdp2_cpu_2_processes.yaml

Runs `docuchat-rl train` on the embedded default for each process count (one after the other), with
the same global settings (`rollout.prompts_per_step` is split across the processes), and prints the
median seconds per step over the steps after the first (the sum of the step's phase timings on the
main process), the rollout tokens per second of all processes together, and the speed-up over the
first count. On a 2-core machine no speed-up is expected: the processes share the cores. With
`--accelerate-config` the runs of more than one process go through `accelerate launch` with that config
(FSDP2, for instance), and the parameters each process holds are printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(procs: int, a, out: Path) -> dict:
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(procs)] if procs > 1 \
        else [sys.executable]
    if procs > 1 and a.accelerate_config:
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", a.accelerate_config,
                    "--num_processes", str(procs)]
    sets = [f"run.output_dir={out}", f"run.steps={a.steps}", f"run.threads={a.threads}", "logging.progress=false",
            "eval.before_and_after=false", "eval.every=null", f"checkpoint.every={a.steps}", *a.overrides]
    cmd = [*launcher, "-m", "docuchat_rl", "train", "--config", str(ROOT / a.config),
           *[x for s in sets for x in ("--set", s)]]
    proc = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": str(a.threads)})
    held = re.search(r"each holds ([\d.]+) MB of the model's ([\d.]+) MB", proc.stderr)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()][1:]
    step_s = [sum(v for k, v in r.items() if k.startswith("time/")) for r in rows]
    return {"processes": procs, "s_per_step": statistics.median(step_s),
            "rollout_tok_s": statistics.median(r["rollout_tokens_per_s"] for r in rows),
            "reward_mean": statistics.mean(r["reward/mean"] for r in rows),
            "params_mb": f"{held[1]} of {held[2]}" if held else "all"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process")
    ap.add_argument("--config", default="config/default.yaml")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--accelerate-config", help="launch the multi-process runs with accelerate and this config")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as work:
        for n in a.processes:
            results.append(run(n, a, Path(work) / f"p{n}"))
    if a.json:
        print(json.dumps(results))
        return
    print(f"{a.config}, {a.steps} steps, {a.threads} thread(s) per process, {os.cpu_count()} cores")
    print(f"{'processes':>9} {'s/step':>8} {'rollout tok/s':>14} {'speed-up':>9} {'mean reward':>12}  params MB held")
    for r in results:
        print(f"{r['processes']:>9} {r['s_per_step']:>8.3f} {r['rollout_tok_s']:>14.0f} "
              f"{results[0]['s_per_step'] / r['s_per_step']:>9.2f} {r['reward_mean']:>12.3f}  {r['params_mb']}")


if __name__ == "__main__":
    main()
