"""Peak memory of one training step: resident memory (RSS) on a CPU, allocated memory on CUDA.

Every step's metrics record carries `memory/peak_mb`, the largest of the processes' peaks since the step
began. On CUDA that is torch's `max_memory_allocated` (reset at the step's start). On a CPU it is Linux's
peak resident set size of the process (`VmHWM` in /proc/self/status), reset at the step's start by
writing 5 to /proc/self/clear_refs (Linux >= 4.0); where that file is missing (macOS, Windows) it is the
process's peak so far (`resource.getrusage`), which only grows.

`TensorBytes` counts the bytes of the tensors alive on any device, per phase: what `max_memory_allocated`
counts on CUDA (without its allocator's rounding, workspaces or CUDA graph pools), measurable on a CPU, where
RSS also holds the allocator's caches and the libraries' own memory. The benchmark reads it
(`scripts/benchmark.py --tensor-memory`) to compare where ours and TRL's step hold memory without a GPU.

Deliberately left out: per-phase peaks in the training log (a phase's peak is the step's peak when it is the
largest one; `TensorBytes` and the profiling scripts read phases) and memory of other processes (a vLLM
engine's own process).
"""

from __future__ import annotations

import gc
import re
import warnings
import weakref
from pathlib import Path

import torch

_STATUS, _CLEAR = Path("/proc/self/status"), Path("/proc/self/clear_refs")


def reset_peak(device: torch.device) -> None:
    """Start a new peak at the current use."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        _CLEAR.write_text("5")
    except OSError:
        pass  # (no such file: the lifetime peak is reported)


def peak_mb(device: torch.device) -> float:
    """The peak since the last `reset_peak` (see the module docstring), in MiB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    try:
        found = re.search(r"VmHWM:\s+(\d+)\s+kB", _STATUS.read_text())
        if found:
            return int(found.group(1)) / 1024
    except OSError:
        pass
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


class TensorBytes:
    """Bytes of tensor storage alive, counted per storage (views share their base's), and the peak of that
    count in each phase: `with TensorBytes() as held:`, `held.phase("rollout")` as the work moves on,
    `held.peaks` {phase: bytes}. Every tensor an operation returns is counted until its storage is freed;
    those alive when counting starts or a phase begins (weights read from a file without an operation) are
    found then among the Python heap's tensors. Operations in other threads are not seen (a dispatch mode is
    per thread).

    Hand-written: torch's MemTracker (torch.distributed._tools) refuses a module called more than once in an
    iteration, which a decode loop does every token; the CUDA allocator's counters exist on CUDA only.

    >>> with TensorBytes() as held:
    ...     before = held.now  # (the tensors alive already)
    ...     a = torch.empty(1000)  # 4,000 bytes
    ...     b = a[:10]  # a view: nothing new
    ...     held.phase("two")
    ...     c = torch.empty(250, dtype=torch.float64)  # 2,000 more
    ...     del a, b
    >>> held.now - before, {name: peak - before for name, peak in held.peaks.items()}
    (2000, {'start': 4000, 'two': 6000})
    """

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        counter = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor):
                        counter._count(t)
                return out

        self._mode = _Mode()
        self.sizes: dict[tuple[str, int], int] = {}  # (device, address) of each storage alive -> its bytes
        self.now = 0
        self.current = "start"
        self.peaks: dict[str, int] = {}

    def _count(self, t: torch.Tensor) -> None:
        if t.is_meta or getattr(t, "is_sparse", False):
            return
        storage = t.untyped_storage()
        key = (str(storage.device), storage.data_ptr())
        if key[1] == 0 or key in self.sizes:
            return
        self.sizes[key] = storage.nbytes()
        self.now += storage.nbytes()
        self.peaks[self.current] = max(self.peaks.get(self.current, 0), self.now)
        weakref.finalize(storage, self._free, key)

    def _free(self, key) -> None:
        self.now -= self.sizes.pop(key, 0)

    def _sweep(self) -> None:
        """Count the tensors alive that no counted operation made (read from a file, made before `with`)."""
        with warnings.catch_warnings():  # (isinstance on a deprecated torch object warns)
            warnings.simplefilter("ignore")
            found = [obj for obj in gc.get_objects()  # (plain tensors and parameters: a subclass such as
                     if type(obj) is torch.Tensor or isinstance(obj, torch.nn.Parameter)]  # FakeTensor has no data)
        for obj in found:
            try:
                self._count(obj)
            except (RuntimeError, NotImplementedError):  # (no storage of its own: sparse, nested)
                pass
        self.peaks[self.current] = max(self.peaks.get(self.current, 0), self.now)

    def phase(self, name: str) -> None:
        """The work is now in phase `name` (a phase entered again adds to its own peak)."""
        self.current = name
        self._sweep()

    def __enter__(self) -> TensorBytes:
        self._sweep()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)


