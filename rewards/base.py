"""The reward contract and registry. Pure Python: this package imports nothing from torch or the trainer.

A reward is a registered class whose instances are callables in TRL's convention,
``reward(prompts, completions, **columns) -> list[float | None]`` (``None`` = not applicable), and can
explain themselves: ``reward.explain(...)`` returns one `Score` (value + JSON-able ``info``) per
completion. Subclasses implement ``score(prompt, completion, row)`` for one completion, or override
``explain`` when batching pays.

A user's function (a dotted path `package.module:function`) is called as TRL calls it (`FunctionReward`):
by keyword, async functions included.

Deliberately left out: remote reward servers; call one from a function.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import sys
import threading
from concurrent.futures import Future
from collections import ChainMap
from collections.abc import Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable


class RewardError(ValueError):
    """A reward that cannot be built or called as configured; the message names it."""


@dataclass
class Score:
    value: float | None  # None: not applicable to this completion
    info: dict[str, Any] = field(default_factory=dict)  # why: JSON-serialisable


def text_of(item: Any) -> str:
    """Plain text of a prompt or completion, in either TRL form: a string or a list of chat messages. Of a
    message list, the last message that is not a tool's: a tool's output is never the text a reward scores
    (a conversation cut right after a call must not be scored on what the tool returned).

    >>> text_of([{"role": "assistant", "content": "<tool_call>...</tool_call>"}, {"role": "tool", "content": "42"}])
    '<tool_call>...</tool_call>'
    """
    if isinstance(item, str):
        return item
    if isinstance(item, list) and item and isinstance(item[-1], dict):
        own = [m for m in item if isinstance(m, dict) and m.get("role") != "tool"]
        return str(own[-1].get("content", "")) if own else ""
    if isinstance(item, dict):
        return str(item.get("content", ""))
    return "" if item is None else str(item)


def rows_of(n: int, columns: dict[str, Any]) -> list[dict[str, Any]]:
    """Per-completion dicts from column lists (TRL passes every data set column as a list of length n)."""
    rows: list[dict[str, Any]] = [{} for _ in range(n)]
    for key, values in columns.items():
        if isinstance(values, (list, tuple)) and len(values) == n:
            for row, v in zip(rows, values):
                row[key] = v
    return rows


class Reward:
    """Base class: subclasses set `name` (through `@register`) and implement `score`."""

    name = "reward"
    #: documented range of the score, checked by the property tests
    low, high = 0.0, 1.0

    def __init__(self, **params: Any):
        if params:
            raise RewardError(f"reward {self.name!r} takes no parameter {sorted(params)}")

    @property
    def __name__(self) -> str:  # TRL names reward columns after the function's __name__
        return self.name

    def score(self, prompt: str, completion: str, row: dict[str, Any]) -> Score:
        raise NotImplementedError

    def explain(self, prompts: list, completions: list, **columns: Any) -> list[Score]:
        if len(prompts) != len(completions):
            raise RewardError(f"{self.name}: {len(prompts)} prompts for {len(completions)} completions")
        rows = rows_of(len(completions), columns)
        return [self.score(text_of(p), text_of(c), r) for p, c, r in zip(prompts, completions, rows)]

    def __call__(self, prompts: list, completions: list, **columns: Any) -> list[float | None]:
        return [s.value for s in self.explain(prompts, completions, **columns)]


class FunctionReward(Reward):
    """A user's plain TRL-style function, given the explain interface (its info is empty).

    Called as TRL's GRPOTrainer calls reward functions: every argument by keyword (`prompts=`,
    `completions=`, `completion_ids=` when the trainer has them, each data set column by its name, and
    the component's `params`), so `def reward_len(completions, **kwargs)` and
    `def accuracy_reward(completions, solution, **kwargs)` work as written. A function without
    `**kwargs` gets only the arguments it names. An `async def` function is run to completion. A None
    in its list means "no value for this completion". TRL's two logging hooks, `log_extra` and
    `log_metric`, come among the columns from the `CompositeReward` that calls it (which owns where
    their values go).

    >>> def reward_len(completions, **kwargs):
    ...     return [-abs(20 - len(c)) for c in completions]
    >>> FunctionReward(reward_len, "reward_len")(["Q", "Q"], ["short", "x" * 20])
    [-15, 0]
    """

    low, high = float("-inf"), float("inf")

    def __init__(self, fn: Callable, name: str, **params: Any):
        self.fn, self.name, self.params = fn, name, params
        try:
            parameters = inspect.signature(fn).parameters.values()
        except (TypeError, ValueError):  # (some builtins have no signature: pass everything, as TRL does)
            parameters = [inspect.Parameter("kwargs", inspect.Parameter.VAR_KEYWORD)]
        self._takes_all = any(p.kind is p.VAR_KEYWORD for p in parameters)
        self._names = {p.name for p in parameters}

    @property
    def is_async(self) -> bool:
        """An `async def` function (or an object with one as `__call__`): `start` runs it on the event loop."""
        return inspect.iscoroutinefunction(self.fn) or inspect.iscoroutinefunction(getattr(self.fn, "__call__", None))

    def _arguments(self, prompts: list, completions: list, columns: dict[str, Any]) -> dict[str, Any]:
        kwargs = {"prompts": prompts, "completions": completions, **columns, **self.params}
        return kwargs if self._takes_all else {k: v for k, v in kwargs.items() if k in self._names}

    def start(self, prompts: list, completions: list, **columns: Any) -> Future:
        """The call started on the run's one event loop, its values to come through the future (`scores`
        reads them): the composite starts every async component before it waits for any, so they are
        awaited concurrently, as TRL gathers them. The loop is the same for every call, so an async client,
        semaphore or session a reward module keeps between calls stays on the loop it was made on."""
        return asyncio.run_coroutine_threadsafe(_awaited(self.fn(**self._arguments(prompts, completions, columns))),
                                                _event_loop())

    def scores(self, values: Any) -> list[Score]:
        """The function's returned values as Scores: a list or tuple, or what TRL also iterates, a 1-d numpy
        array or torch tensor (read through `.tolist()`, so this package imports neither); else an error
        naming the type.

        >>> import numpy as np
        >>> [s.value for s in FunctionReward(len, "n").scores(np.array([1.0, 0.5]))]
        [1.0, 0.5]
        """
        if not isinstance(values, (list, tuple)) and callable(getattr(values, "tolist", None)) \
                and len(getattr(values, "shape", ())) == 1:
            values = values.tolist()
        if not isinstance(values, (list, tuple)):
            raise RewardError(f"reward {self.name!r} returned {type(values).__name__}, expected a list")
        return [Score(v) for v in values]

    def explain(self, prompts: list, completions: list, **columns: Any) -> list[Score]:
        values = self.fn(**self._arguments(prompts, completions, columns))
        if inspect.isawaitable(values):  # (a sync function that returned an awaitable: awaited on the loop)
            future = asyncio.run_coroutine_threadsafe(_awaited(values), _event_loop())
            try:
                values = future.result()
            except BaseException:  # (interrupted at the time limit, or Ctrl-C: the coroutine stops too)
                future.cancel()
                raise
        return self.scores(values)


_LOOP: list[asyncio.AbstractEventLoop] = []  # the process's event loop for async rewards, made on first use
_LOOP_LOCK = threading.Lock()


def _event_loop() -> asyncio.AbstractEventLoop:
    """One event loop for every async reward call of the process, run by a daemon thread of its own
    (TRL keeps one loop the same way; `asyncio.run` per call would make a new loop each time, and an
    `AsyncOpenAI` client or `asyncio.Semaphore` from the first call fails on the next)."""
    with _LOOP_LOCK:
        if not _LOOP:
            loop = asyncio.new_event_loop()
            threading.Thread(target=loop.run_forever, name="reward-event-loop", daemon=True).start()
            _LOOP.append(loop)
        return _LOOP[0]


def start_async(awaitable) -> Future:
    """An awaitable started on the process's one event loop (async rewards, async tools): its result comes
    through the future; sys.exit() inside it becomes an error of the call."""
    return asyncio.run_coroutine_threadsafe(_awaited(awaitable), _event_loop())


async def _awaited(awaitable):
    """The result of an awaitable (run_coroutine_threadsafe wants a coroutine). sys.exit() inside it
    becomes an error of the call: asyncio would re-raise SystemExit in the loop's thread, ending the loop
    that every later async call needs."""
    try:
        return await awaitable
    except SystemExit as e:
        raise RewardError(f"called sys.exit({e.code!r})") from None


_REGISTRY: dict[str, type[Reward]] = {}  # rewards outside this package (the engine's torch-based
# `reward_model`) register here themselves when their module is imported


def register(name: str) -> Callable[[type[Reward]], type[Reward]]:
    """Class decorator: make a reward available under `name` (the name used in YAML, logs and traces)."""

    def deco(cls: type[Reward]) -> type[Reward]:
        old = _REGISTRY.get(name)
        if old is not None and not _same_definition(old, cls):
            raise RewardError(f"reward name {name!r} is already registered (by {old.__qualname__})")
        cls.name = name
        _REGISTRY.setdefault(name, cls)  # (a definition imported twice: the first import's class stays)
        return cls

    return deco


def _same_definition(a: type, b: type) -> bool:
    """Whether two classes are one definition imported twice (the same name in the same source file), as
    pytest's importlib mode does when it collects one reward file's doctests: that registers again, a
    second class under a taken name does not."""
    import inspect

    try:
        return a.__qualname__ == b.__qualname__ and inspect.getsourcefile(a) == inspect.getsourcefile(b)
    except TypeError:  # (a class without a source file: defined in an interpreter session)
        return False


def registered() -> list[str]:
    """Every registered reward name, sorted."""
    return sorted(_REGISTRY)


_FILE_MODULES: dict[Path, Any] = {}  # reward files loaded by path
_OBJECTS: dict[str, Callable] = {}  # reward functions handed over as Python objects (add_function), by name
_OWN: ContextVar[Mapping[str, Callable]] = ContextVar("reward_objects", default={})  # the objects of the trainer
# whose reward is being built now (`own_objects`): looked up before the process-wide ones


@contextmanager
def own_objects(objects: dict[str, Callable]):
    """Within the block, reward names resolve to `objects` first: the Python API's trainer builds its rewards
    (training's and every evaluation's) from the objects it was given, whatever another trainer in the same
    process names alike.

    >>> with own_objects({"short": lambda completions, **kw: [len(c) for c in completions]}):
    ...     resolve_reward("short")(["abc"])
    [3]
    """
    token = _OWN.set(ChainMap(objects, _OWN.get()))  # (a live view: objects added inside the block count)
    try:
        yield
    finally:
        _OWN.reset(token)


def add_function(name: str, fn: Callable) -> None:
    """Make the callable `fn` (any function TRL accepts, a lambda included) the reward named `name` in this
    process, as the Python API passes a reward object; naming it again replaces it (a notebook cell run again).

    >>> add_function("short", lambda completions, **kw: [-len(c) for c in completions])
    >>> resolve_reward("short")(["ab"])
    [-2]
    """
    check_function(name, fn)
    _OBJECTS[name] = fn


def check_function(name: str, fn: Callable) -> None:
    """A reward object may take `name`: callable, and not a registered reward's name."""
    if name in _REGISTRY:
        raise RewardError(f"reward name {name!r} is a registered reward's; give the function another name")
    if not callable(fn):
        raise RewardError(f"reward {name!r} is not callable")


