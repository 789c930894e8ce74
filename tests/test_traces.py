"""The trace contract: one definition gives docs/traces.md's schema table, the audit's columns and the
records; a step's metrics from its records against hand-computed values."""

import pytest

from docuchat_rl.data import Example
from docuchat_rl.tools.audit import BASE_COLUMNS
from docuchat_rl.traces import ALGORITHM_FIELDS, TraceRecord, columns, completion_fields, schema_table, step_metrics
from rewards import CompositeReward

from .conftest import ROOT


def test_the_documented_schema_table_is_the_one_the_trace_module_gives():
    assert schema_table() in (ROOT / "docs" / "traces.md").read_text()


def test_the_audit_reads_every_scalar_field_a_trace_line_has():
    assert BASE_COLUMNS == columns()
    assert {"total_missing", "advantage", "value"} <= set(BASE_COLUMNS) and "rewards" not in BASE_COLUMNS


def _records():
    comp = CompositeReward([{"name": "correctness", "weight": 1.0}, {"name": "format", "weight": 0.5}])
    texts = ["<think>2+2=4</think><answer>4</answer>", "<answer>5</answer>", "no answer at all"]
    scored = comp(["Q"] * 3, texts, answer=["4", "4", "4"]).records
    ex = Example(7, "Q", "4")
    return [TraceRecord(run_id="r", step=1, group=0, used=True, algorithm={"advantage": 0.5 - i},
                        **completion_fields(ex, i, t, 10 * (i + 1), i == 2, rec))
            for i, (t, rec) in enumerate(zip(texts, scored))]


def test_a_record_flattens_the_algorithms_fields_into_its_json_line():
    line = _records()[0].to_json()
    assert line["advantage"] == 0.5 and "algorithm" not in line and "value" not in line
    assert set(line) == {f for f in columns() if f != "value"} | {"rewards"}
    fmt = line["rewards"]["format"]
    assert (fmt["raw"], fmt["weight"], fmt["weighted"], fmt["error"]) == (1.0, 0.5, 0.5, None)
    assert set(ALGORITHM_FIELDS) == {"advantage", "value"}


def test_step_metrics_against_hand_computed_values():
    m = step_metrics(_records(), ["correctness", "format"], "correctness")
    # correctness 1, 0, 0 (the third has no answer: 0); format 1, 0, 0; totals 1.5, 0, 0
    assert m["reward/mean"] == pytest.approx(0.5) and m["reward/std"] == pytest.approx(0.5 ** 0.5)
    assert m["rewards/correctness/mean"] == pytest.approx(1 / 3) == m["accuracy"]
    assert m["rewards/format/errors"] == 0
    assert (m["completion_len/mean"], m["completion_len/max"]) == (20.0, 30)
    assert m["truncated_frac"] == pytest.approx(1 / 3) and m["reward_missing"] == 0
