"""The composite reward: selected components, weighted, traced and fault-isolated.

total = sum over components of weight * raw, over the components that returned a value for that
completion. A component that is not applicable (None) or failed contributes nothing and the weights are
NOT renormalised (as TRL's nansum): renormalising would hand a failed correctness reward's weight to
the others (format alone would then carry it), which invites reward hacking. When no component has a
value the total is 0.0 and the record says `total_missing`.

Every component also gets TRL's two logging hooks among its columns: `log_extra(column, values)` (one
value per completion, into that completion's `info` for this component) and `log_metric(name, value)`
(into `BatchResult.metrics`); each call has its own, so a timed-out call abandoned in its thread logs
into nothing.

A failure is any of: the call raised, returned a non-list or the wrong number of values, returned a
non-number, NaN or inf (that completion only), or ran past `timeout_s`. It is recorded in the
component's `error` field and counted in `errors[name]`; with `strict=True` it raises `RewardFailure`
at once instead.

Deliberately left out: killing a timed-out reward. Python cannot stop a thread, so a reward past its
limit is abandoned (its result ignored) and keeps a worker thread busy until it returns.
"""

from __future__ import annotations

import math
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

from .base import Reward, RewardError, Score, build_reward


class RewardFailure(RuntimeError):
    """Raised in strict mode: which reward failed, and how."""


@dataclass
class ComponentResult:
    """One component's score of one completion: raw value, weight, weighted value, reason, error."""

    raw: float | None
    weight: float
    weighted: float | None
    info: dict[str, Any]
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"raw": self.raw, "weight": self.weight, "weighted": self.weighted, "info": self.info,
                "error": self.error}


@dataclass
class RewardRecord:
    total: float
    components: dict[str, ComponentResult]
    total_missing: bool = False


@dataclass
class BatchResult:
    """A batch scored: one record per completion, failures and wall time per component."""

    records: list[RewardRecord]
    errors: dict[str, int] = field(default_factory=dict)  # failed completions per component
    seconds: dict[str, float] = field(default_factory=dict)  # wall time per component
    metrics: dict[str, list[float]] = field(default_factory=dict)  # what user functions logged (log_metric)

    @property
    def totals(self) -> list[float]:
        return [r.total for r in self.records]


class CompositeReward:
    """Weighted sum of rewards, built from specs `[{"name", "weight", "params"}]` (only those listed).

    >>> comp = CompositeReward([{"name": "correctness", "weight": 1.0}, {"name": "format", "weight": 0.5}])
    >>> res = comp(["Q"], ["<think>2+2=4</think><answer>4</answer>"], answer=["4"])
    >>> res.records[0].total, res.records[0].components["format"].weighted
    (1.5, 0.5)
    """

    def __init__(self, specs: list[dict[str, Any]], strict: bool = False, timeout_s: float = 10.0):
        if not specs:
            raise RewardError("the composite reward needs at least one component")
        self.components: list[tuple[str, float, Reward]] = []
        for spec in specs:
            name, weight = spec["name"], float(spec.get("weight", 1.0))
            self.components.append((name, weight, build_reward(name, spec.get("params"))))
        names = [n for n, _, _ in self.components]
        if len(set(names)) != len(names):
            raise RewardError(f"a reward is listed twice: {names}")
        self.strict, self.timeout_s = strict, timeout_s
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")

    @property
    def names(self) -> list[str]:
        return [n for n, _, _ in self.components]

    def _call(self, reward: Reward, prompts: list, completions: list, columns: dict) -> list[Score]:
        """One component on the batch, under the time limit; raises on any malformed result."""
        future = self._pool.submit(reward.explain, prompts, completions, **columns)
        try:
            scores = future.result(timeout=self.timeout_s)
        except FutureTimeout:
            # abandon the stuck worker; a fresh pool serves the next calls
            self._pool.shutdown(wait=False)
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")
            raise TimeoutError(f"exceeded the {self.timeout_s:g} s time limit") from None
        if not isinstance(scores, (list, tuple)):
            raise TypeError(f"returned {type(scores).__name__}, expected a list")
        if len(scores) != len(completions):
            raise ValueError(f"returned {len(scores)} values for {len(completions)} completions")
        return list(scores)

    def __call__(self, prompts: list, completions: list, **columns: Any) -> BatchResult:
        n = len(completions)
        if len(prompts) != n:
            raise RewardError(f"{len(prompts)} prompts for {n} completions")
        per: list[dict[str, ComponentResult]] = [{} for _ in range(n)]
        result = BatchResult(records=[])
        for name, weight, reward in self.components:
            t0 = time.perf_counter()
            extras: dict[str, list] = {}  # this call's log_extra columns (TRL's hook): into each completion's info
            logged: dict[str, list[float]] = {}  # this call's log_metric values (TRL's hook): into result.metrics
            hooks = {"log_extra": lambda column, values, extras=extras: extras.__setitem__(str(column), list(values)),
                     "log_metric": lambda key, value, logged=logged: logged.setdefault(str(key), []).append(
                         float(value))}
            try:
                scores = self._call(reward, prompts, completions, {**columns, **hooks})
                batch_error = None
                for key, values in logged.items():
                    result.metrics.setdefault(key, []).extend(values)
            except Exception as e:  # isolation: any failure of a user's reward is recorded, not raised
                if self.strict:
                    raise RewardFailure(f"reward {name!r} failed: {type(e).__name__}: {e}") from e
                scores, batch_error = [Score(None)] * n, f"{type(e).__name__}: {e}"
            result.seconds[name] = time.perf_counter() - t0
            failed = 0
            for i, s in enumerate(scores):
                error = batch_error
                raw, info = (s.value, s.info) if isinstance(s, Score) else (s, {})
                if extras:
                    info = {**info, **{k: v[i] for k, v in extras.items() if i < len(v)}}
                if error is None and raw is not None:
                    if isinstance(raw, bool) or not isinstance(raw, (int, float)):
                        error, raw = f"returned {type(raw).__name__} {str(raw)[:40]!r}, expected a number", None
                    elif not math.isfinite(raw):
                        error, raw = f"returned a non-finite value {raw}", None
                if error is not None:
                    raw = None
                    failed += 1
                    if self.strict:
                        raise RewardFailure(f"reward {name!r} failed on completion {i}: {error}")
                weighted = None if raw is None else weight * float(raw)
                per[i][name] = ComponentResult(None if raw is None else float(raw), weight, weighted,
                                               info, error)
            result.errors[name] = failed
        for comps in per:
            vals = [c.weighted for c in comps.values() if c.weighted is not None]
            result.records.append(RewardRecord(float(sum(vals)), comps, total_missing=not vals))
        return result
