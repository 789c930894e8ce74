"""TRL's GRPOConfig, SFTConfig and peft's LoraConfig as our recipe (docuchat_rl/trl_args.py): every field
classified, every field applied as TRL applies it (defaults included) or refused by name (generated over the
dataclasses), TRL's units converted, docs/from_trl.md's table the one the code applies. What the trainers then do
with it is compared with TRL's own trainers in tests/test_trl_differential.py."""

from __future__ import annotations

import dataclasses
import re
import warnings

import pytest

from docuchat_rl.config import ConfigError, config_from_dict, load_config

from .conftest import ROOT

warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*is deprecated")


def _grpo(**kw):
    from trl import GRPOConfig

    return GRPOConfig(output_dir="/tmp/d", use_cpu=True, **kw)


def _translate(args, rows=64):
    from docuchat_rl.trl_args import translate

    return translate(args, rows)


@pytest.mark.parametrize("kind", ["grpo", "sft"])
def test_every_field_of_trls_config_is_mapped_inert_or_refused(kind):
    """Every field of TRL's GRPOConfig / SFTConfig (its own and TrainingArguments') is in the mapping, the joint
    fields, the inert set or the refused set: a field TRL adds later fails here, never slips through unmapped."""
    from trl import GRPOConfig, SFTConfig

    from docuchat_rl import trl_args as t

    cls, table = (GRPOConfig, t.GRPO) if kind == "grpo" else (SFTConfig, t.SFT)
    known = set(table) | set(t.JOINT) | t.INERT | t.REFUSED | t.API_FIELDS
    missing = [f.name for f in dataclasses.fields(cls) if f.name not in known]
    assert not missing, f"{cls.__name__} fields neither mapped, inert nor refused: {missing}"


def _other_value(default, field):
    """A value of `field` other than TRL's default that TRL itself may accept, or None where none is simple."""
    import enum

    if isinstance(default, bool):
        return not default
    if isinstance(default, enum.Enum):
        others = [m for m in type(default) if m != default]
        return others[0].value if others else None
    if isinstance(default, int):
        return default + 2
    if isinstance(default, float):
        return default / 2 if default else 0.5
    if isinstance(default, str) and field.name not in ("output_dir",):
        return default + "x"
    if default is None and "float" in str(field.type) and "int" not in str(field.type):
        return 0.5
    if default is None and "int" in str(field.type):
        return 3
    return None


@pytest.mark.parametrize("kind", ["grpo", "sft"])
def test_a_field_set_away_from_trls_default_is_applied_or_refused_by_name(kind):
    """Generated over the dataclass: each field set to another value TRL accepts either changes the recipe keys
    (mapped), changes nothing (inert) or is one ConfigError naming `args.<field>` (or the field its value sets)."""
    from trl import GRPOConfig, SFTConfig

    from docuchat_rl import trl_args as t

    cls, table = (GRPOConfig, t.GRPO) if kind == "grpo" else (SFTConfig, t.SFT)
    default = cls(output_dir="/tmp/d", use_cpu=True)
    base = _translate(default).overrides
    tried = mapped = refused = 0
    for f in dataclasses.fields(cls):
        value = _other_value(getattr(default, f.name), f)
        if value is None or f.name in ("output_dir", "use_cpu"):
            continue
        try:
            args = cls(output_dir="/tmp/d", use_cpu=True, **{f.name: value})
        except Exception:  # noqa: BLE001 (TRL refuses the value itself: not a config a user could pass)
            continue
        tried += 1
        try:
            got = _translate(args).overrides
        except ConfigError as e:
            refused += 1
            named = re.search(r"args\.(\w+)", str(e))
            assert named, (f.name, str(e))
            assert named.group(1) == f.name or getattr(args, named.group(1)) != getattr(default, named.group(1)), \
                (f.name, str(e))
            assert f.name not in t.INERT, f"inert field {f.name} refused"
            continue
        if f.name in t.INERT:
            assert got == base, f"{f.name} changed the recipe though it is inert: {got}"
        else:
            mapped += got != base
    assert tried > 60 and mapped > 15 and refused > 5, (tried, mapped, refused)


