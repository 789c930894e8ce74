"""How the audit scales: write N synthetic trace records, then time loading, the summary, the
detectors and a filter, and report peak RSS.

    python scripts/audit_scale.py [--records 1000000] [--keep FILE]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import tempfile
import time
from pathlib import Path


def write_traces(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            correct = float(rng.random() < 0.3 + 0.3 * i / n)
            fmt = float(rng.random() < 0.95)
            rec = {"run_id": "scale", "step": i // 64 + 1, "prompt_id": rng.randrange(6000), "group": (i % 64) // 8,
                   "sample": i % 8, "used": True, "prompt": f"Ava has {i % 97} apples. How many now?",
                   "completion": f"<think>\n{i % 97} + 3 = {i % 97 + 3}\n</think>\n<answer>{i % 97 + 3}</answer>",
                   "gold": str(i % 97 + 3), "completion_tokens": 30 + i % 20, "truncated": False,
                   "rewards": {"correctness": {"raw": correct, "weight": 1.0, "weighted": correct,
                                               "info": {"gold": "3", "extracted": "3"}, "error": None},
                               "format": {"raw": fmt, "weight": 0.2, "weighted": 0.2 * fmt,
                                          "info": {"mode": "strict"}, "error": None}},
                   "total": correct + 0.2 * fmt, "total_missing": False, "advantage": correct - 0.5}
            f.write(json.dumps(rec) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=1_000_000)
    ap.add_argument("--keep", type=Path, default=None, help="write the traces here and keep them")
    ap.add_argument("--memory-limit", default="1GB", help="DuckDB memory limit (it spills to disk beyond)")
    a = ap.parse_args()
    from docuchat_rl.tools.audit import TraceStore

    with tempfile.TemporaryDirectory() as tmp:
        path = a.keep or Path(tmp) / "traces.jsonl"
        t0 = time.perf_counter()
        write_traces(path, a.records)
        print(f"wrote {a.records} records, {path.stat().st_size / 1e6:.0f} MB, in {time.perf_counter() - t0:.1f} s")
        t0 = time.perf_counter()
        with TraceStore([path], memory_limit=a.memory_limit) as store:
            print(f"load: {time.perf_counter() - t0:.1f} s ({store.rows} records)")
            t0 = time.perf_counter()
            store.summary(bins=10)
            print(f"summary: {time.perf_counter() - t0:.1f} s")
            t0 = time.perf_counter()
            store.detect(bins=10)
            print(f"detectors: {time.perf_counter() - t0:.1f} s")
            t0 = time.perf_counter()
            n = store.count("correctness.raw == 0 and format.raw == 1 and step > 100")
            print(f"filter: {time.perf_counter() - t0:.2f} s ({n} matches)")
    print(f"peak RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MB")


if __name__ == "__main__":
    main()
