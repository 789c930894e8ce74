"""TRL's `GRPOConfig` and `SFTConfig` as our recipe: the one mapping from TRL's fields to our keys, in TRL's units.

The Python API takes a TRL `args=` object through `translate` (`RLTrainer(args=GRPOConfig(...))`,
`SFTTrainer(args=SFTConfig(...))`); docs/from_trl.md's tables are checked against `GRPO` and `SFT` here, and
tests/test_trl_differential.py runs TRL's own trainers beside ours on a table of settings. **Every field is applied
as TRL applies it, defaults included**: a GRPOConfig left at `learning_rate=1e-6` trains at 1e-6, its
`max_steps` counts optimizer steps, its `per_device_train_batch_size` is per process. The recipe fills only what
TRL has no field for, and the API says which of its values it kept (`kept_from_recipe`). Every field of TRL's
dataclass (its own and `transformers.TrainingArguments`') is in exactly one of these places:

- `GRPO` / `SFT` (their shared `TrainingArguments` fields in `SHARED`): the field maps to our keys by a function
  of its value and of the other fields (a value we cannot express is refused, naming the field);
- `JOINT`: fields read together by one function (the batch fields, the length of the run);
- `INERT`: the field changes nothing a run here computes (how TRL logs, loads, reports or parallelises);
- `API_FIELDS`: read by the trainer itself (reward_weights: the weights of the reward functions it is given);
- `REFUSED`: a feature we do not have: a value other than TRL's default is one line naming the field.

A field in none of them fails the test that walks the dataclasses (a new TRL field cannot slip through unmapped),
and the differential test fails for a mapped field no row of its table sets.

Units: one of our steps is one generation and its updates. TRL takes `steps_per_generation x num_iterations /
gradient_accumulation_steps` optimizer steps from one generation (`per_generation`), so its max_steps,
save_steps and eval_steps are divided by that; the learning-rate schedule counts optimizer steps on both sides.

Deliberately left out: TRL's model-init keywords other than the dtype, trust_remote_code and revision (load the
model yourself and pass it), a chat template cloned from another tokenizer (`chat_template_path` naming a
tokenizer: a .jinja file is taken), epoch-based saving and evaluation, and the hub (`push_to_hub`: no network).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .config import SCHEDULE_KEYS, ConfigError, flat_keys

Mapper = Callable[[Any, Any], dict[str, Any]]  # (the field's value, the whole args) -> our keys


@dataclass
class Translation:
    """A TRL config as our recipe: `overrides` (our keys, every mapped field), `notes` (what the run does that a
    TRL user would not guess from the fields alone: said once by the API), `per_generation` (TRL optimizer steps
    in one of our steps)."""

    overrides: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    per_generation: int = 1


def _name(v):
    return getattr(v, "value", v)  # (transformers' enums as their values)


def _to(*keys: str) -> Mapper:
    """The value as it is, at each key."""
    return lambda v, a: {k: v for k in keys}


def _nothing(v, a) -> dict:
    """A field another field's function reads (named where it is)."""
    return {}


def _refuse(field_: str, value, why: str) -> ConfigError:
    return ConfigError(f"args.{field_}={_name(value)!r}: {why}")


def _only(field_: str, *values: Any) -> Mapper:
    """A field whose supported values map to nothing (what we always do); others refused."""
    def map_(v, a):
        if _name(v) not in values:
            raise _refuse(field_, v, f"docuchat-rl always runs as {values[0]!r} (docs/from_trl.md)")
        return {}
    return map_


# ------------------------------------------------------------------------------------------ units and lengths
def per_generation(a) -> int:
    """TRL's optimizer steps from one generation: its generation batch is split into steps_per_generation
    micro-batches, used num_iterations times, with an optimizer step every gradient_accumulation_steps of them.
    One that straddles two generations (accumulation over generations) is refused: a step here updates on its
    own generation."""
    spg, accum = a.steps_per_generation, a.gradient_accumulation_steps
    if spg % accum:
        raise ConfigError(f"args.gradient_accumulation_steps={accum}: TRL would take an optimizer step across "
                          f"generations (steps_per_generation {spg} is not a multiple of it); here a step updates on "
                          "its own generation: make steps_per_generation a multiple of gradient_accumulation_steps")
    return spg * a.num_iterations // accum


def _prompts(a) -> int:
    return a.generation_batch_size // a.num_generations


