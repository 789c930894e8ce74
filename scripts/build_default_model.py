"""Build the embedded default model from nothing: a BPE tokenizer and a tiny Llama trained by SFT.

    python scripts/build_default_model.py [--out data/model] [--seed 0]
    python scripts/build_default_model.py --stage1 data/model     # redo stage 2 only

Stage 1 trains a byte-level BPE tokenizer (digits split into single characters; <think>/<answer> tags kept
as ordinary tokens so `skip_special_tokens=True` keeps them) and a ~2M-parameter Llama on the task's train
split, with worked completions `<think>…steps…</think><answer>N</answer>`. It evaluates greedy accuracy on
a validation split (disjoint from train and test) every `--eval-every` steps and stops at the first
evaluation inside the target band: the model is deliberately mediocre so RL has room to act.

Stage 2 is a short SFT on a mix of worked and answer-only targets (`<think>\n</think>` then the answer),
the answer-only share depending on the problem's length (`--answer-only SHORT LONG`: 2-step problems vs
3- and 4-step ones), as in SFT corpora that mix worked solutions with bare answers. The model comes out
answering most long problems without working, and mostly wrong: a habit that a correctness reward alone
can train away (the format reward accepts an empty think block, so it does not push either way). This is
what the embedded default demonstrates: RL teaching a small model to reason step by step, on a CPU, in
minutes. The card (card.json) records both stages and the held-out accuracy by problem length.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import time
from pathlib import Path

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from docuchat_rl.config import DEFAULT_SYSTEM_PROMPT
from docuchat_rl.data import reasoning_target, render_prompt
from docuchat_rl.sampling.generation import generate
from docuchat_rl.synthetic import make_split, make_task
from rewards.correctness import gold_of

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


def answer_only_target(answer: str) -> str:
    """A GSM8K answer as a completion without its working: an empty think block, then the answer.

    >>> answer_only_target("4 + 3 = <<4+3=7>>7\\n#### 7")
    '<think>\\n</think>\\n<answer>7</answer>'
    """
    return "<think>\n</think>\n<answer>" + gold_of(answer) + "</answer>"


def num_steps(p) -> int:
    """Operations in a problem's solution (its calculator annotations)."""
    return p.answer.count("<<")


def encode_batch(tok, batch, system_prompt, device, targets=None):
    """Right-padded prompt+target ids with labels only on the target (prompt and padding = -100).

    targets: completion texts, one per problem (default: the worked `reasoning_target`)."""
    rows, labels = [], []
    targets = targets or [reasoning_target(p.answer) for p in batch]
    for p, text in zip(batch, targets):
        prompt = tok(render_prompt(tok, p.question, system_prompt), add_special_tokens=False)["input_ids"]
        target = tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        rows.append(prompt + target)
        labels.append([-100] * len(prompt) + target)
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tok.pad_token_id)
    lab = torch.full((len(rows), width), -100)
    att = torch.zeros((len(rows), width), dtype=torch.long)
    for i, (r, l) in enumerate(zip(rows, labels)):
        ids[i, :len(r)], lab[i, :len(l)], att[i, :len(r)] = torch.tensor(r), torch.tensor(l), 1
    return ids.to(device), att.to(device), lab.to(device)


_EMPTY_THINK = re.compile(r"\s*<think>\s*</think>")


