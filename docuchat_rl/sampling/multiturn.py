"""Multi-turn rollouts: the model calls tools (plain functions, an environment's methods) between its turns.

The interface is TRL's GRPOTrainer's, so its users' tools and environments run unchanged:
    rollout.tools: [pkg.mod.fn, ...]          functions, sync or async, described by their type hints and
                                              docstrings (transformers.utils.get_json_schema)
    rollout.environment_factory: pkg.mod.Env  a class; one instance per completion, `reset(**row)` before it
                                              samples (a returned string is appended to the last user turn),
                                              its public methods are tools, an optional `get_reward()` is the
                                              `environment` reward component (rewards/environment.py)

One loop for every engine (`run_turns`): the engine only samples the next assistant turn from token ids;
generate -> parse the turn's calls -> call the tools -> append the results -> generate, until a turn makes
no call or a limit holds (rollout.max_turns assistant turns, rollout.max_tool_calls calls, the completion's
rollout.max_new_tokens, which counts model and tool tokens). The conversation is built by appending token
ids, never by re-tokenising the history: the trained tokens are exactly the sampled ones, and a tool result
becomes the tokens the chat template gives it after an assistant turn (rendered on a fixed dummy
conversation and cut there, as TRL does). Tool tokens are out of the loss (`Generation.model_mask`).

Protocols (`rollout.tool_protocol`): a chat template that renders `tools` gets them through
`apply_chat_template(tools=...)` and its tool-result turns; one that does not (the embedded default's,
SmolLM2's GGUF template) gets the Hermes text protocol: the tool signatures in the system prompt, calls as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, results as a user turn of
`<tool_response>...</tool_response>` blocks. Calls are parsed as Hermes `<tool_call>` JSON (Qwen2.5, Hermes,
SmolLM2) or, for Llama 3 templates, a turn that is one JSON object `{"name": ..., "parameters": ...}`.

Faults are the model's or the tool's, never the run's: a malformed call, an unknown tool, a tool that raises,
hangs past rollout.tool_timeout_s, calls sys.exit or returns something that is not text (or a number, or
JSON) gives the model the error text as the result, and the trace records it. A result longer than
rollout.max_tool_result_tokens is truncated (said in the text and the trace), never dropped; it is cut by
characters before it is tokenised, so a tool that returns megabytes costs what its cap costs, and the
trace keeps the text as inserted. A turn whose calls leave no room for their results and one more token
ends the completion there (`max_new_tokens`): the results were never shown, so they are not part of the
conversation the rewards score. An environment's first observation is cut the same way to what
data.max_prompt_tokens leaves of the prompt. An environment whose `reset` raises drops its prompt's group
(one warning line).

Deliberately left out: several environment classes in one run (TRL's environment column), pooling
environment instances across steps (one per completion per step), multimodal tool results, and parsing
through a tokenizer's `response_template` (no template we support carries one).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
import threading
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import ToolError
from ..traces import NOT_RUN
from .generation import Generation
from .turn_cache import turn_cache

TEXT_SYSTEM = ("Tools:\n{tools}\nTo call a tool, write <tool_call>{{\"name\": \"tool\", \"arguments\": {{...}}}}"
               "</tool_call>; its result comes back in <tool_response></tool_response>.")
_HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)
RESERVED = ("reset", "get_reward")  # an environment's methods that are not tools (TRL's rule)


@dataclass
class ToolCall:
    """One call the model made, and what it got back."""

    name: str | None  # None: the call could not be parsed
    arguments: dict | None  # as parsed (None when malformed)
    result: str  # the text inserted for the model (the error text on a fault; cut, with its note, when truncated)
    error: str | None = None  # why the call failed (malformed, unknown tool, raised, timed out, not text, not
    # run: a limit was reached)
    result_tokens: int = 0  # tokens of the result as inserted (the truncation note included)
    truncated: bool = False  # the result was cut to rollout.max_tool_result_tokens
    seconds: float = 0.0

    @property
    def ran(self) -> bool:
        """Whether the call reached its tool (or was refused by the loop as malformed or unknown): a call a
        limit kept from running is neither a success nor the tool's failure."""
        return self.error not in NOT_RUN


@dataclass
class Turn:
    """One assistant turn and the tool tokens appended after it."""

    model_tokens: int
    text: str = ""  # the turn as the parser and the rewards read it (special tokens kept, end-of-turn removed)
    calls: list[ToolCall] = field(default_factory=list)
    env_tokens: int = 0  # tool-result tokens appended after the turn (the chat template's framing included)
    ended: str = "answer"  # answer (no call) | tools (results appended, the model goes on) | max_turns |
    # max_tool_calls | max_new_tokens (no room for the results and another token: the results were not
    # shown) | truncated (cut mid-turn)


