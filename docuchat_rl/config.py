"""Typed run configuration: YAML in `config/`, `--set section.key=value` overrides, validated at load.

Every setting has one home here, with its one-line doc as the attribute docstring (shown by
`docuchat-rl config --explain`). Derived values (rows per step, the number of optimizer steps per
rollout) are properties computed from the fields, never stored twice. Any error (unknown key, wrong
type, impossible combination) is raised as one `ConfigError` line naming the key and what is allowed.

Deliberately left out: config inheritance (`defaults:` lists) and environment-variable interpolation;
a recipe is one readable file plus `--set` overrides.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import AfterValidator, BaseModel, Field, ValidationError, field_validator, model_validator

from .algorithm_configs import ALGORITHMS, AlgorithmConfig, BatchShape, GRPOConfig, Keys

DEFAULT_SYSTEM_PROMPT = (
    "Solve the problem. Think step by step inside <think> </think>, "
    "then give the final answer inside <answer> </answer>."
)


AUTO = "auto"  # a speed switch's default, decided per device type from measurements (docs/performance.md)
Switch = bool | Literal["auto"]


def _count_or_auto(v):
    if v != AUTO and v < 1:
        raise ValueError("must be at least 1 (or auto)")
    return v


CountOrAuto = Annotated[int | Literal["auto"], AfterValidator(_count_or_auto)]  # a size decided per device


def _steps_or_share(v):
    if isinstance(v, float) and not v.is_integer() and not 0 < v < 1:
        raise ValueError("must be a whole number of steps, or a share of the run's steps between 0 and 1")
    return int(v) if isinstance(v, float) and v.is_integer() else v


StepsOrShare = Annotated[int | float, AfterValidator(_steps_or_share)]  # (transformers 5's rule for warmup_steps,
# save_steps and eval_steps: a number below 1 is that share of the run's steps)


def steps_of(value: int | float, total: int) -> int:
    """A StepsOrShare as steps of a run of `total` steps: a share below 1 rounded up, as transformers does
    (`TrainingArguments.get_warmup_steps`), so a TRL config's ratio means here what it means there.

    >>> steps_of(0.1, 45), steps_of(10, 45), steps_of(0, 45)
    (5, 10, 0)
    """
    return math.ceil(total * value) if 0 < value < 1 else int(value)


def saves_at(step: int, every: int | float | None, total: int) -> bool:
    """Whether step `step` of a run of `total` steps is one of a period's (checkpoint.every, eval.every: steps or a
    share of the run; None: none)."""
    return every is not None and step % max(1, steps_of(every, total)) == 0


# The bounds of the sampling arguments the commands and the Python API take beside the recipe (`generate --top-p`,
# RLTrainer.generate(top_p=...)): one table, read by both (cli._bounded, api), so neither accepts what the other
# refuses. (kind, low, high, low excluded)
BOUNDS: dict[str, tuple[type, float, float | None, bool]] = {
    "temperature": (float, 0, None, True), "top_p": (float, 0, 1, True), "top_k": (int, 0, None, False),
    "max_new_tokens": (int, 1, None, False), "n": (int, 1, None, False),
}


def out_of_bounds(name: str, value) -> str | None:
    """Why `value` is not a `name` (BOUNDS), as a phrase (`must be above 0`), or None when it is one.

    >>> out_of_bounds("top_p", 0.0), out_of_bounds("top_k", 3), out_of_bounds("max_new_tokens", 1.5)
    ('must be above 0 and at most 1', None, 'must be a whole number')
    """
    kind, low, high, low_open = BOUNDS[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not float(value).is_integer()):
        return "must be a whole number" if kind is int else "must be a number"
    if value != value or (value <= low if low_open else value < low) or (high is not None and value > high):
        return f"must be {'above' if low_open else 'at least'} {low}" + (f" and at most {high}" if high is not None else "")
    return None


SCHEDULE_KEYS: dict[str, tuple[str, ...]] = {  # transformers' schedules (get_scheduler) and their own keywords
    "constant": (), "linear": (), "cosine": ("num_cycles",), "cosine_with_restarts": ("num_cycles",),
    "polynomial": ("lr_end", "power"), "inverse_sqrt": ("timescale",),
    "cosine_with_min_lr": ("num_cycles", "min_lr", "min_lr_rate"),
    "cosine_warmup_with_min_lr": ("num_cycles", "min_lr", "min_lr_rate", "warmup_lr_rate"),
    "warmup_stable_decay": ("num_decay_steps", "num_stable_steps", "warmup_type", "decay_type", "min_lr_ratio",
                            "num_cycles"),
}  # (constant warms up over warmup_steps: transformers' constant_with_warmup; tests check these against transformers)
Schedule = Literal["constant", "linear", "cosine", "cosine_with_restarts", "polynomial", "inverse_sqrt",
                   "cosine_with_min_lr", "cosine_warmup_with_min_lr", "warmup_stable_decay"]


def check_schedule_kwargs(schedule: str, kwargs: dict, key: str) -> None:
    """Refuse a keyword transformers' schedule `schedule` does not take, naming `key` and the ones it does."""
    wrong = sorted(set(kwargs) - set(SCHEDULE_KEYS[schedule]))
    if wrong:
        takes = ", ".join(SCHEDULE_KEYS[schedule]) or "none"
        raise ValueError(f"{key}.{wrong[0]} is not a keyword of schedule {schedule} (its keywords: {takes})")


class ConfigError(ValueError):
    """A configuration that cannot run; the message is one line naming the key at fault."""


class Section(Keys):
    """A section of the run's config (see algorithm_configs.Keys)."""


