"""Every GRPO loss type and knob of TRL 1.16 against TRL's own code, on the same tensors.

Each case builds a real `trl.GRPOTrainer` (the committed tiny model, TRL's settings for the case), lets it
generate and score a batch with its own `_generate_and_score_completions` (two reward functions, one of
which returns None for some completions), and computes TRL's loss with its `_compute_loss` after giving
it rollout-time log-probs that differ from the current ones (so ratios, clips and masks bind). Our GRPO
algorithm then computes its advantages from the same rewards and its loss on the same model and tokens;
loss and gradients must agree to float tolerance. Where we deliberately differ, the case says how and
checks the documented relation instead.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from .conftest import MODEL

G = 4  # completions per prompt
MAX_NEW = 40  # (some completions end within it, some are cut: mask_truncated_completions has both kinds)
PROMPTS = [[{"role": "user", "content": f"Omar has {i} books. Omar buys {i + 1} more books. "
                                        "How many books does Omar have now?"}] for i in range(1, 5)]
# (prompts of one token length: TRL's training forward passes no position ids, ours derives them from
# the attention mask; with left padding the two would differ, which is not what this file tests)


def _text(completion) -> str:
    return completion[0]["content"] if isinstance(completion, list) else completion


def length_mod(completions, **kwargs):
    return [float(len(_text(c)) % 3) for c in completions]


def says_nine(completions, **kwargs):
    return [None if len(_text(c)) % 5 == 0 else float("9" in _text(c)) for c in completions]


WEIGHTS = (1.0, 0.5)


def trl_run(tmp_path, **trl_args):
    """A real GRPOTrainer's batch (TRL's generation, rewards and advantages) -> (trainer, inputs)."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir=str(tmp_path), use_cpu=True, bf16=False, per_device_train_batch_size=2 * G,
                      num_generations=G, max_completion_length=MAX_NEW, report_to="none", save_strategy="no",
                      activation_checkpointing=False, reward_weights=list(WEIGHTS), seed=0, **trl_args)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        trainer = GRPOTrainer(model=str(MODEL), reward_funcs=[length_mod, says_nine], args=args,
                              train_dataset=Dataset.from_list([{"prompt": p} for p in PROMPTS]))
    torch.manual_seed(0)
    inputs = trainer._generate_and_score_completions([{"prompt": p} for p in PROMPTS[:2] for _ in range(G)])
    return trainer, inputs