def _grpo_steps(a, rows: int | None, per: int) -> int:
    """Our run.steps for TRL's max_steps (optimizer steps) or, at max_steps <= 0, num_train_epochs: transformers
    counts ceil(epochs x ceil(batches / accumulation)) optimizer steps, and TRL's sampler makes rows //
    prompts-a-generation generation batches an epoch, each used steps_per_generation x num_iterations times."""
    if a.max_steps > 0:
        total, what = a.max_steps, f"args.max_steps={a.max_steps}"
    else:
        if rows is None:
            raise ConfigError("args.num_train_epochs: the training rows must be known to count the run's steps")
        generations = rows // _prompts(a)
        if generations < 1:
            raise ConfigError(f"args.num_train_epochs: {rows} training rows make no generation batch of "
                              f"{_prompts(a)} prompts (generation_batch_size / num_generations)")
        total = math.ceil(a.num_train_epochs * generations * per)
        what = f"args.num_train_epochs={a.num_train_epochs} ({total} optimizer steps over {rows} rows)"
    if total % per:
        raise ConfigError(f"{what}: TRL would stop inside a generation's {per} optimizer steps (steps_per_generation "
                          f"x num_iterations / gradient_accumulation_steps); here a run ends after a whole one: give "
                          f"max_steps a multiple of {per}")
    return total // per


def _every(steps, per: int):
    """TRL's save_steps / eval_steps (optimizer steps, or a share of the run below 1) in our steps."""
    return steps if 0 < steps < 1 else max(1, math.ceil(steps / per))


# ------------------------------------------------------------------------------------------------ mappers
def _betas(v, a) -> dict:  # (adam_beta1 and adam_beta2: our key holds both)
    return {"optim.betas": [a.adam_beta1, a.adam_beta2]}


def _optim(v, a) -> dict:
    if _name(v) not in ("adamw_torch", "adamw_torch_fused"):
        raise _refuse("optim", v, "supported here are adamw_torch and adamw_torch_fused (the same AdamW; "
                                  "the fused kernel is a speed choice)")
    return {"optim.name": "adamw"}


def _bf16(v, a) -> dict:
    if a.fp16:
        raise _refuse("fp16", True, "float16 training with a loss scaler is not built: use bf16=True")
    return {"model.dtype": "bf16-autocast" if v else "float32"}


def _report_to(v, a) -> dict:
    names = [v] if isinstance(v, str) else list(v or [])
    names = [n for n in names if n not in ("none", "all")] if "all" not in names else ["wandb"]
    other = [n for n in names if n != "wandb"]
    if other:
        raise _refuse("report_to", v, f"here metrics go to metrics.jsonl and, with wandb, to Weights & Biases "
                                      f"({other[0]} is not built)")
    return {"logging.wandb": "wandb" in names}


def _model_init(v, a) -> dict:
    """model_init_kwargs: what changes the model we load (its dtype, trust_remote_code, revision)."""
    out = {}
    dtypes = {"bfloat16": "bfloat16", "float32": "float32", "float16": "float16", "auto": "auto"}
    for key, value in (v or {}).items():
        if key in ("dtype", "torch_dtype"):
            name = str(value).removeprefix("torch.")
            if name not in dtypes:
                raise _refuse("model_init_kwargs", v, f"dtype {value!r}: supported are {sorted(dtypes)}")
            out["model.dtype"] = dtypes[name]
        elif key in ("trust_remote_code", "revision"):
            out[f"model.{key}"] = value
        elif key == "quantization_config":
            out.update(quantization_of(value))
        else:
            raise _refuse("model_init_kwargs", v, f"{key!r} is not built here (its dtype, trust_remote_code and "
                                                  "revision are; or load the model yourself and pass it)")
    return out


def quantization_of(q) -> dict:
    """transformers' BitsAndBytesConfig (TRL's `model_init_kwargs={"quantization_config": ...}`, its QLoRA) as our
    model.quantization keys; a setting we do not have is refused naming it."""
    from transformers import BitsAndBytesConfig

    if isinstance(q, dict):
        q = BitsAndBytesConfig(**q)
    if not isinstance(q, BitsAndBytesConfig):
        raise ConfigError(f"args.model_init_kwargs: quantization_config {type(q).__name__}: bitsandbytes' "
                          "BitsAndBytesConfig here (4-bit nf4/fp4 or 8-bit)")
    default = BitsAndBytesConfig(load_in_4bit=q.load_in_4bit, load_in_8bit=q.load_in_8bit)
    taken = {"load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "bnb_4bit_compute_dtype",
             "bnb_4bit_use_double_quant", "bnb_4bit_quant_storage"}
    for k, v in q.to_dict().items():
        if k not in taken and k in default.to_dict() and not _same(v, default.to_dict()[k]):
            raise ConfigError(f"args.model_init_kwargs: quantization_config.{k}={v!r} is not built here (leave it at "
                              f"bitsandbytes' default)")
    if q.load_in_8bit:
        return {"model.quantization": "int8"}
    if not q.load_in_4bit:
        return {}
    compute = str(q.bnb_4bit_compute_dtype).removeprefix("torch.")
    if compute not in ("float32", "bfloat16"):
        raise ConfigError(f"args.model_init_kwargs: quantization_config.bnb_4bit_compute_dtype={compute}: float32 or "
                          "bfloat16 here")
    return {"model.quantization": q.bnb_4bit_quant_type, "model.bnb_4bit_compute_dtype": compute,
            "model.bnb_4bit_use_double_quant": bool(q.bnb_4bit_use_double_quant)}


