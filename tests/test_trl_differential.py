"""TRL's own trainers beside ours, on one table of GRPOConfig / SFTConfig / LoraConfig settings: each row runs TRL
1.16's GRPOTrainer (or SFTTrainer) and our RLTrainer (or SFTTrainer) for 1-4 optimizer steps on the embedded
default and compares what each did, read off the trainers themselves: optimizer steps, completions sampled a
generation, the learning rate of every optimizer step, the optimizer's hyperparameters, the clip range, the KL
coefficient and its correction, the loss aggregation, the sampling settings, the adapter's trainable parameters,
the prompts' tokens (SFT: every example's tokens and the ones its loss reads). A mapped TRL field that no row sets
fails `test_every_mapped_field_has_a_row` (so a new field needs a row, or a stated reason in NOT_RUN)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest

from .conftest import MODEL, ROOT, TASK

TEMPLATE = ROOT / "tests" / "flavoured_template.jinja"  # a chat template that reads a variable (chat_template_kwargs)


def _rows(n: int, conversational: bool = False) -> list[dict]:
    qs = [json.loads(x)["question"] for x in (TASK / "train.jsonl").read_text().splitlines()[:n]]
    return [{"prompt": [{"role": "user", "content": q}] if conversational else q} for q in qs]


def _reward(completions, **kw):  # (a spread inside every group, so every step has advantages)
    return [float(len(str(c)) % 3) for c in completions]


GRPO_BASE = dict(use_cpu=True, bf16=False, max_completion_length=6, max_steps=2, report_to="none", disable_tqdm=True,
                 logging_steps=1, save_strategy="no", per_device_train_batch_size=4, num_generations=4,
                 gradient_checkpointing=False, learning_rate=1e-3)

# (row id, GRPOConfig fields over GRPO_BASE, LoraConfig fields or None for the default LoraConfig, data set)
GRPO_ROWS = [
    ("trl-defaults", {"per_device_train_batch_size": 8, "num_generations": 8, "learning_rate": 1e-6,
                      "gradient_checkpointing": True, "max_steps": 2}, None, "text"),
    ("steps-per-generation", {"steps_per_generation": 2}, None, "text"),
    ("steps-per-generation-4", {"steps_per_generation": 4, "max_steps": 4}, None, "text"),
    ("mu-2", {"num_iterations": 2}, None, "text"),
    ("accumulation", {"gradient_accumulation_steps": 2, "max_steps": 2}, None, "text"),
    ("generation-batch", {"generation_batch_size": 16, "max_steps": 4}, None, "text"),
    ("epochs", {"max_steps": -1, "num_train_epochs": 1.0}, None, "4rows"),
    ("symmetric-clip", {"epsilon": 0.3, "loss_type": "grpo"}, None, "text"),
    ("clip-higher", {"epsilon": 0.2, "epsilon_high": 0.28, "loss_type": "bnpo", "delta": 1.5}, None, "text"),
    ("cispo", {"loss_type": "cispo", "epsilon_high": 5.0}, None, "text"),
    ("sapo", {"loss_type": "sapo", "sapo_temperature_pos": 0.9, "sapo_temperature_neg": 1.1}, None, "text"),
    ("vespo", {"loss_type": "vespo", "vespo_k_pos": 1.5, "vespo_k_neg": 2.5, "vespo_lambda_pos": 2.0,
               "vespo_lambda_neg": 1.0}, None, "text"),
    ("kl-corrected", {"beta": 0.04, "loss_type": "dr_grpo", "scale_rewards": "batch"}, None, "text"),
    ("kl-plain", {"beta": 0.04, "use_bias_correction_kl": False, "importance_sampling_level": "sequence",
                  "loss_type": "luspo"}, None, "text"),
    ("warmup-ratio-cosine", {"warmup_steps": 0.5, "lr_scheduler_type": "cosine", "max_steps": 4}, None, "text"),
    ("constant-with-warmup", {"warmup_steps": 1, "lr_scheduler_type": "constant_with_warmup", "max_steps": 3,
                              "weight_decay": 0.1, "adam_beta1": 0.8, "adam_beta2": 0.99, "adam_epsilon": 1e-6,
                              "max_grad_norm": 0.5, "seed": 7}, None, "text"),
    ("constant-ignores-warmup", {"lr_scheduler_type": "constant", "warmup_steps": 2, "max_steps": 3}, None, "text"),
    ("min-lr", {"lr_scheduler_type": "cosine_with_min_lr", "lr_scheduler_kwargs": {"min_lr_rate": 0.1},
                "max_steps": 3}, None, "text"),
    ("sampling", {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "mask_truncated_completions": True,
                  "top_entropy_quantile": 0.5, "entropy_coef": 0.01, "off_policy_mask_threshold": 0.5,
                  "multi_objective_aggregation": "normalize_then_sum", "disable_dropout": True}, None, "text"),
    ("conversation-template", {"chat_template_kwargs": {"flavor": "salty"}}, None, "chat"),
    ("peft-default-targets", {}, {"r": 4, "lora_alpha": 8, "target_modules": None}, "text"),
    ("peft-layers", {}, {"r": 2, "lora_alpha": 4, "target_modules": ["q_proj", "k_proj", "o_proj"],
                         "exclude_modules": ["o_proj"], "layers_to_transform": [0, 2], "layers_pattern": "layers",
                         "use_rslora": True,
                         "init_lora_weights": "gaussian", "lora_dropout": 0.1,
                         "rank_pattern": {"k_proj": 4}, "alpha_pattern": {"k_proj": 2}}, "text"),
]

SFT_BASE = dict(use_cpu=True, bf16=False, max_steps=2, report_to="none", disable_tqdm=True, logging_steps=1,
                save_strategy="no", per_device_train_batch_size=4, gradient_checkpointing=False)
SFT_ROWS = [
    ("sft-defaults-messages", {"learning_rate": 2e-5, "chat_template_path": str(TEMPLATE)}, None, "messages"),
    ("sft-prompt-completion", {"lr_scheduler_type": "cosine", "lr_scheduler_kwargs": {"num_cycles": 0.25},
                               "warmup_steps": 0.5, "max_steps": 4,
                               "gradient_accumulation_steps": 2, "learning_rate": 1e-3}, None, "prompt_completion"),
    ("sft-epochs-truncated", {"max_steps": -1, "num_train_epochs": 2.0, "max_length": 40,
                              "truncation_mode": "keep_start", "completion_only_loss": False,
                              "eos_token": "<|endoftext|>"}, {"r": 4, "lora_alpha": 8}, "prompt_completion"),
]

def _inert_sample(n: int = 8, seed: int = 0) -> dict:
    """A generated row: `n` of GRPOConfig's inert fields (trl_args.INERT), drawn by `seed`, each set to another value
    TRL itself accepts (a bool flipped, a number moved): with them, TRL and we must still do the same."""
    import dataclasses
    import random

    from trl import GRPOConfig

    from docuchat_rl.trl_args import INERT

    base = GRPOConfig(output_dir="/tmp/inert", **GRPO_BASE)
    fields = sorted(f.name for f in dataclasses.fields(GRPOConfig) if f.name in INERT)
    out: dict = {}
    for name in random.Random(seed).sample(fields, len(fields)):
        value = getattr(base, name)
        other = (not value if isinstance(value, bool) else value + 3 if isinstance(value, int)
                 else value * 2 if isinstance(value, float) and value else None)
        if other is None or name in ("local_rank", "logging_steps", "eval_on_start", "load_best_model_at_end"):
            continue  # (processes; TRL's own logging; the two that need an evaluation set, which no row has)
        try:
            GRPOConfig(output_dir="/tmp/inert", **{**GRPO_BASE, **out, name: other})
        except Exception:  # noqa: BLE001 (a value TRL refuses, or one that needs another field)
            continue
        out[name] = other
        if len(out) == n:
            break
    return out


GRPO_ROWS.append(("generated-inert-fields", _inert_sample(), None, "text"))

# mapped fields the table does not run, and why (each is mapped in trl_args and checked in tests/test_trl_args.py)
NOT_RUN = {
    "use_vllm": "vLLM is not in the main environment (scripts/vllm_tests.sh holds its tests)",
    **{f: "vLLM's (use_vllm)" for f in ("vllm_mode", "vllm_server_base_url", "vllm_server_host", "vllm_server_port",
                                         "vllm_server_timeout", "vllm_gpu_memory_utilization", "vllm_tensor_parallel_size",
                                         "vllm_max_model_length", "vllm_enable_sleep_mode",
                                         "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                                         "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max",
                                         "vllm_importance_sampling_cap")},
    "bf16": "bfloat16 on a CPU without AVX512-BF16 is 6-20x slower; the dtype is compared in test_trl_args",
    "fp16": "refused (test_trl_args)", "report_to": "where metrics go", "disable_tqdm": "the progress bar",
    "output_dir": "each side's own folder", "use_cpu": "every row runs on the CPU",
    "save_steps": "checkpoints: test_trl_args", "save_strategy": "checkpoints: test_trl_args",
    "save_total_limit": "checkpoints: test_trl_args", "eval_strategy": "evaluation: test_trl_args",
    "eval_steps": "evaluation: test_trl_args", "num_generations_eval": "evaluation: test_trl_args",
    "trust_remote_code": "no remote code here", "model_init_kwargs": "the dtype: test_trl_args",
    "max_tool_calling_iterations": "tools: test_trl_args", "cast_lm_head_to_fp32": "a float32 head here",
    "shuffle_dataset": "the data order is each side's own seeded shuffle", "activation_checkpointing":
    "gradient_checkpointing's new name", "optim": "adamw_torch_fused is TRL's default in every row",
    "packing": "refused unless False", "padding_free": "refused unless False", "loss_type": "SFT: nll only",
    "assistant_only_loss": "refused unless False",
}


def _trl_grpo(kwargs, lora, data, out, model=MODEL):
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    seen = {"generations": [], "prompt_ids": {}}

    class Watched(GRPOTrainer):  # (TRL's trainer itself; what it generated is recorded on the way out)
        def _generate_and_score_completions(self, inputs):
            result = super()._generate_and_score_completions(inputs)
            ids, mask = result["prompt_ids"], result["prompt_mask"]
            seen["generations"].append(len(ids))
            for row, m, x in zip(ids.tolist(), mask.tolist(), inputs):
                seen["prompt_ids"][json.dumps(x["prompt"])] = [t for t, k in zip(row, m) if k]
            return result

    lrs = []

    from transformers import TrainerCallback

    class Rates(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            lrs.append(kw["lr_scheduler"].get_last_lr()[0])

    args = GRPOConfig(output_dir=str(out), **{**GRPO_BASE, **kwargs})
    tr = Watched(model=str(model), reward_funcs=[_reward], args=args, train_dataset=Dataset.from_list(data),
                 peft_config=LoraConfig(**(lora or {})), callbacks=[Rates()])
    tr.train()
    opt = tr.optimizer.param_groups[0]
    loss = tr.loss_type
    return {
        "optimizer_steps": tr.state.global_step, "generation_rows": seen["generations"], "lr_at_step": lrs,
        "optimizer": {k: opt[k] for k in ("weight_decay", "eps")} | {"betas": list(opt["betas"])},
        "max_grad_norm": args.max_grad_norm, "seed": args.seed,
        "clip": ([0.0, tr.epsilon_high] if loss == "cispo" else [1 - tr.epsilon_low, 1 + tr.epsilon_high]),
        "delta": args.delta, "beta": tr.beta, "kl_corrected": bool(tr.beta and args.use_bias_correction_kl),
        "aggregation": {"grpo": "sequence_mean", "sapo": "sequence_mean", "bnpo": "token_mean", "dapo": "token_mean",
                        "cispo": "token_mean", "vespo": "token_mean", "dr_grpo": "max_length",
                        "luspo": "sequence_sum"}[loss],
        "objective": {"cispo": "cispo", "sapo": "sapo", "vespo": "vespo"}.get(loss, "clip"),
        "sapo": [args.sapo_temperature_pos, args.sapo_temperature_neg] if loss == "sapo" else None,
        "vespo": ([args.vespo_k_pos, args.vespo_k_neg, args.vespo_lambda_pos, args.vespo_lambda_neg]
                  if loss == "vespo" else None),
        "scale": tr.scale_rewards, "ratio_level": tr.importance_sampling_level,
        "mask_truncated": tr.mask_truncated_completions, "entropy_quantile": tr.top_entropy_quantile,
        "entropy_coef": args.entropy_coef, "off_policy": tr.off_policy_mask_threshold,
        "objectives": args.multi_objective_aggregation,
        "sampling": [tr.temperature, tr.top_p, tr.top_k or 0, tr.max_completion_length],
        "dropout": _dropouts(tr.model),
        "checkpointing": bool(tr.model.base_model.model.is_gradient_checkpointing),
        "trainable": sorted(n for n, p in tr.model.named_parameters() if p.requires_grad),
        "prompt_ids": seen["prompt_ids"],
    }


def _ours_grpo(kwargs, lora, data, out, model=MODEL):
    from peft import LoraConfig
    from trl import GRPOConfig

    import docuchat_rl as dr

    args = GRPOConfig(output_dir=str(out), **{**GRPO_BASE, **kwargs})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = dr.RLTrainer(model=str(model), reward_funcs=[_reward], args=args, train_dataset=data,
                         peft_config=LoraConfig(**(lora or {})), overrides={"eval.before_and_after": False})
    with t:
        got = t.train()
        history = t.state.log_history
        a, r, run = t.cfg.algorithm, t.cfg.rollout, t.trainer
        opt = run.learner.optimizer.param_groups[0]
        steps = [json.loads(x)["step"] for x in (out / "traces.jsonl").read_text().splitlines()]
        per = t._per_generation
        texts = run.collector.prompt_texts
        prompt_ids = {json.dumps(row["prompt"]): run.tokenizer(texts[i], add_special_tokens=False)["input_ids"]
                      for i, row in enumerate(data)}
        sched = _lr_per_optimizer_step(t.cfg, run.learner.updates_per_step * t.cfg.run.steps)
        return {
            "optimizer_steps": got.global_step if sum(m["optimizer_steps"] for m in history) == got.global_step else -1,
            "generation_rows": [steps.count(s) for s in sorted(set(steps))],
            "lr_at_step": sched if [m["lr"] for m in history] == sched[per - 1::per] else ["the logged lr differs"],
            "optimizer": {k: opt[k] for k in ("weight_decay", "eps")} | {"betas": list(opt["betas"])},
            "max_grad_norm": t.cfg.optim.max_grad_norm, "seed": t.cfg.run.seed,
            "clip": ([0.0, 1 + a.epsilon_high] if a.surrogate == "cispo" else [1 - a.epsilon_low, 1 + a.epsilon_high]),
            "delta": a.delta, "beta": a.beta, "kl_corrected": bool(a.beta and a.kl_bias_correction),
            "aggregation": {"grpo": "sequence_mean", "dapo": "token_mean", "bnpo": "token_mean",
                            "dr_grpo": "max_length", "luspo": "sequence_sum"}[a.loss_aggregation],
            "objective": a.surrogate,
            "sapo": [a.sapo_temperature_pos, a.sapo_temperature_neg] if a.surrogate == "sapo" else None,
            "vespo": ([a.vespo_k_pos, a.vespo_k_neg, a.vespo_lambda_pos, a.vespo_lambda_neg]
                      if a.surrogate == "vespo" else None),
            "scale": a.scale, "ratio_level": a.ratio_level, "mask_truncated": a.mask_truncated_completions,
            "entropy_quantile": a.top_entropy_quantile, "entropy_coef": a.ent_coef,
            "off_policy": a.off_policy_mask_threshold, "objectives": a.multi_objective_aggregation,
            "sampling": [r.temperature, r.top_p, r.top_k, r.max_new_tokens],
            "dropout": _dropouts(run.policy_model),
            "checkpointing": bool(run.policy_model.base_model.model.is_gradient_checkpointing),
            "trainable": sorted(n for n, p in run.policy_model.named_parameters() if p.requires_grad),
            "prompt_ids": {k: v for k, v in prompt_ids.items()},
        }


def _dropouts(model) -> list:
    """Every dropout of the trained model (LoRA's included) with its probability, by name."""
    import torch

    return sorted((n, m.p) for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout))


