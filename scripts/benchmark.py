"""Seconds per training step, split by phase, and rollout tokens/s for a config (default: the embedded one).

    python scripts/benchmark.py [--config config/default.yaml] [--steps 10] [--set key=value ...]

Runs the real trainer for `--steps` steps in a temporary folder and prints the median over the steps
after the first (the first pays one-off costs), per phase, plus peak RSS.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import tempfile


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="config/default.yaml")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    a = ap.parse_args()

    from docuchat_rl.config import load_config
    from docuchat_rl.trainer import Trainer

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(a.config, [f"run.output_dir={out}", f"run.steps={a.steps}", "logging.progress=false",
                                     f"checkpoint.every={a.steps + 1}", "eval.before_and_after=false",
                                     *a.overrides])
        trainer = Trainer(cfg)
        history = trainer.train()
        trainer.close()
    rest = history[1:] or history
    phases = sorted({k for m in rest for k in m if k.startswith("time/")})
    result = {
        "config": a.config, "steps": a.steps, "rows_per_step": cfg.rollout.batch_rows,
        "max_new_tokens": cfg.rollout.max_new_tokens,
        "seconds_per_step": statistics.median(sum(m[p] for p in phases) for m in rest),
        **{p.replace("time/", "seconds/"): statistics.median(m[p] for m in rest) for p in phases},
        "rollout_tokens_per_s": statistics.median(m["rollout_tokens_per_s"] for m in rest),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "mean_reward_last_5": statistics.mean(m["reward/mean"] for m in history[-5:]),
    }
    if a.json:
        print(json.dumps(result))
        return
    for k, v in result.items():
        print(f"{k:>24}  {v:.3f}" if isinstance(v, float) else f"{k:>24}  {v}")


if __name__ == "__main__":
    main()
