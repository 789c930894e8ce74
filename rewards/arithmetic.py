"""Arithmetic: check each calculation a completion writes out ("a + b = c"), as a calculator would.

A process reward for worked arithmetic: the share of the completion's equations whose result is right.
GSM8K's own worked answers carry the same check as calculator annotations (`<<48/2=24>>`). It is where a
small model goes wrong: of the equations SmolLM2-135M-Instruct wrote on the embedded task, 37% were wrong
(subtractions 79%), so a reward on the final answer alone reaches few of its completions.

`gold_steps` is partial credit on multi-step problems: the share of the gold answer's intermediate results
(its `<<a op b=c>>` annotations) that the completion reaches with a right equation of its own. On the
embedded 2-4 operation task SmolLM2-135M's groups rarely hold a fully right completion, so correctness alone
gives GRPO no signal there (issue 44); a completion that gets the first two of three steps right does.

Deliberately left out: chains (`a + b + c = d`), parentheses, percentages and units; an equation it cannot
read is not counted. `arithmetic` says nothing about whether the right quantities were combined: that is
correctness's job, and a completion can score 1 here with trivially true equations, so weigh it low
beside correctness. `gold_steps` does not check the order of the steps, nor which quantities an equation
combined (only the value it reached); a gold answer without annotations gives None.
"""

from __future__ import annotations

import re
from typing import Any

from .base import Reward, RewardError, Score, register

_NUM = r"-?\d[\d,]*(?:\.\d+)?"
_EQUATION = re.compile(rf"(?<![\d.])({_NUM})\s*([-+*/x×÷])\s*({_NUM})\s*=\s*({_NUM})(?!\.?\d)")
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b, "x": lambda a, b: a * b,
        "×": lambda a, b: a * b, "/": lambda a, b: a / b if b else None, "÷": lambda a, b: a / b if b else None}


def _value(text: str) -> float:
    return float(text.replace(",", ""))


def _same(x: float, y: float, tolerance: float) -> bool:
    return abs(x - y) <= tolerance * max(1.0, abs(x))


def _equations(completion: str, tolerance: float) -> list[tuple[str, float, bool]]:
    """Each `a op b = c` the completion writes: (its text, the value it claims, whether a op b is that value)."""
    found = []
    for a, op, b, c in _EQUATION.findall(completion):
        value = _OPS[op](_value(a), _value(b))
        found.append((f"{a} {op} {b} = {c}", _value(c), value is not None and _same(value, _value(c), tolerance)))
    return found


@register("arithmetic")
class Arithmetic(Reward):
    """The share of the completion's `a op b = c` equations (op: + - * x × / ÷) whose result is right
    (to `tolerance`, relative); None when it writes none (nothing to check).

    >>> Arithmetic()(["Q"] * 3, ["5 + 3 = 8\\n8 * 2 = 16", "5 + 3 = 9\\n9 x 2 = 18", "So the answer is 8."])
    [1.0, 0.5, None]
    """

    def __init__(self, tolerance: float = 1e-6):
        if not 0 <= tolerance < 1:
            raise RewardError(f"arithmetic: tolerance must be in [0, 1), got {tolerance!r}")
        self.tolerance = float(tolerance)

    def score(self, prompt: str, completion: str, row: dict[str, Any]) -> Score:
        checked = _equations(completion, self.tolerance)
        if not checked:
            return Score(None, {"equations": 0, "reason": "no equation to check"})
        wrong = [text for text, _, ok in checked if not ok]
        return Score((len(checked) - len(wrong)) / len(checked), {"equations": len(checked), "wrong": wrong[:5]})


_ANNOTATION = re.compile(rf"<<[^<>=]*=\s*({_NUM})\s*>>")


@register("gold_steps")
class GoldSteps(Reward):
    """The share of the gold answer's intermediate results (GSM8K's `<<a op b=c>>` annotations, in the column
    `answer_key`: by default `answer_text`, the answer column as the data set wrote it) that the completion
    reaches as the result of one of its own right `a op b = c` equations (each of its results counts for one
    gold step at most); None when the gold has no annotations.

    >>> r = GoldSteps()
    >>> gold = "4 + 3 = <<4+3=7>>7\\n7 * 2 = <<7*2=14>>14\\n14 - 1 = <<14-1=13>>13\\n#### 13"
    >>> r(["Q"] * 4, ["4 + 3 = 7\\n7 * 2 = 14\\n14 - 1 = 12", "4 + 3 = 7\\n#### 13", "7 + 0 = 8", "#### 13"],
    ...   answer_text=[gold] * 4)
    [0.6666666666666666, 0.3333333333333333, 0.0, 0.0]
    >>> r(["Q"], ["anything"], answer_text=["#### 13"])
    [None]
    """

    def __init__(self, answer_key: str = "answer_text", tolerance: float = 1e-6):
        if not 0 <= tolerance < 1:
            raise RewardError(f"gold_steps: tolerance must be in [0, 1), got {tolerance!r}")
        self.answer_key = answer_key
        self.tolerance = float(tolerance)

    def score(self, prompt: str, completion: str, row: dict[str, Any]) -> Score:
        if self.answer_key not in row:
            raise RewardError(f"gold_steps needs the column {self.answer_key!r}; got {sorted(row)}")
        gold = [_value(c) for c in _ANNOTATION.findall(str(row[self.answer_key] or ""))]
        if not gold:
            return Score(None, {"gold_steps": 0, "reason": "the gold answer has no <<a op b=c>> annotations"})
        reached = [value for _, value, ok in _equations(completion, self.tolerance) if ok]  # right results
        hit, missed = 0, []
        for g in gold:
            at = next((i for i, v in enumerate(reached) if _same(g, v, self.tolerance)), None)
            if at is None:
                missed.append(g)
            else:
                hit += 1
                del reached[at]
        return Score(hit / len(gold), {"gold_steps": len(gold), "reached": hit, "missed": missed[:5]})