def _chat_template_path(v, a) -> dict:
    if v is None:
        return {}
    if not str(v).endswith((".jinja", ".j2")):
        raise _refuse("chat_template_path", v, "a Jinja template file (.jinja) here; a tokenizer to clone the "
                                               "template and its tokens from is not built")
    return {"model.chat_template": str(v)}


def _cast_head(v, a) -> dict:
    if v and a.bf16:
        raise _refuse("cast_lm_head_to_fp32", v, "the output head runs under bfloat16 autocast here (bf16=True)")
    return {}  # (in float32 the head is float32 already)


def _schedule(kind: str) -> Mapper:
    """lr_scheduler_type (with warmup_steps and lr_scheduler_kwargs) at `kind`'s keys (optim or sft)."""
    def map_(v, a):
        name = _name(v)
        warm = a.warmup_steps
        if warm < 0 or (isinstance(warm, float) and not warm.is_integer() and warm >= 1):
            raise _refuse("warmup_steps", warm, "a whole number of optimizer steps, or a share of the run below 1")
        kwargs = dict(a.lr_scheduler_kwargs or {})
        if name == "constant":
            warm = 0  # (transformers' constant schedule has no warm-up: TRL's warmup_steps does nothing there)
        elif name == "constant_with_warmup":
            name = "constant"  # (our constant warms up over warmup_steps)
        elif name not in SCHEDULE_KEYS:
            raise _refuse("lr_scheduler_type", v, f"supported here are {sorted({*SCHEDULE_KEYS, 'constant_with_warmup'})} "
                                                  "(the others need a metric to step on)")
        return {f"{kind}.schedule": name, f"{kind}.schedule_kwargs": kwargs, f"{kind}.warmup_steps": warm}
    return map_


def _checkpoints(v, a) -> dict:
    """save_strategy with save_steps (in our steps) and save_total_limit."""
    strategy = _name(a.save_strategy)
    if strategy not in ("steps", "no"):
        raise _refuse("save_strategy", a.save_strategy, "supported here are 'steps' (save_steps) and 'no' (only the "
                                                        "run's last step is saved, as every run here ends saved)")
    every = None if strategy == "no" else _every(a.save_steps, per_generation(a) if _is_grpo(a) else 1)
    return {"checkpoint.every": every, "checkpoint.keep_last": a.save_total_limit}


def _evaluations(v, a) -> dict:
    """eval_strategy with eval_steps (logging_steps when None), in our steps."""
    strategy = _name(a.eval_strategy)
    if strategy == "no":
        return {"eval.every": None}
    if strategy != "steps":
        raise _refuse("eval_strategy", a.eval_strategy, "evaluation here is every eval_steps steps ('steps') or "
                                                        "none ('no')")
    steps = a.eval_steps if a.eval_steps is not None else a.logging_steps
    out = {"eval.every": _every(steps, per_generation(a) if _is_grpo(a) else 1)}
    if _is_grpo(a):  # (TRL's evaluation samples num_generations_eval completions a prompt: our pass@k)
        out["eval.pass_k"] = a.num_generations_eval or a.num_generations
    return out


def _loss_type(v, a) -> dict:
    """TRL's loss_type as our aggregation and surrogate (docs/from_trl.md's rows)."""
    table = {"grpo": {"algorithm.loss_aggregation": "grpo"}, "dapo": {"algorithm.loss_aggregation": "dapo"},
             "bnpo": {"algorithm.loss_aggregation": "bnpo"}, "dr_grpo": {"algorithm.loss_aggregation": "dr_grpo"},
             "luspo": {"algorithm.loss_aggregation": "luspo"},
             "cispo": {"algorithm.surrogate": "cispo", "algorithm.loss_aggregation": "dapo"},
             "sapo": {"algorithm.surrogate": "sapo", "algorithm.loss_aggregation": "grpo"},
             "vespo": {"algorithm.surrogate": "vespo", "algorithm.loss_aggregation": "dapo"}}
    if v not in table:
        raise _refuse("loss_type", v, f"supported here are {sorted(table)}")
    return table[v]


def _clip(v, a) -> dict:
    """epsilon and epsilon_high (None: epsilon, TRL's symmetric default); under cispo TRL caps the ratio at
    epsilon_high itself, here at 1 + epsilon_high."""
    high = a.epsilon if a.epsilon_high is None else a.epsilon_high
    if a.loss_type == "cispo":
        if high <= 1:
            raise _refuse("epsilon_high", a.epsilon_high, f"under loss_type cispo TRL caps the ratio at epsilon_high "
                                                          f"({high}: every ratio near 1 would be capped); set it above 1 "
                                                          "(MiniMax-M1: 5.0)")
        return {"algorithm.epsilon_low": a.epsilon, "algorithm.epsilon_high": high - 1.0}
    return {"algorithm.epsilon_low": a.epsilon, "algorithm.epsilon_high": high}


