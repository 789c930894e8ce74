"""The trace contract: one `TraceRecord` per sampled completion, written to `traces.jsonl`.

This module is the one definition of a trace: its fields with their types (the audit's DuckDB columns)
and docs (docs/traces.md's schema table, `schema_table()`), the builder of the fields a completion has
wherever it was sampled (`completion_fields`: training traces and `docuchat-rl generate` records), and
the metrics a step's records give (`step_metrics`, `reward_means`: the metrics record and evaluation
compute reward means the same way). Torch-free.

Deliberately left out: a binary trace format (Parquet, Arrow); JSON lines stay readable with `head`
and appendable with a crash-safe write.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from rewards.composite import RewardRecord

    from .data import Example


def _f(sql: str, doc: str, default: Any = MISSING) -> Any:
    """A trace field with its DuckDB type and its one-line doc (docs/traces.md's schema table)."""
    return field(default=default, metadata={"sql": sql, "doc": doc})


@dataclass
class TraceRecord:
    """One completion of a training step: what was sampled, how each reward scored it, what it trained."""

    run_id: str = _f("VARCHAR", "the run (kept across resumes)")
    step: int = _f("BIGINT", "training step")
    prompt_id: int = _f("BIGINT", "row of the training file")
    group: int | None = _f("BIGINT", "group index within the step (null when dynamic sampling dropped the group)")
    sample: int = _f("BIGINT", "index within the group")
    used: bool = _f("BOOLEAN", "false when the group was dropped by dynamic sampling (traced, not trained on)")
    prompt: str = _f("VARCHAR", "the question")
    completion: str = _f("VARCHAR", "the decoded completion")
    gold: str | None = _f("VARCHAR", "the gold final answer")
    completion_tokens: int = _f("BIGINT", "completion length in tokens")
    truncated: bool = _f("BOOLEAN", "true when no EOS came within max_new_tokens")
    rewards: dict[str, dict] = _f("STRUCT", "`{name: {raw, weight, weighted, info, error}}` per component")
    total: float = _f("DOUBLE", "the weighted total of the components that had a value")
    total_missing: bool = _f("BOOLEAN", "true when no component had a value (then the row is out of its "
                                        "group's baseline and its advantage is 0)")
    # the replay coordinate (`docuchat-rl replay`): everything that regenerates this completion
    slot: int | None = _f("BIGINT", "replay: the prompt's position among the step's sampled prompts", None)
    seed: int | None = _f("BIGINT", "replay: the seed of the completion's own random stream (from run.seed, "
                                    "step, slot, sample)", None)
    completion_ids: list[int] | None = _f("BIGINT[]", "replay: the completion's token ids", None)
    policy_version: int | None = _f("BIGINT", "replay: the policy that sampled it: the weights after step "
                                              "policy_version (step - 1 - rollout.async_lag, at least 0; 0: the "
                                              "initial adapter)", None)
    adapter_sha256: str | None = _f("VARCHAR", "replay: sha256 of that policy's adapter tensors (first 16 hex "
                                               "digits; null when sharded)", None)
    sampling: dict | None = _f("JSON", "replay: engine, temperature, top_k, top_p, max_new_tokens, "
                                       "min_new_tokens, stop_ids of the sampler", None)
    versions: dict | None = _f("JSON", "replay: torch, transformers, vllm (null when not installed) and "
                                       "docuchat-rl versions of the run", None)
    turns: list[dict] | None = _f("JSON", "multi-turn (rollout.tools, environment_factory): each assistant turn's "
                                          "model_tokens, calls (name, arguments, result, error, result_tokens, "
                                          "truncated, seconds), env_tokens and how it ended; null when single-turn",
                                  None)
    observation: str | None = _f("VARCHAR", "multi-turn: the environment's first observation as appended to the "
                                            "prompt (cut to data.max_prompt_tokens, said in its text); null when "
                                            "none", None)
    prompt_pass_rate: float | None = _f("DOUBLE", "data.difficulty: the prompt's pass rate (its last group's mean "
                                                  "accuracy) when this step drew it; null on its first draw; absent "
                                                  "without data.difficulty", None)  # (NOT_DRAWN_BY_DIFFICULTY: left out)
    algorithm: dict[str, float | None] = field(default_factory=dict)  # the algorithm's per-row values
    # (Algorithm.trace_fields: ALGORITHM_FIELDS below), None on rows not trained on; flattened into the JSON

    def to_json(self) -> dict:
        """The JSON line: the fields above, the algorithm's values at the top level."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "algorithm"}
        if out["prompt_pass_rate"] == NOT_DRAWN_BY_DIFFICULTY:  # (by value: a record gathered from another
            # process is a copy)
            del out["prompt_pass_rate"]  # (a run without data.difficulty writes the lines it always wrote)
        out.update(self.algorithm)
        return out


NOT_DRAWN_BY_DIFFICULTY = float("-inf")  # a TraceRecord's prompt_pass_rate when data.difficulty is off: the field
# is left out of the line (a pass rate is never negative)

REQUIRED = ("step", "prompt_id", "completion", "rewards", "total")  # what every trace line holds: a line without
# one is another file's (a run's metrics.jsonl, say), never read as a trace (the audit, rescore, replay)

NOT_RUN = ("max_turns", "max_tool_calls", "max_new_tokens")  # a traced call's errors when a limit kept it from
# running (sampling/multiturn.py): neither a success nor the tool's failure

ALGORITHM_FIELDS = {  # what Algorithm.trace_fields may give: name -> (DuckDB type, doc)
    "advantage": ("DOUBLE", "the completion's advantage (mean over its tokens); null when not used"),
    "value": ("DOUBLE", "PPO and A2C only: the critic's value of the prompt; null when not used"),
}


def _schema() -> list[tuple[str, str, str]]:
    """(name, DuckDB type, doc) of every field of a trace line, in order."""
    own = [(f.name, f.metadata["sql"], f.metadata["doc"]) for f in fields(TraceRecord) if f.name != "algorithm"]
    return own + [(name, sql, doc) for name, (sql, doc) in ALGORITHM_FIELDS.items()]


def columns() -> dict[str, str]:
    """Every scalar trace field -> its DuckDB type (the reward components become STRUCT columns apart)."""
    return {name: sql for name, sql, _ in _schema() if sql != "STRUCT"}


_PY_TYPES = {"BIGINT": (int,), "DOUBLE": (int, float), "BOOLEAN": (bool,), "VARCHAR": (str,)}


def mistyped(line: dict, required: tuple[str, ...] = ()) -> str | None:
    """What is wrong with a trace line's types (the same rule as the audit's load), or None: a field that
    holds another JSON type than its schema's (null is allowed unless the field is `required`), a list of
    other than integers in completion_ids, or a reward component that is not an object of numbers.

    >>> mistyped({"step": "three"})
    'field step holds str, expected bigint'
    """
    for name, sql, _ in _schema():
        value = line.get(name)
        if value is None:
            if name in required:
                return f"field {name} is missing"
            continue
        kinds = _PY_TYPES.get(sql)
        if kinds is not None and (not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)):
            return f"field {name} holds {type(value).__name__}, expected {sql.lower()}"
        if sql == "BIGINT[]" and (not isinstance(value, list) or
                                  not all(isinstance(i, int) and not isinstance(i, bool) for i in value)):
            return f"field {name} holds a list of other than integers"
        if sql == "STRUCT":
            if not isinstance(value, dict):
                return f"field {name} is not an object"
            for component, c in value.items():
                if not isinstance(c, dict) or any(c.get(k) is not None and (not isinstance(c[k], (int, float))
                                                                             or isinstance(c[k], bool))
                                                  for k in ("raw", "weight", "weighted")):
                    return f"reward component {component} is not an object of numbers (raw, weight, weighted)"
    return None


def schema_table() -> str:
    """docs/traces.md's trace schema table, from the fields' docs."""
    rows = ["| field | type | meaning |", "|---|---|---|"]
    rows += [f"| `{name}` | {sql.lower()} | {doc} |" for name, sql, doc in _schema()]
    return "\n".join(rows)


def library_versions() -> dict[str, str | None]:
    """The versions a completion's numbers depend on (the replay coordinate's `versions`)."""
    from importlib import metadata

    out: dict[str, str | None] = {}
    for name in ("torch", "transformers", "vllm", "docuchat-rl"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def completion_fields(example: Example, sample: int, text: str, tokens: int, truncated: bool,
                      reward: RewardRecord | None) -> dict[str, Any]:
    """The fields every record of a sampled completion has, trained on or only generated (the reward's
    fields only when it was scored)."""
    out: dict[str, Any] = {"prompt_id": example.prompt_id, "sample": sample, "prompt": example.question,
                           "completion": text, "gold": example.answer or None, "completion_tokens": tokens,
                           "truncated": truncated}
    if reward is not None:
        out.update(rewards={k: c.as_dict() for k, c in reward.components.items()}, total=reward.total,
                   total_missing=reward.total_missing)
    return out


def reward_means(raws: list[dict[str, float | None]], names: list[str]) -> dict[str, float | None]:
    """Each component's mean raw score over the completions that had a value (None when none had)."""
    out = {}
    for name in names:
        values = [r[name] for r in raws if r.get(name) is not None]
        out[name] = float(np.mean(values)) if values else None
    return out


