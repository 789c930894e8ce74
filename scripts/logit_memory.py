"""Peak memory and time of one training forward + backward, and of one no-grad scoring pass (the old
log-probs / reference pass), with and without chunked log-probs.

    python scripts/logit_memory.py                    # 8 rows x 256 completion tokens, vocab 151,936
    python scripts/logit_memory.py --rows 16 --tokens 512 --chunks 0 1024 4096 --layers 24
    python scripts/logit_memory.py --layers 24 --checkpointing   # activation checkpointing in the train pass

A random small Qwen2-shaped model with Qwen2.5's 151,936-token vocabulary (`--hidden` 64 and `--layers` 2 by
default: the logits dominate, as they do for a 0.5B model at these lengths; more and wider layers show
what the layers' own activations cost), LoRA on q/v projections, one
`policy_forward` with the diagnostic entropy. Each measurement runs in its own process, so each peak
resident memory is its own (CPU; on a GPU the same script reports torch.cuda.max_memory_allocated).
`--chunks 0` is the whole-tensor path ([rows, T, V] float32 logits).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time


def worker(a) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from docuchat_rl.learning.batch import build_batch
    from docuchat_rl.learning.forward import policy_forward

    torch.manual_seed(0)
    dev = torch.device(a.device)
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=151_936, hidden_size=a.hidden, intermediate_size=2 * a.hidden,
                                         num_hidden_layers=a.layers, num_attention_heads=4, num_key_value_heads=2,
                                         tie_word_embeddings=True, max_position_embeddings=4096)).to(dev)
    pm = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                          task_type="CAUSAL_LM"))
    if a.checkpointing:
        pm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        pm.enable_input_require_grads()
    pm.train(a.mode == "train")
    gen = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 151_936, (a.rows, 32), generator=gen).tolist()
    comps = torch.randint(0, 151_936, (a.rows, a.tokens), generator=gen).tolist()
    batch = build_batch(prompts, comps, [0.0] * a.rows, list(range(a.rows)), 0).to(dev)
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    base_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    t0 = time.perf_counter()
    with torch.set_grad_enabled(a.mode == "train"):
        out = policy_forward(pm, batch, with_entropy=True, logit_chunk=a.chunk)
        if a.mode == "train":
            (out.logps * batch.completion_mask).sum().backward()
    if dev.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    peak = (torch.cuda.max_memory_allocated() / 2**20 if dev.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - base_rss)
    return {"chunk": a.chunk, "mode": a.mode, "peak_mb": round(peak, 1), "seconds": round(seconds, 3),
            "logits_mb_unchunked": round(a.rows * a.tokens * 151_936 * 4 / 2**20, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--chunks", type=int, nargs="+", default=[0, 4096, 1024])
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing (train pass)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--chunk", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=["train", "no-grad"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.chunk is not None:
        print(json.dumps(worker(a)))
        return
    print(f"{a.rows} rows x {a.tokens} completion tokens, vocab 151,936, {a.layers} layers of {a.hidden}, {a.device}"
          f"{', activation checkpointing' if a.checkpointing else ''}")
    print(f"{'logit_chunk':>12} {'train peak MB':>14} {'train s':>8} {'no-grad peak MB':>16} {'no-grad s':>10}")
    for chunk in a.chunks:
        res = {}
        for mode in ("train", "no-grad"):
            cmd = [sys.executable, __file__, "--rows", str(a.rows), "--tokens", str(a.tokens), "--device", a.device,
                   "--layers", str(a.layers), "--hidden", str(a.hidden), "--chunk", str(chunk), "--mode", mode,
                   *(["--checkpointing"] if a.checkpointing else [])]
            res[mode] = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.splitlines()[-1])
        print(f"{chunk or 'off':>12} {res['train']['peak_mb']:>14.1f} {res['train']['seconds']:>8.3f} "
              f"{res['no-grad']['peak_mb']:>16.1f} {res['no-grad']['seconds']:>10.3f}")
    res = res["train"]
    print(f"(the unchunked float32 logits alone are {res['logits_mb_unchunked']:.0f} MB)")


if __name__ == "__main__":
    main()