def _scale(v, a) -> dict:
    named = {True: "group", False: "none", "group": "group", "batch": "batch", "none": "none"}
    if v not in named:
        raise _refuse("scale_rewards", v, "supported here are group, batch, none (or True/False)")
    return {"algorithm.scale": named[v]}


def _surrogate_key(key: str, surrogate: str) -> Mapper:
    """A knob of one loss type: applied under it; elsewhere TRL's default only (TRL ignores it; here a value that
    would change nothing is refused, naming it)."""
    def map_(v, a):
        mine = {"sapo": "sapo", "vespo": "vespo"}.get(a.loss_type, "clip")
        if mine == surrogate:
            return {key: v}
        name = key.rsplit(".", 1)[-1]  # (TRL's field has our key's name)
        if not _same(v, getattr(_defaults(a), name)):
            raise _refuse(name, v, f"applies to loss_type {surrogate}, not {a.loss_type}")
        return {}
    return map_


VLLM_COLOCATED = ("vllm_gpu_memory_utilization", "vllm_tensor_parallel_size", "vllm_max_model_length",
                  "vllm_enable_sleep_mode")
VLLM_SERVED = ("vllm_server_base_url", "vllm_server_host", "vllm_server_port", "vllm_server_timeout")
VLLM_CORRECTION = ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
                   "vllm_importance_sampling_clip_min", "vllm_importance_sampling_clip_max",
                   "vllm_importance_sampling_cap")


def _vllm(v, a) -> dict:
    """use_vllm with the vLLM fields of its mode and TRL's importance-sampling correction (which TRL applies under
    vLLM only); a vLLM field set without use_vllm, or one of the other mode, is refused (TRL ignores it)."""
    default = _defaults(a)
    moved = [f for f in (*VLLM_COLOCATED, *VLLM_SERVED, *VLLM_CORRECTION, "vllm_mode")
             if not _same(getattr(a, f), getattr(default, f))]
    if not v:
        if moved:
            raise _refuse(moved[0], getattr(a, moved[0]), "applies with use_vllm=True")
        return {}
    mode = _name(a.vllm_mode)
    if mode not in ("colocate", "server"):
        raise _refuse("vllm_mode", a.vllm_mode, "supported here are colocate and server")
    other = VLLM_SERVED if mode == "colocate" else VLLM_COLOCATED
    if any(f in moved for f in other):
        f = next(f for f in other if f in moved)
        raise _refuse(f, getattr(a, f), f"does not apply to vllm_mode {mode!r}")
    out: dict[str, Any] = {"rollout.engine": "vllm", "rollout.vllm.mode": mode}
    if mode == "server":
        out["rollout.vllm.server_base_url"] = (a.vllm_server_base_url or
                                               f"http://{a.vllm_server_host}:{a.vllm_server_port}")
        out["rollout.vllm.startup_timeout_s"] = a.vllm_server_timeout
    else:
        out.update({"rollout.vllm.gpu_memory_utilization": a.vllm_gpu_memory_utilization,
                    "rollout.vllm.tensor_parallel_size": a.vllm_tensor_parallel_size,
                    "rollout.vllm.max_model_len": a.vllm_max_model_length,
                    "rollout.vllm.sleep": a.vllm_enable_sleep_mode})
    if a.vllm_importance_sampling_correction:
        high = a.vllm_importance_sampling_clip_max
        out.update({"rollout.correction": a.vllm_importance_sampling_mode,
                    "rollout.correction_min": a.vllm_importance_sampling_clip_min or 0.0,
                    "rollout.correction_max": 1e30 if high is None else high})
    return out


def _tool_turns(v, a) -> dict:
    return {"rollout.max_turns": v + 1} if v is not None else {}


def _shuffle(v, a) -> dict:
    if not v and _is_grpo(a):
        raise _refuse("shuffle_dataset", v, "the data order here is always a seeded shuffle (run.seed)")
    return {}  # (SFT: TRL's sampler shuffles every epoch whatever it says; so does ours)


def _sft_length(v, a) -> dict:
    """max_steps, else num_train_epochs (sft.steps and sft.epochs exclude each other)."""
    if a.max_steps > 0:
        return {"sft.steps": a.max_steps, "sft.epochs": None}
    return {"sft.steps": None, "sft.epochs": float(a.num_train_epochs)}


def _truncation(v, a) -> dict:
    if _name(v) not in ("keep_start", "keep_end"):
        raise _refuse("truncation_mode", v, "supported here are keep_start and keep_end")
    return {"sft.truncation": _name(v) if a.max_length is not None else "refuse"}