def test_a_grpo_config_at_trls_defaults_trains_at_trls_values():
    """The issue's case: learning_rate=1e-6, seed=42, loss_type="dapo", max_completion_length=512,
    lr_scheduler_type="linear" are all TRL's defaults, and each is the run's (not the recipe's 5e-4, seed 0, grpo,
    64 tokens, constant); the batch is TRL's (8 completions of one prompt a step, one optimizer step a generation),
    the clip symmetric, the KL bias-corrected, the prompt the data set's."""
    cfg = load_config("default")
    got = config_from_dict(cfg.to_dict(), [f"{k}={_yaml(v)}" for k, v in _translate(
        _grpo(learning_rate=1e-6, seed=42, loss_type="dapo", max_completion_length=512, lr_scheduler_type="linear",
              bf16=False), rows=6000).overrides.items()])
    assert (got.optim.lr, got.run.seed, got.algorithm.loss_aggregation, got.rollout.max_new_tokens,
            got.optim.schedule) == (1e-6, 42, "dapo", 512, "linear")
    assert (got.rollout.prompts_per_step, got.rollout.num_generations, got.optim.minibatch_size,
            got.optim.micro_batch_size) == (1, 8, 8, 8)
    assert got.run.steps == 3 * 6000  # (num_train_epochs 3 over 6000 prompts, one a generation)
    assert (got.algorithm.epsilon_low, got.algorithm.epsilon_high, got.algorithm.kl_bias_correction) == (0.2, 0.2, True)
    assert (got.data.prompt_format, got.data.system_prompt, got.model.gradient_checkpointing,
            got.model.disable_dropout, got.checkpoint.every, got.checkpoint.keep_last) == \
        ("as_given", None, True, False, 500, None)


def _yaml(v):
    import json

    return json.dumps(v)


@pytest.mark.parametrize("fields,steps,per,prompts,minibatch", [
    ({"max_steps": 2, "steps_per_generation": 2}, 1, 2, 2, 8),  # (TRL: 2 optimizer steps from 1 generation)
    ({"max_steps": 32, "steps_per_generation": 4}, 8, 4, 4, 8),
    ({"max_steps": 8, "num_iterations": 2}, 4, 2, 1, 8),
    ({"max_steps": 6, "gradient_accumulation_steps": 2}, 6, 1, 2, 16),  # (steps_per_generation follows accumulation)
    ({"max_steps": 4, "generation_batch_size": 32}, 1, 4, 4, 8),
])
def test_max_steps_counts_optimizer_steps_as_in_trl(fields, steps, per, prompts, minibatch):
    t = _translate(_grpo(**fields))
    o = t.overrides
    assert (o["run.steps"], t.per_generation, o["rollout.prompts_per_step"], o["optim.minibatch_size"]) == \
        (steps, per, prompts, minibatch)


def test_the_batch_counts_every_process_as_trl_does():
    """Under 2 processes, per_device_train_batch_size=8 with accumulation 2 is an optimizer step of 32 completions
    (TRL's), not 16; the generation batch spans both processes."""
    from trl import GRPOConfig

    class TwoProcesses(GRPOConfig):
        @property
        def world_size(self):
            return 2

    args = TwoProcesses(output_dir="/tmp/d", use_cpu=True, per_device_train_batch_size=8, gradient_accumulation_steps=2,
                        max_steps=4)
    o = _translate(args).overrides
    assert (o["optim.minibatch_size"], o["optim.micro_batch_size"], o["rollout.prompts_per_step"]) == (32, 8, 4)


