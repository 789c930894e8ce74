"""Engines: what samples a step's completions, behind one interface, registered by name as algorithms are.

An engine turns a step's prompts (rendered text, G completions each, one seed per completion) into a
`Generation` (token ids, truncation flags, the sampler's log-prob of every token) sampled by a given adapter
version, and a multi-turn row's next turn from its token ids (`continue_rows`, for the tool loop of
`multiturn.py`). The collector (`rollout.py`), the fixed lag (`lag.py`) and replay talk to this interface only;
`decoding.rollout_engine` names the class from `rollout.engine` and `rollout.vllm.mode` (the engine choice, made
there once):

    fast          our decode loop on the learner's model, in this process (generation.py)
    hf            transformers.generate on the learner's model, in this process
    vllm          a vLLM engine colocated in this process (vllm_engine.py), synced with the merged weights
    vllm-server   vLLM's own OpenAI-compatible servers (vllm_server.py), each version loaded as a LoRA adapter

Two kinds. An engine on the learner's model (fast, hf, colocated vLLM: `owns_versions` False) samples the
policy that model holds when the step begins (`begin_step`); the loop swaps a lagged version in
(`lag.SamplingPolicy`). An engine with weights of its own (a server; the engines in a fixed lag's worker
process) keeps the adapter versions it is given (`add_version`) and samples the one it is asked for.
`submit` starts a step's sampling and returns a future: a server's requests stay in flight while the learner
updates; an engine in this process samples at once.

Adding an engine = one module: a subclass registered with `@register_engine("name")`, imported below.

Deliberately left out: SGLang and TensorRT-LLM engines, and an engine chosen per step.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch

from .decoding import Decoding, rollout_engine
from .generation import Generation, generate

if TYPE_CHECKING:
    from ..config import Config
    from ..distributed import Dist


@dataclass
class EngineContext:
    """What an engine is built from."""

    cfg: Config  # the run's config, its `auto` switches decided
    tokenizer: object
    model: torch.nn.Module | None  # the learner's peft model (None in a worker process that builds its own)
    dist: Dist  # this process among the launched ones
    out_dir: Path | None = None  # the run folder (an engine with weights of its own writes its versions there)
    lockstep: Callable | None = None  # sharded generation: every process makes the same model calls
    sharded: bool = False  # the learner's model is FSDP2-sharded over the processes


class Engine:
    """A step's completions from prompts and seeds (see the module docstring)."""

    name: ClassVar[str] = "engine"
    owns_versions: ClassVar[bool] = False  # keeps the adapter versions it is given, instead of the learner's model

    def __init__(self, ctx: EngineContext):
        self.ctx = ctx

    @classmethod
    def check(cls, ctx: EngineContext) -> None:
        """Refuse, in one line, a run this engine cannot sample for (before anything is built)."""

    @classmethod
    def worker_spec(cls, ctx: EngineContext):
        """What a fixed lag's worker process builds this engine from, beyond the run's config (None: nothing)."""
        return None

    def begin_step(self, model, version: int) -> None:
        """Before a step samples (synchronous loop): the policy after step `version` is what `model` holds now."""

    def add_version(self, version: int, state: dict[str, torch.Tensor], keep_from: int) -> None:
        """An engine with weights of its own: adapter `version` (its LoRA tensors); the versions before
        `keep_from` are no longer asked for."""

    def generate(self, prompts: list[str], seeds: list[int], version: int, step: int | None = None) -> Generation:
        """G completions of each prompt (rows prompt-major), row r from seeds[r], sampled by `version` (for
        step `step`, which messages name)."""
        raise NotImplementedError

    def continue_rows(self, ids: list[list[int]], seeds: list[int], version: int, step: int | None,
                      max_new_tokens: int) -> Generation:
        """One more assistant turn of each multi-turn row (multiturn.run_turns): row r continues from its
        token ids `ids[r]` (prompt and completion so far, never re-tokenised) with seed `seeds[r]`, at most
        `max_new_tokens` tokens."""
        raise NotImplementedError(f"engine {self.name} samples single turns only")

    def submit(self, prompts: list[str], seeds: list[int], version: int, step: int) -> Future:
        """`generate` started: its Generation comes through the future (here: at once, in this process)."""
        done: Future = Future()
        try:
            done.set_result(self.generate(prompts, seeds, version, step))
        except Exception as e:  # (the taker re-raises it)
            done.set_exception(e)
        return done

    def close(self) -> None:
        """Release what the engine holds (an engine's memory, its servers' adapters)."""