def _completion_only(v, a) -> dict:
    return {"sft.loss_tokens": {True: "target", False: "all", None: "by_format"}[v]}


def _is_grpo(a) -> bool:
    return hasattr(a, "num_generations")


# ------------------------------------------------------------------------------------------------ the tables
# TrainingArguments fields both trainers read, mapped alike (each trainer's learning-rate keys are its own)
SHARED: dict[str, Mapper] = {
    "output_dir": _to("run.output_dir"),
    "seed": _to("run.seed"),
    "max_grad_norm": _to("optim.max_grad_norm"),
    "weight_decay": _to("optim.weight_decay"),
    "adam_epsilon": _to("optim.eps"),
    "adam_beta1": _betas,
    "adam_beta2": _nothing,  # (adam_beta1's)
    "optim": _optim,
    "save_steps": _checkpoints,
    "save_strategy": _nothing,  # (save_steps')
    "save_total_limit": _nothing,  # (save_steps')
    "gradient_checkpointing": _to("model.gradient_checkpointing"),
    "activation_checkpointing": _to("model.gradient_checkpointing"),  # (transformers 5's name for it)
    "use_cpu": lambda v, a: {"model.device": "cpu"} if v else {},
    "bf16": _bf16,
    "fp16": _nothing,  # (bf16's: refused)
    "report_to": _report_to,
    "disable_tqdm": lambda v, a: {"logging.progress": not v},
    "eval_strategy": _evaluations,
    "eval_steps": _nothing,  # (eval_strategy's)
    "trust_remote_code": _to("model.trust_remote_code"),
    "model_init_kwargs": _model_init,
    "chat_template_path": _chat_template_path,
    "shuffle_dataset": _shuffle,
}

GRPO: dict[str, Mapper] = {
    **SHARED,
    "learning_rate": _to("optim.lr"),
    "lr_scheduler_type": _schedule("optim"),
    "warmup_steps": _nothing,  # (lr_scheduler_type's)
    "lr_scheduler_kwargs": _nothing,  # (lr_scheduler_type's)
    "num_generations": _to("rollout.num_generations"),
    "max_completion_length": _to("rollout.max_new_tokens"),
    "temperature": _to("rollout.temperature"),
    "top_p": _to("rollout.top_p"),
    "top_k": lambda v, a: {"rollout.top_k": v or 0},
    "beta": _to("algorithm.beta"),
    "epsilon": _clip,
    "epsilon_high": _nothing,  # (epsilon's)
    "delta": lambda v, a: {"algorithm.delta": v} if v is not None else {},
    "num_iterations": _to("algorithm.num_iterations"),
    "scale_rewards": _scale,
    "loss_type": _loss_type,
    "importance_sampling_level": lambda v, a: {"algorithm.ratio_level": v},
    "multi_objective_aggregation": _to("algorithm.multi_objective_aggregation"),
    "mask_truncated_completions": _to("algorithm.mask_truncated_completions"),
    "top_entropy_quantile": _to("algorithm.top_entropy_quantile"),
    "off_policy_mask_threshold": _to("algorithm.off_policy_mask_threshold"),
    "entropy_coef": _to("algorithm.ent_coef"),
    "use_bias_correction_kl": _to("algorithm.kl_bias_correction"),
    "sapo_temperature_pos": _surrogate_key("algorithm.sapo_temperature_pos", "sapo"),
    "sapo_temperature_neg": _surrogate_key("algorithm.sapo_temperature_neg", "sapo"),
    "vespo_k_pos": _surrogate_key("algorithm.vespo_k_pos", "vespo"),
    "vespo_k_neg": _surrogate_key("algorithm.vespo_k_neg", "vespo"),
    "vespo_lambda_pos": _surrogate_key("algorithm.vespo_lambda_pos", "vespo"),
    "vespo_lambda_neg": _surrogate_key("algorithm.vespo_lambda_neg", "vespo"),
    "max_tool_calling_iterations": _tool_turns,
    "disable_dropout": _to("model.disable_dropout"),
    "chat_template_kwargs": lambda v, a: {"model.chat_template_kwargs": dict(v or {})},
    "cast_lm_head_to_fp32": _cast_head,
    "num_generations_eval": _nothing,  # (eval_strategy's)
    "use_vllm": _vllm,
    **{f: _nothing for f in (*VLLM_COLOCATED, *VLLM_SERVED, *VLLM_CORRECTION, "vllm_mode")},  # (use_vllm's)
}
# read together: the batch fields (prompts a step, completions an optimizer step and a forward) and the run's
# length (max_steps, else num_train_epochs), in `_joint`
JOINT = ("per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation", "generation_batch_size",
         "max_steps", "num_train_epochs")

