"""The few collectives data-parallel training needs, on torch.distributed (set up by accelerate under
`accelerate launch` or `torchrun`), and the identity on one process; and FSDP2 sharding of the frozen
base model when the launcher's accelerate config asks for FSDP.

The trainer does not wrap the model in DistributedDataParallel: a step's ranks may hold different
numbers of rows in a minibatch (a group never spans ranks), and the trainable parameters (LoRA adapters,
a value head, a critic adapter) are small, so after each minibatch's backward the gradients are summed
across ranks in one flat all-reduce. The loss of each rank is already normalised by the minibatch's
global row or token count, so the sum is exactly the one-process gradient (up to summation order).

Sharding (`accelerate launch --config_file config/accelerate/fsdp2.yaml`): torch's FSDP2 `fully_shard`
on each decoder layer, with that layer's trainable parameters left out (`ignored_params`). The frozen
base weights of the decoder layers, most of a model's memory, are split across processes and gathered
layer by layer in each forward and backward; the LoRA adapters, the embeddings, the output head and the
critic stay whole on every process, so the optimizer, the gradient sum, the chunked output head and
the checkpoints are those of the data-parallel path. accelerate's own FSDP2 preparation is not used for
the wrapping: it shards every parameter (the adapters too) and wants to own the model's forward, while
the trainer drives generation and its passes itself. What sharding demands of the trainer: every
process runs the same number of forwards (and backwards) through the sharded layers, since each one is
a collective (`Dist.steps` pads the short processes with placeholder micro-batches), and generation
runs on gathered weights (`gathered`), as TRL does under ZeRO-3 by default.

Deliberately left out: DeepSpeed ZeRO (refused with a pointer to FSDP2), FSDP1, CPU offload of
parameters, loading the model already sharded (each process loads it whole, then shards it), and
sharding the embeddings and the output head.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch

from .modeling import base_model


def end_processes(together: bool = True) -> bool:
    """Tear down the process group, if one was started, before the interpreter exits. Without it a gloo
    process whose peer exited first can abort at exit ("terminate called without an active exception",
    SIGABRT) after its work is done, and the launcher reports the whole run as failed. `together` (a
    command that finished normally): first wait, up to a minute, until every process is here, so no process
    tears its connections down while another still uses them. After an error the processes do not wait for
    each other. With both, the abort still came in 2 of 5 full test runs (2026-11-24): the caller then ends
    the process without the interpreter's teardown (cli.main). Returns whether a group was torn down."""
    import datetime

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return False
    if together:
        with contextlib.suppress(RuntimeError):  # (a peer that failed: the launcher ends this process anyway)
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=60)) if dist.get_backend() == "gloo" \
                else dist.barrier()
    dist.destroy_process_group()
    return True