# ------------------------------------------------------------------------------------------ sizing the rollout
SHARE = 0.5  # of the memory free once the model is loaded, what the rollout's rows may ask for (the update's
# activations, the optimizer's states and the allocator's slack take the rest)


def bytes_per_position(model) -> int:
    """Bytes one row's keys and values take a position, over every layer: 2 x key/value heads x head size x the
    cache's element size (the model's compute dtype), from the model's config.

    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> tiny = LlamaForCausalLM(LlamaConfig(hidden_size=192, num_attention_heads=6, num_key_value_heads=6,
    ...                                     num_hidden_layers=4, intermediate_size=64, vocab_size=32))
    >>> bytes_per_position(tiny)  # 4 layers x 2 x 6 heads x 32 x 4 bytes (float32)
    6144
    """
    c = getattr(model, "config", model)
    c = c.get_text_config() if hasattr(c, "get_text_config") else c
    heads = getattr(c, "num_attention_heads", 1)
    kv = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    element = 4
    for p in model.parameters() if hasattr(model, "parameters") else ():
        if p.is_floating_point():  # (the first floating weight's: the dtype activations and the cache are kept in)
            element = p.element_size()
            break
    return int(c.num_hidden_layers * 2 * kv * head_dim * element)


def bytes_per_row(model, positions: int) -> int:
    """One generated row's memory at `positions` (prompt + completion): its keys and values, and its float32
    logits and their softmax over the vocabulary at one step (the draw's), 8 bytes a token of the vocabulary."""
    c = getattr(model, "config", model)
    vocab = getattr(c.get_text_config() if hasattr(c, "get_text_config") else c, "vocab_size", 0)
    return bytes_per_position(model) * positions + 8 * vocab


def free_bytes(device: torch.device) -> int:
    """The memory the device has free now: CUDA's (torch.cuda.mem_get_info), else the host's available memory."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    import psutil

    return int(psutil.virtual_memory().available)


def rows_that_fit(free: int, per_row: int, cap: int, group: int) -> int:
    """The rows a generate call holds within SHARE of `free` bytes at `per_row` bytes a row: at most `cap`, at
    least a group (a call never splits one), in whole groups; 0 when not even one group fits.

    >>> rows_that_fit(free=100_000, per_row=1_000, cap=256, group=8)  # 50 rows fit: 6 groups of 8
    48
    >>> rows_that_fit(free=10**12, per_row=1_000, cap=64, group=8), rows_that_fit(free=10_000, per_row=1_000, cap=64, group=8)
    (64, 0)
    """
    fit = int(free * SHARE) // max(per_row, 1)
    if fit < group:
        return 0
    return min(cap, fit // group * group) if cap >= group else min(cap, fit)


def size_rollout(model, rows_cap: int, group: int, positions: int, device: torch.device, key: str) -> int:
    """`rollout.generation_batch_size: auto` decided from the memory the device has once the model is loaded:
    `rows_that_fit` at the model's bytes a row; one line naming the keys to change when not one group of
    `group` rows fits at `positions`, before anything is allocated."""
    per_row = bytes_per_row(model, positions)
    free = free_bytes(device)
    rows = rows_that_fit(free, per_row, rows_cap, group)
    if rows == 0:
        need = per_row * group
        raise MemoryError(f"{key}: a group of {group} rows at {positions} positions needs {need / 2**30:.2f} GiB of "
                          f"keys, values and logits ({per_row / 2**20:.1f} MiB a row), and {SHARE:.0%} of the "
                          f"{free / 2**30:.2f} GiB free on {device} is less: lower rollout.num_generations or "
                          "rollout.max_new_tokens, or load the base quantized (model.quantization)")
    return rows
