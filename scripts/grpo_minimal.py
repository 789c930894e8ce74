"""One GRPO step on one screen: what `docuchat-rl train` computes in its first step, top to bottom.

    python scripts/grpo_minimal.py                          # the embedded default (config/default.yaml)
    python scripts/grpo_minimal.py --config config/smollm2.yaml --set rollout.prompts_per_step=2

Sample a group of completions per prompt, score them, normalise the rewards within each group, take the
clipped surrogate of every completion token, average, backward. It uses the project's own functions, so
its loss and gradients are the trainer's (tests/test_grpo_minimal.py checks them against `Trainer`'s first
step). What it leaves out, all of which the trainer does (README "Code map" says where):
- the optimizer step, checkpoints, traces, metrics, evaluation; and every step after the first;
- several processes, minibatches and micro-batches (the whole batch is one forward and one backward);
- GRPO's other knobs: only the plain recipe runs here (clipped surrogate, one update per rollout so the
  ratio is 1, `loss_aggregation: grpo`, no KL, no entropy bonus, no sampler correction, every group used);
- the speed switches (shared-prompt forward, length buckets, fused LoRA, merged-adapter sampling): the
  same numbers computed faster.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from docuchat_rl.config import load_config  # noqa: E402
from docuchat_rl.data import PromptSampler, load_split, render_prompt  # noqa: E402
from docuchat_rl.learning.advantages import group_advantages  # noqa: E402
from docuchat_rl.learning.batch import build_batch  # noqa: E402
from docuchat_rl.learning.forward import policy_forward  # noqa: E402
from docuchat_rl.learning.losses import Normalisers, aggregate, clipped_surrogate  # noqa: E402
from docuchat_rl.modeling import build_lora, disable_dropout, load_model_and_tokenizer  # noqa: E402
from docuchat_rl.sampling.generation import generate, row_seed  # noqa: E402
from docuchat_rl.sampling.scoring import build_reward, score  # noqa: E402

PLAIN = {"surrogate": "clip", "num_iterations": 1, "loss_aggregation": "grpo", "beta": 0.0, "ent_coef": 0.0,
         "multi_objective_aggregation": "sum_then_normalize", "ratio_level": "token", "delta": None,
         "top_entropy_quantile": 1.0, "off_policy_mask_threshold": None}


def grpo_step(cfg) -> dict:
    """The first GRPO step of `cfg`'s run: -> its loss, rewards, advantages and the LoRA gradients by name."""
    a, r = cfg.algorithm, cfg.rollout
    changed = {k: getattr(a, k) for k, v in PLAIN.items() if getattr(a, k, v) != v}
    if a.name != "grpo" or changed or r.correction != "none" or r.dynamic_sampling or cfg.minibatch_rows != r.batch_rows:
        raise SystemExit(f"grpo_minimal runs the plain GRPO recipe only; this config sets {changed or a.name}")
    torch.manual_seed(cfg.run.seed)  # (as the trainer: the LoRA A matrices are drawn from it)

    # the policy: the base model, its dropout off (rollouts sample in eval mode), a fresh LoRA adapter
    model, tok = load_model_and_tokenizer(cfg.model.name_or_path, "float32", "cpu")
    disable_dropout(model)
    model = build_lora(model, cfg.lora)

    # 1. rollout: P prompts in the run's data order, G completions each, every row from its own seed
    examples = load_split(cfg.data, "train")
    rows = PromptSampler(len(examples), cfg.run.seed).take(r.prompts_per_step)
    P, G = len(rows), r.num_generations
    prompts = [render_prompt(tok, examples[i].question, cfg.data.system_prompt, examples[i].messages) for i in rows]
    seeds = [row_seed(cfg.run.seed, 1, slot, s) for slot in range(P) for s in range(G)]  # step 1
    model.eval()
    with torch.no_grad():
        gen = generate(model, tok, prompts, max_new_tokens=r.max_new_tokens, do_sample=True,
                       temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, num_return_sequences=G,
                       min_new_tokens=r.min_new_tokens, row_seeds=seeds)  # rows prompt-major: [P * G]
    texts = tok.batch_decode(gen.completion_ids, skip_special_tokens=True)

    # 2. score: every reward component on every completion; the total is their weighted sum
    reward = build_reward(cfg.rewards)
    records = score(reward, [examples[i] for i in rows for _ in range(G)], texts, gen).records
    group = [p for p in range(P) for _ in range(G)]
    batch = build_batch(gen.prompt_ids, gen.completion_ids, [rec.total for rec in records], group, tok.pad_token_id,
                        reward_valid=[not rec.total_missing for rec in records])

    # 3. advantages: A_i = (r_i - mean of its group) / (std of its group + eps), the same for every token
    adv, _ = group_advantages(batch.rewards, batch.group, a.scale, a.std_epsilon, valid=batch.reward_valid)  # [R]
    mask = batch.completion_mask  # [R, T]: 1 on the completion's tokens
    advantages = adv.unsqueeze(-1) * mask  # [R, T]

    # 4. the loss: per token -min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A) with rho = pi / pi_old;
    # one update per rollout, so pi_old is pi itself, detached (rho = 1, the gradient is A * grad log pi)
    model.train()
    logps = policy_forward(model, batch, temperature=r.temperature, top_k=r.top_k, top_p=r.top_p).logps  # [R, T]
    log_rho = logps - logps.detach()  # [R, T]: 0
    per_token, _, _ = clipped_surrogate(log_rho, advantages, a.epsilon_low, a.epsilon_high)  # [R, T]
    # the mean over completions of each completion's token mean ("grpo" aggregation)
    norm = Normalisers(rows=batch.rows, tokens=float(mask.sum()), max_new_tokens=r.max_new_tokens)
    loss = aggregate(per_token, mask, "grpo", norm)

    # 5. backward: the LoRA matrices get their gradients (the base weights are frozen)
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return {"loss": float(loss.detach()), "rewards": batch.rewards.tolist(), "advantages": adv.tolist(), "grads": grads,
            "texts": texts}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="config/default.yaml")
    ap.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = ap.parse_args()
    out = grpo_step(load_config(args.config, args.overrides))
    grad_norm = torch.sqrt(sum((g.double() ** 2).sum() for g in out["grads"].values()))
    rewards = torch.tensor(out["rewards"])
    print(f"completions {len(out['texts'])}, mean reward {rewards.mean():.4f}, loss {out['loss']:.1e} (at ratio 1 "
          "the loss is minus the mean advantage, which the group normalisation makes 0; its gradient is not), "
          f"LoRA gradient norm {grad_norm:.6f} over {len(out['grads'])} matrices")
    print(f"first completion: {out['texts'][0]!r} (reward {out['rewards'][0]:.3f}, advantage "
          f"{out['advantages'][0]:.3f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
