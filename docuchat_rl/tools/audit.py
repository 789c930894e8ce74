"""Audit reward traces: summaries, SQL filters, reward-hacking detectors, comparisons, HTML reports.

The trace files are loaded into a temporary on-disk DuckDB database (bounded memory for millions of
records): every line is read as text first, so a malformed or torn line is reported with its file and
line number and skipped. Each reward component becomes a STRUCT column, so filters read naturally:

    correctness.raw == 0 and format.raw == 1        advantage > 1        step >= 100
    "tests.mod:my_reward".error is not null         completion ilike '%sorry%'

Filters are DuckDB SQL expressions, never Python. After loading, file access is switched off and the
configuration locked, and a filter must parse as one expression of one statement: it can only read the
traces. `group` is an SQL keyword: write "group".

Deliberately left out: live dashboards; `--html` writes a static, self-contained page.
"""

from __future__ import annotations

import json
import math
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..outputs import read_jsonl
from ..traces import REQUIRED, columns

BASE_COLUMNS = columns()  # trace field -> DuckDB type, from the one trace definition


class AuditError(ValueError):
    """Bad input to the audit (a path, an expression, a selection): the message says which."""


def trace_files(path: str | Path) -> list[Path]:
    """The trace files a run folder, a folder of JSONL files or one file stands for."""
    p = Path(path)
    if p.is_dir():
        if (p / "traces.jsonl").exists():
            return [p / "traces.jsonl"]
        found = sorted(p.glob("*.jsonl"))
        if found:
            return found
        raise AuditError(f"{p}: no traces.jsonl (or *.jsonl) in this folder")
    if not p.exists():
        raise AuditError(f"{p}: no such file or folder")
    return [p]


def eval_records(sources: list[str | Path]) -> list[dict]:
    """The held-out evaluations (`eval.jsonl`) beside the given runs' traces, in file order; lines that
    do not parse, or lack their step, are skipped (a run killed mid-write)."""
    out = []
    for src in sources:
        p = Path(src)
        path = (p if p.is_dir() else p.parent) / "eval.jsonl"
        if path.exists():
            out += [rec for rec in read_jsonl(path) if isinstance(rec.get("step"), int)]
    return out


def rescored_records(sources: list[str | Path]) -> list[dict]:
    """The lines of a `docuchat-rl rescore --out` file whose total or advantage moved (they keep the old
    values under `before`), for the HTML report's before/now table."""
    out = []
    for src in sources:
        for f in trace_files(src):
            for r in read_jsonl(f):
                b = r.get("before")
                if isinstance(b, dict) and (b.get("total") != r.get("total") or b.get("advantage") != r.get("advantage")):
                    out.append(r)
    return out


