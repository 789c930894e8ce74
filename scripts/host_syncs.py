"""Host syncs (tensor -> Python reads, each a full stop on a GPU) per decoded token and per micro-batch.

    python scripts/host_syncs.py

Decode: conversions per decoded token of `generate` (fast engine, fixed length, 4 rows), on the default
model and on a 24-layer tiny Llama, from the difference between 48 and 16 new tokens (set-up and
read-out cancel). Update: conversions in one `Trainer.update` (2 prompts x 8 completions, mu 2) with 1 and
with 8 micro-batches per optimizer step, all of them and those made by docuchat_rl's own code, and the
extra per added micro-batch. Counted by `docuchat_rl.diagnostics.count_host_reads` (tests/test_syncs.py
asserts the bounds).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from docuchat_rl.diagnostics import count_host_reads

ROOT = Path(__file__).resolve().parents[1]
def decode_per_token(model, tok) -> float:
    from docuchat_rl.sampling.generation import generate

    prompts = ["What is 2 + 2?", "Ben has 5 coins. Ben loses 2 coins. How many coins does Ben have now?"]
    n = {}
    for tokens in (16, 48):
        with count_host_reads() as reads:
            generate(model, tok, prompts, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=True,
                     num_return_sequences=2, row_seeds=list(range(4)))
        n[tokens] = reads.all
    return (n[48] - n[16]) / 32


def update_counts(micro: int) -> dict:
    from docuchat_rl.config import load_config
    from docuchat_rl.trainer import Timer, Trainer

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(ROOT / "config/default.yaml", [
            f"run.output_dir={out}", "rollout.prompts_per_step=2", "rollout.num_generations=8",
            "rollout.max_new_tokens=16", "logging.progress=false", "eval.before_and_after=false",
            f"optim.micro_batch_size={micro}", "algorithm.num_iterations=2"])
        t = Trainer(cfg)
        batch = t.prepare(t.collect(Timer()))
        t.advantages(batch, Timer())
        with count_host_reads() as reads:
            t.update(batch, Timer())
        t.close()
    return {"all": reads.all, "ours": reads.ours}


def main() -> None:
    import transformers as tf

    from docuchat_rl.modeling import load_model_and_tokenizer

    torch.manual_seed(0)
    model, tok = load_model_and_tokenizer(str(ROOT / "data/model"), "float32", "cpu")
    tiny24 = tf.LlamaForCausalLM(tf.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=24, num_attention_heads=4)).eval()
    print(f"decode, conversions per decoded token: default model (4 layers) {decode_per_token(model, tok):.3f}, "
          f"24-layer tiny Llama {decode_per_token(tiny24, tok):.3f}")
    one, eight = update_counts(16), update_counts(2)
    print("update (2 optimizer steps), conversions: "
          f"1 micro-batch per step: {one['all']} ({one['ours']} ours); "
          f"8 micro-batches per step: {eight['all']} ({eight['ours']} ours); "
          f"per added micro-batch: {(eight['all'] - one['all']) / 14:.2f} ({(eight['ours'] - one['ours']) / 14:.2f} ours)")


if __name__ == "__main__":
    main()