SFT: dict[str, Mapper] = {
    **SHARED,
    "output_dir": _to("sft.output_dir"),  # (TRL's SFT checkpoints go there: so do ours)
    "learning_rate": _to("sft.lr"),
    "lr_scheduler_type": _schedule("sft"),
    "warmup_steps": _nothing,
    "lr_scheduler_kwargs": _nothing,
    "max_length": lambda v, a: {"sft.max_length": v},
    "truncation_mode": _truncation,
    "eos_token": _to("sft.eos_token"),
    "completion_only_loss": _completion_only,
    "assistant_only_loss": _only("assistant_only_loss", False),
    "loss_type": _only("loss_type", "nll"),
    "packing": _only("packing", False),
    "padding_free": _only("padding_free", False),
}

# fields the trainer reads itself: reward_weights weighs the reward functions it is given, in order (api.py)
API_FIELDS = {"reward_weights"}

# fields that change nothing a run here computes: how TRL logs, loads, reports or parallelises, and what we do
# always (every completion traced, every step logged, the data order seeded)
INERT = {
    "logging_strategy", "logging_steps", "logging_first_step", "logging_nan_inf_filter",
    "log_level", "log_level_replica", "log_on_each_node", "run_name", "project", "trackio_space_id",
    "save_on_each_node", "save_only_model",
    "dataloader_num_workers", "dataloader_pin_memory", "dataloader_persistent_workers", "dataloader_prefetch_factor",
    "dataloader_drop_last", "remove_unused_columns", "label_names", "log_completions",
    "num_completions_to_print", "log_unique_prompts", "log_multimodal",
    "per_device_eval_batch_size", "eval_accumulation_steps", "eval_delay", "eval_on_start", "prediction_loss_only",
    "include_num_input_tokens_seen", "skip_memory_metrics", "full_determinism",
    "data_seed", "ddp_timeout", "ddp_backend", "ddp_find_unused_parameters", "ddp_bucket_cap_mb",
    "ddp_broadcast_buffers", "local_rank", "torch_compile_mode", "torch_compile_backend", "hub_model_id",
    "hub_strategy", "hub_token", "hub_private_repo", "hub_always_push", "hub_revision",
    "resume_from_checkpoint", "do_train", "do_eval", "do_predict",
    "ignore_data_skip", "accelerator_config", "dataset_num_proc", "dataset_kwargs", "dataset_text_field",
    "eval_packing", "pad_to_multiple_of", "ds3_gather_for_generation", "batch_eval_metrics",
    "average_tokens_across_devices", "restore_callback_states_from_checkpoint", "use_liger_kernel",
    "liger_kernel_config", "eval_do_concat_batches", "metric_for_best_model", "greater_is_better",
    "load_best_model_at_end", "vllm_group_port", "vllm_model_impl", "tf32", "length_column_name",
    "enable_jit_checkpoint", "torch_empty_cache_steps", "use_cache", "bf16_full_eval", "fp16_full_eval",
    "gradient_checkpointing_kwargs", "activation_offloading", "router_aux_loss_coef", "optim_args",
    "pad_token", "activation_checkpointing_kwargs",
    "dataloader_in_order", "dataloader_multiprocessing_context", "ddp_static_graph", "eval_use_gather_object",
    "include_for_metrics", "trackio_bucket_id", "trackio_static_space_id",
}

# features we do not have: TRL's default passes, any other value is refused naming the field
REFUSED = {"optim_target_modules", "train_sampling_strategy",
    "min_p", "repetition_penalty", "generation_kwargs", "cache_implementation",
    "sync_ref_model", "ref_model_mixup_alpha", "ref_model_sync_steps",
    "use_adaptive_entropy", "entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target",
    "use_transformers_paged", "use_transformers_continuous_batching", "transformers_continuous_batching_config",
    "vllm_structured_outputs_regex", "log_completions_hub_repo",
    "neftune_noise_alpha", "packing_strategy", "push_to_hub", "fsdp", "fsdp_config", "deepspeed",
    "parallelism_config", "auto_find_batch_size", "torch_compile",
    "label_smoothing_factor",
    "debug",
}


def _same(a, b) -> bool:
    a, b = _name(a), _name(b)
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


def needs_rows(args) -> bool:
    """Whether the run's length depends on the number of training rows (a GRPOConfig counted in epochs)."""
    return kind_of(args) == "grpo" and args.max_steps <= 0


def translate(args, rows: int | None = None) -> Translation:
    """Our recipe keys for every field of a TRL `args`, as TRL applies it (module docstring); a field we cannot
    honour is one line naming it. `rows`: the number of training rows, when the run is counted in epochs
    (`needs_rows`)."""
    import warnings

    with warnings.catch_warnings():  # (reading a deprecated alias, gradient_checkpointing, warns every time)
        warnings.filterwarnings("ignore", message=".*is deprecated and will be removed", category=FutureWarning)
        return _translate(args, rows)


