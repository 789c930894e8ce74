"""Format rewards: the `<think>…</think><answer>…</answer>` structure, whole (format) or per tag (tag_count).

Deliberately left out: custom tag names per data set beyond the `think`/`answer` parameters.
"""

from __future__ import annotations

import re
from typing import Any

from .base import Reward, RewardError, Score, register


def _tags(think: str, answer: str) -> list[str]:
    return [f"<{think}>", f"</{think}>", f"<{answer}>", f"</{answer}>"]


@register("format")
class Format(Reward):
    """1.0 when the completion has the reasoning structure, else 0.0.

    strict: the whole completion is `<think>…</think>` then `<answer>…</answer>`, whitespace between,
    each tag exactly once, nothing before or after (text after the answer fails). lenient: a
    `<think>…</think>` block followed somewhere later by an `<answer>…</answer>` block.

    >>> Format()(["Q"], ["<think>\\n1 + 1 = 2\\n</think>\\n<answer>2</answer>"])
    [1.0]
    >>> Format()(["Q"], ["<think>x</think><answer>2</answer> and more"])
    [0.0]
    >>> Format(mode="lenient")(["Q"], ["Sure! <think>x</think> so <answer>2</answer> done"])
    [1.0]
    """

    def __init__(self, mode: str = "strict", think: str = "think", answer: str = "answer"):
        if mode not in ("strict", "lenient"):
            raise RewardError(f"format: mode must be 'strict' or 'lenient', got {mode!r}")
        self.mode, self.tags = mode, _tags(think, answer)
        t0, t1, a0, a1 = map(re.escape, self.tags)
        self.strict = re.compile(rf"\s*{t0}(.*?){t1}\s*{a0}(.*?){a1}\s*", re.S)
        self.lenient = re.compile(rf"{t0}(.*?){t1}.*?{a0}(.*?){a1}", re.S)

    def score(self, prompt: str, completion: str, row: dict[str, Any]) -> Score:
        counts = {t: completion.count(t) for t in self.tags}
        info: dict[str, Any] = {"mode": self.mode, "tag_counts": counts}
        if self.mode == "strict":
            m = self.strict.fullmatch(completion)
            if m and all(c == 1 for c in counts.values()):
                return Score(1.0, info)
            tail = re.search(re.escape(self.tags[3]) + r"(.*)\Z", completion, re.S)
            info["reason"] = ("text after the answer" if tail and tail.group(1).strip() and
                              all(c == 1 for c in counts.values()) else "structure not matched")
            return Score(0.0, info)
        m = self.lenient.search(completion)
        if not m:
            info["reason"] = "no think block followed by an answer block"
        return Score(1.0 if m else 0.0, info)


@register("tag_count")
class TagCount(Reward):
    """0.25 for each of the four tags that occurs exactly once (partial credit while format is learnt).

    >>> TagCount()(["Q"] * 3, ["<think>x</think><answer>2</answer>", "<think>x<answer>2", ""])
    [1.0, 0.5, 0.0]
    """

    def __init__(self, think: str = "think", answer: str = "answer"):
        self.tags = _tags(think, answer)

    def score(self, prompt: str, completion: str, row: dict[str, Any]) -> Score:
        counts = {t: completion.count(t) for t in self.tags}
        ok = [t for t, c in counts.items() if c == 1]
        return Score(0.25 * len(ok), {"tag_counts": counts, "well_formed": ok})
