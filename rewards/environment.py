"""The environment's own reward: `get_reward()` of each completion's environment (TRL's environment_factory).

A multi-turn run with `rollout.environment_factory` gives the rewards an `environments` column (one instance
per completion, after its last turn); this component calls each one's `get_reward()` (sync, or async: all of
a batch's are started, then awaited together) and traces its value like any other component's.

Deliberately left out: environments of several classes in one run (TRL's environment column).
"""

from __future__ import annotations

import inspect
from typing import Any

from .base import Reward, RewardError, Score, register, start_async


@register("environment")
class EnvironmentReward(Reward):
    """Each completion's environment's `get_reward()` as its raw score; None where its environment has none.

    >>> class Env:
    ...     def __init__(self, solved): self.solved = solved
    ...     def get_reward(self): return 1.0 if self.solved else 0.0
    >>> EnvironmentReward()(["Q", "Q"], ["a", "b"], environments=[Env(True), Env(False)])
    [1.0, 0.0]
    """

    low, high = float("-inf"), float("inf")

    def explain(self, prompts: list, completions: list, **columns: Any) -> list[Score]:
        envs = columns.get("environments")
        if envs is None:
            raise RewardError("environment: no `environments` column (set rollout.environment_factory)")
        if len(envs) != len(completions):
            raise RewardError(f"environment: {len(envs)} environments for {len(completions)} completions")
        calls = [getattr(e, "get_reward", None) for e in envs]
        started = [start_async(c()) if inspect.iscoroutinefunction(c) else None
                   for c in calls]  # (every async one started before any is awaited)
        out = []
        for call, future in zip(calls, started):
            if call is None:
                out.append(Score(None, {"why": "the environment has no get_reward"}))
                continue
            value = future.result() if future is not None else call()
            out.append(Score(None if value is None else float(value)))
        return out