# ---------------------------------------------------------------------------------------------- loading


def load_object(spec: str, key: str):
    """The object a recipe names: `pkg.mod.attr`, `pkg.mod:attr` or `path/file.py:attr`; errors name `key`."""
    from rewards.base import import_module_or_file

    module, sep, attr = spec.rpartition(":")
    if not sep:
        module, _, attr = spec.rpartition(".")
    if not module or not attr:
        raise ToolError(f"{key}: {spec!r} is not a dotted path (pkg.module.name or file.py:name)")
    try:
        return getattr(import_module_or_file(module), attr)
    except (ImportError, AttributeError, OSError) as e:
        raise ToolError(f"{key}: cannot import {spec!r}: {e}") from None
    except Exception as e:  # (the module raised while it was imported)
        raise ToolError(f"{key}: importing {spec!r} raised {type(e).__name__}: {e}") from None


def environment_methods(env) -> list[Callable]:
    """An environment instance's tools: its public methods other than reset and get_reward (TRL's rule)."""
    return [getattr(env, name) for name, _ in inspect.getmembers(type(env), predicate=inspect.isfunction)
            if name not in RESERVED and not name.startswith("_")]


def schemas(functions: list[Callable], key: str) -> list[dict]:
    """Each tool's JSON schema (transformers' get_json_schema: its name, type hints and docstring); a tool
    it cannot describe fails naming the tool and `key`."""
    from transformers.utils import get_json_schema

    out = []
    for fn in functions:
        try:
            out.append(get_json_schema(fn))
        except Exception as e:  # (transformers raises its own DocstringParsingException / TypeHintParsingException)
            raise ToolError(f"{key}: tool {getattr(fn, '__name__', fn)!r} cannot be described for the chat "
                            f"template: {e}") from None
    names = [s["function"]["name"] for s in out]
    if len(set(names)) < len(names):
        raise ToolError(f"{key}: two tools share the name {next(n for n in names if names.count(n) > 1)!r}")
    return out


@dataclass
class ToolSource:
    """The tools and environment class a recipe names, loaded and described once."""

    functions: list[Callable]
    environment: type | None
    schemas: list[dict]  # of the functions and the environment's methods (described on a probe instance)
    has_reward: bool  # the environment defines get_reward

    @classmethod
    def load(cls, tools: list[str], factory: str | None) -> ToolSource:
        functions = []
        for i, spec in enumerate(tools):
            fn = load_object(spec, f"rollout.tools.{i}")
            if not callable(fn):
                raise ToolError(f"rollout.tools.{i}: {spec!r} is not callable")
            functions.append(fn)
        env_cls, methods = None, []
        if factory:
            env_cls = load_object(factory, "rollout.environment_factory")
            if not callable(env_cls):
                raise ToolError(f"rollout.environment_factory: {factory!r} is not a class")
            if not callable(getattr(env_cls, "reset", None)):
                raise ToolError(f"rollout.environment_factory: {factory!r} has no reset(**row) method")
            try:
                probe = env_cls()
            except Exception as e:
                raise ToolError(f"rollout.environment_factory: {factory}() raised {type(e).__name__}: {e}") from None
            methods = environment_methods(probe)
        described = schemas(functions, "rollout.tools") + schemas(methods, "rollout.environment_factory")
        names = [d["function"]["name"] for d in described]
        twice = next((n for n in names if names.count(n) > 1), None)
        if twice is not None:  # (one name from two sources: the environment's method would silently win)
            raise ToolError(f"rollout.tools and rollout.environment_factory both give a tool named {twice!r}: rename "
                            "one (the model calls tools by name)")
        return cls(functions, env_cls, described, env_cls is not None and callable(getattr(env_cls, "get_reward", None)))


# --------------------------------------------------------------------------------------------- protocol


def template_renders_tools(tokenizer) -> bool:
    """Whether the chat template uses the `tools` it is given (its source names them)."""
    source = getattr(tokenizer, "chat_template", None) or ""
    return isinstance(source, str) and "tools" in source


def call_format(tokenizer) -> str:
    """How this model writes a call: `llama3` (one JSON object per turn) for Llama 3 templates, else `hermes`."""
    source = getattr(tokenizer, "chat_template", None) or ""
    return "llama3" if isinstance(source, str) and "<|python_tag|>" in source else "hermes"