def step_metrics(records: list[TraceRecord], names: list[str], accuracy_component: str | None) -> dict[str, Any]:
    """What a step's trace records say: reward mean/std, each component's mean and error count, accuracy
    (the accuracy component's mean), lengths, the truncated share and the rows without a reward."""
    totals = np.array([r.total for r in records])
    lengths = np.array([r.completion_tokens for r in records])
    means = reward_means([{k: v["raw"] for k, v in r.rewards.items()} for r in records], names)
    m: dict[str, Any] = {"reward/mean": float(totals.mean()), "reward/std": float(totals.std())}
    for name in names:
        m[f"rewards/{name}/mean"] = means[name]
        m[f"rewards/{name}/errors"] = sum(r.rewards[name]["error"] is not None for r in records)
        nans = sum(bool((r.rewards[name].get("info") or {}).get("nan")) for r in records)
        if nans:  # (a NaN is "no value", as in TRL: counted, so that it is never silent)
            m[f"rewards/{name}/nan"] = nans
    if accuracy_component in names:
        m["accuracy"] = means[accuracy_component]
    m.update({"completion_len/mean": float(lengths.mean()), "completion_len/max": int(lengths.max()),
              "truncated_frac": float(np.mean([r.truncated for r in records])),
              "reward_missing": sum(r.total_missing for r in records)})
    if any(r.turns is not None for r in records):  # multi-turn: how the model used its tools this step
        calls = [[c for t in r.turns or [] for c in t["calls"]] for r in records]
        ran = [c for cs in calls for c in cs if c["error"] not in NOT_RUN]  # (a call a limit kept from running
        # is neither a success nor the tool's failure)
        m.update({"turns/mean": float(np.mean([len(r.turns or []) for r in records])),
                  "tool_calls/mean": float(np.mean([len(c) for c in calls])),
                  "tool_call_rate": float(np.mean([bool(c) for c in calls])),
                  "tool_call_ok_frac": sum(c["error"] is None for c in ran) / len(ran) if ran else None,
                  "tool_tokens/mean": float(np.mean([sum(t["env_tokens"] for t in r.turns or []) for r in records]))})
    return m


