"""Build the embedded default model from nothing: a BPE tokenizer and a tiny Llama trained by SFT.

    python scripts/build_default_model.py [--out data/model] [--seed 0]

Trains a byte-level BPE tokenizer (digits split into single characters; <think>/<answer> tags kept as
ordinary tokens so `skip_special_tokens=True` keeps them) and a ~2M-parameter Llama on the task's train
split, with completions `<think>…steps…</think><answer>N</answer>`. It evaluates greedy accuracy on a
validation split (disjoint from train and test) every `--eval-every` steps and stops at the first
evaluation inside the target band: the shipped model is deliberately mediocre so RL has room to act.
The card (card.json) records how it was built and its accuracy on the held-out test split.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from tokenizers import AddedToken
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from docuchat_rl.data import DEFAULT_SYSTEM_PROMPT, gsm8k_gold, reasoning_target, render_prompt
from docuchat_rl.generation import generate
from docuchat_rl.synthetic import make_split, make_task

SPECIAL = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
TAGS = ["<think>", "</think>", "<answer>", "</answer>"]
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


def build_tokenizer(texts: list[str], vocab_size: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in TAGS])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|pad|>",
                                   unk_token=None, bos_token=None,
                                   additional_special_tokens=["<|endoftext|>", "<|im_start|>"])
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 512
    return fast


def encode_batch(tok, batch, system_prompt, device):
    """Right-padded prompt+target ids with labels only on the target (prompt and padding = -100)."""
    rows, labels = [], []
    for p in batch:
        prompt = tok(render_prompt(tok, p.question, system_prompt), add_special_tokens=False)["input_ids"]
        target = tok(reasoning_target(p.answer), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append(prompt + target)
        labels.append([-100] * len(prompt) + target)
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tok.pad_token_id)
    lab = torch.full((len(rows), width), -100)
    att = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r, l) in enumerate(zip(rows, labels)):
        ids[i, :len(r)], lab[i, :len(l)], att[i, :len(r)] = torch.tensor(r), torch.tensor(l), 1
    return ids.to(device), att.to(device), lab.to(device)


def greedy_accuracy(model, tok, problems, system_prompt, max_new_tokens=96) -> tuple[float, float]:
    """(accuracy, format rate): exact match of the <answer> content with the gold integer."""
    model.eval()
    prompts = [render_prompt(tok, p.question, system_prompt) for p in problems]
    gen = generate(model, tok, prompts, max_new_tokens=max_new_tokens, do_sample=False, batch_size=128)
    texts = tok.batch_decode(gen.completion_ids, skip_special_tokens=True)
    correct = fmt = 0
    for p, t in zip(problems, texts):
        m = _ANSWER.search(t)
        fmt += bool(m and t.strip().startswith("<think>"))
        correct += bool(m and m.group(1).strip() == gsm8k_gold(p.answer))
    model.train()
    return correct / len(problems), fmt / len(problems)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("data/model"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--task-seed", type=int, default=1234, help="seed of scripts/make_task_data.py")
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--ffn", type=int, default=512)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--max-steps", type=int, default=3000)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--eval-from", type=int, default=200)
    ap.add_argument("--band", type=float, nargs=2, default=(0.40, 0.50),
                    help="stop at the first validation accuracy inside this band")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()

    t0 = time.time()
    torch.manual_seed(a.seed)
    random.seed(a.seed)
    torch.set_num_threads(a.threads)
    splits = make_task(a.task_seed)
    train, test = splits["train"], splits["test"]
    val = make_split(a.task_seed + 2, 200, exclude={p.question for p in train + test})
    sp = DEFAULT_SYSTEM_PROMPT

    corpus = [sp] + [p.question for p in train] + [reasoning_target(p.answer) for p in train]
    tok = build_tokenizer(corpus, a.vocab)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=a.hidden, intermediate_size=a.ffn,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.heads,
                      max_position_embeddings=512, tie_word_embeddings=True,
                      bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tokenizer vocab {len(tok)}; model {n_params / 1e6:.2f}M parameters", flush=True)

    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = 50
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    rng = random.Random(a.seed)
    order: list = []
    history, n_tokens, step, val_acc = [], 0, 0, 0.0
    model.train()
    while step < a.max_steps:
        if len(order) < a.batch:
            order = train[:]
            rng.shuffle(order)
        batch, order = order[:a.batch], order[a.batch:]
        ids, att, lab = encode_batch(tok, batch, sp, "cpu")
        loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        n_tokens += int(att.sum())
        if step % 50 == 0:
            el = time.time() - t0
            print(f"step {step} loss {loss.item():.3f} tokens/s {n_tokens / el:.0f} min {el / 60:.1f}", flush=True)
        if step >= a.eval_from and step % a.eval_every == 0:
            val_acc, val_fmt = greedy_accuracy(model, tok, val, sp)
            history.append({"step": step, "val_accuracy": val_acc, "val_format": val_fmt,
                            "minutes": round((time.time() - t0) / 60, 2)})
            print(f"  eval step {step}: val accuracy {val_acc:.3f} format {val_fmt:.3f}", flush=True)
            if a.band[0] <= val_acc <= a.band[1]:
                break
            if val_acc > a.band[1]:
                raise SystemExit(f"overshot the band at step {step} ({val_acc:.3f}); evaluate more often")

    a.out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                               bos_token_id=None, do_sample=False)
    model.to(torch.float16).save_pretrained(a.out, safe_serialization=True)
    tok.save_pretrained(a.out)

    # Re-measure on the held-out test split from the saved files, as a user would load them.
    from docuchat_rl.modeling import load_model_and_tokenizer
    saved, saved_tok = load_model_and_tokenizer(str(a.out), dtype="float32")
    acc, fmt = greedy_accuracy(saved, saved_tok, test, sp)
    minutes = (time.time() - t0) / 60
    card = {
        "name": "docuchat-rl tiny default", "architecture": "LlamaForCausalLM", "parameters": n_params,
        "config": {k: getattr(a, k) for k in ("hidden", "layers", "heads", "ffn", "vocab")},
        "tokenizer": "byte-level BPE, digits split, <think>/<answer> as ordinary tokens",
        "seed": a.seed, "task_seed": a.task_seed, "train_rows": len(train), "batch": a.batch, "lr": a.lr,
        "steps": step, "train_tokens": n_tokens, "build_minutes": round(minutes, 2),
        "stop_rule": f"first validation accuracy in {list(a.band)} (200 validation problems, greedy)",
        "validation_curve": history, "saved_dtype": "float16",
        "heldout": {"split": "data/task/test.jsonl", "rows": len(test), "greedy_accuracy": acc,
                    "format_rate": fmt, "max_new_tokens": 96, "system_prompt": sp},
        "built_with": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
    }
    (a.out / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    print(json.dumps(card["heldout"], indent=2), f"\nbuilt in {minutes:.1f} min", flush=True)


if __name__ == "__main__":
    main()