class Protocol:
    """How tools reach the prompt, how calls are read from a turn and how results become tokens."""

    def __init__(self, tokenizer, tools: list[dict], mode: str = "auto", stop_ids: list[int] | tuple = ()):
        self.tokenizer, self.tools = tokenizer, tools
        self.template = template_renders_tools(tokenizer) if mode == "auto" else mode == "template"
        self.format = call_format(tokenizer) if self.template else "hermes"
        # the tokens that end a turn: the model's stops (modeling.eos_ids: its generation config's EOS list,
        # model.stop_tokens among them) and the tokenizer's EOS; a chat template whose end-of-turn token is
        # not the tokenizer's EOS (Gemma's <end_of_turn> beside <eos>) ends its turns with one of the former
        self.stop_ids = frozenset(i for i in (*stop_ids, tokenizer.eos_token_id) if i is not None)

    def prompt_messages(self, turns: list[dict]) -> tuple[list[dict], dict]:
        """(messages, apply_chat_template kwargs) of a prompt: the text protocol puts the signatures in the
        system turn (a new one, or after the existing one's text)."""
        if self.template:
            return turns, {"tools": self.tools}
        text = TEXT_SYSTEM.format(tools="\n".join(signature(t) for t in self.tools))
        if turns and turns[0]["role"] == "system":
            return [{**turns[0], "content": f"{turns[0]['content']}\n\n{text}"}, *turns[1:]], {}
        return [{"role": "system", "content": text}, *turns], {}

    def parse(self, text: str) -> list[ToolCall]:
        """The calls in one assistant turn's text (a malformed one as a ToolCall with its error)."""
        if self.format == "llama3":
            body = text.replace("<|python_tag|>", "").strip()
            if not body.startswith("{"):
                return []
            return [_call_of(body, "parameters")]
        return [_call_of(m.group(1).strip(), "arguments", closed=bool(m.group(2))) for m in _HERMES.finditer(text)]

    def call_text(self, name: str, arguments: dict) -> str:
        """A call as this protocol's model writes it, the text `parse` reads back (the text protocol's compact
        form, a template's as it renders a call: Hermes' block on lines of its own, Llama 3's bare object)."""
        if self.format == "llama3":
            return json.dumps({"name": name, "parameters": arguments})
        body = json.dumps({"name": name, "arguments": arguments})
        return f"<tool_call>\n{body}\n</tool_call>" if self.template else f"<tool_call>{body}</tool_call>"

    def turn_text(self, ids: list[int]) -> str:
        """One assistant turn's text: special tokens kept (Hermes' <tool_call> may be one), the end-of-turn
        token(s) and padding removed."""
        drop = self.stop_ids | {self.tokenizer.pad_token_id}
        return self.tokenizer.decode([t for t in ids if t not in drop], skip_special_tokens=False)

    def result_ids(self, results: list[tuple[str, str]]) -> list[int]:
        """The tokens that follow an assistant turn's end-of-turn token to show `results` [(tool name, text)]
        and open the next assistant turn: the template rendered after a fixed dummy turn, cut at that turn's
        last end-of-turn token (TRL's method: the history before it is never re-tokenised)."""
        tok = self.tokenizer
        if self.template:
            calls = [{"type": "function", "function": {"name": results[0][0], "arguments": {}}}]
            head = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": calls}]
            tail = [{"role": "tool", "name": n, "content": c} for n, c in results]
        else:
            head = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "dummy"}]
            body = "\n".join(f"<tool_response>\n{c}\n</tool_response>" for _, c in results)
            tail = [{"role": "user", "content": body}]
        prefix = tok.apply_chat_template(head, tokenize=True, return_dict=False)
        full = tok.apply_chat_template(head + tail, tokenize=True, return_dict=False, add_generation_prompt=True)
        ends = [i for i, t in enumerate(prefix) if t in self.stop_ids]
        if ends:
            prefix = prefix[:ends[-1] + 1]
        if full[:len(prefix)] != prefix:
            raise ToolError("the chat template renders an assistant turn differently once tool results follow it: "
                            "its tool results cannot be appended as tokens (set rollout.tool_protocol: text)")
        return full[len(prefix):]


def signature(schema: dict) -> str:
    """A tool's one line in the text protocol (short: the embedded default's context is 512 tokens).

    >>> signature({"function": {"name": "add", "description": "Add two integers.", "parameters": {
    ...     "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}})
    'add(a: integer, b: integer): Add two integers.'
    """
    f = schema["function"]
    args = ", ".join(f"{k}: {v.get('type', 'any')}" for k, v in f.get("parameters", {}).get("properties", {}).items())
    return f"{f['name']}({args}): {f.get('description', '')}".rstrip(": ")