def _lr_per_optimizer_step(cfg, total: int) -> list[float]:
    """The rate of every optimizer step of our run, from our own optimizer and schedule (run.build_optimizer)."""
    import torch

    from docuchat_rl.run import build_optimizer

    opt, sched = build_optimizer([torch.nn.Parameter(torch.zeros(1))], cfg.optim, total)
    out = []
    for _ in range(total):
        out.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return out


def _data(kind: str) -> list[dict]:
    return {"text": _rows(16), "4rows": _rows(4), "chat": _rows(16, conversational=True)}[kind]


@pytest.mark.slow
@pytest.mark.parametrize("row", GRPO_ROWS, ids=[r[0] for r in GRPO_ROWS])
def test_grpo_trains_as_trls_grpo_trainer_does(tmp_path, row):
    _, kwargs, lora, kind = row
    data, model = _data(kind), MODEL
    if kind == "chat":  # (the embedded model with a chat template that reads a variable: chat_template_kwargs')
        import shutil

        model = Path(shutil.copytree(MODEL, tmp_path / "model"))
        shutil.copy(TEMPLATE, model / "chat_template.jinja")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = _trl_grpo(kwargs, lora, data, tmp_path / "trl", model)
    ours = _ours_grpo(kwargs, lora, data, tmp_path / "ours", model)
    their_prompts, our_prompts = theirs.pop("prompt_ids"), ours.pop("prompt_ids")
    assert their_prompts and all(our_prompts[p] == ids for p, ids in their_prompts.items()), \
        next((p, ids, our_prompts[p]) for p, ids in their_prompts.items() if our_prompts[p] != ids)
    theirs["lr_at_step"] = pytest.approx(theirs["lr_at_step"], rel=1e-6)
    assert ours == theirs


