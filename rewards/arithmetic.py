"""Arithmetic: check each calculation a completion writes out ("a + b = c"), as a calculator would.

A process reward for worked arithmetic: the share of the completion's equations whose result is right.
GSM8K's own worked answers carry the same check as calculator annotations (`<<48/2=24>>`). It is where a
small model goes wrong: of the equations SmolLM2-135M-Instruct wrote on the embedded task, 37% were wrong
(subtractions 79%), so a reward on the final answer alone reaches few of its completions.

Deliberately left out: chains (`a + b + c = d`), parentheses, percentages and units; an equation it cannot
read is not counted. It says nothing about whether the right quantities were combined: that is
correctness's job, and a completion can score 1 here with trivially true equations, so weigh it low
beside correctness.
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
        checked, wrong = 0, []
        for a, op, b, c in _EQUATION.findall(completion):
            value = _OPS[op](_value(a), _value(b))
            ok = value is not None and abs(value - _value(c)) <= self.tolerance * max(1.0, abs(value))
            checked += 1
            if not ok:
                wrong.append(f"{a} {op} {b} = {c}")
        if not checked:
            return Score(None, {"equations": 0, "reason": "no equation to check"})
        return Score((checked - len(wrong)) / checked, {"equations": checked, "wrong": wrong[:5]})