def our_batch(trainer, inputs, mask_truncated: bool = False):
    """Our Batch of TRL's rows: the same prompt and completion tokens, TRL's per-function rewards."""
    from docuchat_rl.learning.batch import build_batch

    tok = trainer.processing_class
    prompt_ids = [ids[m.bool()].tolist() for ids, m in zip(inputs["prompt_ids"], inputs["prompt_mask"])]
    lengths = [int(n) for n in (inputs["completion_ids"] != tok.pad_token_id).sum(-1)]
    completion_ids = [ids[:n].tolist() for ids, n in zip(inputs["completion_ids"], lengths)]
    truncated = [ids[-1] != tok.eos_token_id for ids in completion_ids]
    texts = [{"role": "assistant", "content": tok.decode(ids, skip_special_tokens=True)} for ids in completion_ids]
    raw = [[r if r is not None else float("nan") for r in f(completions=[[t] for t in texts])]
           for f in (length_mod, says_nine)]
    components = [list(row) for row in zip(*raw)]  # [R, K]
    totals = [sum(w * r for w, r in zip(WEIGHTS, row) if r == r) for row in components]
    batch = build_batch(prompt_ids, completion_ids, totals, [i // G for i in range(len(totals))], tok.pad_token_id,
                        reward_valid=[any(r == r for r in row) for row in components],
                        trained=[not (mask_truncated and t) for t in truncated], component_rewards=components)
    return batch, truncated


def our_config(**algorithm):
    from docuchat_rl.config import load_config

    sets = [f"algorithm.{k}={v}" for k, v in algorithm.items()] + [
        f"rollout.max_new_tokens={MAX_NEW}", f"rollout.num_generations={G}", "rollout.prompts_per_step=2",
        f"rewards.correctness.weight={WEIGHTS[0]}", f"rewards.format.weight={WEIGHTS[1]}"]
    return load_config(None, sets)


def off_policy(inputs, model, batch, seed: int = 1):
    """Rollout-time and sampler log-probs that differ from the current ones (ratios away from 1)."""
    from docuchat_rl.learning.forward import policy_forward

    with torch.no_grad():
        now = policy_forward(model, batch).logps  # [R, T]
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(batch.info.completion_lens).unsqueeze(-1)  # [R, 1]
    mask = (torch.arange(now.shape[1]) < lens).float()  # [R, T]: every real token (trained on or not)
    old = now + 0.4 * torch.randn(now.shape, generator=g) * mask
    sampler = old + 0.3 * torch.randn(now.shape, generator=g) * mask
    t = inputs["completion_ids"].shape[1]
    pad = lambda x: torch.nn.functional.pad(x, (0, t - x.shape[1]))  # noqa: E731  (TRL's width)
    inputs = {**inputs, "old_per_token_logps": pad(old), "sampling_per_token_logps": pad(sampler)}
    if "ref_per_token_logps" in inputs:  # (beta > 0: a reference away from the policy, so the KL binds)
        batch.ref_logps = now + 0.3 * torch.randn(now.shape, generator=g) * mask
        inputs["ref_per_token_logps"] = pad(batch.ref_logps)
    return inputs, old, sampler


def both_losses(trainer, inputs, cfg, batch, old, sampler, norm_tokens=None):
    """(TRL's loss, its gradients) and (ours, our gradients) on TRL's model."""
    from docuchat_rl.learning.algorithms import GRPO
    from docuchat_rl.learning.forward import policy_forward
    from docuchat_rl.learning.losses import Normalisers

    model = trainer.model
    model.train()
    trainer.current_gradient_accumulation_steps = 1
    params = [p for p in model.parameters() if p.requires_grad]
    model.zero_grad()
    theirs = trainer._compute_loss(model, inputs)
    theirs.backward()
    their_grads = [p.grad.clone() for p in params]
    model.zero_grad()

    algo = GRPO(cfg.algorithm, reward_weights=cfg.rewards.weights)
    metrics = algo.advantages(batch)
    batch.old_logps, batch.sampler_logps = old, sampler
    tokens = sum(batch.info.loss_lens) if norm_tokens is None else norm_tokens
    norm = Normalisers(rows=batch.rows, tokens=float(tokens), max_new_tokens=MAX_NEW)
    out = policy_forward(model, batch, with_entropy=True, entropy_grad=algo.entropy_grad)
    ours, _ = algo.loss(out, batch, norm)
    ours.backward()
    our_grads = [p.grad.clone() for p in params]
    model.zero_grad()
    return (theirs, their_grads), (ours, our_grads), metrics


def assert_same(a, b, tol=2e-5):
    (la, ga), (lb, gb) = a, b
    assert abs(float(la) - float(lb)) <= tol * max(1.0, abs(float(la))), (float(la), float(lb))
    num = sum(float((x - y).norm() ** 2) for x, y in zip(ga, gb)) ** 0.5
    den = sum(float(x.norm() ** 2) for x in ga) ** 0.5
    assert den > 0 and num <= 1e-4 * den, (num, den)


# TRL's arguments, ours, for one loss type or knob at a time
CASES = {
    "grpo": ({"loss_type": "grpo"}, {"loss_aggregation": "grpo"}),
    "dapo": ({"loss_type": "dapo"}, {"loss_aggregation": "dapo"}),
    "bnpo": ({"loss_type": "bnpo"}, {"loss_aggregation": "bnpo"}),
    "dr_grpo": ({"loss_type": "dr_grpo"}, {"loss_aggregation": "dr_grpo"}),
    "gspo": ({"loss_type": "grpo", "importance_sampling_level": "sequence"},
             {"loss_aggregation": "grpo", "ratio_level": "sequence"}),
    "luspo": ({"loss_type": "luspo", "importance_sampling_level": "sequence"},
              {"loss_aggregation": "luspo", "ratio_level": "sequence"}),
    # TRL caps cispo's ratio at epsilon_high itself; we cap at 1 + epsilon_high (TRL's 5.0 is our 4.0)
    "cispo": ({"loss_type": "cispo", "epsilon_high": 1.3}, {"surrogate": "cispo", "loss_aggregation": "dapo",
                                                            "epsilon_high": 0.3}),
    "sapo": ({"loss_type": "sapo", "sapo_temperature_neg": 1.2},
             {"surrogate": "sapo", "loss_aggregation": "grpo", "sapo_temperature_neg": 1.2}),
    "vespo": ({"loss_type": "vespo", "vespo_k_neg": 2.5},
              {"surrogate": "vespo", "loss_aggregation": "dapo", "vespo_k_neg": 2.5}),
    "delta": ({"loss_type": "dapo", "delta": 1.5}, {"loss_aggregation": "dapo", "delta": 1.5}),
    "clip-higher": ({"loss_type": "dapo", "epsilon": 0.1, "epsilon_high": 0.28},
                    {"loss_aggregation": "dapo", "epsilon_low": 0.1, "epsilon_high": 0.28}),
    "off_policy_mask": ({"loss_type": "dapo", "off_policy_mask_threshold": 0.03},
                        {"loss_aggregation": "dapo", "off_policy_mask_threshold": 0.03}),
    "top_entropy_quantile": ({"loss_type": "dapo", "top_entropy_quantile": 0.2},
                             {"loss_aggregation": "dapo", "top_entropy_quantile": 0.2}),
    "entropy_coef": ({"loss_type": "grpo", "entropy_coef": 0.05}, {"loss_aggregation": "grpo", "ent_coef": 0.05}),
    "mask_truncated_completions": ({"loss_type": "dapo", "mask_truncated_completions": True},
                                   {"loss_aggregation": "dapo", "mask_truncated_completions": True}),
    "normalize_then_sum": ({"loss_type": "dapo", "multi_objective_aggregation": "normalize_then_sum"},
                           {"loss_aggregation": "dapo", "multi_objective_aggregation": "normalize_then_sum"}),
    "scale_batch": ({"loss_type": "dapo", "scale_rewards": "batch"}, {"loss_aggregation": "dapo", "scale": "batch"}),
    # TRL's default use_bias_correction_kl: each token's k3 KL times the (not detached) importance ratio
    "kl_bias_corrected": ({"loss_type": "dapo", "beta": 0.1},
                          {"loss_aggregation": "dapo", "beta": 0.1, "kl_bias_correction": True}),
    "kl_bias_corrected_gspo": ({"loss_type": "grpo", "beta": 0.1, "importance_sampling_level": "sequence"},
                               {"loss_aggregation": "grpo", "beta": 0.1, "kl_bias_correction": True,
                                "ratio_level": "sequence"}),
    "kl_plain": ({"loss_type": "dapo", "beta": 0.1, "use_bias_correction_kl": False},
                 {"loss_aggregation": "dapo", "beta": 0.1}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_our_grpo_loss_equals_trls(tmp_path, case):
    trl_args, ours = CASES[case]
    trainer, inputs = trl_run(tmp_path, **trl_args)
    mask_truncated = bool(ours.get("mask_truncated_completions"))
    batch, truncated = our_batch(trainer, inputs, mask_truncated)
    assert 0 < sum(truncated) < len(truncated)  # both kinds of completion are in the batch
    cfg = our_config(**ours)
    inputs, old, sampler = off_policy(inputs, trainer.model, batch)
    theirs, mine, _ = both_losses(trainer, inputs, cfg, batch, old, sampler)
    # the advantages first: TRL's, from its own reward machinery, equal ours from the same rewards
    row_adv = (batch.advantages.sum(-1) / batch.completion_mask.sum(-1).clamp(min=1))
    trained = batch.completion_mask.sum(-1) > 0
    torch.testing.assert_close(row_adv[trained], inputs["advantages"][trained], atol=1e-5, rtol=1e-5)
    assert_same(theirs, mine)


def test_the_knobs_change_the_loss(tmp_path):
    """Each case above binds on this batch: its loss differs from plain dapo's (else the equality above
    would prove nothing about the knob)."""
    trainer, inputs = trl_run(tmp_path, loss_type="dapo")
    batch, _ = our_batch(trainer, inputs)
    inputs, old, sampler = off_policy(inputs, trainer.model, batch)
    base = float(both_losses(trainer, inputs, our_config(loss_aggregation="dapo"), batch, old, sampler)[1][0])
    for case in ("delta", "off_policy_mask", "top_entropy_quantile", "clip-higher"):
        batch, _ = our_batch(trainer, inputs)
        loss = float(both_losses(trainer, inputs, our_config(**CASES[case][1]), batch, old, sampler)[1][0])
        assert abs(loss - base) > 1e-4, case


def test_the_kl_correction_changes_the_gradient_on_policy_too(tmp_path):
    """With one update a rollout (old = the policy itself, every ratio 1), TRL's bias-corrected KL still changes
    the gradient (KL x grad log pi), and ours equals it; without the correction the two runs differ."""
    trainer, inputs = trl_run(tmp_path, loss_type="dapo", beta=0.1)
    batch, _ = our_batch(trainer, inputs)
    inputs, old, sampler = off_policy(inputs, trainer.model, batch)
    from docuchat_rl.learning.forward import policy_forward

    with torch.no_grad():
        now = policy_forward(trainer.model, batch).logps
    t = inputs["completion_ids"].shape[1]
    inputs["old_per_token_logps"] = torch.nn.functional.pad(now, (0, t - now.shape[1]))
    corrected = both_losses(trainer, inputs, our_config(loss_aggregation="dapo", beta=0.1, kl_bias_correction=True),
                            batch, now, sampler)
    assert_same(corrected[0], corrected[1])
    plain = both_losses(trainer, inputs, our_config(loss_aggregation="dapo", beta=0.1), batch, now, sampler)[1]
    num = sum(float((x - y).norm() ** 2) for x, y in zip(corrected[1][1], plain[1])) ** 0.5
    assert num > 1e-3 * sum(float(x.norm() ** 2) for x in plain[1]) ** 0.5
