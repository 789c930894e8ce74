"""Counting host syncs: every read of a tensor back into Python (`item`, `tolist`, `int`, `float`,
`bool`, `__index__`) stops the host until a GPU has caught up. On a CPU they cost nothing, so
`torch.cuda.set_sync_debug_mode` cannot see them there; wrapping torch.Tensor's conversions can, which is
how `scripts/host_syncs.py` measures and `tests/test_syncs.py` bounds the reads of the decode loop and
the update on any device.

Deliberately left out: device-to-host copies that are not Python conversions (`.cpu()`, `.to("cpu")`)
and host-to-device copies.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass

import torch

CONVERSIONS = ("item", "tolist", "__int__", "__float__", "__bool__", "__index__")


@dataclass
class HostReads:
    """Conversions counted so far: all of them, and those made by docuchat_rl's own code."""

    all: int = 0
    ours: int = 0


@contextlib.contextmanager
def count_host_reads():
    """Count every tensor -> Python conversion made inside the block (not thread-safe: for measurements).

    >>> with count_host_reads() as reads:
    ...     _ = float(torch.ones(1).sum()), torch.zeros(2).tolist()
    >>> reads.all
    2
    """
    reads = HostReads()
    originals = {name: getattr(torch.Tensor, name) for name in CONVERSIONS}

    def wrap(fn):
        def inner(self, *args, **kwargs):
            reads.all += 1
            reads.ours += "/docuchat_rl/" in sys._getframe(1).f_code.co_filename
            return fn(self, *args, **kwargs)
        return inner

    for name, fn in originals.items():
        setattr(torch.Tensor, name, wrap(fn))
    try:
        yield reads
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
