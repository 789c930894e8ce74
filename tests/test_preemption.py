"""The random states a step draws from are captured and restored exactly (a step stopped before its
update is replayed from them)."""

import random

import numpy as np
import torch

from docuchat_rl.preemption import RandomState


def test_restore_replays_every_generator_exactly():
    torch.manual_seed(3)
    state = RandomState.capture()
    first = (random.random(), float(np.random.rand()), torch.rand(3).tolist())
    state.restore()
    assert (random.random(), float(np.random.rand()), torch.rand(3).tolist()) == first
