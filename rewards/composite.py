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
non-number or inf (that completion only), or ran past `timeout_s`. A NaN is "no value", as in TRL's nansum,
but never silent: the component's `info` says `nan: true` and the step's metrics count it. It is recorded in the
component's `error` field and counted in `errors[name]`; with `strict=True` it raises `RewardFailure`
at once instead.

Where a reward runs: in the calling thread when that is the main thread (as TRL calls sync rewards, so
signal-based code such as math_verify's timeouts works), interrupted at `timeout_s` by a watchdog;
called from another thread, in a worker thread of its own. An `async def` component runs on the process's
one event loop: every async component of a call is started before any is awaited, so they run concurrently
(as TRL gathers them) while the sync ones run in turn; each has `timeout_s` from its start.

Deliberately left out: killing a reward stuck inside C code that never returns to Python (in the main
thread it is interrupted when it does; a worker thread past its limit is abandoned, its result ignored,
and since it is a daemon a run that has finished exits without waiting for it).
"""

from __future__ import annotations

import contextlib
import math
import queue
import signal
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

from .base import Reward, RewardError, Score, build_reward


def as_number(value: Any) -> float | None:
    """A reward function's value as a float, accepting what TRL accepts (it reads the list with
    `torch.tensor(..., dtype=float32)`): int, float, bool, numpy scalars, and one-element arrays or tensors
    (read through `.item()`, so this module needs neither numpy nor torch); None for anything else
    (text, a list, an array of several values, a complex number).

    >>> [as_number(v) for v in (1, 0.5, True, "1", [1.0])]
    [1.0, 0.5, 1.0, None, None]
    """
    if isinstance(value, Real):  # (bool and numpy's integer and floating scalars are Reals too)
        return float(value)
    item = getattr(value, "item", None)
    if callable(item) and not isinstance(value, (str, bytes)):
        try:
            inner = item()  # a one-element numpy array or torch tensor; several elements raise
        except (ValueError, RuntimeError, TypeError):
            return None
        return float(inner) if isinstance(inner, Real) else None
    return None


class _Worker:
    """One daemon thread that runs the calls given to it in turn, each answered through a Future.

    Hand-written because concurrent.futures' ThreadPoolExecutor joins its threads at interpreter exit: a
    reward abandoned past its time limit (sleeping, or waiting on a judge that never answers) would keep a
    finished run from exiting, and its output folder's lock held. A daemon thread is not waited for."""

    def __init__(self):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._loop, name="reward", daemon=True).start()

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            fn, args, kwargs, future = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args, **kwargs))
                except BaseException as e:  # (SystemExit too: it is the caller's to judge)
                    future.set_exception(e)

    def submit(self, fn, *args, **kwargs) -> Future:
        future: Future = Future()
        self._jobs.put((fn, args, kwargs, future))
        return future

    def abandon(self) -> None:
        """Let the thread end after its current call (if that ever returns)."""
        self._jobs.put(None)


class _Deadline(BaseException):
    """Raised in the main thread when a reward's time is up (a BaseException: a reward's own `except
    Exception` cannot swallow it)."""


_DEADLINE_SIGNAL = getattr(signal, "SIGUSR2", None)  # (SIGALRM is math_verify's: its alarm(0) would cancel ours)


@contextlib.contextmanager
def _main_thread_deadline(seconds: float):
    """Run the block in the main thread and interrupt it after `seconds`: a watchdog thread sends SIGUSR2 to
    the main thread, whose handler raises while the block still runs (a sleep or a socket wait is cut
    short; a long call inside C code is interrupted when it returns to Python). Hand-written because
    signal-based timeouts (SIGALRM) are what user code like math_verify uses itself, and they nest badly."""
    state = {"running": True}

    def interrupt(signum, frame):
        if state["running"]:
            raise _Deadline

    previous = signal.signal(_DEADLINE_SIGNAL, interrupt)
    watchdog = threading.Timer(seconds, signal.pthread_kill, (threading.main_thread().ident, _DEADLINE_SIGNAL))
    watchdog.daemon = True
    watchdog.start()
    try:
        try:
            yield
        finally:
            state["running"] = False
            watchdog.cancel()
    except _Deadline:
        raise TimeoutError(f"exceeded the {seconds:g} s time limit") from None
    finally:
        signal.signal(_DEADLINE_SIGNAL, previous)