@pytest.mark.parametrize("fields,said", [
    ({"steps_per_generation": 1, "gradient_accumulation_steps": 2, "max_steps": 2}, "args.gradient_accumulation_steps=2"),
    ({"per_device_train_batch_size": 4, "num_generations": 8, "steps_per_generation": 2, "max_steps": 2},
     "args.per_device_train_batch_size=4: an optimizer step of 4 completions"),
    ({"max_steps": 3, "steps_per_generation": 2}, "args.max_steps=3: TRL would stop inside a generation"),
    ({"loss_type": "cispo", "max_steps": 2}, "args.epsilon_high=None: under loss_type cispo"),
    ({"vllm_gpu_memory_utilization": 0.5, "max_steps": 2}, "args.vllm_gpu_memory_utilization=0.5: applies with use_vllm"),
    ({"use_vllm": True, "vllm_mode": "server", "vllm_gpu_memory_utilization": 0.5, "max_steps": 2},
     "args.vllm_gpu_memory_utilization=0.5: does not apply to vllm_mode 'server'"),
    ({"save_strategy": "epoch", "max_steps": 2}, "args.save_strategy='epoch'"),
    ({"model_init_kwargs": {"device_map": "auto"}, "max_steps": 2}, "args.model_init_kwargs="),
    ({"sapo_temperature_pos": 2.0, "max_steps": 2}, "args.sapo_temperature_pos=2.0: applies to loss_type sapo"),
    ({"shuffle_dataset": False, "max_steps": 2}, "args.shuffle_dataset=False"),
    ({"repetition_penalty": 1.1, "max_steps": 2}, "args.repetition_penalty=1.1: not supported here"),
])
def test_what_cannot_be_run_as_trl_runs_it_is_refused_in_one_line_naming_the_field(fields, said):
    with pytest.raises(ConfigError) as e:
        _translate(_grpo(**fields))
    assert str(e.value).startswith(said) and "\n" not in str(e.value), str(e.value)


def test_clip_warmup_checkpoints_evaluation_and_vllm_mean_what_they_mean_in_trl():
    o = _translate(_grpo(epsilon=0.3, max_steps=4)).overrides
    assert (o["algorithm.epsilon_low"], o["algorithm.epsilon_high"]) == (0.3, 0.3)  # (TRL: epsilon_high = epsilon)
    o = _translate(_grpo(loss_type="cispo", epsilon_high=5.0, max_steps=4)).overrides
    assert o["algorithm.epsilon_high"] == 4.0  # (TRL caps CISPO's ratio at 5.0; ours at 1 + epsilon_high)
    o = _translate(_grpo(warmup_steps=0.1, max_steps=40, save_steps=0.25, save_total_limit=2,
                         eval_strategy="steps", steps_per_generation=2)).overrides
    assert (o["optim.warmup_steps"], o["checkpoint.every"], o["checkpoint.keep_last"]) == (0.1, 0.25, 2)
    assert (o["eval.every"], o["eval.pass_k"]) == (5, 8)  # (logging_steps 10 optimizer steps: 5 generations)
    o = _translate(_grpo(save_steps=500, steps_per_generation=4, max_steps=8, save_strategy="no")).overrides
    assert o["checkpoint.every"] is None
    o = _translate(_grpo(save_steps=10, steps_per_generation=4, max_steps=8)).overrides
    assert o["checkpoint.every"] == 3  # (10 optimizer steps: every third generation of 4)
    t = _translate(_grpo(lr_scheduler_type="constant", warmup_steps=5, max_steps=4))
    assert t.overrides["optim.warmup_steps"] == 0 and "no warm-up in TRL" in t.notes[0]
    o = _translate(_grpo(use_vllm=True, vllm_mode="server", vllm_server_host="gpu0", vllm_server_port=8001,
                         max_steps=4)).overrides
    assert (o["rollout.engine"], o["rollout.vllm.server_base_url"], o["rollout.correction"],
            o["rollout.correction_max"]) == ("vllm", "http://gpu0:8001", "sequence_mask", 3.0)
    assert "rollout.correction" not in _translate(_grpo(max_steps=4)).overrides  # (TRL corrects under vLLM only)