def reward_gaps(rewards: list[dict[str, dict]], names: list[str], where: str, only_all: bool = False) -> list[str]:
    """The one rule every command that scores says its rewards' gaps by: one line per component that failed or
    gave no value (None) on some completion of `rewards` (each completion's {name: {raw, error, ...}}), with
    the counts and the first error; `only_all`: only a component that had no value on any of them (training
    says that each step; the counts of a partial gap are in its metrics).

    >>> rows = [{"f": {"raw": None, "error": "boom"}, "g": {"raw": None, "error": None}}] * 3
    >>> reward_gaps(rows, ["f", "g"], "held-out completions")
    ["reward 'f' failed on 3 of 3 held-out completions (first error: boom)", "reward 'g' gave no value (None) for 3 of 3 held-out completions"]
    """
    lines, n = [], len(rewards)
    for name in names:
        errors = [r[name]["error"] for r in rewards if name in r and r[name].get("error") is not None]
        empty = sum(1 for r in rewards if name in r and r[name].get("raw") is None and r[name].get("error") is None)
        if not (errors or empty) or (only_all and len(errors) + empty < n):
            continue
        parts = ([f"failed on {len(errors)}"] if errors else []) + ([f"gave no value (None) for {empty}"] if empty else [])
        first = f" (first error: {errors[0]})" if errors else ""
        lines.append(f"reward {name!r} {' and '.join(parts)} of {n} {where}{first}")
    return lines


