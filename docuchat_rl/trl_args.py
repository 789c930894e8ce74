"""TRL's `GRPOConfig` and `SFTConfig` as our recipe: the one mapping from TRL's fields to our keys.

The Python API takes a TRL `args=` object through `overrides_of` (`RLTrainer(args=GRPOConfig(...))`,
`SFTTrainer(args=SFTConfig(...))`); docs/from_trl.md's tables are checked against `GRPO` and `SFT` here. Every
field of TRL's dataclass (its own and `transformers.TrainingArguments`') is in exactly one of three places:

- `GRPO` / `SFT` (and `SHARED` for the TrainingArguments fields both read): the field maps to our keys, by a
  function of its value (a value the function cannot express is refused, naming the field);
- `INERT`: the field changes nothing a run here computes (how TRL logs, loads or reports; what we always do);
- `API_FIELDS`: read by the trainer itself (reward_weights: the weights of the reward functions it is given);
- `REFUSED`: a feature we do not have: a value other than TRL's default is one line naming the field.

A field in none of them fails the test that walks the dataclasses (so a new TRL field cannot slip through
unmapped). Only fields set away from TRL's default are applied: a field left at TRL's default leaves the
recipe's value, and the defaults that differ from the recipe's are said once (`unshared_defaults`).

Deliberately left out: TRL's model-init keywords (`model_init_kwargs`: load the model yourself and pass it),
and the hub (`push_to_hub`: no network here; `save_model` writes the folder a push would upload).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from .config import ConfigError, flat_keys

Mapper = Callable[[Any], dict[str, Any]]


def _to(*keys: str) -> Mapper:
    """The value as it is, at each key."""
    return lambda v: {k: v for k in keys}


def _choice(key: str, allowed: dict[Any, Any], field: str) -> Mapper:
    """A value among `allowed` (TRL's -> ours) at `key`; anything else refused naming `field`."""
    def map_(v):
        name = getattr(v, "value", v)  # (transformers' enums)
        if name not in allowed:
            raise ConfigError(f"args.{field}={name!r}: supported here are {sorted(map(str, allowed))}")
        return {key: allowed[name]}
    return map_


def _only(field: str, *values: Any) -> Mapper:
    """A field whose supported values map to nothing (what we always do); others refused."""
    def map_(v):
        name = getattr(v, "value", v)
        if name not in values:
            raise ConfigError(f"args.{field}={name!r}: docuchat-rl always runs as {values[0]!r} (docs/from_trl.md)")
        return {}
    return map_


def _loss_type(v) -> dict:
    """TRL's loss_type as our aggregation and surrogate (docs/from_trl.md's rows)."""
    table = {"grpo": {"algorithm.loss_aggregation": "grpo"}, "dapo": {"algorithm.loss_aggregation": "dapo"},
             "bnpo": {"algorithm.loss_aggregation": "bnpo"}, "dr_grpo": {"algorithm.loss_aggregation": "dr_grpo"},
             "luspo": {"algorithm.loss_aggregation": "luspo", "algorithm.ratio_level": "sequence"},
             "cispo": {"algorithm.surrogate": "cispo", "algorithm.loss_aggregation": "dapo"},
             "sapo": {"algorithm.surrogate": "sapo", "algorithm.loss_aggregation": "grpo"},
             "vespo": {"algorithm.surrogate": "vespo", "algorithm.loss_aggregation": "dapo"}}
    if v not in table:
        raise ConfigError(f"args.loss_type={v!r}: supported here are {sorted(table)}")
    return table[v]


def _scale(v) -> dict:
    named = {True: "group", False: "none", "group": "group", "batch": "batch", "none": "none"}
    if v not in named:
        raise ConfigError(f"args.scale_rewards={v!r}: supported here are group, batch, none (or True/False)")
    return {"algorithm.scale": named[v]}


def _report_to(v) -> dict:
    names = [v] if isinstance(v, str) else list(v or [])
    names = [n for n in names if n not in ("none", "all")] if "all" not in names else ["wandb"]
    other = [n for n in names if n != "wandb"]
    if other:
        raise ConfigError(f"args.report_to={v!r}: here metrics go to metrics.jsonl and, with wandb, to Weights & "
                          f"Biases ({other[0]} is not built)")
    return {"logging.wandb": "wandb" in names}


def _eval_strategy(v) -> dict:
    name = getattr(v, "value", v)
    if name == "no":
        return {"eval.every": None}
    if name == "steps":
        return {}  # (eval_steps says how often)
    raise ConfigError(f"args.eval_strategy={name!r}: evaluation here is every eval_steps steps ('steps') or none ('no')")


def _epsilon_high(v) -> dict:
    return {} if v is None else {"algorithm.epsilon_high": v}


# ------------------------------------------------------------------------------------------------ the tables
# TrainingArguments fields both trainers read, mapped alike (SFT's learning-rate keys are its own: SFT below)
SHARED: dict[str, Mapper] = {
    "output_dir": _to("run.output_dir"),
    "seed": _to("run.seed"),
    "max_grad_norm": _to("optim.max_grad_norm"),
    "weight_decay": _to("optim.weight_decay"),
    "adam_epsilon": _to("optim.eps"),
    "adam_beta1": lambda v: {"optim.betas.0": v},
    "adam_beta2": lambda v: {"optim.betas.1": v},
    "save_steps": lambda v: {"checkpoint.every": int(v)} if v >= 1 else {},
    "save_total_limit": lambda v: {"checkpoint.keep_last": v} if v else {},
    "gradient_checkpointing": _to("model.gradient_checkpointing"),
    "activation_checkpointing": _to("model.gradient_checkpointing"),  # (transformers 5's name for it)
    "use_cpu": lambda v: {"model.device": "cpu"} if v else {},
    "bf16": lambda v: {"model.dtype": "bf16-autocast" if v else "float32"},
    "report_to": _report_to,
    "disable_tqdm": lambda v: {"logging.progress": not v},
    "eval_strategy": _eval_strategy,
    "eval_steps": lambda v: {"eval.every": int(v)} if v and v >= 1 else {},
    "trust_remote_code": _to("model.trust_remote_code"),
}

GRPO: dict[str, Mapper] = {
    **SHARED,
    "max_steps": lambda v: {"run.steps": v} if v > 0 else {},
    "learning_rate": _to("optim.lr"),
    "lr_scheduler_type": _choice("optim.schedule", {"constant": "constant", "linear": "linear",
                                                    "cosine": "cosine"}, "lr_scheduler_type"),
    "warmup_steps": lambda v: {"optim.warmup_steps": int(v)} if v >= 1 else {},
    "num_generations": _to("rollout.num_generations"),
    "max_completion_length": _to("rollout.max_new_tokens"),
    "temperature": _to("rollout.temperature"),
    "top_p": _to("rollout.top_p"),
    "top_k": lambda v: {"rollout.top_k": v or 0},
    "beta": _to("algorithm.beta"),
    "epsilon": _to("algorithm.epsilon_low"),
    "epsilon_high": _epsilon_high,
    "delta": _to("algorithm.delta"),
    "num_iterations": _to("algorithm.num_iterations"),
    "scale_rewards": _scale,
    "loss_type": _loss_type,
    "importance_sampling_level": _choice("algorithm.ratio_level", {"token": "token", "sequence": "sequence"},
                                         "importance_sampling_level"),
    "multi_objective_aggregation": _to("algorithm.multi_objective_aggregation"),
    "mask_truncated_completions": _to("algorithm.mask_truncated_completions"),
    "top_entropy_quantile": _to("algorithm.top_entropy_quantile"),
    "off_policy_mask_threshold": _to("algorithm.off_policy_mask_threshold"),
    "entropy_coef": _to("algorithm.ent_coef"),
    "sapo_temperature_pos": _to("algorithm.sapo_temperature_pos"),
    "sapo_temperature_neg": _to("algorithm.sapo_temperature_neg"),
    "vespo_k_pos": _to("algorithm.vespo_k_pos"),
    "vespo_k_neg": _to("algorithm.vespo_k_neg"),
    "vespo_lambda_pos": _to("algorithm.vespo_lambda_pos"),
    "vespo_lambda_neg": _to("algorithm.vespo_lambda_neg"),
    "max_tool_calling_iterations": lambda v: {"rollout.max_turns": v + 1} if v is not None else {},
    "use_vllm": lambda v: {"rollout.engine": "vllm"} if v else {},
    "vllm_mode": _choice("rollout.vllm.mode", {"colocate": "colocate", "server": "server"}, "vllm_mode"),
    "vllm_server_base_url": _to("rollout.vllm.server_base_url"),
    "vllm_server_timeout": _to("rollout.vllm.startup_timeout_s"),
    "vllm_gpu_memory_utilization": _to("rollout.vllm.gpu_memory_utilization"),
    "vllm_tensor_parallel_size": _to("rollout.vllm.tensor_parallel_size"),
    "vllm_max_model_length": _to("rollout.vllm.max_model_len"),
    "vllm_enable_sleep_mode": _to("rollout.vllm.sleep"),
    "vllm_importance_sampling_correction": lambda v: {} if v else {"rollout.correction": "none"},
    "vllm_importance_sampling_cap": _to("rollout.correction_max"),
}
# (per_device_train_batch_size, gradient_accumulation_steps, steps_per_generation and generation_batch_size say
# how many prompts a step samples: `_batch` reads them together)
BATCH = ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
         "generation_batch_size")

