"""Memory of one GRPO step at real widths and lengths, ours against TRL's GRPOTrainer, and what fits a GPU.

    python scripts/memory_table.py                          # the table in docs/performance.md ("Memory at real sizes")
    python scripts/memory_table.py --shapes qwen2.5-0.5b --lengths 512 1024 --layers 1 2
    python scripts/memory_table.py --json runs/memory.json  # every point's figures, as measured

Each point builds a random-weight Qwen2.5 shape (scripts/benchmark.py's SHAPES: its width, heads, vocabulary)
with a few decoder layers (this machine holds neither a 7B model's 15 GB of bfloat16 weights beside a step's
activations nor the hours its every layer takes on 2 cores) and runs one GRPO step a side in its own process
(benchmark.py's workers: the same prompt, G 8, fixed-length completions of the point's length, LoRA r16 on all
linear layers, bf16 autocast over bfloat16 weights, or the base in NF4 on our side and TRL's QLoRA on its), counting
each phase's live tensors (docuchat_rl.memory.TensorBytes: what CUDA's max_memory_allocated counts) and the peak
RSS. A point is measured at two layer counts; the step's peak is linear in the layers (checked: `--check-layers`
measures 1, 2 and 4 layers of one shape and prints the fit's largest residual), so the full model's peak is
extrapolated from the two, and said so. `fits` says, from the extrapolated peaks, which (shape, length) fit in
16 / 24 / 40 / 80 GB with 10% left to the allocator, ours, ours with NF4, TRL.

Deliberately left out: the GPU's own overheads (CUDA graph pools, the allocator's fragmentation, kernels'
workspaces), which only a GPU run measures (scripts/gpu_checklist.sh's memory stage).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

import benchmark  # noqa: E402  (the shapes and the workers)

GB = 10 ** 9
CARDS = (16, 24, 40, 80)


def point(shape: str, layers: int, length: int, side: str, nf4: bool, folder: Path) -> dict:
    """One side's step at one point, in its own process: {"peak_mb": tensors' peak over the phases, "phases": ...,
    "rss_mb": ...}."""
    cmd = [sys.executable, str(ROOT / "scripts" / "benchmark.py"), "--worker", side, "--prompts", "1",
           "--generations", "8", "--max-new", str(length), "--steps", "1", "--warmup", "0", "--lr", "1e-5",
           "--temperature", "1.0", "--threads", "2", "--fixed-length", "--trl-dtype", "bfloat16", "--tensor-memory",
           "--set", f"model.name_or_path={folder}", "--set", "model.dtype=bf16-autocast",
           "--set", "data.max_prompt_tokens=512"]
    if nf4:
        cmd += ["--set", "model.quantization=nf4"] if side == "ours" else ["--trl-quantization", "nf4"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{side} {shape} x{layers} at {length} failed:\n{done.stderr[-2000:]}")
    r = json.loads(done.stdout.strip().splitlines()[-1])
    phases = r["tensor_peaks_mb"]
    return {"peak_mb": max(phases.values()), "phases": phases, "rss_mb": r["peak_mb"],
            "seconds": r["seconds_per_step"]}


def extrapolate(a: dict, b: dict, la: int, lb: int, full: int) -> float:
    """The peak (MB) at `full` layers from the peaks at `la` and `lb` layers (linear in the layers)."""
    slope = (b["peak_mb"] - a["peak_mb"]) / (lb - la)
    return b["peak_mb"] + slope * (full - lb)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-3b", "qwen2.5-7b"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[512, 1024])
    ap.add_argument("--layers", nargs=2, type=int, default=[1, 2], metavar=("A", "B"),
                    help="the two layer counts each point is measured at")
    ap.add_argument("--nf4", action="store_true", help="also each point with the base in NF4 (TRL: its QLoRA)")
    ap.add_argument("--sides", nargs="+", default=["ours", "trl"])
    ap.add_argument("--check-layers", action="store_true", help="first: 1, 2 and 4 layers of the first shape at the "
                                                                 "first length, and the linear fit's residual")
    ap.add_argument("--json", type=Path, default=None, help="write every point's figures here (appended as it goes)")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="memory-table-") as tmp:
        def model(shape: str, layers: int) -> Path:
            folder = Path(tmp) / f"{shape}-{layers}"
            if not folder.exists():
                benchmark.build_shape(shape, folder, layers)
            return folder

        if a.check_layers:
            shape, length = a.shapes[0], a.lengths[0]
            for side in a.sides:
                got = {n: point(shape, n, length, side, False, model(shape, n)) for n in (1, 2, 4)}
                slope = (got[4]["peak_mb"] - got[1]["peak_mb"]) / 3
                residual = got[2]["peak_mb"] - (got[1]["peak_mb"] + slope)
                peaks = ", ".join(f"{got[n]['peak_mb']:.0f}" for n in (1, 2, 4))
                print(f"# linearity, {side} {shape} at {length}: 1/2/4 layers {peaks} MB; 2 layers off the 1-4 line "
                      f"by {residual:+.0f} MB ({residual / got[2]['peak_mb']:+.1%})", flush=True)
        for shape in a.shapes:
            full = benchmark.SHAPES[shape][2]
            for length in a.lengths:
                for nf4 in ([False, True] if a.nf4 else [False]):
                    for side in a.sides:
                        la, lb = a.layers
                        pa = point(shape, la, length, side, nf4, model(shape, la))
                        pb = point(shape, lb, length, side, nf4, model(shape, lb))
                        row = {"shape": shape, "length": length, "nf4": nf4, "side": side, "layers": [la, lb],
                               "measured": [pa, pb], "full_layers": full,
                               "extrapolated_peak_mb": extrapolate(pa, pb, la, lb, full)}
                        rows.append(row)
                        print(f"{shape:>13} {length:>5} {'nf4 ' if nf4 else 'bf16'} {side:>4}: {la}/{lb} layers "
                              f"{pa['peak_mb']:.0f}/{pb['peak_mb']:.0f} MB (update {pb['phases'].get('update', 0):.0f}, "
                              f"rollout {pb['phases'].get('rollout', 0):.0f}), full {full} layers ~"
                              f"{row['extrapolated_peak_mb'] / 1024:.1f} GiB (extrapolated)", flush=True)
                        if a.json:
                            with open(a.json, "a") as f:
                                f.write(json.dumps(row) + "\n")
    print_table(rows)


def print_table(rows: list[dict]) -> None:
    """Each (shape, length): each side's extrapolated peak, ours/TRL, and the smallest card it fits."""
    def card(mb: float) -> str:
        need = mb * 2**20 / 0.9  # (10% left to the allocator)
        return next((f"{c} GB" for c in CARDS if need <= c * GB), "> 80 GB")

    by = {(r["shape"], r["length"], r["nf4"], r["side"]): r["extrapolated_peak_mb"] for r in rows}
    print("\n| shape | length | ours GiB | ours NF4 GiB | TRL GiB | TRL QLoRA GiB | ours/TRL | smallest card: ours, "
          "ours NF4, TRL |")
    print("|---|---|---|---|---|---|---|---|")
    for shape, length in sorted({(r["shape"], r["length"]) for r in rows}, key=lambda k: (benchmark.SHAPES[k[0]][0], k[1])):
        o, on, t, tn = (by.get((shape, length, nf4, side)) for nf4, side in
                        ((False, "ours"), (True, "ours"), (False, "trl"), (True, "trl")))
        fmt = lambda mb: f"{mb / 1024:.1f}" if mb else "-"  # noqa: E731
        ratio = f"{o / t:.2f}" if o and t else "-"
        cards = ", ".join(card(x) if x else "-" for x in (o, on, t))
        print(f"| {shape} | {length} | {fmt(o)} | {fmt(on)} | {fmt(t)} | {fmt(tn)} | {ratio} | {cards} |")


if __name__ == "__main__":
    main()