def test_sft_lengths_batches_and_losses_are_trls():
    from trl import SFTConfig

    o = _translate(SFTConfig(output_dir="/tmp/d", use_cpu=True)).overrides
    assert (o["sft.lr"], o["sft.schedule"], o["sft.epochs"], o["sft.steps"], o["sft.batch_size"], o["sft.max_length"],
            o["sft.truncation"], o["sft.loss_tokens"]) == (2e-5, "linear", 3.0, None, 8, 1024, "keep_start", "by_format")
    o = _translate(SFTConfig(output_dir="/tmp/d", use_cpu=True, max_steps=5, gradient_accumulation_steps=4,
                             per_device_train_batch_size=2, completion_only_loss=True, max_length=None)).overrides
    assert (o["sft.steps"], o["sft.epochs"], o["sft.batch_size"], o["sft.micro_batch_size"], o["sft.loss_tokens"],
            o["sft.max_length"], o["sft.truncation"]) == (5, None, 8, 2, "target", None, "refuse")


def test_every_peft_field_is_applied_or_refused_by_name():
    """Generated over peft's LoraConfig: a field set away from peft's default changes our lora keys or is one line
    naming `peft_config.<field>`; target_modules=None keeps peft's default for the architecture."""
    from peft import LoraConfig

    from docuchat_rl.trl_args import LORA, LORA_INERT, lora_of

    base = lora_of(LoraConfig())
    assert base["lora.target_modules"] is None and base["lora.r"] == 8
    values = {"exclude_modules": ["o_proj"], "layers_to_transform": [0], "layers_pattern": "layers",
              "rank_pattern": {"q_proj": 4}, "alpha_pattern": {"q_proj": 4}, "init_lora_weights": "pissa",
              "modules_to_save": ["lm_head"], "bias": "all", "trainable_token_indices": [1, 2], "lora_bias": True,
              "use_dora": True, "target_modules": ["q_proj"],
              "layer_replication": [[0, 1]], "task_type": "SEQ_CLS", "target_parameters": ["x.weight"]}
    applied = refused = 0
    for f in dataclasses.fields(LoraConfig):
        if f.name in LORA_INERT:
            continue
        value = values.get(f.name, _other_value(getattr(LoraConfig(), f.name), f))
        if value is None:
            continue
        try:
            config = LoraConfig(**{f.name: value})
        except Exception:  # noqa: BLE001 (peft refuses the value itself)
            continue
        try:
            got = lora_of(config)
        except ConfigError as e:
            refused += 1
            assert str(e).startswith(f"args.peft_config.{f.name}="), (f.name, str(e))
            continue
        assert f.name in LORA and got != base, f"peft_config.{f.name}={value!r} was neither applied nor refused"
        applied += 1
    assert applied >= 9 and refused >= 10, (applied, refused)


def test_the_docs_table_is_the_mapping_the_api_applies():
    """docs/from_trl.md's GRPOConfig table names every field trl_args maps (and the joint fields and
    reward_weights), and names no GRPOConfig field the code does not map."""
    from trl import GRPOConfig

    from docuchat_rl import trl_args as t

    text = (ROOT / "docs" / "from_trl.md").read_text()
    table = text[text.index("| TRL `GRPOConfig` |"):].split("\n\n")[0]
    fields = {f.name for f in dataclasses.fields(GRPOConfig)}
    named = {w for row in table.splitlines()[2:] for w in re.findall(r"`(\w+)", row.split("|")[1]) if w in fields}
    mapped = (set(t.GRPO) | set(t.JOINT) | t.API_FIELDS) & fields
    assert mapped - named == set(), f"mapped but not in the table: {sorted(mapped - named)}"
    said = {"generation_kwargs", "logging_steps"}  # (the API refuses the one and names the key instead; the other
    # is inert, named as eval_steps' default)
    assert named - mapped - said == set(), f"in the table but not mapped: {sorted(named - mapped)}"