SFT: dict[str, Mapper] = {
    **SHARED,
    "output_dir": _to("sft.output_dir"),  # (TRL's SFT checkpoints go there: so do ours)
    "max_steps": lambda v: {"sft.steps": v} if v > 0 else {},
    "num_train_epochs": _to("sft.epochs"),
    "learning_rate": _to("sft.lr"),
    "lr_scheduler_type": _choice("sft.schedule", {"constant": "constant", "linear": "linear", "cosine": "cosine"},
                                 "lr_scheduler_type"),
    "warmup_steps": lambda v: {"sft.warmup_steps": int(v)} if v >= 1 else {},
    "max_length": lambda v: {"sft.max_length": v} if v else {},
    "completion_only_loss": _only("completion_only_loss", True, None),
    "assistant_only_loss": lambda v: {},  # (a conversation's last assistant turn is the target, tool results out)
    "loss_type": _only("loss_type", "nll"),
    "packing": _only("packing", False),
    "padding_free": _only("padding_free", False),
    "shuffle_dataset": _only("shuffle_dataset", True),
}
SFT_BATCH = ("per_device_train_batch_size", "gradient_accumulation_steps")

# fields the trainer reads itself: reward_weights weighs the reward functions it is given, in order (api.py)
API_FIELDS = {"reward_weights"}