def _translate(args, rows: int | None) -> Translation:
    kind = kind_of(args)
    table = SFT if kind == "sft" else GRPO
    default = _defaults(args)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(args):
        value, was = getattr(args, f.name, None), getattr(default, f.name, None)
        if f.name in JOINT or f.name in API_FIELDS or f.name in INERT:
            continue
        if f.name in table:
            out.update(table[f.name](value, args))
        elif f.name in REFUSED or f.name in GRPO or f.name in SFT:
            if not _same(value, was):
                raise ConfigError(f"args.{f.name}={_name(value)!r}: not supported here (docs/from_trl.md); "
                                  f"leave it at TRL's default ({_name(was)!r})")
        else:  # (a field newer than this table: never applied silently)
            raise ConfigError(f"args.{f.name}: a {type(args).__name__} field docuchat-rl does not know; leave it at "
                              "TRL's default")
    t = Translation(out)
    _joint(args, kind, rows, t)
    _notes(args, kind, t)
    return t


def _joint(a, kind: str, rows: int | None, t: Translation) -> None:
    """The batch fields and the run's length: SFT's examples a step and a forward, and its steps or epochs; GRPO's
    prompts a step (generation_batch_size / num_generations), completions an optimizer step (per-device x
    accumulation x processes) and a forward (per-device), and run.steps in generations."""
    per_device, accum, world = a.per_device_train_batch_size, a.gradient_accumulation_steps, a.world_size
    # the prompt is the data set's (TRL adds no system prompt or demonstration): a text as it is, a conversation
    # through the chat template
    t.overrides.update({"data.prompt_format": "as_given", "data.system_prompt": None, "data.few_shot": []})
    if kind == "sft":
        t.overrides.update({"sft.batch_size": per_device * accum * world, "sft.micro_batch_size": per_device,
                            "model.disable_dropout": False,  # (transformers' Trainer trains in train mode)
                            **_sft_length(None, a)})
        return
    t.per_generation = per = per_generation(a)
    minibatch = per_device * accum * world
    if minibatch % a.num_generations:
        raise ConfigError(f"args.per_device_train_batch_size={per_device}: an optimizer step of {minibatch} "
                          f"completions (x gradient_accumulation_steps {accum} x {world} processes) splits a group of "
                          f"num_generations={a.num_generations}; here an optimizer step takes whole groups: make it "
                          "a multiple of num_generations")
    t.overrides.update({"rollout.prompts_per_step": _prompts(a), "optim.minibatch_size": minibatch,
                        "optim.micro_batch_size": per_device, "run.steps": _grpo_steps(a, rows, per)})


def _notes(a, kind: str, t: Translation) -> None:
    """What a TRL user should hear once about how the fields are run (the API warns with these)."""
    if _name(a.lr_scheduler_type) == "constant" and a.warmup_steps:
        t.notes.append(f"lr_scheduler_type 'constant' has no warm-up in TRL (transformers' constant schedule), so "
                       f"warmup_steps={a.warmup_steps} does nothing here either: use 'constant_with_warmup' for one")
    if kind == "grpo" and t.per_generation > 1:
        t.notes.append(f"a step here is one generation and its {t.per_generation} optimizer steps (steps_per_generation "
                       f"{a.steps_per_generation} x num_iterations {a.num_iterations} / gradient_accumulation_steps "
                       f"{a.gradient_accumulation_steps}): max_steps {t.overrides['run.steps'] * t.per_generation} are "
                       f"run.steps {t.overrides['run.steps']}, and callbacks' state.global_step counts optimizer steps")


def overrides_of(args, rows: int | None = None) -> dict[str, Any]:
    """`translate(args, rows).overrides`: our recipe keys for every field of a TRL `args`."""
    return translate(args, rows).overrides


def kept_from_recipe(recipe_cfg, trl_keys: set[str], given: set[str], name: str, lora_given: bool) -> str | None:
    """What the recipe (`recipe_cfg`, before TRL's fields) still decides in a run from a TRL config: its keys that
    differ from our defaults, less those TRL's fields (`trl_keys`) or the caller's arguments (`given`) set; and the
    LoRA adapter where no peft_config was given (TRL would train every weight). One sentence, or None."""
    from .config import Config

    mine = flat_keys(recipe_cfg.to_dict())
    base = flat_keys(Config().to_dict())
    covered = lambda k: any(k == c or k.startswith(c + ".") or c.startswith(k + ".") for c in trl_keys | given)  # noqa: E731
    kept = [f"{k} {v!r}" for k, v in mine.items()
            if k not in ("run.output_dir", "sft.output_dir") and not _same(v, base.get(k)) and not covered(k)]
    parts = []
    if not lora_given:
        lora = recipe_cfg.lora
        parts.append(f"no peft_config, so the recipe's LoRA adapter (r {lora.r}, alpha {lora.alpha}, on "
                     f"{lora.target_modules}) is trained where TRL would train every weight")
    if kept:
        parts.append("its " + ", ".join(kept))
    return f"the recipe {name!r} fills what TRL has no field for: " + "; ".join(parts) if parts else None