ENGINES: dict[str, type[Engine]] = {}


def register_engine(name: str) -> Callable[[type[Engine]], type[Engine]]:
    """Class decorator: the engine `name` (what `decoding.rollout_engine` returns for a config) is this class."""
    def deco(cls: type[Engine]) -> type[Engine]:
        if ENGINES.get(name, cls) is not cls:
            raise ValueError(f"engine {name!r} already has a class ({ENGINES[name].__name__})")
        ENGINES[name] = cls
        return cls
    return deco


# Engines registered by modules of their own, imported when first named (the module imports this one to
# register itself; importing it from here would close an import circle, .importlinter)
ELSEWHERE = {"vllm-server": "docuchat_rl.sampling.vllm_server"}


def get_engine_class(name: str) -> type[Engine]:
    """The engine registered as `name`; an unknown name fails listing the valid ones."""
    if name not in ENGINES and name in ELSEWHERE:
        import importlib

        importlib.import_module(ELSEWHERE[name])
    if name not in ENGINES:
        raise KeyError(f"unknown engine {name!r}; valid: {', '.join(sorted({*ENGINES, *ELSEWHERE}))}")
    return ENGINES[name]


def build_engine(ctx: EngineContext) -> Engine:
    """The engine the run's config asks for."""
    return get_engine_class(rollout_engine(ctx.cfg.rollout))(ctx)


@register_engine("fast")
@register_engine("hf")
class LocalEngine(Engine):
    """Our decode loop (`fast`) or transformers.generate (`hf`) on a Hugging Face model in this process, with
    the rollout's settings (merged adapter, grouped decode: `sample_rows`). On the learner's model it
    samples what the model holds; in a fixed lag's worker (no learner model in the context) it builds its own
    copy with the run's LoRA layout and puts each version's tensors in for the step that asks for it."""

    def __init__(self, ctx: EngineContext):
        super().__init__(ctx)
        self.model, self.tokenizer, self.versions = ctx.model, ctx.tokenizer, {}
        if self.model is None:  # (a worker process: its own copy of the policy)
            self.model, self.tokenizer = _own_policy(ctx.cfg)
        self.owns_versions = ctx.model is None

    def decoding(self) -> Decoding:
        """The rollout's decoding for the model as it is now (its loop is chosen per call: FSDP2 weights
        gathered for generation are whole only while they sample)."""
        return Decoding.of(self.ctx.cfg.rollout, self.model, lockstep=self.ctx.lockstep is not None)

    def begin_step(self, model, version: int) -> None:
        if not self.owns_versions:  # (the learner's model as the loop hands it: wrapped, a lagged version in)
            self.model = model

    def add_version(self, version: int, state: dict[str, torch.Tensor], keep_from: int) -> None:
        if self.owns_versions:
            self.versions[version] = state
            for old in [k for k in self.versions if k < keep_from]:
                del self.versions[old]

    def generate(self, prompts: list[str], seeds: list[int], version: int, step: int | None = None) -> Generation:
        if self.owns_versions:
            from peft import set_peft_model_state_dict

            set_peft_model_state_dict(self.model, self.versions[version], adapter_name="default")
        return sample_rows(self.model, self.tokenizer, self.decoding(), prompts, seeds, self.ctx.lockstep)

    def continue_rows(self, ids: list[list[int]], seeds: list[int], version: int, step: int | None,
                      max_new_tokens: int) -> Generation:
        return sample_rows(self.model, self.tokenizer, self.decoding(), ids, seeds, self.ctx.lockstep,
                           turn_tokens=max_new_tokens)


def _own_policy(cfg: Config) -> tuple[torch.nn.Module, object]:
    """(model, tokenizer): a copy of the policy for a worker process, the base model with the run's LoRA
    layout, in eval mode (the versions' tensors go into it)."""
    from ..learning.fused_lora import fuse_lora
    from ..modeling import build_lora, disable_dropout, load_configured

    model, tokenizer = load_configured(cfg.model)
    if cfg.model.disable_dropout:
        disable_dropout(model)
    model = build_lora(model, cfg.lora)
    if cfg.lora.fused:
        fuse_lora(model)
    return model.eval(), tokenizer


