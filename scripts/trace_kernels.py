"""Where one decoded token's GPU time goes, from a profiler trace of a rollout (scripts/profile_step.py
--trace, which the GPU checklist's profile stages write and bring back gzipped).

    python scripts/trace_kernels.py trace-graphs.json.gz

The token step is found in the trace itself: the span between two launches of the kernel that takes the
longest on average among those launched at least 16 times (in a sampled rollout the float64 CDF's scan, in
a greedy one the LM head's matmul), so the figures are per token without knowing the step count. Prints the
median token step's kernel count, GPU-busy and wall span (the difference is the gaps between kernels), then
the mean busy time and count of each kind of kernel: matmuls, attention's softmax, the LM head and sampling
(everything from the step's largest matmul on, and the marker), and the rest (elementwise, norms, copies,
concatenations: what a fusing compiler would merge). Reads Chrome-trace JSON (torch.profiler's export).
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
from collections import Counter, defaultdict

MATMUL = ("nvjet", "gemm", "splitK", "cutlass", "xmma", "triton_tem")  # cuBLAS, CUTLASS, inductor's templates


def kind(name: str) -> str:
    if any(m in name for m in MATMUL):
        return "matmul"
    if "softmax_warp" in name:
        return "attention softmax"
    return "other (elementwise, norms, copies)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--min-launches", type=int, default=16, help="launches a marker kernel needs at least")
    args = ap.parse_args()
    opener = gzip.open if args.trace.endswith(".gz") else open
    with opener(args.trace, "rt") as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    if not kernels:
        raise SystemExit(f"{args.trace}: no GPU kernels in the trace (a CPU run's trace has none)")
    launches, total = Counter(), defaultdict(float)
    for e in kernels:
        launches[e["name"]] += 1
        total[e["name"]] += e["dur"]
    frequent = [n for n, c in launches.items() if c >= args.min_launches]
    marker = max(frequent, key=lambda n: total[n] / launches[n])
    at = [i for i, e in enumerate(kernels) if e["name"] == marker]
    pairs = list(zip(at, at[1:]))
    pairs = pairs[len(pairs) // 10: len(pairs) - len(pairs) // 10] or pairs  # the middle: no warm-up, no tail
    steps = [kernels[a + 1:b + 1] for a, b in pairs]  # each step: after one marker, up to the next one
    print(f"{args.trace}: {len(kernels)} kernels; token steps between launches of {marker[:70]}... "
          f"({len(at)} launches, {total[marker] / launches[marker]:.1f} us each); {len(steps)} steps read")
    count = statistics.median(len(s) for s in steps)
    busy = statistics.median(sum(e["dur"] for e in s) for s in steps)
    end = [e["ts"] + e["dur"] for e in kernels]
    span = statistics.median(end[b] - end[a] for a, b in pairs)  # (the gap after the marker included)
    print(f"a token step: {count:.0f} kernels, {busy / 1e3:.2f} ms GPU-busy in a {span / 1e3:.2f} ms span "
          f"({(span - busy) / 1e3:.2f} ms of gaps, {(span - busy) / count:.2f} us a kernel)")
    per_kind, per_count = defaultdict(float), defaultdict(float)
    for s in steps:
        head = max(range(len(s)), key=lambda i: s[i]["dur"] if kind(s[i]["name"]) == "matmul" else -1.0)
        for i, e in enumerate(s):
            k = "LM head + sampling" if i >= head else kind(e["name"])
            per_kind[k] += e["dur"] / len(steps)
            per_count[k] += 1 / len(steps)
    print(f"  {'kind':36s} {'kernels':>8s} {'us':>9s} {'share':>6s}")
    for k in sorted(per_kind, key=per_kind.get, reverse=True):
        print(f"  {k:36s} {per_count[k]:8.0f} {per_kind[k]:9.0f} {per_kind[k] / sum(per_kind.values()):6.1%}")


if __name__ == "__main__":
    main()