def greedy_report(model, tok, problems, system_prompt, max_new_tokens=96) -> dict:
    """Greedy accuracy (exact match of the <answer> content with the gold integer), format rate, and per
    solution length (2/3/4 steps): rows, accuracy and the share answered without working."""
    model.eval()
    prompts = [render_prompt(tok, p.question, system_prompt) for p in problems]
    gen = generate(model, tok, prompts, max_new_tokens=max_new_tokens, do_sample=False, batch_size=128)
    texts = tok.batch_decode(gen.completion_ids, skip_special_tokens=True)
    model.train()
    by: dict[int, list[int]] = {}
    correct = fmt = 0
    for p, t in zip(problems, texts):
        m = _ANSWER.search(t)
        ok = bool(m and m.group(1).strip() == gold_of(p.answer))
        fmt += bool(m and t.strip().startswith("<think>"))
        correct += ok
        row = by.setdefault(num_steps(p), [0, 0, 0])
        row[0], row[1], row[2] = row[0] + 1, row[1] + ok, row[2] + bool(_EMPTY_THINK.match(t))
    return {"accuracy": correct / len(problems), "format_rate": fmt / len(problems),
            "answer_only_rate": sum(r[2] for r in by.values()) / len(problems),
            "by_steps": {str(k): {"rows": n, "accuracy": round(c / n, 4), "answer_only_rate": round(e / n, 4)}
                         for k, (n, c, e) in sorted(by.items())}}


def stage1(a, tok, train, val, sp, t0) -> tuple[LlamaForCausalLM, dict]:
    """Worked-solution SFT from random weights until validation accuracy is inside the band."""
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=a.hidden, intermediate_size=a.ffn,
                      num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.heads,
                      max_position_embeddings=512, tie_word_embeddings=True,
                      bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = 50
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))
    rng = random.Random(a.seed)
    order: list = []
    history, n_tokens, step = [], 0, 0
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
            rep = greedy_report(model, tok, val, sp)
            val_acc = rep["accuracy"]
            history.append({"step": step, "val_accuracy": val_acc, "val_format": rep["format_rate"],
                            "minutes": round((time.time() - t0) / 60, 2)})
            print(f"  eval step {step}: val accuracy {val_acc:.3f} format {rep['format_rate']:.3f}", flush=True)
            if a.band[0] <= val_acc <= a.band[1]:
                break
            if val_acc > a.band[1]:
                raise SystemExit(f"overshot the band at step {step} ({val_acc:.3f}); evaluate more often")
    # Stage 2 starts from the weights as saved (float16), so that `--stage1 PATH` gives the same model.
    model.to(torch.float16).to(torch.float32)
    return model, {"batch": a.batch, "lr": a.lr, "warmup": warmup, "steps": step, "train_tokens": n_tokens,
                   "stop_rule": f"first validation accuracy in {list(a.band)} (200 validation problems, greedy)",
                   "validation_curve": history, "minutes": round((time.time() - t0) / 60, 2)}


