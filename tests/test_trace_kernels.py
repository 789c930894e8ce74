"""scripts/trace_kernels.py, where a decoded token's GPU time goes, on a profiler trace written here in
torch.profiler's Chrome-trace format (no GPU on this machine makes real kernels): the token step found from
the trace alone, its kernels counted and timed by kind."""

import gzip
import json
import subprocess
import sys

from .conftest import ROOT

# one token step's kernels as a graphed rollout launches them: (name, microseconds); the step's last kernel,
# the float64 cumulative sum of the sampling, is its slowest frequent one (the marker the script finds)
LAYER = [("void at::native::elementwise_kernel<128, 4, add>", 2.0), ("nvjet_sm90_tst_64x8_qkv", 5.0),
         ("void at::native::vectorized_elementwise_kernel<4, mul>", 1.0),
         ("void (anonymous namespace)::softmax_warp_forward<float>", 3.0), ("nvjet_sm90_tst_96x64_mlp", 6.0)]
TAIL = [("nvjet_sm90_tst_192x128_lm_head", 80.0), ("direct_copy_kernel_cuda", 60.0),
        ("cunn_SoftMaxForward<2, double>", 190.0), ("tensor_kernel_scan_innermost_dim<double>", 300.0)]


def _trace(path, tokens: int, layers: int, gap: float):
    events, ts = [{"name": "a cpu op", "cat": "cpu_op", "ts": 0, "dur": 5}], 10.0
    for _ in range(tokens):
        for name, dur in LAYER * layers + TAIL:
            events.append({"name": name, "cat": "kernel", "ts": ts, "dur": dur})
            ts += dur + gap
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_a_token_steps_kernels_are_counted_and_timed_by_kind(tmp_path):
    path = tmp_path / "trace-graphs.json.gz"
    _trace(path, tokens=30, layers=3, gap=0.5)
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "trace_kernels.py"), str(path)], capture_output=True,
                         text=True, check=True).stdout
    kernels = 3 * len(LAYER) + len(TAIL)  # 19
    busy = 3 * sum(d for _, d in LAYER) + sum(d for _, d in TAIL)  # 681 us
    assert "tensor_kernel_scan_innermost_dim<double>" in out.splitlines()[0]  # the marker, found from the trace
    assert f"a token step: {kernels} kernels, {busy / 1e3:.2f} ms GPU-busy" in out
    assert f"({kernels * 0.5 / 1e3:.2f} ms of gaps, 0.50 us a kernel)" in out
    rows = {line[:38].strip(): line[38:].split() for line in out.splitlines()[2:]}
    assert rows["LM head + sampling"][:2] == ["4", "630"]
    assert rows["matmul"][:2] == ["6", "33"]  # 2 a layer (the LM head's counts with the sampling)
    assert rows["attention softmax"][:2] == ["3", "9"]
    assert rows["other (elementwise, norms, copies)"][:2] == ["6", "9"]


def test_a_trace_without_gpu_kernels_is_refused_in_one_line(tmp_path):
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"traceEvents": [{"name": "aten::mm", "cat": "cpu_op", "ts": 0, "dur": 5}]}))
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "trace_kernels.py"), str(path)],
                          capture_output=True, text=True)
    assert done.returncode == 1 and "no GPU kernels in the trace" in done.stderr