def _trl_sft(kwargs, lora, data, out):
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import SFTConfig, SFTTrainer

    lrs = []

    class Rates(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            lrs.append(kw["lr_scheduler"].get_last_lr()[0])

    args = SFTConfig(output_dir=str(out), **{**SFT_BASE, **kwargs})
    tr = SFTTrainer(model=str(MODEL), args=args, train_dataset=Dataset.from_list(data),
                    peft_config=LoraConfig(**(lora or {})), callbacks=[Rates()])
    tr.train()
    examples = [(x["input_ids"], [t for t in x["labels"][1:] if t != -100]) for x in tr.train_dataset]
    return {"optimizer_steps": tr.state.global_step, "lr_at_step": lrs,
            "trainable": sorted(n for n, p in tr.model.named_parameters() if p.requires_grad),
            "examples": sorted(examples)}


def _ours_sft(kwargs, lora, data, out):
    from peft import LoraConfig
    from trl import SFTConfig

    import docuchat_rl as dr

    args = SFTConfig(output_dir=str(out), **{**SFT_BASE, **kwargs})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        t = dr.SFTTrainer(model=str(MODEL), args=args, train_dataset=data, peft_config=LoraConfig(**(lora or {})),
                          overrides={"eval.before_and_after": False})
    with t:
        got = t.train()
        run = t.trainer
        history = t.state.log_history
        examples = sorted((x.prompt_ids + x.target_ids, [i for i, k in zip(x.target_ids, x.loss_mask) if k])
                          for x in run.targets)
        return {"optimizer_steps": got.global_step, "lr_at_step": [m["lr"] for m in history],
                "trainable": sorted(n for n, p in run.policy_model.named_parameters() if p.requires_grad),
                "examples": examples}


def _sft_data(kind: str) -> list[dict]:
    rows = [json.loads(x) for x in (TASK / "train.jsonl").read_text().splitlines()[:10]]
    if kind == "messages":
        return [{"messages": [{"role": "user", "content": r["question"]},
                              {"role": "assistant", "content": r["answer"]}]} for r in rows]
    return [{"prompt": r["question"], "completion": r["answer"]} for r in rows]


@pytest.mark.slow
@pytest.mark.parametrize("row", SFT_ROWS, ids=[r[0] for r in SFT_ROWS])
def test_sft_trains_as_trls_sft_trainer_does(tmp_path, row):
    _, kwargs, lora, kind = row
    data = _sft_data(kind)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = _trl_sft(kwargs, lora, data, tmp_path / "trl")
    ours = _ours_sft(kwargs, lora, data, tmp_path / "ours")
    theirs["lr_at_step"] = pytest.approx(theirs["lr_at_step"], rel=1e-6)
    assert ours == theirs


def test_every_mapped_field_has_a_row():
    """Each field trl_args maps (GRPO, SFT, the joint fields, peft's LoraConfig) is set by some row of the table or
    named in NOT_RUN with its reason: a field TRL adds, once mapped, needs a row here."""
    from docuchat_rl import trl_args as t

    set_grpo = {k for _, kw, _, _ in GRPO_ROWS for k in kw} | set(GRPO_BASE)
    set_sft = {k for _, kw, _, _ in SFT_ROWS for k in kw} | set(SFT_BASE)
    set_lora = {k for *_, lora, _ in GRPO_ROWS + SFT_ROWS for k in (lora or {})}
    missing = sorted((set(t.GRPO) | set(t.JOINT)) - set_grpo - set(NOT_RUN) - set(t.SHARED)
                     | (set(t.SFT) - set(t.SHARED) - set_sft - set(NOT_RUN))
                     | (set(t.SHARED) - set_grpo - set_sft - set(NOT_RUN))
                     | (set(t.LORA) - set_lora - {"task_type", "bias", "modules_to_save", "use_dora", "lora_bias",
                                                  "trainable_token_indices", "inference_mode", "fan_in_fan_out"}))
    assert not missing, f"mapped TRL fields no row of the differential table sets: {missing}"