# fields that change nothing a run here computes: how TRL logs, loads, reports or parallelises, and what we do
# always (every completion traced, every step logged, the data order seeded)
INERT = {
    "logging_strategy", "logging_steps", "logging_first_step", "logging_nan_inf_filter",
    "log_level", "log_level_replica", "log_on_each_node", "run_name", "project", "trackio_space_id",
    "save_strategy", "save_on_each_node", "save_only_model",
    "dataloader_num_workers", "dataloader_pin_memory", "dataloader_persistent_workers", "dataloader_prefetch_factor",
    "dataloader_drop_last", "remove_unused_columns", "label_names", "disable_dropout", "log_completions",
    "num_completions_to_print", "log_unique_prompts", "log_multimodal",
    "per_device_eval_batch_size", "eval_accumulation_steps", "eval_delay", "eval_on_start", "prediction_loss_only",
    "include_num_input_tokens_seen", "skip_memory_metrics", "full_determinism",
    "data_seed", "ddp_timeout", "ddp_backend", "ddp_find_unused_parameters", "ddp_bucket_cap_mb",
    "ddp_broadcast_buffers", "local_rank", "torch_compile_mode", "torch_compile_backend", "hub_model_id",
    "hub_strategy", "hub_token", "hub_private_repo", "hub_always_push", "hub_revision",
    "resume_from_checkpoint", "do_train", "do_eval", "do_predict",
    "ignore_data_skip", "accelerator_config", "dataset_num_proc", "dataset_kwargs", "dataset_text_field",
    "eval_packing", "pad_to_multiple_of", "cast_lm_head_to_fp32", "ds3_gather_for_generation", "batch_eval_metrics",
    "average_tokens_across_devices", "restore_callback_states_from_checkpoint", "use_liger_kernel",
    "liger_kernel_config", "eval_do_concat_batches", "metric_for_best_model", "greater_is_better",
    "load_best_model_at_end", "vllm_group_port", "vllm_server_host",
    "vllm_server_port", "vllm_model_impl", "model_init_kwargs", "chat_template_kwargs", "chat_template_path",
    "num_generations_eval", "tf32", "length_column_name",
    "enable_jit_checkpoint", "torch_empty_cache_steps", "use_cache", "bf16_full_eval", "fp16_full_eval",
    "gradient_checkpointing_kwargs", "activation_offloading", "router_aux_loss_coef", "optim_args",
    "lr_scheduler_kwargs", "eos_token", "pad_token", "truncation_mode", "activation_checkpointing_kwargs",
    "dataloader_in_order", "dataloader_multiprocessing_context", "ddp_static_graph", "eval_use_gather_object",
    "include_for_metrics", "trackio_bucket_id", "trackio_static_space_id",
}

