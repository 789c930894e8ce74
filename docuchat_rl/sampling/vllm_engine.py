"""The vLLM rollout engine (`rollout.engine: vllm`), colocated in the training process as TRL's
`vllm_mode: colocate`: one engine per process, each generating its own share of the prompts.

What it keeps of our engines' contract:
- The distribution: only temperature, top-k and top-p shape it (vLLM's own defaults from the model's
  generation_config are overridden by explicit SamplingParams), and the log-prob of each sampled token
  is the sampler's own under that processed distribution (`logprobs_mode="processed_logprobs"`; vLLM's
  default `raw_logprobs` ignores temperature and top-k/top-p).
- Reproducibility: each completion is its own request with its own seed (`generation.row_seed`), so what
  a row samples depends on (seed, step, prompt, sample) and the weights, not on its batch.
- The weights: `sync` loads the policy's full state dict, LoRA deltas merged in, into the engine
  (`reload_weights` with every tensor: a partial dict corrupts the model), then resets the prefix
  cache (cached prompt keys/values of the old weights would otherwise be reused). The collector syncs
  before every step's rollout (the policy changes at every step).

Several processes: each runs its own engine on its own share of the prompts, vLLM joining the
launcher's process group (`external_launcher`, as TRL's colocate mode); tensor parallelism across them
is not built (refused).

A fixed lag's worker process (lag.py, `rollout.async_lag` with `async_worker_threads`) runs this engine
in vLLM's LoRA mode instead: it holds no Hugging Face model, only the base weights in vLLM, and serves each
adapter version it is sent as a LoRA adapter (`add_version`, written as peft's adapter folder; the k + 2
versions in use stay loaded, as TRL's async GRPO keeps max_staleness + 1). The synchronous loop keeps the
merged sync: vLLM's LoRA path was 5x slower than a merged sync on the CPU in issue #24's measurement.

This module is the colocated engine (in the training process, or in a fixed lag's worker beside it); vLLM's
own servers on GPUs or machines of their own are `vllm_server.py`.

Deliberately left out: sharded (FSDP2) models and sharded generation.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ..modeling import base_model, merged_adapter
from .generation import Generation, eos_ids

if TYPE_CHECKING:
    from ..config import Config, RolloutConfig

_SET_NUM_THREADS = torch.set_num_threads  # (vLLM's CPU worker replaces it with a no-op; kept before that)
INSTALL_HINT = "pip install 'docuchat-rl[vllm]' (on a CPU-only machine: see docs/vllm.md)"


def import_vllm():
    """vllm, or one line saying how to install it."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in this process (colocated)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # leave the training's threads alone
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # (INFO logs every weight sync and cache reset)
    try:
        import vllm
    except ImportError as e:
        from ..errors import ModelError

        raise ModelError(f"rollout.engine vllm needs vLLM, which is not installed ({e}); {INSTALL_HINT}") from None
    return vllm


@dataclass(frozen=True)
class EngineSpec:
    """What an engine needs of the policy model: plain data, so that a fixed lag's worker process (lag.py),
    which holds no Hugging Face model, can be sent it."""

    dtype: str  # the base weights' dtype name
    stop: list[int]  # the token ids that end a completion
    longest: int  # prompt + completion positions the engine must accept
    eager: bool  # no CUDA graphs (always on a CPU)
    adapter_config: str | None = None  # peft's adapter_config.json: serve adapter versions as LoRA (else: merged syncs)


def engine_spec(rollout: RolloutConfig, model, tokenizer, max_prompt_tokens: int, lora: bool = False) -> EngineSpec:
    """The EngineSpec of the policy `model`; `lora`: the adapter versions are served as LoRA adapters."""
    import json

    dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}[
        next(base_model(model).parameters()).dtype]
    device = next(model.parameters()).device
    config = None
    if lora:  # (sets, as peft keeps target_modules, are not JSON)
        fields = model.peft_config["default"].to_dict()
        config = json.dumps({k: sorted(v) if isinstance(v, set) else v for k, v in fields.items()}, default=str)
    return EngineSpec(dtype, eos_ids(model, tokenizer),
                      min(max_prompt_tokens + rollout.max_new_tokens, _positions(model)),
                      rollout.vllm.enforce_eager or device.type == "cpu", config)