# ------------------------------------------------------------------------------------------------ peft_config
def _modules(field_: str, key: str, allow_none: bool = True) -> Mapper:
    def map_(v, c):
        if v is None:
            return {key: None}
        if isinstance(v, str):
            if field_ == "target_modules" and v == "all-linear":
                return {key: "all-linear"}
            raise _refuse(f"peft_config.{field_}", v, "a list of module names here (a regex is not built)")
        return {key: sorted(v)}
    return map_


def _layers(v, c) -> dict:
    return {"lora.layers_to_transform": None if v is None else [v] if isinstance(v, int) else list(v)}


def _layers_pattern(v, c) -> dict:
    if isinstance(v, list):
        if len(v) != 1:
            raise _refuse("peft_config.layers_pattern", v, "one name of the model's list of layers")
        v = v[0]
    return {"lora.layers_pattern": v}


def _init(v, c) -> dict:
    if v not in (True, False, "gaussian"):
        raise _refuse("peft_config.init_lora_weights", v, "supported here are True, False and 'gaussian' (pissa, olora, "
                                                          "loftq, eva and corda change the base weights or need data)")
    return {"lora.init_lora_weights": v}


def _lora_only(field_: str, *values, why: str) -> Mapper:
    def map_(v, c):
        if _name(v) not in values:
            raise _refuse(f"peft_config.{field_}", v, why)
        return {}
    return map_


LORA: dict[str, Mapper] = {
    "r": _to("lora.r"),
    "lora_alpha": lambda v, c: {"lora.alpha": float(v)},
    "lora_dropout": lambda v, c: {"lora.dropout": float(v)},
    "target_modules": _modules("target_modules", "lora.target_modules"),
    "exclude_modules": _modules("exclude_modules", "lora.exclude_modules"),
    "layers_to_transform": _layers,
    "layers_pattern": _layers_pattern,
    "use_rslora": _to("lora.use_rslora"),
    "rank_pattern": lambda v, c: {"lora.rank_pattern": dict(v or {})},
    "alpha_pattern": lambda v, c: {"lora.alpha_pattern": {k: float(x) for k, x in (v or {}).items()}},
    "init_lora_weights": _init,
    "task_type": _lora_only("task_type", "CAUSAL_LM", None, why="the adapter here is a causal LM's (CAUSAL_LM)"),
    "bias": _lora_only("bias", "none", why="trained base biases would stay in the reference model (adapter disabled) "
                                           "and out of the merged sampling weights; not built"),
    "modules_to_save": _lora_only("modules_to_save", None, why="whole trained copies of modules are not built (the "
                                                               "sampler reads the base module's weights)"),
    "use_dora": _lora_only("use_dora", False, why="DoRA is not built (its magnitude vector is not merged for sampling)"),
    "lora_bias": _lora_only("lora_bias", False, why="a bias on LoRA's B is not built (it is not in the merged delta)"),
    "trainable_token_indices": _lora_only("trainable_token_indices", None, why="trained embedding rows are not built"),
    "inference_mode": _lora_only("inference_mode", False, why="a frozen adapter trains nothing"),
    "fan_in_fan_out": _lora_only("fan_in_fan_out", False, why="peft sets it itself for the layers that need it "
                                                              "(GPT-2's Conv1D)"),
}
LORA_INERT = {"peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision", "runtime_config",
              "megatron_core"}  # (peft's bookkeeping, and runtime_config's ephemeral GPU offload: where, not what)


def lora_of(peft_config) -> dict[str, Any]:
    """peft's LoraConfig as our lora section, every field applied or refused by name (LORA; a field of neither
    LORA nor LORA_INERT set away from peft's default is refused); `target_modules=None` keeps peft's default for
    the architecture (lora.target_modules null)."""
    from peft import LoraConfig

    if not isinstance(peft_config, LoraConfig):
        raise ConfigError(f"peft_config: a peft LoraConfig (the adapter trained here is LoRA), not "
                          f"{type(peft_config).__name__}")
    default = LoraConfig()
    out: dict[str, Any] = {}
    for f in dataclasses.fields(peft_config):
        value = getattr(peft_config, f.name)
        if f.name in LORA:
            out.update(LORA[f.name](value, peft_config))
        elif f.name not in LORA_INERT and not _same(value, getattr(default, f.name)):
            raise _refuse(f"peft_config.{f.name}", value, f"not supported here; leave it at peft's default "
                                                          f"({_name(getattr(default, f.name))!r})")
    return out