# features we do not have: TRL's default passes, any other value is refused naming the field (a trainer's own
# table comes first: SFT maps num_train_epochs, GRPO refuses it)
REFUSED = {"optim_target_modules", "train_sampling_strategy",
    "fp16", "optim", "num_train_epochs", "min_p", "repetition_penalty", "generation_kwargs", "cache_implementation",
    "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps", "use_bias_correction_kl",
    "use_adaptive_entropy", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target",
    "use_transformers_paged", "use_transformers_continuous_batching", "transformers_continuous_batching_config",
    "vllm_importance_sampling_mode", "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max",
    "vllm_structured_outputs_regex", "log_completions_hub_repo", "shuffle_dataset",
    "neftune_noise_alpha", "packing_strategy", "push_to_hub", "fsdp", "fsdp_config", "deepspeed",
    "parallelism_config", "auto_find_batch_size", "torch_compile",
    "label_smoothing_factor",
    "debug",
}


def _same(a, b) -> bool:
    a, b = getattr(a, "value", a), getattr(b, "value", b)  # (transformers' enums against their values)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 (values that do not compare: not the same)
        return False


def _defaults(args):
    """TRL's defaults for `args`'s class, its __post_init__ applied alike (on a machine where TRL's bf16 default
    is refused without a GPU, with the device and precision `args` gives)."""
    try:
        return type(args)(output_dir=args.output_dir, use_cpu=args.use_cpu)
    except ValueError:
        return type(args)(output_dir=args.output_dir, use_cpu=args.use_cpu, bf16=args.bf16)


def kind_of(args) -> str:
    """`sft` for TRL's SFTConfig, `grpo` for its GRPOConfig (either's subclass); anything else one line."""
    from trl import GRPOConfig, SFTConfig

    if isinstance(args, SFTConfig):
        return "sft"
    if isinstance(args, GRPOConfig):
        return "grpo"
    raise ConfigError(f"args: TRL's GRPOConfig (RLTrainer) or SFTConfig (SFTTrainer), not {type(args).__name__}; our "
                      "own settings go in overrides={...}")