def _call_of(body: str, args_key: str, closed: bool = True) -> ToolCall:
    if not closed:
        return ToolCall(None, None, "Error: the tool call is not closed with </tool_call>", error="malformed: unclosed")
    try:
        obj = json.loads(body)
    except ValueError as e:
        return ToolCall(None, None, f"Error: the tool call is not valid JSON ({e})", error=f"malformed: {e}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall(None, None, "Error: a tool call needs a \"name\"", error="malformed: no name")
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # (some models write the arguments as a JSON string)
        try:
            args = json.loads(args)
        except ValueError:
            pass
    if not isinstance(args, dict):
        return ToolCall(obj["name"], None, f"Error: the arguments of {obj['name']} are not an object",
                        error="malformed: arguments not an object")
    return ToolCall(obj["name"], args, "")


# -------------------------------------------------------------------------------------------- execution


def as_text(value: Any) -> str | None:
    """A tool's return value as the text the model sees: a string as is, a number or JSON value as JSON;
    None for anything else (None, an object), which is reported as the tool's error.

    >>> [as_text(v) for v in ("7", 7, {"x": [1, 2]}, None)]
    ['7', '7', '{"x": [1, 2]}', None]
    """
    if isinstance(value, str):
        return value
    if value is None:
        return None
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return None


def _start(fn: Callable, args: dict) -> Future:
    """The call started: an async tool on the process's one event loop (the rewards' loop: every async tool
    of a round is started before any is awaited, so they run concurrently), a sync one in a daemon thread of
    its own (a hung tool is abandoned at its time limit, and a finished run does not wait for it)."""
    from rewards.base import start_async

    if inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None)):
        try:
            return start_async(fn(**args))
        except BaseException as e:  # (a bad argument: the coroutine could not be made)
            done: Future = Future()
            done.set_exception(e)
            return done
    future: Future = Future()

    def run():
        try:
            future.set_result(fn(**args))
        except BaseException as e:  # (SystemExit included: the model is told, the run goes on)
            future.set_exception(e)

    threading.Thread(target=run, name="tool", daemon=True).start()
    return future


def call_tools(rows: list[list[ToolCall]], tools: list[dict[str, Callable]], timeout_s: float) -> None:
    """Run every row's parsed calls (concurrently: all are started, then each awaited until its deadline) and
    fill in each call's result, error and seconds."""
    started = []
    for calls, named in zip(rows, tools):
        for c in calls:
            if c.error is not None:
                continue
            fn = named.get(c.name)
            if fn is None:
                c.result, c.error = f"Error: no tool named {c.name!r} (tools: {', '.join(named)})", "unknown tool"
                continue
            started.append((c, _start(fn, c.arguments), time.perf_counter()))
    for c, future, t0 in started:
        try:
            value = future.result(timeout=max(0.0, timeout_s - (time.perf_counter() - t0)))
        except FutureTimeout:
            future.cancel()
            c.result, c.error = f"Error: {c.name} timed out after {timeout_s:g} s", "timeout"
        except KeyboardInterrupt:
            if not future.done():  # Ctrl-C or a second signal while waiting: the run's interrupt, not the tool's
                for _, other, _ in started:
                    other.cancel()
                raise
            c.result, c.error = f"Error: {c.name} raised KeyboardInterrupt", "KeyboardInterrupt"
        except SystemExit as e:
            c.result, c.error = f"Error: {c.name} called sys.exit({e.code!r})", f"sys.exit({e.code!r})"
        except BaseException as e:  # noqa: BLE001 (the tool's fault, told to the model)
            c.result, c.error = f"Error: {type(e).__name__}: {e}", f"{type(e).__name__}: {e}"
        else:
            text = as_text(value)
            if text is None:
                c.result, c.error = (f"Error: {c.name} returned {type(value).__name__}, not text",
                                     f"returned {type(value).__name__}")
            else:
                c.result = text
        c.seconds = time.perf_counter() - t0


# ------------------------------------------------------------------------------------------------- loop