def no_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum over the processes of a one-process run: the tensor itself (the default `reduce` of the
    functions that take one)."""
    return x


def on_cpu(device_setting: str) -> bool:
    """Whether `model.device` means the CPU (accelerate sets up multi-process CPU runs, on gloo, only when
    told `cpu=True`; without it, torchrun on a machine without GPUs runs N independent copies)."""
    return device_setting == "cpu" or (device_setting == "auto" and not torch.cuda.is_available())


class Dist:
    """This process's place among the launched ones (world, rank, device) and the collectives over them;
    every method is the identity (or trivial) on one process."""

    def __init__(self, world: int = 1, rank: int = 0, device: torch.device | None = None):
        self.world, self.rank, self.device = world, rank, device or torch.device("cpu")

    @classmethod
    def from_accelerator(cls, accelerator) -> Dist:
        """From an Accelerator or a PartialState (the processes a launcher started, or this one alone)."""
        return cls(accelerator.num_processes, accelerator.process_index, accelerator.device)

    @property
    def active(self) -> bool:
        """Several processes (the collectives communicate)."""
        return self.world > 1

    @property
    def is_main(self) -> bool:
        """The process that writes the run's files."""
        return self.rank == 0

    def _reduce(self, x: torch.Tensor, op: str) -> torch.Tensor:
        if not self.active:
            return x
        import torch.distributed as dist

        out = x.detach().to(self.device, copy=True)
        dist.all_reduce(out, op=getattr(dist.ReduceOp, op))
        return out.to(x.device)

    def share(self, n: int) -> tuple[int, int]:
        """[lo, hi): this process's contiguous share of n items (the first processes get fewer when n
        does not divide)."""
        return self.rank * n // self.world, (self.rank + 1) * n // self.world

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over ranks (a new tensor; x itself unchanged)."""
        return self._reduce(x, "SUM")

    def sum_floats(self, values: list[float]) -> list[float]:
        """Host numbers summed over ranks (on one process: the numbers themselves, no tensor at all)."""
        if not self.active:
            return list(values)
        return self.sum(torch.tensor(values, dtype=torch.float64)).tolist()

    def max(self, x: torch.Tensor) -> torch.Tensor:
        """x's element-wise maximum over ranks (a new tensor)."""
        return self._reduce(x, "MAX")

    def gather(self, items: list) -> list:
        """Every rank's list, concatenated in rank order (on every rank)."""
        if not self.active:
            return items
        import torch.distributed as dist

        out: list = [None] * self.world
        dist.all_gather_object(out, items)
        return [x for part in out for x in part]

    def any(self, flag: bool) -> bool:
        """Whether `flag` holds on any process."""
        return bool(self.max(torch.tensor([float(flag)])))

    def steps(self, n: int) -> int:
        """The largest of every process's `n` (the number of collective passes all of them must run)."""
        return int(self.max(torch.tensor([float(n)])))

    def barrier(self) -> None:
        """Wait for every process (nothing on one process)."""
        if self.active:
            import torch.distributed as dist

            dist.barrier()

    def broadcast_(self, tensors: list[torch.Tensor]) -> None:
        """Overwrite each tensor, in place, with the main process's (one flat broadcast): the trainable
        weights start identical on every process even if some initialisation drew rank-dependent numbers."""
        if not self.active or not tensors:
            return
        import torch.distributed as dist

        flat = torch.cat([t.detach().reshape(-1).to(self.device, torch.float32) for t in tensors])  # [total]
        dist.broadcast(flat, src=0)
        start = 0
        with torch.no_grad():
            for t in tensors:
                t.copy_(flat[start:start + t.numel()].view_as(t))
                start += t.numel()

    def sum_grads(self, params: list[torch.nn.Parameter]) -> None:
        """Replace each parameter's gradient by its sum over ranks (missing gradients count as zeros)."""
        if not self.active:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = self.sum(torch.cat([g.reshape(-1).float() for g in grads]))  # [total trainable]
        start = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[start:start + n].view_as(p).to(p.dtype)
            start += n


@dataclass(frozen=True)
class Sharding:
    """FSDP2 over the decoder layers, as the launcher's accelerate config asked."""

    reshard_after_forward: bool  # free a layer's gathered weights after its forward (gather again in backward)
    layer_classes: tuple[str, ...] | None  # the module classes to shard; None: the model's _no_split_modules


class ShardingError(ValueError):
    """The launcher's accelerate config asks for something this trainer does not do."""


