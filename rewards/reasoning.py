"""Reasoning steps: count explicit step markers, saturating at a configured count.

Deliberately left out: judging whether the steps are valid; that is correctness's job.
"""

from __future__ import annotations

import re
from typing import Any

from .base import Reward, Score, register

DEFAULT_MARKERS = [
    r"(?im)^\s*step\s*\d+\s*[:.)]",  # "Step 1:"
    r"(?m)^\s*\d+[.)]\s+\S",  # "1. ..." numbered lines
    r"(?m)^\s*[-*•]\s+\S",  # bullet points
    r"\b(?:First|Second|Third|Next|Then|Finally|Therefore|Thus|So),",  # transitions
    r"(?m)^[^=\n]*\d[^=\n]*=\s*-?[\d.,/]+\s*$",  # an equation with a numeric result per line
]


@register("reasoning_steps")
class ReasoningSteps(Reward):
    """min(1, markers / saturate): numbered steps, transitions ("First,", "Next,"…), equations per line.

    Counted inside `<think>` when present, else in the whole completion.

    >>> r = ReasoningSteps(saturate=3)
    >>> r(["Q"], ["<think>\\n4 + 3 = 7\\n7 * 2 = 14\\n14 - 1 = 13\\n</think>"])
    [1.0]
    >>> r(["Q"], ["Step 1: add. Nothing else."])
    [0.3333333333333333]
    """

    def __init__(self, saturate: int = 3, markers: list[str] | None = None):
        self.saturate = max(1, int(saturate))
        self.patterns = [re.compile(p) for p in (markers or DEFAULT_MARKERS)]

    def score(self, prompt: str, completion: str, row: dict[str, Any]) -> Score:
        m = re.search(r"<think>(.*?)(?:</think>|\Z)", completion, re.S)
        text = m.group(1) if m else completion
        lines: set[int] = set()
        found = []
        for p in self.patterns:
            for hit in p.finditer(text):
                line = text.count("\n", 0, hit.start())
                if line not in lines:  # one marker per line at most
                    lines.add(line)
                    found.append(hit.group(0).strip()[:40])
        return Score(min(1.0, len(found) / self.saturate), {"count": len(found), "markers": found[:10]})
