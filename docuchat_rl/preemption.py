"""Preemption: SIGTERM / SIGINT ask the loop to stop at its next safe point, on every process at once.

Slurm and Kubernetes send SIGTERM some seconds before they kill a job. The handler only records the
signal; the loop asks `Preemption.requested()` at its two safe points (before a step's update, after a
step) and all processes agree on the answer, so they stop at the same place. A second signal stops at
once (KeyboardInterrupt), the last checkpoint intact. A step stopped before its update is replayed on
resume from the random states and data position it started with: `RandomState` captures and restores
them.

Deliberately left out: a time budget (stop N minutes before a wall-clock limit); the scheduler's signal
is the one contract.
"""

from __future__ import annotations

import contextlib
import random
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .distributed import Dist


class Preemption:
    """The stop request of this run: set by a signal handler, agreed across processes at a safe point."""

    def __init__(self, dist: Dist):
        self.dist = dist
        self.signal: signal.Signals | None = None
        self.second: signal.Signals | None = None  # a second signal, which stopped the run at once

    @contextlib.contextmanager
    def handling(self):
        """Install the handlers for SIGTERM and SIGINT for the block (main thread only), then put back
        the previous ones."""
        self.signal = self.second = None

        def ask(signum, frame):
            if self.signal is not None:
                signal.signal(signal.SIGINT, signal.default_int_handler)
                self.second = signal.Signals(signum)
                raise KeyboardInterrupt
            self.signal = signal.Signals(signum)
            print(f"docuchat-rl: {self.signal.name} received: stopping at the next safe point "
                  "(send it again to stop at once)", file=sys.stderr, flush=True)

        with _handled_by(ask):
            yield

    def requested(self) -> bool:
        """Whether any process was asked to stop (a collective: every process calls it at the same point)."""
        signum = int(self.dist.max(torch.tensor([int(self.signal) if self.signal is not None else 0])))
        if signum and self.signal is None:
            self.signal = signal.Signals(signum)
        return bool(signum)


@contextlib.contextmanager
def at_once(got: list):
    """For the block, SIGTERM stops at once as SIGINT does (KeyboardInterrupt), the signal appended to `got`:
    for stages with nothing to save (loading, evaluating), where SIGTERM's default would end the process
    without a word (main thread only)."""
    def stop(signum, frame):
        got.append(signal.Signals(signum))
        raise KeyboardInterrupt

    with _handled_by(stop):
        yield


@contextlib.contextmanager
def _handled_by(handler):
    """SIGTERM and SIGINT go to `handler` for the block, the previous handlers put back after (signals are
    handled in the main thread only: elsewhere the block runs as it is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


@dataclass(frozen=True)
class RandomState:
    """Every global random state a step draws from (Python, NumPy, torch's CPU and CUDA generators)."""

    python: Any
    numpy: Any
    torch: torch.Tensor
    cuda: list[torch.Tensor] | None

    @classmethod
    def capture(cls) -> RandomState:
        return cls(random.getstate(), np.random.get_state(), torch.get_rng_state(),
                   torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None)

    def restore(self) -> None:
        """Put every captured generator back as it was."""
        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch)
        if self.cuda is not None:
            torch.cuda.set_rng_state_all(self.cuda)
