"""How a process samples: the engine choice, made here once, and the decode loop's settings as one object.

The config decides every `auto` switch for the device first (`Config.for_device`, as measured:
docs/performance.md). From the decided rollout settings this module names the engine that samples a run's
training steps (`rollout_engine`) and the decode loop that samples in this process (`local_loop`): evaluation,
`generate`, chat, and the steps themselves under `fast` / `hf`. Nothing after it switches on `rollout.engine`:

    rollout.engine  vllm.mode   rollout_engine  local_loop
    fast            -           fast            fast; on a GPU with cuda_graphs, hf for a model the static
                                                decode does not cover or for sharded weights in lockstep
                                                (our dynamic loop is launch-bound there)
    hf              -           hf              hf
    vllm            colocate    vllm            fast (a vLLM engine serves training rollouts only)
    vllm            server      vllm-server     fast

`Decoding` is what the decode loop (`generation.generate`) is handed: every setting it reads, `Decoding.of` a
decided rollout config, so a step's sampling, evaluation and chat cannot disagree on one of them.

Deliberately left out: an engine chosen per step or per prompt length.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from .grouped_decode import covers

if TYPE_CHECKING:
    from ..config import RolloutConfig

LOOPS = ("fast", "hf")


def _decided(r: RolloutConfig, *keys: str) -> None:
    for key in ("engine", *keys):
        if getattr(r, key) == "auto":
            raise ValueError(f"rollout.{key} is still auto: decide the config for the device first (Config.for_device)")


def rollout_engine(r: RolloutConfig) -> str:
    """The registered engine (engines.ENGINES) that samples the training steps of a decided rollout config."""
    _decided(r)
    return "vllm-server" if r.engine == "vllm" and r.vllm.mode == "server" else r.engine


def local_loop(r: RolloutConfig, model=None, lockstep: bool = False,
               device_type: str | None = None) -> Literal["fast", "hf"]:
    """The decode loop that samples `model` in this process under a decided rollout config (the table above);
    `lockstep`: every process decodes the same model calls (sharded weights); `device_type`: where the model
    is (read off it when None)."""
    _decided(r, "cuda_graphs")
    loop = "fast" if r.engine == "vllm" else r.engine
    if loop == "fast" and r.cuda_graphs and model is not None:
        device_type = device_type or next(model.parameters()).device.type
        if device_type == "cuda" and (lockstep or not covers(model)):
            return "hf"
    return loop


@dataclass(frozen=True)
class Decoding:
    """Every setting of this process's decode loop (generation.generate); `Decoding.of` a decided rollout
    config, one field changed with `dataclasses.replace` (`with_`)."""

    max_new_tokens: int
    do_sample: bool = True  # False: greedy
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    batch_size: int = 64  # rows a model call decodes
    num_return_sequences: int = 1  # completions per prompt, rows prompt-major
    min_new_tokens: int = 0  # no EOS before this many tokens
    loop: Literal["fast", "hf"] = "fast"  # our decode loop, or transformers.generate
    grouped_decode: bool = True  # fast loop: each prompt's keys/values read once for its G rows
    cuda_graphs: bool = False  # fast loop: static shapes, replayed as CUDA graphs on a GPU
    compile_decode: bool = False  # with cuda_graphs: the static step compiled by torch.compile
    fused_projections: bool = False  # with cuda_graphs: q/k/v and gate/up as one matmul each
    merge_adapter: bool = False  # sample with the LoRA folded into the weights (restored after)

    def __post_init__(self):
        if self.loop not in LOOPS:
            raise ValueError(f"unknown decode loop {self.loop!r}; valid: {', '.join(LOOPS)} (rollout.engine names "
                             "the engine; decoding.local_loop the loop it samples with in this process)")

    @classmethod
    def of(cls, r: RolloutConfig, model=None, lockstep: bool = False, **changes) -> Decoding:
        """The rollout's sampling (its processors, sizes and switches, the loop this process runs), with
        `changes` (e.g. do_sample=False, batch_size=eval.batch_size)."""
        return cls(max_new_tokens=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                   batch_size=r.generation_batch_size, num_return_sequences=r.num_generations,
                   min_new_tokens=r.min_new_tokens, loop=local_loop(r, model, lockstep),
                   grouped_decode=r.grouped_decode, cuda_graphs=r.cuda_graphs, compile_decode=r.compile_decode,
                   fused_projections=r.fused_projections, merge_adapter=r.merge_adapter).with_(**changes)

    def with_(self, **changes) -> Decoding:
        return dataclasses.replace(self, **changes) if changes else self
