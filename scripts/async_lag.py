"""rollout.async_lag measured side by side on one recipe: seconds per step and held-out accuracy at equal steps.

    python scripts/async_lag.py --config config/default.yaml --steps 30
    python scripts/async_lag.py --config config/smollm2.yaml --steps 10 --eval-limit 0
    .venv-vllm/bin/python scripts/async_lag.py --steps 12 --eval-limit 0 --vllm --server http://127.0.0.1:8000

Variants, each a fresh run in its own folder (run one after another, never side by side):
- sync: async_lag 0, the learner given every core (run.threads = --threads);
- lag k inline: the lagged policy sampled in the learner's process (no overlap), every core;
- lag k worker: a worker process with --worker-threads samples ahead, the learner has the rest;
- with --vllm: vLLM colocated in the learner's process (synchronous, every core);
- with --server URL: vLLM's server at URL (`docuchat-rl serve` started it for the same recipe), synchronous
  and at each lag (the server samples ahead; it shares the machine's cores with the learner when local).
Prints s/step (the step's phases summed, checkpoint and evaluation left out; median over the steps after the
first two: the worker's start is in step 1), the phase
times, the held-out accuracy after the last step (eval.limit rows; 0 skips it), and a model of the step
time were generation and learning on separate devices: max(rollout, everything else) per step, from the
synchronous run's measured phases (a model, not a measurement).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


# the update's view of the lag, averaged over the run's steps (None where a run has no such key: a synchronous
# run has no sampler weights)
LEARNING = ("clip_low", "clip_high", "async/kl_sampler_learner", "sampler/weight_mean", "sampler/capped_share",
            "sampler/mismatch_mean")


def _mean(rows: list[dict], key: str) -> float | None:
    values = [x[key] for x in rows if isinstance(x.get(key), (int, float))]
    return round(statistics.fmean(values), 5) if values else None


def _run(config: str, out: Path, sets: list[str]) -> list[dict]:
    cmd = [sys.executable, "-m", "docuchat_rl", "train", "--config", config, "--set", f"run.output_dir={out}"]
    for s in sets:
        cmd += ["--set", s]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="config/default.yaml")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lags", default="1,2")
    ap.add_argument("--threads", type=int, default=2, help="cores the synchronous loop gets")
    ap.add_argument("--worker-threads", type=int, default=1, help="the worker's share (the learner: the rest)")
    ap.add_argument("--eval-limit", type=int, default=100, help="held-out rows evaluated at the end (0: none)")
    ap.add_argument("--no-inline", action="store_true", help="leave out the in-process lag variants")
    ap.add_argument("--no-sync", action="store_true", help="leave out the synchronous run (and the model from it)")
    ap.add_argument("--vllm", action="store_true", help="add vLLM colocated (run from the vLLM environment)")
    ap.add_argument("--server", default=None, help="add vLLM's server at this URL, synchronous and lagged")
    ap.add_argument("--kv-bytes", type=int, default=268435456, help="colocated vLLM's KV cache on a CPU")
    ap.add_argument("--only", default=None, help="comma-separated variant names to run (e.g. 'vllm server')")
    ap.add_argument("--eval-every", type=int, default=None, help="also evaluate every N steps (a learning curve)")
    ap.add_argument("--keep", default=None, help="write the run folders under this folder (default: a temporary one)")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    a = ap.parse_args()

    every = a.eval_every or a.steps
    common = [f"run.steps={a.steps}", "logging.progress=false", f"checkpoint.every={a.steps}", *a.sets,
              "eval.every=null"] + ([f"eval.limit={a.eval_limit}", f"eval.every={every}"] if a.eval_limit else [])
    variants = [] if a.no_sync else [("sync", [f"run.threads={a.threads}"])]
    for k in (int(x) for x in a.lags.split(",")):
        if not a.no_inline:
            variants.append((f"lag {k} inline", [f"rollout.async_lag={k}", f"run.threads={a.threads}"]))
        variants.append((f"lag {k} worker", [f"rollout.async_lag={k}", f"run.threads={a.threads - a.worker_threads}",
                                             f"rollout.async_worker_threads={a.worker_threads}"]))
    if a.vllm:
        variants.append(("vllm colocate", ["rollout.engine=vllm", f"rollout.vllm.kv_cache_memory_bytes={a.kv_bytes}",
                                           f"run.threads={a.threads}"]))
    if a.server:
        server = ["rollout.engine=vllm", "rollout.vllm.mode=server", f"rollout.vllm.server_base_url={a.server}",
                  f"run.threads={a.threads}"]
        variants.append(("vllm server", server))
        variants += [(f"vllm server lag {k}", [*server, f"rollout.async_lag={k}"]) for k in map(int, a.lags.split(","))]
    if a.only:
        variants = [v for v in variants if v[0] in a.only.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() if a.keep is None else contextlib.nullcontext(a.keep) as tmp:
        for name, sets in variants:
            sets = [*common, *sets, "eval.before_and_after=false"]
            if a.eval_limit:
                sets = [s for s in sets if s != "eval.every=null"]
            m = _run(a.config, Path(tmp) / name.replace(" ", "-"), sets)
            later = m[2:] or m
            phase = {p: statistics.median(x.get(f"time/{p}", 0.0) for x in later)
                     for p in ("rollout", "score", "advantages", "update", "log")}
            step_s = statistics.median(sum(v for k, v in x.items() if k.startswith("time/")) for x in later)
            rows.append({"variant": name, "s_per_step": round(step_s, 3), **{f"{k}_s": round(v, 3) for k, v in phase.items()},
                         "accuracy": next((x.get("eval/accuracy") for x in reversed(m) if x.get("eval/accuracy")
                                           is not None), None), "steps": len(m),
                         "rollout_tokens_per_s": round(statistics.median(x["rollout_tokens_per_s"] or 0 for x in later)),
                         "accuracy_at": {x["step"]: x["eval/accuracy"] for x in m if x.get("eval/accuracy") is not None},
                         **{k.replace("/", "_"): _mean(m, k) for k in LEARNING}})
            print(json.dumps(rows[-1]), flush=True)
    if a.no_sync or a.only:
        return
    sync = rows[0]
    rest = sum(sync[f"{p}_s"] for p in ("score", "advantages", "update", "log"))
    print(json.dumps({"model": "separate devices (from the sync run's phases)", "sync_step_s":
                      round(sync["rollout_s"] + rest, 3), "overlapped_step_s": round(max(sync["rollout_s"], rest), 3),
                      "speedup": round((sync["rollout_s"] + rest) / max(sync["rollout_s"], rest, 1e-9), 2)}))


if __name__ == "__main__":
    main()