def _q(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _lit(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


# the JSON types a trace field of each DuckDB type may hold (null always may); JSON columns hold anything
_JSON_TYPES = {"BIGINT": ("BIGINT", "UBIGINT"), "DOUBLE": ("DOUBLE", "BIGINT", "UBIGINT"), "BOOLEAN": ("BOOLEAN",),
               "VARCHAR": ("VARCHAR",), "BIGINT[]": ("ARRAY",)}
_NUMBER = ("DOUBLE", "BIGINT", "UBIGINT", "NULL")


def _first_mistyped() -> str:
    """An SQL expression over a trace line `j`: why its first mistyped field is wrong, or NULL."""
    def kind(path: str) -> str:
        return f"coalesce(json_type(j, {_lit(path)}), 'NULL')"

    def one_of(kinds) -> str:
        return ", ".join(_lit(k) for k in kinds)

    cases = [f"WHEN json_type(j, {_lit('$.' + _json_key(name))}) IS NULL THEN 'field {name} is missing: not a trace line'"
             for name in REQUIRED]  # (another file of the run, metrics.jsonl say, is not read as traces)
    for name, sql_type in BASE_COLUMNS.items():
        allowed = _JSON_TYPES.get(sql_type)
        if allowed is not None:
            path = "$." + _json_key(name)
            cases.append(f"WHEN {kind(path)} NOT IN ({one_of((*allowed, 'NULL'))}) THEN "
                         f"'field {name} holds ' || lower({kind(path)}) || ', expected {sql_type.lower()}'")
            if sql_type == "BIGINT[]":
                cases.append(f"WHEN {kind(path)} = 'ARRAY' AND len(list_filter(json_type(j, {_lit(path + '[*]')}), "
                             f"lambda t: t NOT IN ('BIGINT', 'UBIGINT'))) > 0 "
                             f"THEN 'field {name} holds a list of other than integers'")
    cases.append(f"WHEN {kind('$.rewards')} NOT IN ('OBJECT', 'NULL') THEN 'field rewards is not an object'")
    component = ("list_filter(coalesce(json_keys(j->'rewards'), []), lambda k: coalesce(json_type(j->'rewards'->k), 'NULL') "
                 "NOT IN ('OBJECT', 'NULL') OR {test})")
    numbers = " OR ".join(f"coalesce(json_type(j->'rewards'->k->'{f}'), 'NULL') NOT IN ({one_of(_NUMBER)})"
                          for f in ("raw", "weight", "weighted"))
    bad = component.format(test=numbers)
    cases.append(f"WHEN {kind('$.rewards')} = 'OBJECT' AND len({bad}) > 0 THEN 'reward component ' || {bad}[1] || "
                 "' is not an object of numbers (raw, weight, weighted)'")
    return "CASE " + " ".join(cases) + " ELSE NULL END"


def _json_key(name: str) -> str:
    return '"' + name.replace('"', '\\"') + '"'


@dataclass
class Finding:
    """One detector's verdict: whether it fired, what it measured, its threshold, example rows."""

    check: str
    fired: bool
    detail: str
    threshold: str
    examples: list[dict] = field(default_factory=list)
    trace: dict | None = None  # when fired: one whole trace record the check points at (the report shows it)


# multi-turn traces (rollout.tools): columns derived from `turns`, for filters (`tool_calls > 2`, `tool_errors > 0`)
# and the tool detectors; 0, [] and '' on single-turn lines
TOOL_COLUMNS = [
    "coalesce(len(json_extract(j, '$.turns[*].calls[*]')), 0) AS tool_calls",
    "coalesce(len(list_filter(json_extract_string(j, '$.turns[*].calls[*].error'), lambda x: x IS NOT NULL)), 0) "
    "AS tool_errors",
    "coalesce(json_extract_string(j, '$.turns[*].calls[*].result'), []) AS tool_results",
    # the model's own words: its turns without tool calls and without the final answer (<answer>, "#### N")
    "trim(regexp_replace(regexp_replace(array_to_string(coalesce(json_extract_string(j, '$.turns[*].text'), []), "
    "' '), '<tool_call>.*?</tool_call>|<answer>.*?</answer>|####.*', '', 'gs'), '[^A-Za-z0-9]+', ' ', 'g')) "
    "AS reasoning",
]


class TraceStore:
    """One or more trace files as a table `traces`, plus the malformed lines found while loading."""

    def __init__(self, sources: list[str | Path], memory_limit: str = "1GB"):
        import duckdb

        self._tmp = tempfile.TemporaryDirectory(prefix="docuchat-audit-")
        self.con = duckdb.connect(str(Path(self._tmp.name) / "audit.duckdb"))
        self.con.execute(f"SET memory_limit={_lit(memory_limit)}")
        self.con.execute(f"SET temp_directory={_lit(self._tmp.name)}")
        self.malformed: list[dict] = []
        files = [f for s in sources for f in trace_files(s)]
        self.con.execute("CREATE TABLE raw (source VARCHAR, lineno BIGINT, line VARCHAR)")
        for f in files:
            # every line as one text value: a delimiter and quote that never occur in JSONL
            self.con.execute(
                f"INSERT INTO raw SELECT {_lit(str(f))}, row_number() OVER (), line FROM read_csv("
                f"{_lit(str(f))}, columns={{'line': 'VARCHAR'}}, header=false, delim='\\x01', quote='', "
                "escape='', auto_detect=false, strict_mode=false)")
        self.malformed = [{"source": s, "line": n, "text": (t or "")[:120], "why": "not a JSON object"}
                          for s, n, t in self.con.execute(
            "SELECT source, lineno, line FROM raw WHERE line IS NOT NULL AND trim(line) <> '' "
            "AND (NOT json_valid(line) OR json_type(line::JSON) <> 'OBJECT') ORDER BY source, lineno").fetchall()]
        self.con.execute("CREATE TABLE objects AS SELECT source, lineno, line, line::JSON AS j FROM raw WHERE "
                         "json_valid(line) AND json_type(line::JSON) = 'OBJECT'")
        self.con.execute("DROP TABLE raw")
        # a line whose field holds another JSON type than the trace schema's (a hand edit, another tool's
        # file) is skipped with its reason: a cast would fail the whole load, or round 1.5 into a row id
        self.con.execute(f"CREATE TABLE checked AS SELECT *, {_first_mistyped()} AS why FROM objects")
        self.con.execute("DROP TABLE objects")
        self.malformed += [{"source": s, "line": n, "text": (t or "")[:120], "why": w} for s, n, t, w in
                           self.con.execute("SELECT source, lineno, line, why FROM checked WHERE why IS NOT NULL "
                                            "ORDER BY source, lineno").fetchall()]
        self.malformed.sort(key=lambda m: (m["source"], m["line"]))
        self.con.execute("CREATE TABLE good AS SELECT source, lineno, j FROM checked WHERE why IS NULL")
        self.con.execute("DROP TABLE checked")
        self.components = [r[0] for r in self.con.execute(
            "SELECT DISTINCT unnest(json_keys(j->'rewards')) AS k FROM good ORDER BY k").fetchall()]
        cols = [f"CAST(j->>{_lit(k)} AS {t}) AS {_q(k)}" for k, t in BASE_COLUMNS.items()]
        for c in self.components:
            base = f"j->'rewards'->{_lit(c)}"
            cols.append(f"{{'raw': CAST({base}->>'raw' AS DOUBLE), 'weight': CAST({base}->>'weight' AS DOUBLE), "
                        f"'weighted': CAST({base}->>'weighted' AS DOUBLE), 'error': {base}->>'error', "
                        f"'info': {base}->'info'}} AS {_q(c)}")
        cols += TOOL_COLUMNS
        self.con.execute(f"CREATE TABLE traces AS SELECT source, lineno, {', '.join(cols)} FROM good")
        self.con.execute("DROP TABLE good")
        self.rows = self.con.execute("SELECT count(*) FROM traces").fetchone()[0]
        if not self.rows and self.malformed:  # (input that is not what the audit reads: said, never summarised)
            first = self.malformed[0]
            self.close()
            raise AuditError(f"{first['source']}: no trace lines ({len(self.malformed)} lines skipped; line "
                             f"{first['line']}: {first['why']})")
        if not self.rows:  # (an empty file, or a run that has not finished its first step)
            self.close()
            raise AuditError(f"{', '.join(str(s) for s in sources)}: no trace lines (empty: a run writes them as "
                             "each step ends)")
        self.con.execute("SET enable_external_access=false")
        self.con.execute("SET lock_configuration=true")

    def close(self) -> None:
        self.con.close()
        self._tmp.cleanup()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ------------------------------------------------------------ filters
    def _checked(self, expr: str, what: str, name: str | None = None) -> str:
        """`expr` as a checked SQL filter (`what` where) or order (sort); errors name `name`, the setting it came
        from (the audit's --where / --sort by default; sft.where for the SFT stage's)."""
        import duckdb

        name = name or f"--{what}"
        if not expr.strip():
            raise AuditError(f"empty {name} expression")
        sql = f"SELECT 1 FROM traces WHERE ({expr}) LIMIT 0" if what == "where" else \
              f"SELECT 1 FROM traces ORDER BY {expr} LIMIT 0"
        try:
            if len(self.con.extract_statements(sql)) != 1:
                raise AuditError(f"{name} must be a single expression")
            self.con.execute(sql)
        except duckdb.Error as e:
            first = str(e).splitlines()[0]
            raise AuditError(f"bad {name} expression {expr!r}: {first}. Fields: "
                             f"{', '.join(BASE_COLUMNS)}; components (use .raw/.weight/.weighted/.error/.info): "
                             f"{', '.join(self.components)}") from None
        return expr

    def select(self, where: str | None = None, sort: str | None = None, limit: int | None = None,
               columns: str = "*", where_name: str | None = None) -> list[dict]:
        """Rows of the traces (as dicts) matching a checked SQL `where` (its errors naming `where_name`, the setting
        it came from: --where by default), ordered by `sort`, at most `limit`."""
        sql = f"SELECT {columns} FROM traces"
        if where:
            sql += f" WHERE ({self._checked(where, 'where', where_name)})"
        sql += f" ORDER BY {self._checked(sort, 'sort')}" if sort else " ORDER BY source, lineno"
        if limit is not None:
            sql += f" LIMIT {int(limit)}"
        cur = self.con.execute(sql)
        names = [d[0] for d in cur.description]
        rows = [dict(zip(names, row)) for row in cur.fetchall()]
        for row in rows:  # DuckDB hands JSON back as text: give callers the info objects themselves
            for c in self.components:
                if isinstance(row.get(c), dict) and isinstance(row[c].get("info"), str):
                    row[c]["info"] = json.loads(row[c]["info"])
        return rows

    def count(self, where: str | None = None) -> int:
        sql = "SELECT count(*) FROM traces" + (f" WHERE ({self._checked(where, 'where')})" if where else "")
        return self.con.execute(sql).fetchone()[0]

    # ------------------------------------------------------------ summary
    def step_bins(self, bins: int) -> list[tuple[int, int]]:
        """The step range split into `bins` contiguous (first, last) ranges."""
        lo, hi = self.con.execute("SELECT min(step), max(step) FROM traces").fetchone()
        if lo is None:
            return []
        width = max(1, math.ceil((hi - lo + 1) / max(1, bins)))
        return [(s, min(hi, s + width - 1)) for s in range(lo, hi + 1, width)]

    def summary(self, bins: int = 5, accuracy: str = "correctness") -> dict:
        """Record counts, components and per-step-range means (reward, accuracy, length, truncation)."""
        out: dict[str, Any] = {"records": self.rows, "malformed_lines": len(self.malformed),
                               "components": self.components, "bins": []}
        if not self.rows:
            return out
        maxima = {c: self.con.execute(f"SELECT max({_q(c)}.raw) FROM traces").fetchone()[0]
                  for c in self.components}
        for lo, hi in self.step_bins(bins):
            where = f"step BETWEEN {lo} AND {hi}"
            row: dict[str, Any] = {"steps": [lo, hi]}
            row.update(dict(zip(["records", "mean_length", "truncated_share", "reward_mean"], self.con.execute(
                f"SELECT count(*), avg(completion_tokens), avg(truncated::INT), avg(total) FROM traces "
                f"WHERE {where}").fetchone())))
            for c in self.components:
                q, mx = _q(c), maxima[c]
                mean, std, zero, at_max, errors, n = self.con.execute(
                    f"SELECT avg({q}.raw), stddev_samp({q}.raw), avg(({q}.raw = 0)::INT), "
                    f"avg(({q}.raw = {mx if mx is not None else 'NULL'})::INT), "
                    f"count(*) FILTER (WHERE {q}.error IS NOT NULL), count({q}.raw) FROM traces WHERE {where}"
                ).fetchone()
                row[c] = {"mean": mean, "std": std, "share_zero": zero, "share_max": at_max, "errors": errors,
                          "scored": n}
            if accuracy in self.components:
                row["accuracy"] = row[accuracy]["mean"]
            if "format" in self.components:
                row["format_rate"] = row["format"]["share_max"] if maxima["format"] == 1 else None
            out["bins"].append(row)
        if accuracy in self.components:
            out["correlation_with_" + accuracy] = {c: self.con.execute(
                f"SELECT corr({_q(c)}.raw, {_q(accuracy)}.raw) FROM traces").fetchone()[0]
                for c in self.components if c != accuracy}
        return out

    def detect(self, **thresholds) -> list[Finding]:
        """The reward-hacking detectors (module function `detect`) over this store."""
        return detect(self, **thresholds)


def detect(store: TraceStore, bins: int = 5, accuracy: str = "correctness", format_name: str = "format",
           min_rise: float = 0.10, min_fall: float = 0.05, length_ratio: float = 2.0,
           repetition_rise: float = 0.10, no_signal_share: float = 0.95, error_share: float = 0.0,
           truncated_share: float = 0.9, tool_error_share: float = 0.5, copied_share: float = 0.5,
           examples: int = 3) -> list[Finding]:
    """Named checks for common reward hacking and broken rewards in `store`, first vs last step range."""
    findings: list[Finding] = []
    ranges = store.step_bins(bins)
    if not ranges:
        return findings
    first, last = ranges[0], ranges[-1]

    def mean(expr: str, r: tuple[int, int]) -> float | None:
        return store.con.execute(f"SELECT avg({expr}) FROM traces WHERE step BETWEEN {r[0]} AND {r[1]}"
                                 ).fetchone()[0]

    traced: dict[str, tuple[str, str]] = {}  # check -> (where, sort) of the trace to show when it fires

    def ex(check: str, fired: bool, where: str, sort: str = "step DESC") -> list[dict]:
        """The check's example rows when it fired (and where its example trace is to be found)."""
        traced[check] = (where, sort)
        return store.select(where, sort, examples, "step, prompt_id, completion, total, completion_tokens") \
            if fired else []

    span = f"steps {first[0]}-{first[1]} vs {last[0]}-{last[1]}"
    if {accuracy, format_name} <= set(store.components) and len(ranges) > 1:
        f0, f1 = mean(f"{_q(format_name)}.raw", first), mean(f"{_q(format_name)}.raw", last)
        a0, a1 = mean(f"{_q(accuracy)}.raw", first), mean(f"{_q(accuracy)}.raw", last)
        if None not in (f0, f1, a0, a1):
            fired = f1 - f0 >= min_rise and a1 - a0 <= -min_fall
            findings.append(Finding(
                "format_up_correctness_down", fired,
                f"{format_name} {f0:.3f} -> {f1:.3f}, {accuracy} {a0:.3f} -> {a1:.3f} ({span})",
                f"{format_name} rise >= {min_rise} and {accuracy} fall >= {min_fall}",
                ex("format_up_correctness_down", fired,
                   f"step >= {last[0]} AND {_q(format_name)}.raw > 0 AND {_q(accuracy)}.raw = 0")))
    if len(ranges) > 1:
        r0, r1 = mean("total", first), mean("total", last)
        l0, l1 = mean("completion_tokens", first), mean("completion_tokens", last)
        if None not in (r0, r1, l0, l1) and l0 > 0:
            ratio = l1 / l0
            rising = r1 - r0 >= min_rise
            for check, fired, how, sort in (
                    ("length_collapse", rising and ratio <= 1 / length_ratio, "shrinking", "completion_tokens ASC"),
                    ("length_growth", rising and ratio >= length_ratio, "growing", "completion_tokens DESC")):
                findings.append(Finding(
                    check, fired, f"reward {r0:.3f} -> {r1:.3f}, mean length {l0:.1f} -> {l1:.1f} tokens ({span})",
                    f"reward rise >= {min_rise} with length {how} by {length_ratio}x",
                    ex(check, fired, f"step >= {last[0]}", sort)))
        rep0, _ = _repetition(store, first)
        rep1, worst = _repetition(store, last, examples)
        findings.append(Finding(
            "repetition_creep", rep1 - rep0 >= repetition_rise,
            f"share of repeated word 3-grams {rep0:.3f} -> {rep1:.3f} ({span})",
            f"rise >= {repetition_rise}", worst if rep1 - rep0 >= repetition_rise else []))
        if worst:
            traced["repetition_creep"] = (f"step = {worst[0]['step']} AND completion = {_lit(worst[0]['completion'])}",
                                          "sample")
    cut = mean("CAST(truncated AS DOUBLE)", last)
    if cut is not None:
        findings.append(Finding(
            "truncated", cut >= truncated_share,
            f"{cut:.1%} of the completions of steps {last[0]}-{last[1]} hit max_new_tokens",
            f"share >= {truncated_share:.0%} (rewards judge unfinished completions)",
            ex("truncated", cut >= truncated_share, f"step >= {last[0]} AND truncated")))
    _zero_spread(store, findings, traced, no_signal_share)
    _tools(store, findings, first, last, accuracy, tool_error_share, copied_share, ex)
    for c in store.components:
        q = _q(c)
        groups, constant = store.con.execute(
            f"SELECT count(*), count(*) FILTER (WHERE lo = hi) FROM (SELECT min({q}.raw) lo, max({q}.raw) hi "
            f"FROM traces WHERE \"group\" IS NOT NULL AND {q}.raw IS NOT NULL "
            f"GROUP BY run_id, step, \"group\" HAVING count(*) > 1)").fetchone()
        if groups:
            share = constant / groups
            findings.append(Finding(
                f"no_signal:{c}", share >= no_signal_share,
                f"{c} is constant within {constant} of {groups} groups ({share:.1%})",
                f"constant in >= {no_signal_share:.0%} of groups (no advantage signal)"))
            traced[f"no_signal:{c}"] = (f"{q}.raw IS NOT NULL", "step DESC")
        n_err, n_all = store.con.execute(
            f"SELECT count(*) FILTER (WHERE {q}.error IS NOT NULL), count(*) FROM traces").fetchone()
        if n_all:
            errs = store.con.execute(
                f"SELECT {q}.error AS error, count(*) AS n FROM traces WHERE {q}.error IS NOT NULL "
                f"GROUP BY 1 ORDER BY n DESC LIMIT {examples}").fetchall()
            findings.append(Finding(
                f"erroring:{c}", n_err / n_all > error_share,
                f"{c} failed on {n_err} of {n_all} completions",
                f"error share > {error_share}", [{"error": e, "count": n} for e, n in errs]))
            traced[f"erroring:{c}"] = (f"{q}.error IS NOT NULL", "step DESC")
    for f in findings:
        if f.fired and f.check in traced:
            rows = store.select(*traced[f.check], limit=1)
            f.trace = rows[0] if rows else None
    return findings


def _tools(store: TraceStore, findings: list[Finding], first: tuple[int, int], last: tuple[int, int], accuracy: str,
           error_share: float, copied_share: float, ex) -> None:
    """Multi-turn runs: the model dropping its tools (the reward is easier to earn without them), calls that
    fail (the model cannot use its tools), and right answers copied from a tool result with no words of the
    model's own around them (the tool did the task; the reward cannot tell)."""
    in_last = f"step BETWEEN {last[0]} AND {last[1]}"

    def rate(r: tuple[int, int]) -> float | None:
        return store.con.execute(f"SELECT avg((tool_calls > 0)::INT) FROM traces WHERE step BETWEEN {r[0]} AND "
                                 f"{r[1]} AND turns IS NOT NULL").fetchone()[0]

    r0, r1 = rate(first), rate(last)
    if r0 is not None and r1 is not None and first != last:
        dropped = r0 >= 0.2 and r1 <= r0 / 2
        findings.append(Finding(
            "tool_use_dropped", dropped, f"completions with a tool call {r0:.1%} -> {r1:.1%} (steps {first[0]}-"
            f"{first[1]} vs {last[0]}-{last[1]})", "from >= 20% to half or less (the rewards pay more without the "
            "tools: a format reward the tool path does not earn, say)",
            ex("tool_use_dropped", dropped, f"{in_last} AND tool_calls = 0")))
    calls, failed, using = store.con.execute(
        f"SELECT sum(tool_calls), sum(tool_errors), count(*) FILTER (WHERE tool_calls > 0) FROM traces "
        f"WHERE {in_last}").fetchone()
    if not calls:
        return
    share = failed / calls
    findings.append(Finding(
        "tool_errors", share >= error_share,
        f"{failed} of {calls} tool calls failed in steps {last[0]}-{last[1]} ({share:.1%}; calls per completion "
        f"{calls / max(1, store.count(in_last)):.2f})",
        f"failed share >= {error_share:.0%} (malformed calls, unknown tools, tools that raise or time out)",
        ex("tool_errors", share >= error_share, f"{in_last} AND tool_errors > 0")))
    if accuracy in store.components and using:
        right = f"{in_last} AND tool_calls > 0 AND {_q(accuracy)}.raw = 1"
        copied = (f"{right} AND length(reasoning) < 10 AND "
                  f"list_contains(tool_results, {_q(accuracy)}.info->>'extracted')")
        n_right, n_copied = store.count(right), store.count(copied)
        share = n_copied / n_right if n_right else 0.0
        findings.append(Finding(
            "tool_answer_copied", n_right > 0 and share >= copied_share,
            f"{n_copied} of {n_right} right answers that used tools copy a tool result with no reasoning "
            f"(steps {last[0]}-{last[1]})", f"share >= {copied_share:.0%}",
            ex("tool_answer_copied", n_right > 0 and share >= copied_share, copied)))


def _zero_spread(store: TraceStore, findings: list[Finding], traced: dict, share_limit: float) -> None:
    """The check over the totals (what the advantages are made of): groups whose completions all got the
    same total teach nothing under GRPO, and a step where every group did trains nothing at all."""
    rows = store.con.execute(
        'SELECT run_id, step, "group", max(total) = min(total) AS flat FROM traces '
        'WHERE "group" IS NOT NULL AND NOT total_missing GROUP BY 1, 2, 3 HAVING count(*) > 1').fetchall()
    if not rows:
        return
    flat = [r for r in rows if r[3]]
    steps: dict[tuple, list[bool]] = {}
    for run_id, step, _, is_flat in rows:
        steps.setdefault((run_id, step), []).append(is_flat)
    dead = sorted(k[1] for k, v in steps.items() if all(v))
    share = len(flat) / len(rows)
    findings.append(Finding(
        "zero_spread", share >= share_limit,
        f"the total reward is the same for every completion in {len(flat)} of {len(rows)} groups ({share:.1%}); "
        f"{len(dead)} of {len(steps)} steps had no group with a spread" + (f" (e.g. step {dead[0]})" if dead else ""),
        f"flat in >= {share_limit:.0%} of groups (every advantage 0: nothing to learn)"))
    if flat:
        run_id, step, group, _ = flat[-1]
        traced["zero_spread"] = (f"run_id = {_lit(run_id)} AND step = {step} AND \"group\" = {group}", "sample")

def _repetition(store: TraceStore, r: tuple[int, int], k: int = 0) -> tuple[float, list[dict]]:
    """Mean share of repeated word 3-grams over up to 400 sampled completions of the step range, and
    the k most repetitive of them (scored once, with our own repetition reward)."""
    from rewards import build_reward

    rows = store.con.execute(
        f"SELECT completion, step, prompt_id FROM traces WHERE step BETWEEN {r[0]} AND {r[1]} "
        f"ORDER BY hash(source, lineno) LIMIT 400").fetchall()
    if not rows:
        return 0.0, []
    texts = [x[0] or "" for x in rows]
    scores = build_reward("repetition", {"n": 3, "max_penalty": -1.0})(texts, texts)
    worst = sorted(zip(scores, range(len(rows))))[:k]
    return -sum(scores) / len(texts), [{"repeated_share": -s, "step": rows[i][1], "prompt_id": rows[i][2],
                                        "completion": texts[i]} for s, i in worst]


def parse_selection(text: str) -> tuple[str, tuple[int, int] | None]:
    """'RUN', 'RUN@12' or 'RUN@10-20' -> (path, step range or None)."""
    m = re.fullmatch(r"(.+?)(?:@(\d+)(?:-(\d+))?)?", text)
    path, a, b = m.group(1), m.group(2), m.group(3)
    if a is None:
        return path, None
    return path, (int(a), int(b if b is not None else a))


def compare(sel_a: str, sel_b: str, accuracy: str = "correctness", examples: int = 5) -> dict:
    """Per prompt: correct (mean accuracy >= 0.5) in selection A vs B; which prompts flipped each way."""
    sels = [parse_selection(sel) for sel in (sel_a, sel_b)]
    per: list[dict[int, tuple[float, str]]] = [{}, {}]
    for path in dict.fromkeys(p for p, _ in sels):  # a file named twice (two step ranges) is loaded once
        with TraceStore([path]) as store:
            if accuracy not in store.components:
                raise AuditError(f"{path}: no {accuracy!r} component in the traces; have {store.components}")
            for i, (p, steps) in enumerate(sels):
                if p != path:
                    continue
                where = f"step BETWEEN {steps[0]} AND {steps[1]}" if steps else "TRUE"
                rows = store.con.execute(
                    f"SELECT prompt_id, avg({_q(accuracy)}.raw), any_value(prompt) FROM traces WHERE {where} "
                    f"AND {_q(accuracy)}.raw IS NOT NULL GROUP BY prompt_id").fetchall()
                per[i] = {pid: (acc, prompt) for pid, acc, prompt in rows}
    common = sorted(set(per[0]) & set(per[1]))
    to_wrong = [p for p in common if per[0][p][0] >= 0.5 > per[1][p][0]]
    to_right = [p for p in common if per[0][p][0] < 0.5 <= per[1][p][0]]

    def show(ids):
        return [{"prompt_id": p, "a": per[0][p][0], "b": per[1][p][0], "prompt": per[0][p][1]}
                for p in ids[:examples]]

    return {"a": sel_a, "b": sel_b, "prompts_in_both": len(common),
            "correct_a": sum(per[0][p][0] >= 0.5 for p in common),
            "correct_b": sum(per[1][p][0] >= 0.5 for p in common),
            "correct_to_wrong": len(to_wrong), "wrong_to_correct": len(to_right),
            "examples_correct_to_wrong": show(to_wrong), "examples_wrong_to_correct": show(to_right)}


def export(rows: list[dict], path: str | Path) -> None:
    """Write rows to a .jsonl or .csv file (by its extension)."""
    p = Path(path)
    if p.suffix == ".jsonl":
        p.write_text("".join(json.dumps(r, default=str, ensure_ascii=False) + "\n" for r in rows))
    elif p.suffix == ".csv":
        import csv

        with open(p, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]) if rows else ["step"])
            w.writeheader()
            for r in rows:
                w.writerow({k: json.dumps(v, default=str) if isinstance(v, (dict, list)) else v
                            for k, v in r.items()})
    else:
        raise AuditError(f"--export {p}: use a .jsonl or .csv file name")
