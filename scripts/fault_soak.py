"""Kill -9 soak: SIGKILL a training run at random moments in each phase, resume each time, compare.

    python scripts/fault_soak.py --kills 20            # 5 kills in each of rollout, update, log, checkpoint
    python scripts/fault_soak.py --kills 4 --steps 6   # the short version the test suite runs

A small recipe (the embedded default shrunk: 2 prompts x 4 completions, 24 new tokens, a checkpoint every
step) runs once uninterrupted, then again while this script kills it: it watches the phase the trainer
is in (each run is `docuchat-rl train` started through this script's `child` mode, whose Trainer
`on_phase` hook writes the phase to a file), picks the next target phase in turn (rollout,
update, log = the trace/metrics write, checkpoint = the checkpoint write), waits a random moment inside
it, sends SIGKILL, reads back the phase the process was really in, checks that `--resume latest` would
choose an intact checkpoint, and restarts with `--resume latest`. When the kills are done the run
finishes, and its traces, metrics and final adapter are compared with the uninterrupted run's (timings
and run ids aside). Printed: kills per phase hit, records lost and doubled, whether every resumed run
was identical, and whether a half-written checkpoint was ever chosen. Exit code 1 when anything differs.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PHASES = ("rollout", "update", "log", "checkpoint")
# how long after entering a phase the kill may land (s): about each phase's length on 2 CPU cores
WINDOW = {"rollout": 0.25, "update": 0.2, "log": 0.0, "checkpoint": 0.03}


def recipe(out: Path, steps: int) -> list[str]:
    sets = [f"run.output_dir={out}", f"run.steps={steps}", "run.threads=2", "rollout.prompts_per_step=2",
            "rollout.num_generations=4", "rollout.max_new_tokens=24", "checkpoint.every=1",
            "checkpoint.keep_last=2", "logging.progress=false", "eval.before_and_after=false"]
    return [sys.executable, str(Path(__file__).resolve()), "child", "--config", str(ROOT / "config/default.yaml"),
            *[a for s in sets for a in ("--set", s)]]


def child(argv: list[str]) -> int:
    """`docuchat-rl train ARGV`, the phase the loop enters written to $SOAK_PHASE_FILE (when set)."""
    from docuchat_rl import cli

    path = os.environ.get("SOAK_PHASE_FILE")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644) if path else None

    def on_phase(name: str) -> None:
        if fd is not None:
            os.pwrite(fd, f"{name:<12}".encode(), 0)

    return cli.cmd_train(cli.parser().parse_args(["train", *argv]), on_phase=on_phase)


def restart(out: Path, steps: int) -> list[str]:
    """`--resume latest` once a checkpoint exists; before that, a fresh start over the killed one's files."""
    more = ["--resume", "latest"] if (out / "latest").exists() else ["--set", "run.overwrite=true"]
    return recipe(out, steps) + more


def untimed(path: Path) -> list[dict]:
    from docuchat_rl.outputs import read_jsonl
    from docuchat_rl.trainer import MEASURED

    return [{k: v for k, v in r.items() if not k.startswith(MEASURED) and k != "run_id"} for r in read_jsonl(path)]


def kill_in(cmd: list[str], phase_file: Path, target: str, rng: random.Random, timeout: float) -> str | None:
    """Start `cmd`, SIGKILL it at a random moment of phase `target`; the phase it was really in, or None
    when the run ended first."""
    phase_file.write_text("")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "SOAK_PHASE_FILE": str(phase_file)})
    deadline = time.time() + timeout
    try:
        while proc.poll() is None and time.time() < deadline:
            if phase_file.read_text().strip() == target:
                time.sleep(rng.uniform(0, WINDOW[target]))
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()
                return phase_file.read_text().strip()
            time.sleep(0.0002)
        if proc.poll() is None:
            proc.kill()
            raise RuntimeError(f"phase {target!r} not reached in {timeout:.0f} s")
        if proc.returncode != 0:
            raise RuntimeError(f"training failed: {proc.stderr.read().decode()[-2000:]}")
        return None
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


def soak(kills: int, steps: int, seed: int, work: Path) -> dict:
    from safetensors.torch import load_file

    from docuchat_rl.checkpoint import resolve_resume, verify_checkpoint

    ref, cut, phase_file = work / "reference", work / "soaked", work / "phase"
    subprocess.run(recipe(ref, steps), cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rng = random.Random(seed)
    hit: Counter = Counter()
    chosen_damaged = 0
    for k in range(kills):
        phase = kill_in(restart(cut, steps), phase_file, PHASES[k % len(PHASES)], rng, timeout=120)
        if phase is None:
            break  # the run finished before this kill
        hit[phase] += 1
        if (cut / "latest").exists() and verify_checkpoint(resolve_resume("latest", cut)) is not None:
            chosen_damaged += 1
    subprocess.run(restart(cut, steps), cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    keys = [(r["step"], r["group"], r["sample"]) for r in untimed(cut / "traces.jsonl")]
    expected = {(s, g, i) for s in range(1, steps + 1) for g in range(2) for i in range(4)}
    final = f"checkpoint-{steps}"
    a = load_file(ref / final / "adapter_model.safetensors")
    b = load_file(cut / final / "adapter_model.safetensors")
    return {
        "kills": sum(hit.values()), "phases_hit": dict(hit), "steps": steps,
        "records": len(keys), "records_lost": len(expected - set(keys)),
        "records_doubled": len(keys) - len(set(keys)),
        "traces_identical": untimed(cut / "traces.jsonl") == untimed(ref / "traces.jsonl"),
        "metrics_identical": untimed(cut / "metrics.jsonl") == untimed(ref / "metrics.jsonl"),
        "adapter_identical": a.keys() == b.keys() and all(bool((a[n] == b[n]).all()) for n in a),
        "damaged_checkpoint_chosen": chosen_damaged,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kills", type=int, default=20)
    ap.add_argument("--steps", type=int, default=None, help="training steps (default: kills + 4)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as work:
        t0 = time.time()
        res = soak(a.kills, a.steps or a.kills + 4, a.seed, Path(work))
        res["minutes"] = round((time.time() - t0) / 60, 2)
    ok = (res["records_lost"] == res["records_doubled"] == res["damaged_checkpoint_chosen"] == 0
          and res["traces_identical"] and res["metrics_identical"] and res["adapter_identical"])
    if a.json:
        print(json.dumps({**res, "ok": ok}))
    else:
        per_phase = ", ".join(f"{p} {res['phases_hit'].get(p, 0)}" for p in PHASES)
        print(f"kills: {res['kills']} ({per_phase}) over {res['steps']} steps, {res['minutes']} min")
        print(f"records: {res['records']}, lost {res['records_lost']}, doubled {res['records_doubled']}")
        print(f"identical to the uninterrupted run: traces {res['traces_identical']}, metrics "
              f"{res['metrics_identical']}, final adapter {res['adapter_identical']}")
        print(f"half-written checkpoint chosen on resume: {res['damaged_checkpoint_chosen']} times")
        print("OK" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    if sys.argv[1:2] == ["child"]:
        sys.exit(child(sys.argv[2:]))
    main()