class VLLMEngine:
    """One colocated vLLM engine for the policy of `spec` (its base weights are loaded from the model's own
    folder); then either `sync` gives it the policy's current weights, or (`spec.adapter_config`) it serves
    adapter versions as LoRA adapters (`add_version`, `generate(version=...)`)."""

    def __init__(self, cfg: Config, tokenizer, spec: EngineSpec, processes: int = 1):
        vllm = import_vllm()
        v, r = cfg.rollout.vllm, cfg.rollout
        self.cfg, self.tokenizer, self.processes, self.spec = cfg, tokenizer, processes, spec
        # several processes (torchrun / accelerate launch): vLLM joins the launcher's process group instead
        # of starting its own (TRL's colocate mode does the same); each engine serves its own process
        launched = dict(distributed_executor_backend="external_launcher") if processes > 1 else {}
        self.stop, longest = spec.stop, spec.longest  # (longest: prompt + completion)
        threads = torch.get_num_threads()
        memory = dict(kv_cache_memory_bytes=v.kv_cache_memory_bytes) if v.kv_cache_memory_bytes else \
            dict(gpu_memory_utilization=v.gpu_memory_utilization)
        lora = {}
        self.versions: dict[int, Path] = {}
        self._asleep = False  # (rollout.vllm.sleep: the engine sleeps between rollouts)
        if spec.adapter_config:  # as TRL's async GRPO (PR #7017): the versions in use stay loaded side by side
            import json
            import tempfile

            rank = json.loads(spec.adapter_config)["r"]
            lora = dict(enable_lora=True, max_lora_rank=max(8, 1 << (rank - 1).bit_length()),  # (vLLM's sizes)
                        max_loras=r.async_lag + 2)
            self._folder = tempfile.TemporaryDirectory(prefix="docuchat-rl-lora-")
        self.llm = vllm.LLM(
            str(Path(cfg.model.name_or_path)), tokenizer=str(Path(cfg.model.name_or_path)), dtype=spec.dtype,
            seed=cfg.run.seed, enforce_eager=spec.eager,
            max_model_len=v.max_model_len or longest,
            max_num_seqs=max(r.generation_batch_size, 1), tensor_parallel_size=v.tensor_parallel_size,
            logprobs_mode="processed_logprobs", enable_sleep_mode=v.sleep,
            # one prefill never chunked: per-request seeds and a chunked prefill do not mix on the CPU
            max_num_batched_tokens=max(8192, longest * r.generation_batch_size),
            **memory, **launched, **lora)
        _SET_NUM_THREADS(threads)  # the training passes keep the thread count they had before the engine

    def add_version(self, version: int, state: dict[str, torch.Tensor], keep_from: int) -> None:
        """Adapter `version` (peft's saved tensors) served from now on; the versions before `keep_from` dropped."""
        from safetensors.torch import save_file

        folder = Path(self._folder.name) / f"v{version}"
        folder.mkdir(exist_ok=True)
        save_file(state, str(folder / "adapter_model.safetensors"))
        (folder / "adapter_config.json").write_text(self.spec.adapter_config)
        self.versions[version] = folder
        for old in [k for k in self.versions if k < keep_from]:
            self.llm.llm_engine.remove_lora(old + 1)  # (the LoRARequest id of version v is v + 1)
            shutil.rmtree(self.versions.pop(old), ignore_errors=True)

    def sync(self, model) -> None:
        """Give the engine the policy's current weights (LoRA merged)."""
        with torch.no_grad(), merged_adapter(model):
            state = {_hf_name(k): t for k, t in base_model(model).state_dict().items() if "lora_" not in k}
            self._wake()
            self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=list(state.items()),
                                                                  is_checkpoint_format=True))
        self.llm.reset_prefix_cache()

    def generate(self, prompts: list[str] | list[list[int]], *, num_return_sequences: int, row_seeds: list[int] | None,
                 max_new_tokens: int, min_new_tokens: int, temperature: float, top_p: float, top_k: int,
                 version: int | None = None) -> Generation:
        """`num_return_sequences` completions per prompt, rows prompt-major (as generation.generate); with
        `version`, sampled by that adapter version (`add_version`) as a LoRA adapter."""
        from vllm import SamplingParams, TokensPrompt
        from vllm.lora.request import LoRARequest

        g = num_return_sequences
        if row_seeds is not None and len(row_seeds) != len(prompts) * g:
            raise ValueError(f"{len(row_seeds)} row seeds for {len(prompts) * g} rows")
        ids = [list(p) if not isinstance(p, str) else self.tokenizer(p, add_special_tokens=False)["input_ids"]
               for p in prompts]  # (token ids: a multi-turn conversation so far)
        requests, params = [], []
        for i, p in enumerate(ids):
            for s in range(g):
                row = i * g + s
                requests.append(TokensPrompt(prompt_token_ids=p))
                params.append(SamplingParams(
                    n=1, max_tokens=max_new_tokens, min_tokens=min_new_tokens, logprobs=0,
                    temperature=temperature, top_p=top_p, top_k=top_k if top_k > 0 else -1,
                    seed=row_seeds[row] if row_seeds is not None else None,
                    stop_token_ids=self.stop, ignore_eos=False, skip_special_tokens=True,
                    repetition_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, min_p=0.0))
        lora = None if version is None else LoRARequest(f"v{version}", version + 1, str(self.versions[version]))
        self._wake()  # (a LoRA-mode engine gets no sync before it samples: it wakes here)
        outs = self.llm.generate(requests, params, use_tqdm=False, lora_request=lora)
        gen = Generation([], [], [], [])
        for i, out in enumerate(outs):
            c = out.outputs[0]
            tokens = list(c.token_ids)
            gen.prompt_ids.append(ids[i // g])
            gen.completion_ids.append(tokens)
            gen.truncated.append(c.finish_reason == "length" and not (tokens and tokens[-1] in self.stop))
            gen.logps.append([float(d[t].logprob) for d, t in zip(c.logprobs, tokens)])
        if self.cfg.rollout.vllm.sleep:
            self.llm.sleep(level=1)
            self._asleep = True
        return gen

    def _wake(self) -> None:
        """Wake a sleeping engine (rollout.vllm.sleep: it sleeps between rollouts)."""
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def close(self) -> None:
        """Shut the engine down and release vLLM's process-wide state (its parallel groups), so that a
        later engine in this process starts clean (an old engine collected late would tear down the new
        one's groups)."""
        if self.llm is None:
            return
        import gc

        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        self.llm = None
        if self.spec.adapter_config:
            self._folder.cleanup()
        gc.collect()
        destroy_model_parallel()
        if self.processes == 1:  # (under a launcher the world group is the training's: it ends with the run)
            destroy_distributed_environment()


def _positions(model) -> int:
    """The longest sequence the model's position embeddings cover (a large number when it does not say)."""
    return int(getattr(base_model(model).config, "max_position_embeddings", None) or 1 << 20)


def _hf_name(key: str) -> str:
    """A parameter name of the (merged) PEFT-wrapped base model as the checkpoint names it."""
    return key.replace(".base_layer.", ".")
