"""Two speed switches measured in isolation on a recipe's model, loaded once, the variants interleaved:
a whole step's noise on this machine (+-6% between runs) hides what a switch worth a few percent does.

    python scripts/switch_ab.py --config config/smollm2.yaml

- `rollout.grouped_decode`: one rollout of 4 prompts x `rollout.num_generations` completions (the
  recipe's sampling settings, the same row seeds on and off, so the same tokens) with the grouped step
  and with the model's own forward;
- `lora.fused`: a forward and backward of the decoder over a micro-batch of random token ids
  (`optim.micro_batch_size` rows x `--tokens`), peft's LoRA layers against the fused ones (the same
  adapter weights).
Prints each repeat and the medians. `scripts/benchmark.py --switches` measures whole steps.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="config/smollm2.yaml")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=230, help="tokens per row of the update's micro-batch")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()

    import torch

    from docuchat_rl.config import load_config
    from docuchat_rl.data import load_split, render_prompt
    from docuchat_rl.learning.fused_lora import fuse_lora
    from docuchat_rl.modeling import build_lora, load_model_and_tokenizer
    from docuchat_rl.sampling.generation import generate

    torch.set_num_threads(a.threads)
    cfg = load_config(a.config).for_device("cpu")
    r = cfg.rollout
    model, tok = load_model_and_tokenizer(cfg.model.name_or_path, "float32", "cpu")
    model.eval()
    rows = load_split(cfg.data, "train", limit=4 * a.repeats)

    times: dict[str, list[float]] = {"grouped on": [], "grouped off": [], "peft LoRA": [], "fused LoRA": []}
    for rep in range(a.repeats):
        prompts = [render_prompt(tok, e.question, cfg.data.system_prompt) for e in rows[4 * rep: 4 * rep + 4]]
        seeds = list(range(1000 * rep, 1000 * rep + 4 * r.num_generations))
        for flag in ((True, False) if rep % 2 == 0 else (False, True)):
            t = time.perf_counter()
            g = generate(model, tok, prompts, max_new_tokens=r.max_new_tokens, do_sample=True,
                         temperature=r.temperature, top_k=r.top_k, top_p=r.top_p,
                         num_return_sequences=r.num_generations, loop="fast", row_seeds=seeds, grouped_decode=flag)
            key = f"grouped {'on' if flag else 'off'}"
            times[key].append(time.perf_counter() - t)
            print(f"rollout {rep} {key}: {times[key][-1]:.2f} s, {sum(map(len, g.completion_ids))} tokens", flush=True)

    plain = build_lora(model, cfg.lora)
    for name, p in plain.named_parameters():
        if "lora_B" in name:  # (peft starts B at zero; a trained adapter's B is not)
            torch.nn.init.normal_(p, 0, 0.01)
    fused = copy.deepcopy(plain)
    fuse_lora(fused)
    plain.train(), fused.train()
    ids = torch.randint(0, len(tok), (cfg.optim.micro_batch_size, a.tokens))  # [rows, T]
    for rep in range(a.repeats):
        pair = [("peft LoRA", plain), ("fused LoRA", fused)]
        for name, m in (pair if rep % 2 == 0 else pair[::-1]):
            t = time.perf_counter()
            hidden = m.get_base_model().model(input_ids=ids).last_hidden_state  # [rows, T, H]
            hidden.pow(2).mean().backward()
            times[name].append(time.perf_counter() - t)
            m.zero_grad(set_to_none=True)
            print(f"update {rep} {name}: {times[name][-1]:.2f} s", flush=True)

    print(f"{a.config}, {a.repeats} interleaved repeats, {a.threads} threads (medians):")
    for name, ts in times.items():
        print(f"  {name:<12} {statistics.median(ts):6.2f} s   (runs {min(ts):.2f}-{max(ts):.2f})")


if __name__ == "__main__":
    main()