def _checked(scores: Any, n: int) -> list:
    """A component's result for `n` completions: a list or tuple of that length, else the error it records."""
    if not isinstance(scores, (list, tuple)):
        raise TypeError(f"returned {type(scores).__name__}, expected a list")
    if len(scores) != n:
        raise ValueError(f"returned {len(scores)} values for {n} completions")
    return list(scores)


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
        self._worker: _Worker | None = None  # made on the first call from a thread other than the main one

    @property
    def names(self) -> list[str]:
        return [n for n, _, _ in self.components]

    def _call(self, reward: Reward, prompts: list, completions: list, columns: dict) -> list[Score]:
        """One component on the batch, under the time limit; raises on any malformed result. In the main
        thread the reward runs right there (as TRL calls sync rewards), so code that relies on signals works
        (math_verify's parse/verify with their default timeouts refuse to run in any other thread), and a
        watchdog interrupts it at the limit (`_main_thread_deadline`); elsewhere it runs in a worker thread,
        abandoned at the limit."""
        if threading.current_thread() is threading.main_thread() and hasattr(signal, "pthread_kill"):
            with _main_thread_deadline(self.timeout_s):
                scores = reward.explain(prompts, completions, **columns)
        else:
            self._worker = self._worker or _Worker()
            future = self._worker.submit(reward.explain, prompts, completions, **columns)
            try:
                scores = future.result(timeout=self.timeout_s)
            except FutureTimeout:
                # abandon the stuck worker; a fresh one serves the next calls
                self._worker.abandon()
                self._worker = None
                raise TimeoutError(f"exceeded the {self.timeout_s:g} s time limit") from None
        return _checked(scores, len(completions))

    def _wait(self, started: tuple[float, Future | BaseException], reward: Reward, n: int) -> list[Score]:
        """An async component's values: its future, under the time limit counted from its start."""
        t0, future = started
        if isinstance(future, BaseException):  # (the call itself failed before it could start)
            raise future
        try:
            values = future.result(timeout=max(0.0, t0 + self.timeout_s - time.perf_counter()))
        except FutureTimeout:  # (__call__ then cancels the coroutine on the loop: a stuck judge stops there too)
            raise TimeoutError(f"exceeded the {self.timeout_s:g} s time limit") from None
        return _checked(reward.scores(values), n)

    def __call__(self, prompts: list, completions: list, **columns: Any) -> BatchResult:
        n = len(completions)
        if len(prompts) != n:
            raise RewardError(f"{len(prompts)} prompts for {n} completions")
        per: list[dict[str, ComponentResult]] = [{} for _ in range(n)]
        result = BatchResult(records=[])
        extras: dict[str, dict[str, list]] = {name: {} for name in self.names}  # each call's log_extra columns
        # (TRL's hook): into each completion's info; log_metric values into result.metrics, kept by the call
        logged: dict[str, dict[str, list[float]]] = {name: {} for name in self.names}
        calls = {name: {**columns,
                        "log_extra": lambda column, values, e=extras[name]: e.__setitem__(str(column), list(values)),
                        "log_metric": lambda key, value, m=logged[name]: m.setdefault(str(key), []).append(
                            float(value))} for name in self.names}
        started: dict[str, tuple[float, Future | BaseException]] = {}
        for name, _, reward in self.components:  # every async component started before any is awaited
            if getattr(reward, "is_async", False):
                t0 = time.perf_counter()
                try:
                    started[name] = (t0, reward.start(prompts, completions, **calls[name]))
                except Exception as e:  # (e.g. a required argument the data has no column for)
                    started[name] = (t0, e)
        try:
            for name, weight, reward in self.components:
                t0 = started[name][0] if name in started else time.perf_counter()
                try:
                    scores = (self._wait(started[name], reward, n) if name in started
                              else self._call(reward, prompts, completions, calls[name]))
                    batch_error = None
                    for key, values in logged[name].items():
                        result.metrics.setdefault(key, []).extend(values)
                except (Exception, SystemExit) as e:  # isolation: any failure of a user's reward is recorded, not
                    # raised; sys.exit() in a reward too (it would end the run at once with no checkpoint); os._exit
                    # cannot be caught in a process
                    why = f"called sys.exit({e.code!r})" if isinstance(e, SystemExit) else f"{type(e).__name__}: {e}"
                    if self.strict:
                        raise RewardFailure(f"reward {name!r} failed: {why}") from e
                    scores, batch_error = [Score(None)] * n, why
                result.seconds[name] = time.perf_counter() - t0
                failed = 0
                for i, s in enumerate(scores):
                    error = batch_error
                    raw, info = (s.value, s.info) if isinstance(s, Score) else (s, {})
                    if extras[name]:
                        info = {**info, **{k: v[i] for k, v in extras[name].items() if i < len(v)}}
                    if error is None and raw is not None:
                        value = as_number(raw)
                        if value is None:
                            error, raw = f"returned {type(raw).__name__} {str(raw)[:40]!r}, expected a number", None
                        elif math.isnan(value):  # (TRL sums rewards with nansum: NaN is "no value", as None;
                            # said in the trace and counted as rewards/{name}/nan, never silent)
                            raw, info = None, {**info, "nan": True}
                        elif not math.isfinite(value):
                            error, raw = f"returned a non-finite value {value}", None
                        else:
                            raw = value
                    if error is not None:
                        raw = None
                        failed += 1
                        if self.strict:
                            raise RewardFailure(f"reward {name!r} failed on completion {i}: {error}")
                    weighted = None if raw is None else weight * float(raw)
                    per[i][name] = ComponentResult(None if raw is None else float(raw), weight, weighted,
                                                   info, error)
                result.errors[name] = failed
        finally:  # (a strict failure or Ctrl-C: no coroutine outlives the call; a finished one ignores it)
            for _, future in started.values():
                if isinstance(future, Future):
                    future.cancel()
        for comps in per:
            vals = [c.weighted for c in comps.values() if c.weighted is not None]
            result.records.append(RewardRecord(float(sum(vals)), comps, total_missing=not vals))
        return result