def stage2(a, model, tok, train, val, sp) -> dict:
    """Short SFT on worked and answer-only targets mixed by problem length; constant lr, fresh AdamW."""
    t0 = time.time()
    short, long_ = a.answer_only
    opt = torch.optim.AdamW(model.parameters(), lr=a.stage2_lr, weight_decay=0.01, betas=(0.9, 0.98))
    order_rng, mix_rng = random.Random(a.seed + 1), random.Random(a.seed + 2)
    order: list = []
    n_tokens = n_bare = 0
    model.train()
    for step in range(1, a.stage2_steps + 1):
        if len(order) < a.batch:
            order = train[:]
            order_rng.shuffle(order)
        batch, order = order[:a.batch], order[a.batch:]
        bare = [mix_rng.random() < (short if num_steps(p) == 2 else long_) for p in batch]
        targets = [answer_only_target(p.answer) if b else reasoning_target(p.answer) for p, b in zip(batch, bare)]
        ids, att, lab = encode_batch(tok, batch, sp, "cpu", targets)
        loss = model(input_ids=ids, attention_mask=att, labels=lab).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        n_tokens, n_bare = n_tokens + int(att.sum()), n_bare + sum(bare)
        if step % 50 == 0:
            print(f"stage 2 step {step} loss {loss.item():.3f} min {(time.time() - t0) / 60:.1f}", flush=True)
    rep = greedy_report(model, tok, val, sp)
    print(f"  stage 2 val accuracy {rep['accuracy']:.3f} answer-only {rep['answer_only_rate']:.3f}", flush=True)
    return {"batch": a.batch, "lr": a.stage2_lr, "steps": a.stage2_steps, "train_tokens": n_tokens,
            "answer_only_probability": {"2 steps": short, "3-4 steps": long_},
            "answer_only_targets": n_bare, "targets": a.stage2_steps * a.batch,
            "validation": rep, "minutes": round((time.time() - t0) / 60, 2)}


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
                    help="stage 1 stops at the first validation accuracy inside this band")
    ap.add_argument("--stage1", type=Path, default=None,
                    help="start stage 2 from this stage-1 model (its folder, with card.json) instead of training one")
    ap.add_argument("--stage2-steps", type=int, default=150)
    ap.add_argument("--stage2-lr", type=float, default=3e-4)
    ap.add_argument("--answer-only", type=float, nargs=2, default=(0.15, 0.85), metavar=("SHORT", "LONG"),
                    help="stage 2: probability of an answer-only target for 2-step / 3- and 4-step problems")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    if not all(0.0 <= x <= 1.0 for x in a.answer_only):
        ap.error(f"--answer-only: probabilities must be in [0, 1], got {a.answer_only}")

    t0 = time.time()
    torch.manual_seed(a.seed)
    random.seed(a.seed)
    torch.set_num_threads(a.threads)
    splits = make_task(a.task_seed)
    train, test = splits["train"], splits["test"]
    val = make_split(a.task_seed + 2, 200, exclude={p.question for p in train + test})
    sp = DEFAULT_SYSTEM_PROMPT

    from docuchat_rl.modeling import load_model_and_tokenizer
    if a.stage1 is not None:
        model, tok = load_model_and_tokenizer(str(a.stage1), dtype="float32")
        prev = json.loads((a.stage1 / "card.json").read_text())
        s1 = dict(prev.get("stage1") or {k: prev[k] for k in ("batch", "lr", "steps", "train_tokens", "stop_rule",
                                                              "validation_curve", "build_minutes")})
        s1["loaded_from"] = str(a.stage1)
    else:
        corpus = [sp] + [p.question for p in train] + [reasoning_target(p.answer) for p in train]
        tok = build_tokenizer(corpus, a.vocab)
        model, s1 = stage1(a, tok, train, val, sp, t0)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"tokenizer vocab {len(tok)}; model {n_params / 1e6:.2f}M parameters", flush=True)
    s2 = stage2(a, model, tok, train, val, sp)

    a.out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                                               bos_token_id=None, do_sample=False)
    model.to(torch.float16).save_pretrained(a.out, safe_serialization=True)
    tok.save_pretrained(a.out)

    # Re-measure on the held-out test split from the saved files, as a user would load them.
    saved, saved_tok = load_model_and_tokenizer(str(a.out), dtype="float32")
    rep = greedy_report(saved, saved_tok, test, sp)
    minutes = (time.time() - t0) / 60
    card = {
        "name": "docuchat-rl tiny default", "architecture": "LlamaForCausalLM", "parameters": n_params,
        "config": {k: getattr(a, k) for k in ("hidden", "layers", "heads", "ffn", "vocab")},
        "tokenizer": "byte-level BPE, digits split, <think>/<answer> as ordinary tokens",
        "seed": a.seed, "task_seed": a.task_seed, "train_rows": len(train),
        "stage1": s1, "stage2": s2, "build_minutes": round(minutes, 2), "saved_dtype": "float16",
        "heldout": {"split": "data/task/test.jsonl", "rows": len(test), "greedy_accuracy": rep["accuracy"],
                    "format_rate": rep["format_rate"], "answer_only_rate": rep["answer_only_rate"],
                    "by_steps": rep["by_steps"], "max_new_tokens": 96, "system_prompt": sp},
        "built_with": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
    }
    (a.out / "card.json").write_text(json.dumps(card, indent=2) + "\n")
    print(json.dumps(card["heldout"], indent=2), f"\nbuilt in {minutes:.1f} min", flush=True)


if __name__ == "__main__":
    main()
