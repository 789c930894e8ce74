"""Where a step's time goes: torch's profiler on one rollout and one update of a recipe, and the rollout's
tokens/s against a bound from the model's matmul FLOPs and this machine's measured matmul speed.

    python scripts/profile_step.py --config config/smollm2.yaml
    python scripts/profile_step.py --config config/smollm2.yaml --set model.dtype=float32 --top 15

Runs `--steps` steps of the recipe (the last one profiled: its rollout and its update, each a table of the
operators with the most time), then prints:
- the decode FLOPs per token: 2 x the parameters of every matmul a token passes through (the decoder's
  linear layers and the output head; the embedding lookup is no matmul) plus attention's 4 x layers x
  heads x head_dim x the mean context length;
- this machine's matmul speed in the model's compute dtype at the decode step's shapes (rows x hidden
  against each linear layer's weight), and the bound tokens/s = that speed / FLOPs per token: what the
  rollout would reach if it did nothing but its matmuls at that speed;
- the measured rollout tokens/s of the profiled step and its share of the bound;
- the decode's bandwidth floor: the weights and the rows' KV cache read once per token step at the device's
  measured copy speed, against the measured milliseconds per token step.
On a GPU the tables rank operators by their kernels' own CUDA time; `--trace FILE` writes the profiled
rollout as a Chrome trace.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def matmul_gflops(shapes: list[tuple[int, int, int, object]], threads: int, seconds: float = 1.0,
                  device: str = "cpu") -> float:
    """Achieved GFLOP/s over a list of (rows, in, out, dtype) matmuls, each run as x [rows, in] @ w.T [in, out]."""
    import torch

    torch.set_num_threads(threads)
    pairs = [(torch.randn(m, k, dtype=dt, device=device), torch.randn(n, k, dtype=dt, device=device))
             for m, k, n, dt in shapes]
    flops = sum(2 * m * k * n for m, k, n, _ in shapes)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for x, w in pairs:  # warm-up
        torch.nn.functional.linear(x, w)
    sync()
    reps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for x, w in pairs:
            torch.nn.functional.linear(x, w)
        reps += 1
        sync()
    return flops * reps / (time.perf_counter() - t0) / 1e9


def copy_gb_per_s(device: str) -> float:
    """The device's memory bandwidth as a copy of 1 GiB moves it (bytes read and written)."""
    import torch

    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    for _ in range(5):
        y.copy_(x)
    sync()
    return 5 * 2 * x.numel() / (time.perf_counter() - t0) / 1e9


def decode_shapes(model, rows: int) -> list[tuple[int, int, int, object]]:
    """(rows, in, out, compute dtype) of every Linear a decoded token passes through (LoRA merged into its
    base layer, as the rollout samples), the output head included (float32 under bf16-mixed)."""
    import torch

    from docuchat_rl.modeling import Float32Head

    mixed = getattr(model, "docuchat_mixed", False)
    out = []
    for name, m in model.named_modules():
        if isinstance(m, Float32Head):
            out.append((rows, m.in_features, m.out_features, torch.float32))
        elif isinstance(m, torch.nn.Linear) and "lora_" not in name:
            out.append((rows, m.in_features, m.out_features, torch.bfloat16 if mixed else m.weight.dtype))
    return out