def is_object(name: str) -> bool:
    """Whether reward `name` is a Python object handed over in this process (it has no importable path: a
    resume in another process cannot find it)."""
    return name in _OBJECTS and name not in _REGISTRY


def import_module_or_file(module: str):
    """A module by dotted name (found from the working folder too, as `python -c` would) or by file path
    (`my_rewards.py`, `path/to/rewards.py`)."""
    if module.endswith(".py") or "/" in module:
        path = Path(module).resolve()
        if not path.is_file():
            raise ImportError(f"no file {module}")
        if path not in _FILE_MODULES:  # (run once per file, as an import is: training and evaluation share it)
            spec = importlib.util.spec_from_file_location(f"_docuchat_rewards_{path.stem}", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            _FILE_MODULES[path] = mod
        return _FILE_MODULES[path]
    cwd = str(Path.cwd())
    if cwd not in sys.path and "" not in sys.path:  # (a console script's path starts at its own bin folder)
        sys.path.append(cwd)
    return importlib.import_module(module)


def resolve_reward(name: str) -> type[Reward] | Callable:
    """A registered reward class, or the object behind a dotted path `package.module:attribute`."""
    if name in _REGISTRY:
        return _REGISTRY[name]
    if name in _OWN.get():
        return _OWN.get()[name]
    if name in _OBJECTS:
        return _OBJECTS[name]
    if ":" in name:
        module, _, attr = name.rpartition(":")
        try:
            obj = getattr(import_module_or_file(module), attr)
        except (ImportError, AttributeError, OSError) as e:
            raise RewardError(f"cannot import reward {name!r}: {e}") from e
        except SyntaxError as e:  # (the module's own code: its file and line, not a traceback)
            raise RewardError(f"cannot import reward {name!r}: syntax error in {e.filename} line {e.lineno}: "
                              f"{e.msg}") from e
        except Exception as e:  # the module raised while it was imported (a NameError at top level, ...)
            raise RewardError(f"cannot import reward {name!r}: importing it raised {type(e).__name__}: {e}") from e
        if not callable(obj):
            raise RewardError(f"reward {name!r} is not callable")
        return obj
    raise RewardError(f"unknown reward {name!r}; registered rewards are {', '.join(registered())} "
                      "(or give a dotted path package.module:function; a function handed to the Python API as an "
                      "object is known only to that process: resume through the Python API with it)")


def build_reward(name: str, params: dict[str, Any] | None = None) -> Reward:
    """An instance ready to call: registered classes get `params` as keyword arguments."""
    obj = resolve_reward(name)
    params = dict(params or {})
    if inspect.isclass(obj) and issubclass(obj, Reward):
        try:
            inst = obj(**params)
        except TypeError as e:
            raise RewardError(f"reward {name!r}: bad params {params}: {e}") from e
        inst.name = name
        return inst
    return FunctionReward(obj, name, **params)