def overrides_of(args) -> dict[str, Any]:
    """Our recipe keys for every field of a TRL `args` set away from TRL's default (module docstring); a field
    we cannot honour is one line naming it."""
    kind = kind_of(args)
    table, batch = (SFT, SFT_BATCH) if kind == "sft" else (GRPO, BATCH)
    default = _defaults(args)
    out: dict[str, Any] = table["output_dir"](args.output_dir)
    for f in dataclasses.fields(args):
        value, was = getattr(args, f.name, None), getattr(default, f.name, None)
        if f.name in batch or f.name in API_FIELDS or _same(value, was):
            continue
        if f.name in table:
            out.update(table[f.name](value))
        elif f.name in INERT:
            continue
        elif f.name in REFUSED:
            raise ConfigError(f"args.{f.name}={getattr(value, 'value', value)!r}: not supported here (docs/from_trl.md); "
                              f"leave it at TRL's default ({getattr(was, 'value', was)!r})")
        else:  # (a field newer than this table: never applied silently)
            raise ConfigError(f"args.{f.name}: a {type(args).__name__} field docuchat-rl does not know; leave it at "
                              "TRL's default")
    if any(not _same(getattr(args, k), getattr(default, k)) for k in batch):
        out.update(_batch(args, kind))
    if out.pop("optim.betas.0", None) is not None or out.pop("optim.betas.1", None) is not None:
        out.pop("optim.betas.1", None)
        out["optim.betas"] = [args.adam_beta1, args.adam_beta2]  # (our key holds both)
    return out


def _batch(args, kind: str) -> dict[str, Any]:
    """The batch fields as our keys: SFT's examples a step and a forward; GRPO's prompts a step (TRL's
    generation_batch_size / num_generations), completions an optimizer step and a forward."""
    per, accum = args.per_device_train_batch_size, args.gradient_accumulation_steps
    if kind == "sft":
        return {"sft.batch_size": per * accum, "sft.micro_batch_size": per}
    rows = args.generation_batch_size or per * (args.steps_per_generation or accum)
    if rows % args.num_generations:
        raise ConfigError(f"args: generation_batch_size {rows} (per_device_train_batch_size x steps_per_generation) is "
                          f"not a multiple of num_generations ({args.num_generations})")
    return {"rollout.prompts_per_step": rows // args.num_generations, "optim.minibatch_size": per * accum,
            "optim.micro_batch_size": per}


NOT_SAID = {"output_dir", "use_cpu", "bf16", "report_to", "disable_tqdm", "save_steps", "save_total_limit",
            "gradient_checkpointing", "activation_checkpointing", "eval_strategy", "eval_steps", "adam_beta1", "adam_beta2",
            "vllm_server_timeout", "vllm_importance_sampling_cap", "vllm_importance_sampling_correction",
            "trust_remote_code"}  # (TRL defaults on where and how a run is kept, not on what it learns)


def unshared_defaults(args, cfg) -> list[str]:
    """The fields `args` leaves at TRL's default whose mapped value differs from the recipe's: the recipe's value
    is used, and these are said once (a TRL default such as learning_rate 1e-6 is no value for this recipe)."""
    from .config import Config

    kind = kind_of(args)
    table = SFT if kind == "sft" else GRPO
    default = _defaults(args)
    flat = flat_keys(cfg.to_dict() if isinstance(cfg, Config) else cfg)
    said = []
    for name, map_ in table.items():
        if name in NOT_SAID or not _same(getattr(args, name, None), getattr(default, name, None)):
            continue
        try:
            mapped = map_(getattr(default, name))
        except ConfigError:
            continue
        differs = [f"{k} {flat.get(k)!r}" for k, v in mapped.items() if k in flat and not _same(flat[k], v)]
        if differs:
            said.append(f"{name} (TRL's {getattr(getattr(default, name), 'value', getattr(default, name))!r}; here "
                        f"{', '.join(differs)})")
    return said