def sharding_from_launcher() -> Sharding | None:
    """The sharding that `accelerate launch` asked for through its environment (None: plain data-parallel).
    accelerate's FullyShardedDataParallelPlugin parses the FSDP_* variables; each setting the trainer
    cannot honour is refused by name rather than ignored."""
    env = os.environ
    if env.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        raise ShardingError("the accelerate config asks for DeepSpeed, which docuchat-rl does not run: its trainable "
                            "state is a LoRA adapter, so ZeRO-1/2 have nothing to shard, and for ZeRO-3 use "
                            "FSDP2 (config/accelerate/fsdp2.yaml)")
    if env.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return None
    check_fsdp_torch(torch.__version__)
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    plugin = FullyShardedDataParallelPlugin()  # reads FSDP_VERSION, FSDP_RESHARD_AFTER_FORWARD, ...
    refused = {
        "fsdp_version": (plugin.fsdp_version != 2, "FSDP1 is not supported; set fsdp_version: 2"),
        "fsdp_offload_params": (type(plugin.cpu_offload).__name__ == "CPUOffloadPolicy" or plugin.cpu_offload is True,
                                "CPU offload is not supported"),
        "fsdp_activation_checkpointing": (plugin.activation_checkpointing,
                                          "not read here: set model.gradient_checkpointing=true in the recipe"),
        "fsdp_cpu_ram_efficient_loading": (plugin.cpu_ram_efficient_loading,
                                           "not supported: every process loads the whole model, then shards it"),
        "fsdp_auto_wrap_policy": (plugin.auto_wrap_policy not in (None, transformer_auto_wrap_policy),
                                  "only TRANSFORMER_BASED_WRAP: the decoder layers are sharded"),
    }
    for key, (bad, why) in refused.items():
        if bad:
            raise ShardingError(f"accelerate config key {key}: {why}")
    names = plugin.transformer_cls_names_to_wrap
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    return Sharding(reshard_after_forward=bool(plugin.reshard_after_forward),
                    layer_classes=tuple(names) if names else None)


FSDP_TORCH = (2, 7)  # fully_shard(..., ignored_params=...) keeps the adapters whole; older torch lacks it


def check_fsdp_torch(version: str) -> None:
    """Refuse FSDP2 on a torch older than FSDP_TORCH (one line, before any model is loaded)."""
    major, minor = (int(x) for x in version.split("+")[0].split(".")[:2])
    if (major, minor) < FSDP_TORCH:
        raise ShardingError(f"FSDP2 here needs torch >= {'.'.join(map(str, FSDP_TORCH))} (fully_shard's "
                            f"ignored_params keeps the LoRA weights whole); this is torch {version}: upgrade torch, "
                            "or launch without the FSDP accelerate config (plain data-parallel)")


@contextlib.contextmanager
def without_fsdp_env():
    """Hide the launcher's FSDP request from accelerate's Accelerator, which would otherwise take over the
    model's preparation (see the module docstring); the trainer shards the model itself."""
    saved = os.environ.pop("ACCELERATE_USE_FSDP", None)
    try:
        yield
    finally:
        if saved is not None:
            os.environ["ACCELERATE_USE_FSDP"] = saved


def shard_layers(model: torch.nn.Module, sharding: Sharding) -> list[torch.nn.Module]:
    """fully_shard each decoder layer of `model`, its trainable parameters left whole; -> the sharded layers."""
    from torch.distributed.fsdp import fully_shard

    base = base_model(model)
    names = set(sharding.layer_classes or getattr(base, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ShardingError(f"no module of class {', '.join(sorted(names)) or '(none named)'} in "
                            f"{type(base).__name__} to shard; set fsdp_transformer_layer_cls_to_wrap in the "
                            "accelerate config")
    for layer in layers:
        fully_shard(layer, reshard_after_forward=sharding.reshard_after_forward,
                    ignored_params={p for p in layer.parameters() if p.requires_grad})
    return layers


@contextlib.contextmanager
def gathered(layers: list[torch.nn.Module], sharding: Sharding | None):
    """The sharded layers' weights gathered whole for the block, and kept so through any number of
    forwards (generation: otherwise each decoding step would gather every layer again, and every process
    would have to decode in lockstep); sharded again afterwards."""
    if not layers:
        yield
        return
    for layer in layers:
        layer.set_reshard_after_forward(False)
        layer.unshard()
    try:
        yield
    finally:
        for layer in layers:
            layer.reshard()
            layer.set_reshard_after_forward(sharding.reshard_after_forward)


def held_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of parameters this process holds, bytes of the whole model's parameters)."""
    from torch.distributed.tensor import DTensor

    mine = whole = 0
    for p in model.parameters():
        whole += p.numel() * p.element_size()
        mine += (p.to_local() if isinstance(p, DTensor) else p).numel() * p.element_size()
    return mine, whole