def turn_seed(seed: int, turn: int) -> int:
    """The random stream of a completion's turn `turn` >= 1 (turn 0 draws from the row's own seed, so a
    completion without calls is what single-turn sampling gives)."""
    digest = hashlib.blake2b(f"{seed}/turn/{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


@dataclass
class TurnLimits:
    max_new_tokens: int  # the whole completion: model and tool tokens
    max_turns: int  # assistant turns
    max_tool_calls: int  # calls executed per completion (0: none; calls are answered with an error)
    tool_timeout_s: float
    max_tool_result_tokens: int


@dataclass
class RowState:
    prompt_ids: list[int]
    seed: int
    tools: dict[str, Callable]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    logps: list[float] = field(default_factory=list)
    turns: list[Turn] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # the conversation as TRL's rewards see it
    calls: int = 0
    done: bool = False
    truncated: bool = False


def _add_turn(row: RowState, ids: list[int], logps: list[float], truncated: bool, text: str) -> None:
    row.ids += ids
    row.mask += [1] * len(ids)
    row.logps += logps
    row.turns.append(Turn(len(ids), text))
    row.messages.append({"role": "assistant", "content": text})
    row.truncated = truncated


def run_turns(first: Generation, more: Callable[[list[list[int]], list[int], int], Generation], seeds: list[int],
              tools: list[dict[str, Callable]], protocol: Protocol, limits: TurnLimits,
              script: dict[int, list[dict]] | None = None) -> Generation:
    """Complete every row of `first` (the rows' first assistant turns) into a multi-turn conversation.

    `more(ids, seeds, max_new_tokens)` samples one further turn for each given row (its whole token history,
    its turn's seed); `tools[r]` are row r's tools by name; `script` (replay) maps a row's seed to its traced
    turns, whose results it is given instead of calling the tools while its calls are the traced ones.
    Returns the rows' Generation with the completion as model and tool tokens (`model_mask` 0 on tool tokens,
    whose log-probs are 0), the turns and the conversations (TRL's conversational completions)."""
    tok = protocol.tokenizer
    rows = [RowState(first.prompt_ids[r], seeds[r], tools[r]) for r in range(len(seeds))]
    frames: dict[tuple, int] = {}  # tool names -> tokens of their empty results' framing (rendered once)
    for row, ids, logps, cut in zip(rows, first.completion_ids, first.logps, first.truncated):
        _add_turn(row, ids, logps, cut, protocol.turn_text(ids))
    for turn in range(1, limits.max_turns + 1):
        pending = []  # rows whose last turn made calls that run now
        for row in rows:
            if row.done:
                continue
            last = row.turns[-1]
            last.calls = [] if row.truncated else protocol.parse(row.messages[-1]["content"])
            allowed = max(0, limits.max_tool_calls - row.calls)
            stop = ("truncated" if row.truncated else "answer" if not last.calls else
                    "max_turns" if turn >= limits.max_turns else "max_tool_calls" if not allowed else None)
            if stop:  # (calls that will not run are recorded with why)
                for c in last.calls:
                    if c.error is None:
                        c.result, c.error = f"Error: not run ({stop} reached)", stop
                last.ended, row.done = stop, True
                continue
            names = tuple(c.name or "tool" for c in last.calls)
            if names not in frames:
                frames[names] = len(protocol.result_ids([(n, "") for n in names]))
            if limits.max_new_tokens - len(row.ids) - frames[names] < 1:  # not even empty results fit: none run
                _not_shown(last, row, "Error: not run (max_new_tokens reached)")
                continue
            for c in [c for c in last.calls if c.error is None][allowed:]:
                c.result, c.error = f"Error: the limit of {limits.max_tool_calls} tool calls is reached", "max_tool_calls"
            row.calls += sum(c.error is None for c in last.calls)
            pending.append(row)
        if not pending:
            break
        live = [r for r in pending if not _scripted(r, script)]
        call_tools([r.turns[-1].calls for r in live], [r.tools for r in live], limits.tool_timeout_s)
        go = []
        for row in pending:
            last = row.turns[-1]
            results = [(c.name or "tool", _truncate(tok, c, limits.max_tool_result_tokens)) for c in last.calls]
            suffix = protocol.result_ids(results)
            room = limits.max_new_tokens - len(row.ids) - len(suffix)
            if room < 1:  # no room for the results and a token of answer: cut here, the results never shown
                _not_shown(last, row)
                continue
            row.messages += [{"role": "tool", "name": name, "content": text} for name, text in results]
            row.ids += suffix
            row.mask += [0] * len(suffix)
            row.logps += [0.0] * len(suffix)
            last.env_tokens, last.ended = len(suffix), "tools"
            go.append((row, room))
        if not go:
            break
        gen = more([r.prompt_ids + r.ids for r, _ in go], [turn_seed(r.seed, turn) for r, _ in go],
                   max(room for _, room in go))
        for (row, room), ids, logps, cut in zip(go, gen.completion_ids, gen.logps, gen.truncated):
            if len(ids) > room:  # (sampled to the longest row's room: each row's own draws, cut to its room)
                ids, logps, cut = ids[:room], logps[:room], True
            _add_turn(row, ids, logps, cut, protocol.turn_text(ids))
    for row in rows:
        if not row.done and row.turns:
            row.turns[-1].ended = "truncated" if row.truncated else "answer"
    return Generation([r.prompt_ids for r in rows], [r.ids for r in rows], [r.truncated for r in rows],
                      [r.logps for r in rows], model_mask=[r.mask for r in rows], turns=[r.turns for r in rows],
                      conversations=[r.messages for r in rows])


def _not_shown(turn: Turn, row: RowState, why: str | None = None) -> None:
    """End `row` at its last turn, whose calls' results have no room before rollout.max_new_tokens: the
    completion is cut there and scored as cut (its conversation ends with the model's turn, never with a
    tool's text the model was not shown); `why` marks calls that were not run at all."""
    if why is not None:
        for c in turn.calls:
            if c.error is None:
                c.result, c.error = why, "max_new_tokens"
    turn.ended, row.done, row.truncated = "max_new_tokens", True, True


def _scripted(row: RowState, script: dict[int, list[dict]] | None) -> bool:
    """Replay: give the row's last turn's calls the traced results, when they are the traced calls (same names
    and arguments); False (call the tools) otherwise."""
    traced = (script or {}).get(row.seed)
    k = len(row.turns) - 1
    if traced is None or k >= len(traced):
        return False
    calls, was = row.turns[-1].calls, traced[k]["calls"]
    if [(c.name, c.arguments) for c in calls] != [(c["name"], c["arguments"]) for c in was]:
        return False
    for c, w in zip(calls, was):
        if c.error is None or w["error"] is not None:
            c.result, c.error, c.truncated = w["result"], w["error"], bool(w.get("truncated"))
    return True


CHARS_PER_TOKEN = 64  # more characters than any token of a real vocabulary spans: a text is cut to
# cap x this before it is tokenised, so a tool's megabytes are never tokenised whole


def cut_text(tokenizer, text: str, cap: int, what: str = "truncated") -> tuple[str, bool]:
    """(`text` as inserted, whether it was cut): at most `cap` tokens of it, then a note saying how much was
    kept. The text is cut by characters first (CHARS_PER_TOKEN a token), so its cost is bounded by `cap`.

    >>> from transformers import AutoTokenizer
    >>> tok = AutoTokenizer.from_pretrained("data/model")
    >>> cut_text(tok, "7", 4)
    ('7', False)
    >>> cut_text(tok, "x" * 10_000_000, 4)[0].endswith("[truncated: 4 tokens kept of 10000000 characters]")
    True
    """
    for chars in (cap * 8, cap * CHARS_PER_TOKEN):  # (most text is a few characters a token: try that first)
        head = text[:chars + 1]
        ids = tokenizer(head, add_special_tokens=False)["input_ids"]
        if len(ids) > cap or len(head) == len(text):
            break
    if len(ids) <= cap and len(head) == len(text):
        return text, False
    return tokenizer.decode(ids[:cap]) + f"\n[{what}: {min(cap, len(ids))} tokens kept of {len(text)} characters]", True


def _truncate(tokenizer, call: ToolCall, cap: int) -> str:
    """The result text as inserted: cut to `cap` tokens, saying so (TRL drops an overlong result; here the
    model sees its start and the trace says it was cut); the call keeps the inserted text. A call already
    marked truncated holds its inserted text (replay's traced results) and is inserted as it is."""
    if not call.truncated:
        call.result, call.truncated = cut_text(tokenizer, call.result, cap)
    call.result_tokens = len(tokenizer(call.result, add_special_tokens=False)["input_ids"])
    return call.result


def turns_json(turns: list[Turn] | None) -> list[dict] | None:
    """A completion's turns as trace JSON."""
    return None if turns is None else [asdict(t) for t in turns]


def conversation_of(turns: list[dict]) -> list[dict]:
    """A traced completion's conversation (`turns` as turns_json wrote them) as TRL's rewards see it: each
    assistant turn, then the tool results it was shown (rescoring multi-turn traces)."""
    out = []
    for t in turns:
        out.append({"role": "assistant", "content": t["text"]})
        if t.get("ended") == "tools":
            out += [{"role": "tool", "name": c["name"] or "tool", "content": c["result"]} for c in t["calls"]]
    return out


def reset_environments(env_cls: type | None, rows: list[dict], group_size: int, quiet: bool = False
                       ) -> tuple[list, list[str | None], dict[int, str]]:
    """One environment per row, reset with its data row: (environments, each row's observation, the groups
    whose reset raised, with the error: dropped, each with one warning line unless `quiet`)."""
    if env_cls is None:
        return [None] * len(rows), [None] * len(rows), {}
    envs, observations, failed = [], [], {}
    for r, row in enumerate(rows):
        env = env_cls()
        try:
            obs = env.reset(**row)
        except Exception as e:  # noqa: BLE001 (the environment's fault: its group is dropped, the run goes on)
            if r // group_size not in failed and not quiet:
                warnings.warn(f"environment reset failed for prompt row {row.get('prompt_id', '?')}: "
                              f"{type(e).__name__}: {e}; its group is dropped this step", stacklevel=2)
            failed.setdefault(r // group_size, f"{type(e).__name__}: {e}")
            obs = None
        if obs is not None and not isinstance(obs, str):  # (TRL's contract: text or None; anything else would be
            # shown to the model as some rendering of it)
            if r // group_size not in failed and not quiet:
                warnings.warn(f"environment reset for prompt row {row.get('prompt_id', '?')} returned "
                              f"{type(obs).__name__}, not text or None: its group is dropped this step", stacklevel=2)
            failed.setdefault(r // group_size, f"reset returned {type(obs).__name__}, not text or None")
            obs = None
        envs.append(env)
        observations.append(obs)
    return envs, observations, failed


class MultiTurn:
    """The collector's multi-turn sampling: environments reset per row, the first turns sampled as single-turn
    ones (the prompts rendered with the tools), then `run_turns`."""

    def __init__(self, source: ToolSource, protocol: Protocol, limits: TurnLimits, group_size: int,
                 system_prompt: str | None = None, prompt_column: str = "question", answer_column: str | None = "answer",
                 few_shot: list[dict] | tuple = (), max_prompt_tokens: int = 512, keep_cache: bool = True):
        self.source, self.protocol, self.limits, self.g = source, protocol, limits, group_size
        self.max_prompt_tokens = max_prompt_tokens  # a prompt with its first observation fits this (the rest is cut)
        self.system_prompt, self.prompt_column, self.answer_column = system_prompt, prompt_column, answer_column
        self.few_shot = list(few_shot)
        self.script: dict[int, list[dict]] | None = None  # replay: row seed -> its traced turns (run_turns)
        self.keep_cache = keep_cache  # a row's keys/values kept from one turn to its next (turn_cache.py)

    def turns(self, example) -> list[dict]:
        """The example's prompt messages: the system prompt, the few-shot turns, its question."""
        from ..data import prompt_turns

        return prompt_turns(example.question, self.system_prompt, example.messages, self.few_shot)

    def prompt_text(self, example) -> str:
        """The example's prompt as the run renders it: its turns with the tools."""
        return self.render(self.turns(example))

    def render(self, turns: list[dict]) -> str:
        """A prompt's text with the tools (the template's way, or the text protocol's system turn)."""
        messages, kwargs = self.protocol.prompt_messages(turns)
        return self.protocol.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                           **kwargs)

    def reset_row(self, example) -> dict:
        """What `reset(**row)` gets: the data row's columns as written (the prompt and the answer column
        under their own names: GSM8K's worked solution, not only its final number, as TRL passes it)."""
        row = {self.prompt_column: list(example.messages) if example.messages else example.question,
               **example.columns}
        if self.answer_column:
            row[self.answer_column] = example.answer_text or example.answer
        return row

    def observed_prompts(self, examples: list, observations: list[str | None]) -> tuple[list[list[int]], list]:
        """(each row's prompt tokens with its observation, the observations as appended): an observation is
        cut (by characters first, then tokens, saying so in its text) to what data.max_prompt_tokens leaves
        of the prompt, so an environment that returns megabytes costs what a full prompt costs."""
        tok, base, ids, shown = self.protocol.tokenizer, {}, [], []
        for e, obs in zip(examples, observations):
            if not obs:
                shown.append(obs)
                ids.append(tok(self.render(self.turns(e)), add_special_tokens=False)["input_ids"])
                continue
            if id(e) not in base:
                base[id(e)] = len(tok(self.render(self.turns(e)), add_special_tokens=False)["input_ids"])
            cap = self.max_prompt_tokens - base[id(e)]
            for _ in range(3):  # (the note and the template's joins take a few tokens: cut further until it fits)
                text, _ = cut_text(tok, obs, max(cap, 0), "observation truncated")
                row = tok(self.render(_observed(self.turns(e), text)), add_special_tokens=False)["input_ids"]
                if len(row) <= self.max_prompt_tokens:
                    break
                cap -= len(row) - self.max_prompt_tokens
            else:  # (no room even for the note: the prompt goes without the observation, traced as "")
                text, row = "", tok(self.render(self.turns(e)), add_special_tokens=False)["input_ids"]
            shown.append(text)
            ids.append(row)
        return ids, shown

    def sample(self, idx: list[int], examples: list, seeds: list[int], first: Callable[[list[int]], Generation],
               more: Callable[[list[list[int]], list[int], int], Generation], group_size: int | None = None
               ) -> Generation:
        """The rows of prompts `idx` (G each, or `group_size`; row r from seeds[r]): `first(idx)` samples the first
        turns of the prompts as rendered for the run; a prompt whose environments returned an observation is
        rendered per row with it and its first turns sampled through `more`."""
        g = group_size or self.g
        rows = [self.reset_row(e) for e in examples for _ in range(g)]
        envs, observations, failed = reset_environments(self.source.environment, rows, g)
        named = [{getattr(f, "__name__", str(f)): f for f in self.source.functions} for _ in rows]
        for tools, env in zip(named, envs):
            if env is not None:
                tools.update({m.__name__: m for m in environment_methods(env)})
        with turn_cache(self.keep_cache) as kept:  # (each row's keys/values from one turn to its next)
            if any(o for o in observations):
                ids, observations = self.observed_prompts([e for e in examples for _ in range(g)], observations)
                gen = more(ids, seeds, self.limits.max_new_tokens)
            else:
                gen = first(idx)
            out = run_turns(gen, more, seeds, named, self.protocol, self.limits, self.script)
        if kept.prefilled or kept.reused:  # (None: an engine that counts none, vLLM's, sampled the turns)
            out.prefill_tokens, out.cached_tokens = kept.prefilled, kept.reused
        out.environments, out.dropped_groups = envs, tuple(sorted(failed))
        out.observations = observations
        return out


def _observed(turns: list[dict], observation: str | None) -> list[dict]:
    """The prompt's messages with an environment's first observation appended to its last user turn (a new
    list: the data set's messages are never changed in place)."""
    if not observation:
        return list(turns)
    last = max(i for i, t in enumerate(turns) if t["role"] == "user")
    return [*turns[:last], {**turns[last], "content": turns[last]["content"] + observation}, *turns[last + 1:]]


def multiturn_from_config(cfg, tokenizer, max_new_tokens: int | None = None, group_size: int | None = None,
                          stop_ids: list[int] | tuple = (), context_len: int | None = None) -> MultiTurn | None:
    """The tools and environment a multi-turn run calls (loaded, described and checked before anything is
    sampled), or None for single-turn rollouts; `max_new_tokens` and `group_size` for evaluation's own,
    `stop_ids` the model's end-of-turn tokens (modeling.eos_ids), `context_len` the model's context."""
    r = cfg.rollout
    if not r.multi_turn:
        return None
    source = ToolSource.load(r.tools, r.environment_factory)
    if not source.schemas:
        raise ToolError("rollout.tools and rollout.environment_factory give the model no tool to call")
    if r.tool_protocol == "template" and not template_renders_tools(tokenizer):
        raise ToolError("rollout.tool_protocol template: this model's chat template does not use the tools it is "
                        "given (the model would never see them); set rollout.tool_protocol: text (or auto)")
    protocol = Protocol(tokenizer, source.schemas, r.tool_protocol, stop_ids)
    protocol.result_ids([(source.schemas[0]["function"]["name"], "0")])  # (a template that cannot append fails now)
    if source.has_reward and "environment" not in {c.name for c in cfg.rewards.components}:
        raise ToolError(f"rollout.environment_factory {r.environment_factory} has get_reward(): add it to the "
                        "rewards as {name: environment, weight: ...} (or remove get_reward)")
    limits = TurnLimits(max_new_tokens or r.max_new_tokens, r.max_turns, r.max_tool_calls, r.tool_timeout_s,
                        r.max_tool_result_tokens)
    return MultiTurn(source, protocol, limits, group_size or r.num_generations, cfg.data.system_prompt,
                     cfg.data.prompt_column, cfg.data.answer_column, cfg.data.few_shot_turns,
                     prompt_limit(cfg.data.max_prompt_tokens, context_len, limits.max_new_tokens), r.turn_cache)


def prompt_limit(max_prompt_tokens: int, context_len: int | None, max_new_tokens: int) -> int:
    """The longest prompt a run samples from: data.max_prompt_tokens, or less where the model's context
    leaves less after rollout.max_new_tokens.

    >>> prompt_limit(512, 512, 192), prompt_limit(256, None, 64)
    (320, 256)
    """
    return max_prompt_tokens if context_len is None else max(1, min(max_prompt_tokens, context_len - max_new_tokens))
