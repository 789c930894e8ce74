"""Evaluation: greedy accuracy, pass@k by sampling, mean of each reward component, format rate, length.

Accuracy is the raw score of the `rewards.accuracy_component` reward (correctness by default) on the
greedy completion; the format rate is the share of greedy completions with a format score of 1 when a
`format` component is configured (strict format otherwise). pass@k is the share of prompts with at least
one correct completion among k samples (k samples per prompt, so the unbiased estimator is this share).
The rewards receive the same inputs as in training (`data.reward_inputs`: the data set's columns,
answer, completion_tokens, truncated, prompt_id), so a custom reward that reads a column scores here too.

Deliberately left out: majority voting (maj@k) and per-difficulty breakdowns.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np
import torch

from rewards import CompositeReward

from .config import Config
from .data import Example, load_examples, render_prompt
from .generation import generate
from .modeling import merged_adapter
from .rollout import score


def evaluate(model, tokenizer, cfg: Config, examples: list[Example] | None = None) -> dict:
    e = cfg.eval
    if examples is None:
        if not cfg.data.test:
            raise ValueError("data.test is null: nothing to evaluate on")
        examples = load_examples(cfg.data.test, cfg.data.test_split, cfg.data.prompt_column,
                                 cfg.data.answer_column, limit=e.limit, revision=cfg.data.revision,
                                 subset=cfg.data.subset)
    specs = [c.model_dump() for c in cfg.rewards.components]
    if "format" not in {s["name"] for s in specs}:
        specs.append({"name": "format", "weight": 0.0})
    reward = CompositeReward(specs, strict=cfg.rewards.strict, timeout_s=cfg.rewards.timeout_s)
    acc_name = cfg.rewards.accuracy_component
    prompts = [render_prompt(tokenizer, x.question, cfg.data.system_prompt) for x in examples]
    max_new = e.max_new_tokens or cfg.rollout.max_new_tokens
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    engine = cfg.rollout.engine

    def merged():  # a fresh context each time: one sampling pass per `with`
        return merged_adapter(model) if cfg.rollout.merge_adapter else contextlib.nullcontext()

    with merged():
        gen = generate(model, tokenizer, prompts, max_new_tokens=max_new, do_sample=False,
                       batch_size=e.batch_size, engine=engine)
    texts = tokenizer.batch_decode(gen.completion_ids, skip_special_tokens=True)
    res = score(reward, examples, texts, gen)
    out: dict = {"rows": len(examples), "max_new_tokens": max_new}
    for name in reward.names:
        vals = [r.components[name].raw for r in res.records if r.components[name].raw is not None]
        out[f"{name}/mean"] = float(np.mean(vals)) if vals else None
    if acc_name in reward.names:
        out["accuracy"] = out[f"{acc_name}/mean"]
    out["format_rate"] = out["format/mean"]
    out["completion_len/mean"] = float(np.mean([len(c) for c in gen.completion_ids]))
    out["truncated_frac"] = float(np.mean(gen.truncated))
    if e.pass_k and acc_name in reward.names:
        with torch.random.fork_rng(), merged():  # eval must not shift the training run's random stream
            torch.manual_seed(cfg.run.seed)
            sgen = generate(model, tokenizer, prompts, max_new_tokens=max_new, do_sample=True,
                            temperature=cfg.rollout.temperature, top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k,
                            batch_size=e.batch_size, num_return_sequences=e.pass_k, engine=engine)
        stexts = tokenizer.batch_decode(sgen.completion_ids, skip_special_tokens=True)
        k = e.pass_k
        sres = score(reward, [x for x in examples for _ in range(k)], stexts, sgen)
        hits = np.array([r.components[acc_name].raw or 0.0 for r in sres.records]).reshape(-1, k)
        out[f"pass@{k}"] = float((hits.max(axis=1) > 0).mean())
        out[f"mean@{k}"] = float(hits.mean())
    out["seconds"] = round(time.perf_counter() - t0, 2)
    model.train(was_training)
    return out