class ModelConfig(Section):
    """The base model: where it comes from, its dtype and device."""

    name_or_path: str = "data/model"
    """Local folder or hub id of any causal LM (default: the embedded tiny model)."""
    revision: str | None = None
    """Hub revision (branch, tag or commit) when loading from the hub."""
    dtype: Literal["auto", "float32", "bfloat16", "bf16-autocast", "bf16-mixed", "float16"] = "auto"
    """Weights dtype; bf16-autocast: bfloat16 weights, float32 LoRA adapters, every forward under bfloat16 autocast (TRL's bf16; keeps no float32 copy of each adapted layer's input: less memory than bfloat16, measured on a CPU); bf16-mixed: bfloat16 weights and matmuls, float32 residual stream and logits (faster on AVX512-BF16 CPUs, larger sampler/trainer gap); auto: bfloat16 on GPUs that have it, else float32."""
    device: str = "auto"
    """Torch device (auto, cpu, cuda, cuda:1, ...)."""
    quantization: Literal["none", "nf4", "fp4", "int8"] = "none"
    """Load the base model's linear layers quantized by bitsandbytes (QLoRA: the LoRA adapter trains in float32 over them; the weights take ~1/4 (nf4, fp4) or ~1/2 (int8) of bfloat16's memory); sampling, scoring and the KL reference all run the same quantized forward, the adapter unmerged; export merges into the dequantized base (pip install 'docuchat-rl[quant]')."""
    bnb_4bit_compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """nf4/fp4: the dtype the 4-bit layers compute in (bitsandbytes' name); auto: the model's dtype (float32 on CPUs, bfloat16 on GPUs that have it)."""
    bnb_4bit_use_double_quant: bool = False
    """nf4/fp4: quantize the quantization constants too (bitsandbytes' name; ~0.4 bits a weight less)."""
    trust_remote_code: bool = False
    """Run model code shipped with a hub repository (off unless you trust it)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward (transformers', non-reentrant): less memory for one more forward per layer; the update's shared prompt is off with it."""
    disable_dropout: bool = True
    """Turn the base model's dropout off (rollouts sample in eval mode; updates must score the same function)."""
    stop_tokens: list[str] = []
    """Texts of extra tokens that end a completion as EOS does, each one token of the vocabulary (e.g. "\n\n" for a base model that goes on with a question of its own); added to the model's EOS ids for every engine, evaluation and export; not part of the completion's text."""
    chat_template: str | None = None
    """A Jinja chat template file (.jinja) to use in place of the tokenizer's own (TRL's chat_template_path); saved with the tokenizer in every checkpoint and export."""
    chat_template_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Variables every rendering of the chat template gets (TRL's chat_template_kwargs, e.g. {enable_thinking: false}): set once in the template itself, so training, evaluation, SFT, chat and export all render with them."""

    @model_validator(mode="after")
    def _quantized(self) -> ModelConfig:
        four = self.quantization in ("nf4", "fp4")
        moved = [k for k in ("bnb_4bit_compute_dtype", "bnb_4bit_use_double_quant")
                 if getattr(self, k) != ModelConfig.model_fields[k].default]
        if moved and not four:
            raise ValueError(f"model.{moved[0]} applies to model.quantization nf4 or fp4, not {self.quantization}")
        if self.quantization != "none" and self.dtype in ("bf16-mixed", "float16"):
            raise ValueError(f"model.quantization {self.quantization} with model.dtype {self.dtype}: a quantized base "
                             "runs its other weights in float32, bfloat16 or bf16-autocast")
        return self

    @field_validator("chat_template_kwargs")
    @classmethod
    def _jinja_names(cls, v: dict) -> dict:
        import json

        for name, value in v.items():
            if not name.isidentifier():
                raise ValueError(f"{name!r} is not a template variable's name")
            try:
                json.dumps(value)
            except TypeError:
                raise ValueError(f"{name}: {type(value).__name__} is not a value a template can be given "
                                 "(text, number, true/false, null, lists and maps of them)") from None
        return v


class LoraConfig(Section):
    """The LoRA adapter that is trained (peft)."""

    r: int = Field(16, ge=1)
    """LoRA rank."""
    alpha: float = Field(32.0, gt=0)
    """LoRA scaling numerator (scale = alpha / r)."""
    dropout: float = Field(0.0, ge=0, lt=1)
    """Dropout on the LoRA input (0 keeps rollouts and updates on the same function)."""
    target_modules: list[str] | Literal["all-linear"] | None = "all-linear"
    """Module names to adapt, all-linear for every linear layer but the output head, or null for peft's default for the architecture (q_proj and v_proj for Llama, Qwen2, Mistral)."""
    exclude_modules: list[str] | None = None
    """Module names left out of target_modules' match (peft's exclude_modules)."""
    layers_to_transform: list[int] | None = None
    """Adapt only these decoder layers, by index (peft's layers_to_transform; null: every layer)."""
    layers_pattern: str | None = None
    """With layers_to_transform: the name of the model's list of layers, when peft cannot tell it (e.g. layers)."""
    use_rslora: bool = False
    """Scale by alpha / sqrt(r) instead of alpha / r (rsLoRA, 2312.03732)."""
    rank_pattern: dict[str, int] = Field(default_factory=dict)
    """Per-module ranks that replace r, by name or regex (peft's rank_pattern)."""
    alpha_pattern: dict[str, float] = Field(default_factory=dict)
    """Per-module alphas that replace alpha, by name or regex (peft's alpha_pattern)."""
    init_lora_weights: Literal[True, False, "gaussian"] = True
    """How the adapter starts: true (B = 0: the base model exactly), gaussian (A gaussian, B = 0), false (both random: another model from the first step)."""
    fused: Switch = AUTO
    """Train each adapted Linear as one matmul with W + s*B*A instead of peft's three (same gradients; float32 only, off under FSDP2); auto: on on CPUs, off on GPUs (measured on CPUs only)."""
    init_from: str | None = None
    """Start the adapter from this one instead of from zero: a checkpoint folder, a run folder (its newest intact checkpoint) or any peft adapter folder of the same base model and LoRA shape (a recipe with an sft section: `train` starts from sft.output_dir instead, docs/sft.md)."""

    @field_validator("target_modules")
    @classmethod
    def _some_module(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("must name at least one module (or all-linear): an adapter on nothing trains nothing")
        return v


class FewShotTurn(Section):
    """One demonstration turn of data.few_shot."""

    role: Literal["user", "assistant"]
    """Who says it."""
    content: str
    """What is said."""


def own_folder(v: str | None) -> str | None:
    """The one rule for a key naming a folder a command writes (run.output_dir, sft.output_dir,
    rollout.vllm.adapter_dir): a folder of its own, never empty (the working folder), a file, or a link to
    nothing (null: the key's default); the working folder by any other name is refused where the folder is
    claimed (outputs.check_writable: a recorded recipe may name the folder a later command runs in)."""
    if v is None:
        return v
    if not v.strip():
        raise ValueError("must name a folder (empty would write into the working folder)")
    p = Path(v).expanduser()
    if p.is_symlink() and not p.exists():
        raise ValueError(f"{v} is a link to nothing ({p.readlink()}): name a folder, or make the link's target")
    if p.exists() and not p.is_dir():
        raise ValueError(f"{v} is a file, not a folder")
    return v  # (the working folder itself is refused where a run claims its folder: outputs.check_writable)


OwnFolder = Annotated[str, AfterValidator(own_folder)]


class CurriculumConfig(Section):
    """Easy rows first: the training rows up to a difficulty level, the next level joining when the run's own training accuracy reaches promote_at (recorded in the metrics, resumed exactly)."""

    level: str = "calculations"
    """A row's level: calculations = the number of <<a op b=c>> annotations in its answer (GSM8K's, ours), or the name of a column of whole numbers."""
    start: int = Field(1, ge=0)
    """The first level: training starts on the rows at this level or below."""
    promote_at: float = Field(0.6, gt=0, le=1)
    """The mean training accuracy over the last `window` steps at which the next level joins (the rows of every level so far stay in)."""
    window: int = Field(10, ge=1)
    """Steps the accuracy is averaged over (counted afresh at each level)."""


class DifficultyConfig(Section):
    """Online difficulty filtering: each prompt's pass rate from the run's own groups, kept across steps; prompts drawn where the policy sometimes succeeds (docs/generalization.md)."""

    low: float = Field(0.0, ge=0, lt=1)
    """A prompt whose last group's pass rate is at or below this is retired as out of reach (the band is above it)."""
    high: float = Field(1.0, gt=0, le=1)
    """A prompt whose last group's pass rate is at or above this is retired as mastered (the band is below it)."""
    revisit_after: int = Field(200, ge=1)
    """Steps a retired prompt rests; then it is due, and drawn again (its pass rate measured anew) in the revisit share, the longest-due first, or when the data order reaches it."""
    revisit: float = Field(0.25, ge=0, le=1)
    """Share of each step's prompts drawn from the due retired prompts, the longest-due first (with what the band leaves of the replay share); 0: only when the data order reaches them."""
    replay: float = Field(0.25, ge=0, le=1)
    """Share of each step's prompts drawn again from the band: prompts whose last group had a pass rate inside it, the longest-waiting first."""
    replay_after: int = Field(5, ge=1)
    """Steps before a prompt in the band may be drawn again."""

    @model_validator(mode="after")
    def _band(self) -> DifficultyConfig:
        if self.low >= self.high:
            raise ValueError(f"data.difficulty.low ({self.low}) must be below data.difficulty.high ({self.high}): "
                             "no pass rate would be inside the band")
        return self


class DataConfig(Section):
    """The training and held-out prompts: sources, columns, system prompt, length limit."""

    train: str = "data/task/train.jsonl"
    """Training prompts: a .jsonl/.csv/.parquet file or a hub data set name."""
    train_split: str = "train"
    """Split of a hub data set used for training."""
    test: str | None = "data/task/test.jsonl"
    """Held-out prompts for eval (file or hub name); null skips evaluation."""
    test_split: str = "test"
    """Split of a hub data set used for eval."""
    subset: str | None = None
    """Hub data set configuration name (e.g. main for openai/gsm8k)."""
    revision: str | None = None
    """Hub data set revision."""
    prompt_column: str = "question"
    """Column holding the prompt: text, or a list of {role, content} messages (TRL's conversational form)."""
    answer_column: str | None = "answer"
    """Column holding the gold answer (GSM8K '#### N' endings are reduced to N); null: the data has none."""
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT
    """System message put before every prompt through the chat template (null for none)."""
    prompt_format: Literal["chat", "as_given"] = "chat"
    """chat: every prompt through the chat template, after system_prompt and few_shot; as_given (TRL's): a text prompt as it is (with the BOS its tokenizer adds), a conversation through the chat template with its own turns only."""
    few_shot: list[FewShotTurn] = Field(default_factory=list)
    """Chat turns put before every prompt, after the system prompt: a demonstration of the answer's shape (e.g. a tool call, docs/tools.md)."""
    max_prompt_tokens: int = Field(512, ge=1)
    """Prompts longer than this (in tokens) are an error naming the row."""
    curriculum: CurriculumConfig | None = None
    """Easy rows first, harder ones joining as the training accuracy rises (null: every row from the start)."""
    difficulty: DifficultyConfig | None = None
    """Online difficulty filtering: prompts drawn where the policy sometimes succeeds, mastered and out-of-reach ones retired and revisited (null: the data order as it is)."""

    @property
    def few_shot_turns(self) -> list[dict]:
        """data.few_shot as chat messages."""
        return [{"role": t.role, "content": t.content} for t in self.few_shot]

    @model_validator(mode="after")
    def _as_given(self) -> DataConfig:
        if self.prompt_format == "as_given" and (self.system_prompt is not None or self.few_shot):
            key = "system_prompt" if self.system_prompt is not None else "few_shot"
            raise ValueError(f"data.{key} does not apply with data.prompt_format as_given (a prompt is used as the "
                             f"data set gives it): set data.{key} to {'null' if key == 'system_prompt' else '[]'}")
        return self


class VLLMConfig(Section):
    """The vLLM engine's settings (rollout.engine vllm), with the names TRL users know."""

    gpu_memory_utilization: float = Field(0.3, gt=0, le=1)
    """Share of GPU memory vLLM may take (weights + KV cache), colocated with training."""
    kv_cache_memory_bytes: int | None = Field(None, ge=1)
    """KV cache size in bytes instead of gpu_memory_utilization (what the CPU build needs)."""
    max_model_len: int | None = Field(None, ge=1)
    """Longest prompt + completion the engine accepts (null: data.max_prompt_tokens + max_new_tokens)."""
    tensor_parallel_size: int = Field(1, ge=1)
    """GPUs one engine spans (tensor parallel)."""
    enforce_eager: bool = False
    """No CUDA graphs (always eager on the CPU)."""
    sleep: bool = False
    """Free the engine's memory between rollouts (vLLM sleep mode; a no-op on the CPU)."""
    mode: Literal["colocate", "server"] = "colocate"
    """colocate: an engine in the training process (TRL's name); server: vLLM's own servers at server_base_url, the adapter versions loaded as LoRA adapters (docs/vllm.md)."""
    server_base_url: str | list[str] | None = None
    """mode server: the server's URL (http://host:8000), or a list of data-parallel servers the prompts are spread over."""
    timeout_s: float = Field(600.0, gt=0)
    """mode server: the longest a server may take to answer one request (or to load an adapter version)."""
    startup_timeout_s: float = Field(900.0, ge=0)
    """mode server: how long the trainer waits, at its start, for a server that does not answer yet (vLLM still loading: connection refused), before it stops saying so (0: not at all)."""
    adapter_dir: OwnFolder | None = None
    """mode server: where each adapter version is written for the servers to load (a folder they can read); null: <run.output_dir>/vllm-adapters."""

    @field_validator("server_base_url")
    @classmethod
    def _urls(cls, v):
        for url in ([v] if isinstance(v, str) else v or []):
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{url!r} is not an http(s) URL (e.g. http://localhost:8000)")
        if isinstance(v, list) and not v:
            raise ValueError("an empty list: give at least one server URL")
        return v

    @model_validator(mode="after")
    def _mode_keys(self) -> VLLMConfig:
        colocated = ("gpu_memory_utilization", "kv_cache_memory_bytes", "max_model_len", "tensor_parallel_size",
                     "enforce_eager", "sleep")
        served = ("server_base_url", "timeout_s", "startup_timeout_s", "adapter_dir")
        other = colocated if self.mode == "server" else served  # (the other mode's keys, left at their defaults)
        wrong = [k for k in other if getattr(self, k) != VLLMConfig.model_fields[k].default]
        if wrong:
            where = ("the server's own flags set them (docuchat-rl serve)" if self.mode == "server"
                     else "set rollout.vllm.mode=server for them")
            raise ValueError(f"rollout.vllm.{wrong[0]} does not apply to rollout.vllm.mode {self.mode}: {where}")
        if self.mode == "server" and not self.server_base_url:
            raise ValueError("rollout.vllm.mode server needs rollout.vllm.server_base_url (the vLLM server's URL)")
        return self


class RolloutConfig(Section):
    """Sampling a step's groups: sizes, the sampler's processors, the engine, the sampler correction."""

    prompts_per_step: int = Field(8, ge=1)
    """Prompts (P) sampled per training step."""
    num_generations: int = Field(8, ge=1)
    """Completions (G) sampled per prompt: the group size."""
    max_new_tokens: int = Field(64, ge=1)
    """Longest completion in tokens; longer ones are cut and flagged truncated."""
    min_new_tokens: int = Field(0, ge=0)
    """No EOS before this many tokens (0 = off; = max_new_tokens gives fixed lengths, for benchmarks)."""
    temperature: float = Field(1.0, gt=0)
    """Sampling temperature."""
    top_p: float = Field(1.0, gt=0, le=1)
    """Nucleus sampling mass (1 = off); the trainer scores the same truncated distribution."""
    top_k: int = Field(0, ge=0)
    """Top-k sampling (0 = off); the trainer scores the same truncated distribution."""
    generation_batch_size: CountOrAuto = AUTO
    """Most completion rows per generate call (bounds memory); a step makes ceil(P*G / this) calls; auto: as many whole groups as half the memory free once the model is loaded holds at the model's bytes a row (keys and values at the longest prompt + max_new_tokens, the draw's logits), at most 64 on CPUs and 256 on GPUs (measured on 2 CPU cores and one H100: docs/performance.md); not even one group: one line before anything is allocated."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose rewards all agree and sample more prompts to refill."""
    max_resample_rounds: int = Field(4, ge=1)
    """Most extra sampling rounds per step when dynamic sampling cannot fill the batch."""
    engine: Literal["auto", "fast", "hf", "vllm"] = AUTO
    """Sampler: fast = our decode loop (prompt prefilled once per group); hf = transformers.generate; vllm = a colocated vLLM engine; auto: fast on CPUs; on GPUs fast with cuda_graphs, hf without (measured on 2 CPU cores and one H100, 0.5B shape: docs/performance.md)."""
    vllm: VLLMConfig = Field(default_factory=VLLMConfig)
    """The vLLM engine's settings (only with engine vllm)."""
    grouped_decode: Switch = AUTO
    """Our fast loop's decode step for Llama, Qwen2 and Mistral (full attention): each prompt's keys/values read once for its G rows (engine fast; eval and chat under vllm); auto: on on CPUs, off on GPUs (measured on 2 CPU cores and one H100)."""
    cuda_graphs: Switch = AUTO
    """Our fast loop's decode at static shapes (Llama, Qwen2, Mistral with full attention), each token's step replayed as one CUDA graph on a GPU (on a CPU it runs the same step eagerly: for tests); on a GPU a model it does not cover samples through transformers.generate; auto: on on GPUs (2.5x faster steps on one H100, 0.5B shape), off on CPUs and with sharded_generation (docs/performance.md)."""
    compile_decode: bool = False
    """torch.compile the static decode step (with cuda_graphs), its output captured in the same graphs: fuses the ~900 small elementwise kernels of a token's step (47% of its GPU time on one H200, 0.5B shape); one compilation per row bucket and shape at first use; off until measured on a GPU (docs/performance.md, round 3)."""
    fused_projections: bool = False
    """In the static decode step (with cuda_graphs), q/k/v as one matmul and gate/up as one (3 of a layer's 10 matmul launches fewer, for a copy of those weights while it decodes: ~0.47 GB in bfloat16 at the 0.5B shape); off until measured on a GPU."""
    merge_adapter: Switch = AUTO
    """Sample with the LoRA deltas folded into the base weights, restored exactly after (in bfloat16 the merge rounds the delta: a small sampler/trainer gap); auto: on (off with sharded_generation; measured on 2 CPU cores and one H100)."""
    sharded_generation: bool = False
    """Under FSDP2: decode on the sharded weights, every process in lockstep (slow: each step gathers every layer, but the whole model never sits on one device); false: gather them to generate."""
    async_lag: int = Field(0, ge=0)
    """Fixed lag k < run.steps: step t trains on completions sampled by the policy after step t-1-k, as decoupled PPO (the ratio clipped against the learner at the step's start, each token weighted by pi_prox / pi_sampler; 0: synchronous); see async_worker_threads for where they are sampled."""
    async_worker_threads: int = Field(0, ge=0)
    """With async_lag: 0 samples in the learner's process between updates; N > 0 in a worker process of N torch threads, ahead, while the learner updates (under engine vllm: a vLLM engine)."""
    async_timeout_s: float = Field(600.0, gt=0)
    """With a worker: a step's samples that do not arrive within this many seconds (counted once the worker has loaded the model) end the run in one line naming the step and adapter version."""
    tools: list[str] = Field(default_factory=list)
    """Tool functions the model may call, by dotted path (pkg.module.fn or file.py:fn), sync or async, described to it by their type hints and docstrings (TRL's `tools`); makes rollouts multi-turn (docs/tools.md)."""
    environment_factory: str | None = None
    """An environment class by dotted path: one instance per completion, reset(**row) before sampling, its public methods are tools, its optional get_reward() the `environment` reward (TRL's `environment_factory`)."""
    max_turns: int = Field(4, ge=1)
    """With tools: most assistant turns in a completion (1: calls are parsed and traced, never run)."""
    max_tool_calls: int = Field(8, ge=0)
    """With tools: most tool calls run per completion (0: none; a call past the limit is answered with an error)."""
    turn_cache: bool = True
    """With tools, our fast loop: each row's keys/values kept from one turn to its next, so a later turn prefills only its new tokens (the tool result); false: the whole conversation again at every turn (turn_cache.py)."""
    tool_timeout_s: float = Field(10.0, gt=0)
    """With tools: a call that has not returned in this many seconds is answered with a timeout error."""
    max_tool_result_tokens: int = Field(256, ge=1)
    """With tools: a tool result longer than this many tokens is cut (the text and the trace say so)."""
    tool_protocol: Literal["auto", "template", "text"] = AUTO
    """With tools: template = the chat template's own tools and tool turns; text = the Hermes text protocol in the system prompt (docs/tools.md); auto: template when the chat template renders tools."""
    correction: Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"] = "none"
    """Weight the loss by pi_prox/pi_sampler per token or sequence, clamped (truncate) or zeroed (mask) outside [correction_min, correction_max]; under async_lag none means token_truncate."""
    correction_min: float = Field(0.0, ge=0)
    """Lower bound C_min of the sampler correction's ratio."""
    correction_max: float = Field(2.0, gt=0)
    """Upper bound C_max of the sampler correction's ratio."""

    @property
    def correction_in_effect(self) -> str | None:
        """The sampler correction the update applies (None: none): `correction`, or under async_lag with none
        set decoupled PPO's token_truncate. This default is decided here and nowhere else."""
        if self.correction != "none":
            return self.correction
        return "token_truncate" if self.async_lag else None

    @property
    def batch_rows(self) -> int:
        """Completions per step (P * G)."""
        return self.prompts_per_step * self.num_generations

    @property
    def multi_turn(self) -> bool:
        """Tools or an environment: completions of several turns (sampling/multiturn.py)."""
        return bool(self.tools or self.environment_factory)


class RewardSpec(Section):
    """One reward component: its registered name (or dotted path), weight and parameters."""

    name: str
    """Registered reward name or a dotted path `package.module:function`."""
    weight: float = 1.0
    """Weight of this component in the total."""
    params: dict[str, Any] = Field(default_factory=dict)
    """Keyword parameters of this reward (see docs/rewards.md)."""


class RewardsConfig(Section):
    """The composite reward: its components and how failures are handled."""

    components: list[RewardSpec] = Field(default_factory=lambda: [
        RewardSpec(name="correctness", weight=1.0), RewardSpec(name="format", weight=0.2)])
    """The selected rewards; YAML may give this list directly as `rewards: [...]`."""
    strict: bool = False
    """Raise on the first failing reward call instead of recording it and going on."""
    timeout_s: float = Field(10.0, gt=0)
    """Per-call time limit of a reward on one batch; slower calls count as failed."""
    max_failed_steps: int = Field(3, ge=1)
    """Stop the run after this many steps in a row in which no component produced a value for any completion (nothing to learn from)."""
    accuracy_component: str | None = "correctness"
    """Component whose raw score is reported as accuracy in logs (null: none)."""

    @property
    def weights(self) -> tuple[float, ...]:
        """The components' weights, in order (what an algorithm that weighs them itself is handed)."""
        return tuple(c.weight for c in self.components)

    @model_validator(mode="before")
    @classmethod
    def _list_shorthand(cls, v):
        return {"components": v} if isinstance(v, list) else v

    @field_validator("components")
    @classmethod
    def _unique(cls, v: list[RewardSpec]) -> list[RewardSpec]:
        names = [c.name for c in v]
        if not v:
            raise ValueError("at least one reward is needed")
        if len(set(names)) != len(names):
            raise ValueError(f"a reward is listed twice: {names}")
        return v


class OptimConfig(Section):
    """The optimizer, its schedule, and how each update is split into minibatches and micro-batches."""

    name: Literal["adamw", "rmsprop"] = "adamw"
    """Optimizer (rmsprop with alpha 0.99, eps 1e-5 is the classic A2C choice)."""
    lr: float = Field(5e-4, gt=0)
    """Peak learning rate."""
    weight_decay: float = Field(0.0, ge=0)
    """Decoupled weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """Adam betas."""
    eps: float = Field(1e-8, gt=0)
    """Optimizer epsilon."""
    alpha: float = Field(0.99, gt=0, lt=1)
    """RMSprop smoothing constant."""
    schedule: Schedule = "constant"
    """Learning-rate shape after warmup: transformers' schedule of that name (constant: constant_with_warmup)."""
    schedule_kwargs: dict[str, Any] = Field(default_factory=dict)
    """The schedule's own keywords (transformers' lr_scheduler_kwargs: num_cycles, min_lr_rate, power, ...)."""
    warmup_steps: StepsOrShare = Field(0, ge=0)
    """Optimizer steps of linear warmup from 0 (a number below 1: that share of the run's optimizer steps, rounded up)."""
    max_grad_norm: float | None = Field(1.0, gt=0)
    """Clip the global gradient norm (null: no clipping)."""
    max_nonfinite_steps: int = Field(3, ge=1)
    """A non-finite loss or gradient norm skips its optimizer step; this many skipped in a row stop the run."""
    minibatch_size: int | None = Field(None, ge=1)
    """Completions per optimizer step; null = the whole rollout batch (one step per iteration)."""
    micro_batch_size: int = Field(64, ge=1)
    """Completions per forward/backward; gradients accumulate up to minibatch_size."""
    share_prompt: Switch = AUTO
    """Run each distinct prompt once per micro-batch and reuse its keys/values for the completions that have it (same gradients; rows are matched by their prompt tokens, so per-row observations are safe); auto: on on CPUs, off on GPUs (measured on 2 CPU cores; it lost on one H100: docs/performance.md)."""
    length_buckets: CountOrAuto = AUTO
    """Split a micro-batch into up to this many forwards by completion length, each padded to its own longest (same numbers; off under FSDP2); auto: 4 on CPUs, 1 on GPUs (measured on CPUs only)."""
    logit_chunk: int | None = Field(None, ge=0)
    """Score this many completion positions at a time from the hidden states, never holding [rows, T, vocab] logits (0: off; null: 1024 when the vocabulary exceeds 32k tokens, else off)."""

    @model_validator(mode="after")
    def _schedule(self) -> OptimConfig:
        check_schedule_kwargs(self.schedule, self.schedule_kwargs, "optim.schedule_kwargs")
        return self



class CheckpointConfig(Section):
    """How often checkpoints are written and how many are kept."""

    every: StepsOrShare | None = Field(50, gt=0)
    """Save a checkpoint every this many training steps, and always at the end (a number below 1: that share of the run's steps, rounded up; null: at the end only)."""
    keep_last: int | None = Field(3, ge=1)
    """Checkpoints kept on disk; older ones are deleted after a new one is complete (null: every one kept)."""


class LoggingConfig(Section):
    """Progress bar and Weights & Biases."""

    progress: bool = True
    """Show a progress bar."""
    wandb: bool = False
    """Log metrics to Weights & Biases (install the `wandb` extra)."""
    wandb_project: str = "docuchat-rl"
    """wandb project name."""
    wandb_mode: Literal["online", "offline", "disabled"] = "offline"
    """wandb mode; offline writes runs locally for a later `wandb sync`."""


class EvalConfig(Section):
    """Held-out evaluation: which rows, how long, pass@k, when."""

    limit: int | None = Field(None, ge=1)
    """Evaluate on the first N held-out rows only (null: all)."""
    max_new_tokens: int | None = Field(None, ge=1)
    """Completion length for eval (null: rollout.max_new_tokens)."""
    pass_k: int = Field(0, ge=0, le=4096)
    """Also sample k completions per prompt and report pass@k (0 = greedy only; at most eval.batch_size, the completions one generate call holds)."""
    batch_size: int = Field(128, ge=1)
    """Completions per generate call in eval (greedy: as many prompts; with pass@k, batch_size // k prompts of k each)."""
    before_and_after: bool = True
    """`train` evaluates the model before and after training."""
    every: StepsOrShare | None = Field(None, gt=0)
    """Also evaluate every N training steps during `train`, appending to eval.jsonl (a number below 1: that share of the run's steps, rounded up; null: never)."""
    also: dict[str, str] = Field(default_factory=dict)
    """More held-out sets, name: file (or hub name), evaluated with the same settings whenever data.test is; their numbers are logged as `<name>/accuracy` and so on (a wording training never saw, say)."""

    @model_validator(mode="after")
    def _pass_k_fits(self) -> EvalConfig:
        if self.pass_k > self.batch_size:  # (bounded before anything is allocated: one call holds a prompt's k)
            raise ValueError(f"eval.pass_k ({self.pass_k}) is more than eval.batch_size ({self.batch_size}), the "
                             "completions one generate call holds: raise eval.batch_size with it (memory grows with "
                             "it) or lower eval.pass_k")
        return self

    @field_validator("also")
    @classmethod
    def _names(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            if not name or "/" in name:
                raise ValueError(f"{name!r} cannot name a held-out set (its numbers are logged as '<name>/...'): "
                                 "use a word without '/'")
        return v


class RunConfig(Section):
    """The run as a whole: output folder, length, seed, threads."""

    output_dir: OwnFolder = "runs/default"
    """Where checkpoints, metrics.jsonl and traces.jsonl go (a folder of their own: never the working folder, a file or a link to nothing)."""
    steps: int = Field(200, ge=1)
    """Training steps (one rollout + its updates each)."""
    seed: int = 0
    """Seed for data order, sampling and initialisation."""
    threads: int | None = Field(None, ge=1)
    """Torch CPU threads (null: torch's default)."""
    overwrite: bool = False
    """A fresh run (no --resume) replaces an earlier run's outputs in output_dir (else that is an error)."""


class SFTConfig(Section):
    """`docuchat-rl sft`: supervised fine-tuning of the recipe's adapter before RL, on the RL prompts (docs/sft.md)."""

    source: Literal["answers", "tool_transcripts", "traces", "jsonl"] = "answers"
    """Where the targets come from: the answer column (sft.answer_template), calculator conversations built from its <<a op b=c>> steps, a run's traced completions (sft.path, sft.where), or a JSONL file of TRL prompt/completion or messages rows (sft.path)."""
    answer_template: Literal["as_written", "steps", "think_answer"] = "as_written"
    """source answers: the answer column as written; its steps without the <<...>> notes then '#### N'; or <think>steps</think><answer>N</answer>."""
    path: str | None = None
    """source traces: the run folder (or its traces.jsonl); source jsonl: the file; source answers or tool_transcripts: the rows to learn (a file or hub name with data's columns and train split; null: data.train), so that RL's rows may differ from SFT's (final answers only, say)."""
    where: str = "correctness.raw == 1"
    """source traces: the audit filter that selects the completions to learn (as `docuchat-rl audit --where`)."""
    per_prompt: int = Field(1, ge=1)
    """source traces: at most this many distinct completions of one prompt, the newest steps' first."""
    keep_truncated: bool = False
    """source traces: also learn completions cut at max_new_tokens (they never end: left out, and counted, by default)."""
    output_dir: OwnFolder | None = None
    """Where `sft` writes its run folder (null: run.output_dir + '-sft'; a folder of its own, as run.output_dir); `train` with this recipe starts its adapter from there."""
    steps: int | None = Field(None, ge=1)
    """Optimizer steps (null: sft.epochs passes over the SFT set)."""
    epochs: float | None = Field(None, gt=0)
    """Passes over the SFT set, when sft.steps is null (null too: 1): ceil(epochs x ceil(examples / batch_size)) steps, as transformers counts them."""
    batch_size: int = Field(16, ge=1)
    """Examples per optimizer step."""
    micro_batch_size: int | None = Field(None, ge=1)
    """Examples per forward (null: the whole batch); the loss is the same."""
    lr: float = Field(2.0e-4, gt=0)
    """Learning rate (the optimizer's other settings are optim's)."""
    schedule: Schedule = "cosine"
    """Learning-rate schedule over the SFT steps (transformers' of that name; constant: constant_with_warmup)."""
    schedule_kwargs: dict[str, Any] = Field(default_factory=dict)
    """The schedule's own keywords (as optim.schedule_kwargs)."""
    warmup_steps: StepsOrShare = Field(0, ge=0)
    """Linear warm-up steps (a number below 1: that share of the SFT steps, rounded up)."""
    max_length: int | None = Field(1024, ge=1)
    """Longest example, prompt and target tokens together (null: the model's context); a longer one is refused naming its row, or cut as sft.truncation says."""
    truncation: Literal["refuse", "keep_start", "keep_end"] = "refuse"
    """An example longer than max_length: refused (naming its row), or cut to its first (TRL's keep_start) or last max_length tokens; a cut example's loss reads only the target tokens kept."""
    eos_token: str | None = None
    """The token a text target ends with (TRL's eos_token; null: the token the chat template ends an assistant turn with)."""
    loss_tokens: Literal["target", "all", "by_format"] = "target"
    """Which tokens the loss reads: the target's (the completion; a conversation's last assistant turn); every token but the first, prompt included; or by_format (TRL's default): all for a messages row, the target for a prompt/completion row."""

    @model_validator(mode="after")
    def _one_length(self) -> SFTConfig:
        check_schedule_kwargs(self.schedule, self.schedule_kwargs, "sft.schedule_kwargs")
        if self.steps is not None and self.epochs is not None:
            raise ValueError("sft.steps and sft.epochs both set: give one (steps wins nothing silently)")
        if self.source in ("traces", "jsonl") and not self.path:
            raise ValueError(f"sft.path: source {self.source} reads a {'run folder' if self.source == 'traces' else 'file'}"
                             ": name it")
        if self.source != "answers" and self.answer_template != "as_written":
            raise ValueError(f"sft.answer_template applies to source answers, not {self.source}")
        moved = [k for k in ("where", "per_prompt", "keep_truncated")
                 if getattr(self, k) != SFTConfig.model_fields[k].default]
        if self.source != "traces" and moved:
            raise ValueError(f"sft.{moved[0]} applies to source traces, not {self.source}")
        return self


class Config(Section):
    """A whole run's settings, one section per concern; `load_config` builds it from YAML and `--set`."""

    run: RunConfig = Field(default_factory=RunConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = Field(default_factory=GRPOConfig)
    rewards: RewardsConfig = Field(default_factory=RewardsConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    sft: SFTConfig | None = None
    """The supervised stage `docuchat-rl sft` runs before `train` (docs/sft.md)."""

    @property
    def sft_dir(self) -> str | None:
        """Where `sft` writes (sft.output_dir, decided at load); None without an sft section."""
        return None if self.sft is None else self.sft.output_dir

    @model_validator(mode="after")
    def _builtin_files(self) -> Config:
        """Relative paths read from the working folder, else the package's built-in copy (recipes.resolve_path:
        an installed package runs its embedded default from any folder)."""
        from .recipes import resolve_path

        for section, key in (("model", "name_or_path"), ("data", "train"), ("data", "test")):
            part = getattr(self, section)
            value = getattr(part, key)
            if resolve_path(value) != value:
                object.__setattr__(part, key, resolve_path(value))
        if any(resolve_path(v) != v for v in self.eval.also.values()):
            object.__setattr__(self.eval, "also", {k: resolve_path(v) for k, v in self.eval.also.items()})
        if self.sft is not None and self.sft.path and resolve_path(self.sft.path) != self.sft.path:
            object.__setattr__(self.sft, "path", resolve_path(self.sft.path))
        return self

    @model_validator(mode="after")
    def _sft_folder(self) -> Config:
        """sft.output_dir null is run.output_dir + '-sft', decided at load and kept in the recipe of record (a
        replay or an evaluation that moves run.output_dir still finds the stage the run started from)."""
        if self.sft is not None and self.sft.output_dir is None:
            object.__setattr__(self.sft, "output_dir", self.run.output_dir.rstrip("/") + "-sft")
        return self

    @property
    def rl_start(self) -> str | None:
        """The adapter `train` starts from: the SFT stage's run folder when the recipe has one, else lora.init_from."""
        return self.sft_dir if self.sft is not None else self.lora.init_from

    @property
    def minibatch_rows(self) -> int:
        """Completions per optimizer step (optim.minibatch_size, or the whole rollout batch)."""
        return self.optim.minibatch_size or self.rollout.batch_rows

    @model_validator(mode="before")
    @classmethod
    def _default_algorithm(cls, raw):
        """`algorithm.name` selects the algorithm's config model; a section without it means grpo."""
        if isinstance(raw, dict) and isinstance(raw.get("algorithm"), dict) and "name" not in raw["algorithm"]:
            raw = {**raw, "algorithm": {"name": "grpo", **raw["algorithm"]}}
        return raw

    @model_validator(mode="after")
    def _combinations(self) -> Config:
        rows = self.rollout.batch_rows
        if rows % self.minibatch_rows:
            raise ValueError(f"optim.minibatch_size: {self.minibatch_rows} must divide the rollout batch "
                             f"(prompts_per_step * num_generations = {rows})")
        if self.minibatch_rows % self.rollout.num_generations:
            raise ValueError(f"optim.minibatch_size: {self.minibatch_rows} must be a multiple of "
                             f"rollout.num_generations ({self.rollout.num_generations}): a group is never split")
        if self.minibatch_rows % min(self.optim.micro_batch_size, self.minibatch_rows):
            raise ValueError(f"optim.micro_batch_size: {self.optim.micro_batch_size} must divide "
                             f"the minibatch ({self.minibatch_rows} completions)")
        if self.rollout.min_new_tokens > self.rollout.max_new_tokens:
            raise ValueError(f"rollout.min_new_tokens: {self.rollout.min_new_tokens} is more than "
                             f"rollout.max_new_tokens ({self.rollout.max_new_tokens})")
        r = self.rollout
        if r.sharded_generation and r.merge_adapter is True:
            raise ValueError("rollout.sharded_generation keeps the weights sharded, so the adapter cannot be folded "
                             "into them: set rollout.merge_adapter=false with it")
        if r.engine == "hf" and "grouped_decode" in r.model_fields_set and r.grouped_decode is not False:
            raise ValueError("rollout.grouped_decode applies to our fast decode loop (rollout.engine fast, and "
                             "evaluation under vllm), not to rollout.engine hf")
        if r.cuda_graphs is True and r.engine in ("hf", "vllm"):
            raise ValueError(f"rollout.cuda_graphs applies to our fast decode loop (rollout.engine fast), not to "
                             f"rollout.engine {r.engine}")
        if r.fused_projections and (r.cuda_graphs is False or r.engine in ("hf", "vllm")):
            raise ValueError("rollout.fused_projections fuses the static decode step's projections: it needs "
                             f"rollout.cuda_graphs (now {r.cuda_graphs}) and our fast loop (rollout.engine now "
                             f"{r.engine})")
        if r.compile_decode and (r.cuda_graphs is False or r.engine in ("hf", "vllm")):
            raise ValueError("rollout.compile_decode compiles the static decode step: it needs rollout.cuda_graphs "
                             f"(now {r.cuda_graphs}) and our fast loop (rollout.engine now {r.engine})")
        if r.engine != "vllm" and r.vllm != VLLMConfig():
            raise ValueError(f"rollout.vllm applies to rollout.engine vllm, not {r.engine}")
        if r.engine == "vllm" and r.sharded_generation:
            raise ValueError("rollout.engine vllm generates on whole weights: rollout.sharded_generation cannot "
                             "be used with it")
        if not r.async_lag and (r.async_worker_threads or r.async_timeout_s != 600.0):  # (by value: a saved
            # config holds every key)
            raise ValueError("rollout.async_worker_threads and rollout.async_timeout_s apply to rollout.async_lag "
                             ">= 1, not to the synchronous loop")
        if r.engine == "vllm" and r.vllm.mode == "server" and r.async_worker_threads:
            raise ValueError("rollout.async_worker_threads does not apply to rollout.vllm.mode server: the servers "
                             "sample ahead themselves (set it to 0)")
        names = {c.name for c in self.rewards.components}
        if self.data.difficulty is not None and r.async_lag:
            raise ValueError("data.difficulty cannot be used with rollout.async_lag (a fixed lag takes later steps' "
                             "prompts before the pass rates that choose them are known)")
        if self.data.difficulty is not None and r.num_generations < 2:
            raise ValueError("data.difficulty measures a prompt's pass rate over its group, and rollout.num_generations "
                             f"is {r.num_generations}: a group of one is always right or wrong, never inside the band "
                             "(use groups of 2 or more)")
        if self.data.difficulty is not None and self.data.curriculum is not None:
            raise ValueError("data.difficulty and data.curriculum both choose the prompts a step draws: use one")
        if self.data.difficulty is not None and self.rewards.accuracy_component not in names:
            raise ValueError(f"data.difficulty measures a prompt's pass rate with reward "
                             f"{self.rewards.accuracy_component!r} (rewards.accuracy_component), which is not among "
                             "the rewards")
        if self.data.curriculum is not None and r.async_lag:
            raise ValueError("data.curriculum cannot be used with rollout.async_lag (a fixed lag takes later steps' "
                             "prompts before the accuracy that decides their level is known)")
        if self.data.curriculum is not None and self.rewards.accuracy_component not in names:
            raise ValueError(f"data.curriculum promotes on the training accuracy, the mean of reward "
                             f"{self.rewards.accuracy_component!r} (rewards.accuracy_component), which is not among "
                             "the rewards")
        if r.async_lag and r.dynamic_sampling:
            raise ValueError("rollout.async_lag cannot be used with rollout.dynamic_sampling (its refill reads the "
                             "same step's rewards, which a fixed lag samples ahead of)")
        if not r.multi_turn:
            moved = [k for k in ("max_turns", "max_tool_calls", "turn_cache", "tool_timeout_s",
                                 "max_tool_result_tokens", "tool_protocol") if getattr(r, k) != RolloutConfig.model_fields[k].default]
            if moved:  # (by value: a saved config holds every key)
                raise ValueError(f"rollout.{moved[0]} applies to multi-turn rollouts (rollout.tools or "
                                 "rollout.environment_factory), and neither is set")
        elif r.async_lag and (r.async_worker_threads or (r.engine == "vllm" and r.vllm.mode == "server")):
            raise ValueError("rollout.tools and rollout.environment_factory with rollout.async_lag sample in the "
                             "learner's process (rollout.async_worker_threads 0, not vLLM's servers) for now: the "
                             "tool loop runs there")
        elif r.sharded_generation:
            raise ValueError("rollout.tools and rollout.environment_factory cannot be used with "
                             "rollout.sharded_generation (its processes decode in lockstep, turns differ per row)")
        quantized = self.model.quantization != "none"
        if quantized:  # (paths that read a layer's weight matrix itself: a 4- or 8-bit one is packed, not a weight)
            on = [k for k, v in (("rollout.grouped_decode", r.grouped_decode), ("rollout.cuda_graphs", r.cuda_graphs),
                                 ("rollout.merge_adapter", r.merge_adapter), ("lora.fused", self.lora.fused))
                  if v is True]
            if on:
                why = ("a merged copy of a quantized weight would be another model than the one trained"
                       if on[0] == "rollout.merge_adapter" else "it reads each layer's weight matrix, which a quantized "
                       "layer packs")
                raise ValueError(f"{on[0]} does not combine with model.quantization {self.model.quantization}: {why} "
                                 f"(leave {on[0]} auto: off with a quantized base)")
        if r.correction_min >= r.correction_max:
            raise ValueError(f"rollout.correction_min ({r.correction_min}) must be below rollout.correction_max "
                             f"({r.correction_max})")
        if self.sft is not None and Path(self.sft_dir).resolve() == Path(self.run.output_dir).resolve():
            raise ValueError(f"sft.output_dir {self.sft.output_dir} is run.output_dir: the SFT stage and the RL run "
                             "each write a run folder of their own")
        problem = self.algorithm.check(BatchShape(r.num_generations, rows, self.minibatch_rows))
        if problem:
            raise ValueError(problem)
        return self

    def check_run(self) -> None:
        """Refuse (ConfigError) settings that cannot take effect in a run of this length: a fixed lag not
        shorter than run.steps (every step would sample with the initial adapter), eval.every past the last
        step. Checked by `train` before anything starts, not when a recipe loads: a finished run's recipe
        still loads for eval, generate, replay and rescore."""
        r = self.rollout
        if r.async_lag and r.async_lag >= self.run.steps:
            raise ConfigError(f"rollout.async_lag {r.async_lag} is not shorter than the run (run.steps "
                              f"{self.run.steps}): every step would sample with the initial adapter")
        if self.eval.every is not None and steps_of(self.eval.every, self.run.steps) > self.run.steps:
            raise ConfigError(f"eval.every {self.eval.every} is longer than the run (run.steps {self.run.steps}): "
                              "no evaluation would run inside it (eval.before_and_after evaluates at its ends); "
                              "set eval.every=null or a shorter period")

    def to_dict(self) -> dict:
        return self.model_dump(mode="json")

    def for_device(self, device_type: str) -> Config:
        """This config with every `auto` speed switch decided for a device type ("cpu", "cuda", ...), each as it
        was measured to win (docs/performance.md: 2 CPU cores on the real model and the embedded default; one
        H100 on a Qwen2.5-0.5B-shaped model, where the fast loop's static decode replayed as CUDA graphs with a
        merged adapter and 256 rows a call won, the hf engine next, and the dynamic fast loop and the shared
        prompt lost); a switch not measured on GPUs is off there.
        Idempotent; model.dtype's auto is decided where the model loads (modeling.resolve_dtype)."""
        cpu = device_type == "cpu"
        r, o = self.rollout, self.optim
        quantized = self.model.quantization != "none"  # (the paths that read weight matrices: off, _combinations)

        def pick(value, on, off):
            return (on if cpu else off) if value == AUTO else value

        graphs = pick(r.cuda_graphs, False, r.engine in (AUTO, "fast") and not r.sharded_generation and not quantized)
        engine = pick(r.engine, "fast", "fast" if graphs else "hf")  # (graphs are the fast loop's)
        if r.fused_projections and not graphs:
            raise ConfigError(f"rollout.fused_projections fuses the static decode step's projections, and "
                              f"rollout.cuda_graphs is off on {device_type}: set rollout.cuda_graphs=true with it")
        if r.compile_decode and not graphs:
            raise ConfigError(f"rollout.compile_decode compiles the static decode step, and rollout.cuda_graphs "
                              f"auto is off on {device_type}" + (" with rollout.sharded_generation (whose lockstep "
                              "decode has no static step)" if r.sharded_generation else ": set "
                              "rollout.cuda_graphs=true with it (on a CPU the step then runs compiled, without "
                              "graphs)"))
        rollout = r.model_copy(update={  # (grouped decode is the fast loop's: never on under the hf engine)
            "engine": engine, "cuda_graphs": graphs,
            "grouped_decode": pick(r.grouped_decode, engine != "hf" and not quantized, False),
            "merge_adapter": pick(r.merge_adapter, not r.sharded_generation and not quantized,
                                  not r.sharded_generation and not quantized),
            "generation_batch_size": pick(r.generation_batch_size, 64, 256)})
        optim = o.model_copy(update={"share_prompt": pick(o.share_prompt, True, False),
                                     "length_buckets": pick(o.length_buckets, 4, 1)})
        lora = self.lora.model_copy(update={"fused": pick(self.lora.fused, not quantized, False)})
        return self.model_copy(update={"rollout": rollout, "optim": optim, "lora": lora})


_UNION_MEMBERS = {"bool": "true/false", "int": "a whole number", "float": "a number", "str": "text"}


def _one_line(err: ValidationError) -> str:
    """The first pydantic error as 'key: message' (pydantic's own report is several lines)."""
    e = err.errors()[0]
    loc = tuple(e["loc"])
    if loc[:1] == ("algorithm",) and len(loc) > 1 and loc[1] in ALGORITHMS:
        algo, loc = loc[1], loc[:1] + loc[2:]  # the union's tag is not part of the key
        if e["type"] == "extra_forbidden":
            allowed = ", ".join(sorted(ALGORITHMS[algo].model_fields))
            return (f"config key 'algorithm.{'.'.join(map(str, loc[1:]))}' does not apply to algorithm "
                    f"{algo!r}; its keys are: {allowed}")
    if e["type"] == "bool_as_number":  # (Keys' check: a model-level error that names its field)
        key = ".".join(str(p) for p in (*loc, e["ctx"]["field"]))
        return f"config key {key!r}: must be a number, not true/false (got {e['ctx']['value']!r})"
    members = [p for p in loc if p in _UNION_MEMBERS or str(p).startswith("literal[")]
    if members:  # a value of a union (a switch: true, false or auto): pydantic reports one error per member
        key = ".".join(str(p) for p in loc if p not in members)
        kinds = [_UNION_MEMBERS.get(str(x["loc"][-1]), str(x["loc"][-1]).removeprefix("literal[").rstrip("]"))
                 for x in err.errors() if tuple(x["loc"][:-1]) == loc[:-1]]
        return f"config key {key!r}: must be {' or '.join(kinds)} (got {e.get('input')!r})"
    key = ".".join(str(p) for p in loc)
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] == "union_tag_invalid":
        return (f"config key '{key}.name': unknown algorithm {e['ctx']['tag']!r}; "
                f"valid: {', '.join(sorted(ALGORITHMS))}")
    if e["type"] == "extra_forbidden":
        parent = _model_at(e["loc"][:-1])
        allowed = sorted(parent.model_fields) if parent else []
        return f"config key {key!r} is unknown; allowed here: {', '.join(allowed)}"
    if e["type"] == "literal_error":
        return f"config key {key!r}: {msg} (got {e.get('input')!r})"
    if not key or msg.startswith(key + "."):  # a cross-field (model-level) check already names its key
        return msg
    return f"config key {key!r}: {msg} (got {e.get('input')!r})"


def _model_at(loc: tuple) -> type[BaseModel] | None:
    model: type[BaseModel] | None = Config
    for part in loc:
        if model is None or isinstance(part, int):
            continue
        field = model.model_fields.get(str(part))
        if field is None:
            return None
        ann = field.annotation
        inner = getattr(ann, "__args__", None)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            model = ann
        elif inner and isinstance(inner[0], type) and issubclass(inner[0], BaseModel):
            model = inner[0]  # list[RewardSpec]
        else:
            model = None
    return model


def apply_override(raw: dict, assignment: str) -> None:
    """Apply one `a.b.c=value` to a raw config dict; the value is parsed as YAML (1e-3, true, [a, b]).

    List entries are addressed by index or, for named entries, by name: `rewards.format.weight=0.5`
    is short for `rewards.components.format.weight=0.5`.
    """
    if "=" not in assignment:
        raise ConfigError(f"--set {assignment!r}: expected section.key=value")
    path, value = assignment.split("=", 1)
    keys = path.strip().split(".")
    try:
        parsed = read_yaml(value) if value.strip() else ""
    except ConfigError as e:
        raise ConfigError(f"--set {path}: {e}") from None
    if keys[0] == "rewards":
        raw["rewards"] = _rewards_mapping(raw.get("rewards"))
        if len(keys) > 2 and keys[1] not in RewardsConfig.model_fields:
            keys = ["rewards", "components", *keys[1:]]
    node: Any = raw
    for i, key in enumerate(keys[:-1]):
        where = ".".join(keys[:i + 1])
        node = _list_item(node, key, where) if isinstance(node, list) else node.setdefault(key, {})
        if not isinstance(node, (dict, list)):
            raise ConfigError(f"--set {path}: {where} is a value, not a section")
    if isinstance(node, list):
        raise ConfigError(f"--set {path}: cannot replace an entry of {'.'.join(keys[:-1])}; set its fields")
    node[keys[-1]] = parsed


def _rewards_mapping(value: Any) -> dict:
    """The `rewards` section in its mapping form, with the default components made explicit."""
    if isinstance(value, list):
        return {"components": value}
    value = dict(value or {})
    value.setdefault("components", [c.model_dump() for c in RewardsConfig().components])
    return value


def _list_item(items: list, key: str, where: str) -> dict:
    """A list element by index or, for lists of named entries (rewards), by name."""
    if key.isdigit() and int(key) < len(items):
        return items[int(key)]
    for item in items:
        if isinstance(item, dict) and item.get("name") == key:
            return item
    names = [it.get("name") for it in items if isinstance(it, dict)]
    raise ConfigError(f"--set {where}: no entry {key!r}; entries are {names} (or an index)")


class _RecipeLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key written twice in one mapping (yaml.safe_load keeps the last and drops
    the first without a word: a recipe would lose a value, or a whole section, silently)."""


def _unique_mapping(loader: _RecipeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=True)
        line = key_node.start_mark.line + 1
        if key in seen and key != "<<":
            raise ConfigError(f"line {line}: key {key!r} is written twice in one mapping (first on line "
                              f"{seen[key]}): one of the two values would be lost; keep one")
        seen.setdefault(key, line)
    return loader.construct_mapping(node, deep=deep)


_RecipeLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)


def read_yaml(text: str) -> Any:
    """YAML text as Python values, a key written twice in one mapping refused (ConfigError naming its line).

    >>> read_yaml("optim: {lr: 1}")
    {'optim': {'lr': 1}}
    >>> read_yaml("optim:\\n  lr: 1\\n  lr: 2")
    Traceback (most recent call last):
    ...
    docuchat_rl.config.ConfigError: line 3: key 'lr' is written twice in one mapping (first on line 2): one of the two values would be lost; keep one
    """
    return yaml.load(text, Loader=_RecipeLoader)  # noqa: S506 (a SafeLoader subclass)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read YAML (or the built-in defaults when path is None), apply overrides, validate."""
    from .recipes import resolve_recipe

    raw: dict = {}
    if path is not None:
        try:
            p = resolve_recipe(path)  # (a file, or a built-in recipe by name: recipes.py)
        except FileNotFoundError as e:
            raise ConfigError(str(e)) from None
        try:
            raw = read_yaml(p.read_text(encoding="utf-8")) or {}
        except ConfigError as e:
            raise ConfigError(f"{p}: {e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{p}: not valid YAML: {str(e).splitlines()[0]}") from e
        except UnicodeDecodeError as e:
            line = p.read_bytes()[:e.start].count(b"\n") + 1
            raise ConfigError(f"{p}: line {line} is not UTF-8 text; save the recipe as UTF-8") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{p}: the top level must be a mapping of sections")
    return config_from_dict(raw, overrides)


def config_from_dict(raw: dict, overrides: list[str] | None = None) -> Config:
    """Validate a raw config mapping (a recipe, or a checkpoint's run_config.json) after the overrides."""
    raw = dict(raw)
    for assignment in overrides or []:
        apply_override(raw, assignment)
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_one_line(e)) from None
    _check_registries(cfg.rewards)
    return cfg


def _check_registries(rewards: RewardsConfig) -> None:
    """Reward names live in a registry (or are dotted paths): each must resolve."""
    from rewards import RewardError, resolve_reward

    for i, spec in enumerate(rewards.components):
        try:
            resolve_reward(spec.name)
        except RewardError as e:
            raise ConfigError(f"config key 'rewards.components.{i}.name': {e}") from None


def explain(cfg: Config | None = None) -> str:
    """Every key with its type, default and doc, section by section (for `docuchat-rl config --explain`);
    the algorithm section lists the keys of `cfg`'s algorithm (grpo by default)."""
    cfg = cfg or Config()
    lines = []
    for section, field in Config.model_fields.items():
        value = getattr(cfg, section)
        model = type(value) if value is not None else next(a for a in field.annotation.__args__ if a is not type(None))
        others = sorted(set(ALGORITHMS) - {cfg.algorithm.name}) if section == "algorithm" else []
        lines.append(f"{section}:" + (f"  # keys of {cfg.algorithm.name}; see also --set algorithm.name="
                                      f"{'|'.join(others)}" if others else "")
                     + (f"  # null unless the recipe has it: {field.description}" if value is None else ""))
        lines += _explain_fields(model, "  ")
    return "\n".join(lines)


def _explain_fields(model: type[BaseModel], indent: str) -> list[str]:
    """One line per key of `model`; a nested section (rollout.vllm) as its own indented block."""
    lines = []
    for name, f in model.model_fields.items():
        default = f.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            lines.append(f"{indent}{name}:  # {f.description or ''}")
            lines += _explain_fields(type(default), indent + "  ")
            continue
        if isinstance(default, list) and default and isinstance(default[0], BaseModel):
            default = [d.model_dump(exclude_defaults=True) for d in default]
        choices = _choices(f.annotation)
        doc = (f.description or "").replace("\n", "\\n")  # (one line a key: a doc that quotes "\n\n" shows it escaped)
        lines.append(f"{indent}{name} = {default!r}" + (f"  [{choices}]" if choices else "") + f"  # {doc}")
    return lines


def _choices(annotation) -> str | None:
    """The values a choice key takes ('grpo | dapo | ...'; a switch: 'true | false | auto'), None for keys
    without named choices."""
    from typing import get_args, get_origin

    values: list[str] = []
    named = False

    def walk(tp) -> None:
        nonlocal named
        if get_origin(tp) is Literal:
            named = True
            values.extend(str(v) for v in get_args(tp))
        elif tp in (bool, int):
            values.extend(["true", "false"] if tp is bool else ["N"])
        else:
            for arg in get_args(tp):
                walk(arg)

    walk(annotation)
    return " | ".join(dict.fromkeys(values)) if named and len(values) > 1 else None


def flat_keys(d: dict, prefix: str = "") -> dict[str, object]:
    """A nested recipe dict as its dotted keys (`{"a": {"b": 1}}` -> `{"a.b": 1}`)."""
    out: dict[str, object] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat_keys(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