def reward_failures(records: list[TraceRecord], names: list[str]) -> list[str]:
    """One line per component that had no value on any completion of the step (failed, or gave None), with
    its first error."""
    return reward_gaps([r.rewards for r in records], names, f"completions of step {records[0].step}",
                       only_all=True) if records else []


class RewardWatch:
    """Watches each step's rewards: says at once when a component failed on every completion or the step had
    no learning signal (`reward_failures`, `signal_warnings`), and stops the run (TrainingError) when no
    component gave any completion a value for `max_failed_steps` steps in a row: it would train nothing.
    The streak is part of a checkpoint (it counts on across a resume)."""

    def __init__(self, names: list[str], max_failed_steps: int, streak: int = 0):
        self.names, self.max_failed_steps, self.streak = names, max_failed_steps, streak

    def check(self, records: list[TraceRecord], m: dict[str, Any]) -> list[str]:
        """The warnings the step's records and metrics call for (the streak counted)."""
        self.streak = self.streak + 1 if m["reward_missing"] == len(records) else 0
        return reward_failures(records, self.names) + signal_warnings(m)

    def stop_if_starved(self, records: list[TraceRecord]) -> None:
        """Raise TrainingError once the streak reaches rewards.max_failed_steps."""
        from .errors import TrainingError

        if self.streak >= self.max_failed_steps:
            first = next((f"reward {name!r}: {c['error']}" for r in records for name, c in r.rewards.items()
                          if c["error"]), "every component returned None")
            raise TrainingError(f"no reward component produced a value for any completion in {self.streak} steps "
                                "in a row (rewards.max_failed_steps): nothing to learn from; first error: "
                                f"{first}")


def replay_coordinate(sampling: dict[str, Any]) -> dict[str, Any]:
    """The run's part of every trace line's replay coordinate: the sampler's settings (`sampling`: engine,
    temperature, top_k, top_p, max/min_new_tokens, stop_ids) and the library versions."""
    return {"sampling": sampling, "versions": library_versions()}


TRUNCATED_WARNING = 0.9  # a step in which at least this share of completions hit max_new_tokens is said


def signal_warnings(m: dict[str, Any]) -> list[str]:
    """The step's silent zero-signal cases, from its metrics record: every group's rewards agreed (GRPO
    trains nothing on it), or nearly every completion was cut at `rollout.max_new_tokens`."""
    lines = []
    if m.get("zero_std_frac") == 1.0:
        lines.append(f"step {m['step']}: the rewards agreed within every group (zero_std_frac 1.0): the step "
                     "had no advantage signal")
    if m.get("dynamic_sampling/unfilled"):
        band = " inside data.difficulty's band" if "difficulty/band_share" in m else ""
        lines.append(f"step {m['step']}: dynamic sampling found no group with varied rewards{band} in every round "
                     "(rollout.max_resample_rounds): the step trains on its last round's groups, whose advantages are "
                     "0 (widen data.difficulty's band, or raise rollout.max_resample_rounds)")
    if m.get("truncated_frac", 0.0) >= TRUNCATED_WARNING:
        lines.append(f"step {m['step']}: {m['truncated_frac']:.0%} of the completions were cut at "
                     "rollout.max_new_tokens (their rewards judge unfinished text)")
    return lines