def attention_flops(config, context: float) -> float:
    """QK^T and AV per token: 2 x 2 x heads x head_dim x context, per layer."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 4 * config.num_hidden_layers * config.num_attention_heads * head_dim * context


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=ROOT / "config/smollm2.yaml")
    ap.add_argument("--steps", type=int, default=3, help="steps run; the last is profiled")
    ap.add_argument("--top", type=int, default=12, help="operators shown per phase")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--trace", type=Path, default=None,
                    help="also write the profiled rollout's trace here (Chrome trace JSON: chrome://tracing, Perfetto)")
    a = ap.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from docuchat_rl import trainer as trainer_mod
    from docuchat_rl.config import load_config
    from docuchat_rl.modeling import base_model

    tables, phase_seconds = {}, {}
    gpu = torch.cuda.is_available()

    def profiled(name, fn):
        def wrapper(self, *args, **kwargs):
            if self.step + 1 < a.steps:
                return fn(self, *args, **kwargs)
            t0 = time.perf_counter()
            with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if gpu else [])]) as p:
                out = fn(self, *args, **kwargs)
                if gpu:
                    torch.cuda.synchronize()
            phase_seconds[name] = time.perf_counter() - t0
            # (on a GPU: by the kernels' own device time, the launch-bound decode's tell-tale beside the CPU's)
            tables[name] = p.key_averages().table(sort_by="self_cuda_time_total" if gpu else "self_cpu_time_total",
                                                  row_limit=a.top)
            if a.trace is not None and name.startswith("rollout"):
                p.export_chrome_trace(str(a.trace))
            return out
        return wrapper

    trainer_mod.Trainer.collect = profiled("rollout + score", trainer_mod.Trainer.collect)
    trainer_mod.Trainer.update = profiled("update", trainer_mod.Trainer.update)
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(a.config, [f"run.output_dir={out}", f"run.steps={a.steps}", "logging.progress=false",
                                     f"checkpoint.every={a.steps + 1}", "eval.before_and_after=false", "eval.every=null",
                                     *a.overrides])
        t = trainer_mod.Trainer(cfg)
        history = t.train()
        model = base_model(t.learner.model)
        prompt_ids = t.run.tokenizer(t.collector.prompt_texts[:64], add_special_tokens=False)["input_ids"]
        t.close()
    last = history[-1]
    for name, table in tables.items():
        print(f"\n== {name}: {phase_seconds[name]:.2f} s (profiled)\n{table}")
    rows = cfg.rollout.prompts_per_step * cfg.rollout.num_generations
    threads = cfg.run.threads or torch.get_num_threads()
    shapes = decode_shapes(model, rows)
    gflops = matmul_gflops(shapes, threads, device="cuda" if gpu else "cpu")
    matmul_flops = 2 * sum(k * n for _, k, n, _ in shapes)
    # a token attends to its prompt and the completion before it: half the completion on average
    mean_context = statistics.mean(map(len, prompt_ids)) + last["completion_len/mean"] / 2
    per_token = matmul_flops + attention_flops(model.config, mean_context)
    bound = gflops * 1e9 / per_token
    print(f"\nmodel: {type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, "
          f"model.dtype {cfg.model.dtype}, {threads} threads")
    print(f"decode FLOPs per token: {per_token / 1e6:.0f} MFLOP (matmuls {matmul_flops / 1e6:.0f}, "
          f"attention at a mean context of {mean_context:.0f} tokens {attention_flops(model.config, mean_context) / 1e6:.0f})")
    print(f"matmul speed at the decode shapes ({rows} rows): {gflops:.0f} GFLOP/s -> bound {bound:.0f} tokens/s")
    # the decode's floor: a token step reads every weight once and the rows' KV cache (at half the completion)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_bytes = (2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * rows * mean_context
                * next(model.parameters()).element_size())
    bandwidth = copy_gb_per_s("cuda" if gpu else "cpu")
    floor_ms = (weight_bytes + kv_bytes) / (bandwidth * 1e9) * 1e3
    new_tokens = cfg.rollout.max_new_tokens
    step_ms = last["time/rollout"] / new_tokens * 1e3
    print(f"decode floor: {weight_bytes / 1e9:.2f} GB of weights + {kv_bytes / 1e9:.2f} GB of KV cache at "
          f"{bandwidth:.0f} GB/s = {floor_ms:.2f} ms a token step; measured {step_ms:.2f} ms (the rollout's "
          f"seconds / {new_tokens} tokens, prefill included) = {step_ms / floor_ms:.0f}x the floor")
    measured = last["rollout_tokens_per_s"]
    print(f"measured rollout (step {last['step']}): {measured:.0f} tokens/s = {100 * measured / bound:.0f}% of the bound; "
          f"step phases: " + ", ".join(f"{k.removeprefix('time/')} {v:.2f} s" for k, v in last.items()
                                        if k.startswith("time/")))


if __name__ == "__main__":
    sys.exit(main())