@register_engine("vllm")
class VLLMColocated(Engine):
    """A vLLM engine in this process (vllm_engine.VLLMEngine). On the learner's side it is synced with the
    merged policy before each step; in a fixed lag's worker it runs in vLLM's LoRA mode and serves the
    versions it is given as LoRA adapters (`spec.adapter_config`)."""

    @classmethod
    def check(cls, ctx: EngineContext) -> None:
        from ..errors import ModelError, TrainingError
        from ..modeling import tied_head_adapted, unmergeable

        if ctx.dist.active and ctx.cfg.rollout.vllm.tensor_parallel_size > 1:
            raise TrainingError("rollout.vllm.tensor_parallel_size > 1 with several training processes is not "
                                "built (each process runs its own engine): use 1, or one process")
        if ctx.sharded:
            raise TrainingError("rollout.engine vllm loads the whole model in each process: it cannot run with "
                                "FSDP2 sharding (use accelerate's data-parallel launch, or the fast engine)")
        if ctx.cfg.model.quantization != "none":  # (before unmergeable, whose reason would name the LoRA layers)
            raise TrainingError(f"rollout.engine vllm with model.quantization {ctx.cfg.model.quantization}: the "
                                "colocated engine takes each version merged into its weights, which a quantized base "
                                "cannot hold (and vLLM's CPU build loads no bitsandbytes model): use rollout.engine "
                                "fast, or hf on a GPU")
        tied = tied_head_adapted(ctx.model)
        why = unmergeable(ctx.model) or (f"its output head {tied} shares the input embedding's weight (tied), "
                                         "which vLLM restores from the embedding" if tied else None)
        if why:  # (the sync would send the base weights: vLLM would sample the untrained model, silently)
            raise ModelError(f"rollout.engine vllm samples the policy with its LoRA merged into the weights, and "
                             f"{why}: take that layer out of lora.target_modules, or use rollout.engine fast")

    @classmethod
    def worker_spec(cls, ctx: EngineContext):
        """The worker's engine serves the versions as LoRA adapters (nothing merged on either side)."""
        from .vllm_engine import engine_spec

        return engine_spec(ctx.cfg.rollout, ctx.model, ctx.tokenizer, ctx.cfg.data.max_prompt_tokens, lora=True)

    def __init__(self, ctx: EngineContext, spec=None):
        super().__init__(ctx)
        from .vllm_engine import VLLMEngine, engine_spec

        if spec is None:
            spec = engine_spec(ctx.cfg.rollout, ctx.model, ctx.tokenizer, ctx.cfg.data.max_prompt_tokens)
        self.engine = VLLMEngine(ctx.cfg, ctx.tokenizer, spec, processes=ctx.dist.world)
        self.owns_versions = spec.adapter_config is not None

    def begin_step(self, model, version: int) -> None:
        if not self.owns_versions:
            self.engine.sync(model)  # the policy of the steps before this one

    def add_version(self, version: int, state: dict[str, torch.Tensor], keep_from: int) -> None:
        if self.owns_versions:
            self.engine.add_version(version, state, keep_from)

    def generate(self, prompts: list[str], seeds: list[int], version: int, step: int | None = None) -> Generation:
        r = self.ctx.cfg.rollout
        return self.engine.generate(prompts, num_return_sequences=r.num_generations, row_seeds=seeds,
                                    max_new_tokens=r.max_new_tokens, min_new_tokens=r.min_new_tokens,
                                    temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                    version=version if self.owns_versions else None)

    def continue_rows(self, ids: list[list[int]], seeds: list[int], version: int, step: int | None,
                      max_new_tokens: int) -> Generation:
        r = self.ctx.cfg.rollout
        return self.engine.generate(ids, num_return_sequences=1, row_seeds=seeds, max_new_tokens=max_new_tokens,
                                    min_new_tokens=0, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                                    version=version if self.owns_versions else None)

    def close(self) -> None:
        self.engine.close()


def sample_rows(model, tokenizer, decoding: Decoding, prompts: list[str] | list[list[int]], seeds: list[int] | None,
                lockstep=None, turn_tokens: int | None = None) -> Generation:
    """G completions of each prompt with the rollout's `decoding`, each row from its own seed: a step's
    sampling, in the learner's process or in a fixed lag's worker (lag.py). A multi-turn row's next turn
    (`turn_tokens` set): its token ids as the prompt, one completion, at most `turn_tokens` tokens."""
    if turn_tokens:
        decoding = decoding.with_(num_return_sequences=1, max_new_tokens=turn_tokens, min_new_tokens=0)
    return generate(model, tokenizer, prompts, decoding, row_seeds=seeds, lockstep=lockstep)
