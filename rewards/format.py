"""Format rewards: the `<think>…</think><answer>…</answer>` structure, whole (format) or per tag (tag_count),
or GSM8K's own final-answer line `#### N` (format, mode hashes: what a small instruct model can reach).

Deliberately left out: custom tag names per data set beyond the `think`/`answer` parameters.
"""

from __future__ import annotations

import re
from typing import Any

from .base import Reward, RewardError, Score, register


def _tags(think: str, answer: str) -> list[str]:
    return [f"<{think}>", f"</{think}>", f"<{answer}>", f"</{answer}>"]


_FINAL_LINE = re.compile(r"(?:\A|\n)[ \t]*####[ \t]*(-?[\d.,/]*\d)[ \t.]*\Z")  # the last line: #### N
_NUMBERED_MARK = re.compile(r"####[ \t]*-?\d")  # a marker with a number after it (not the prompt's "#### N")


@register("format")
class Format(Reward):
    """1.0 when the completion has the answer format, else `partial` when it shows the format's answer
    marker in the wrong shape, else 0.0.

    strict: the whole completion is `<think>…</think>` then `<answer>…</answer>`, whitespace between,
    each tag exactly once, nothing before or after (text after the answer fails). lenient: a
    `<think>…</think>` block followed somewhere later by an `<answer>…</answer>` block. hashes: GSM8K's
    own format, any working and then a last line `#### N` (a number), the marker `####` exactly once.
    `partial` (0 by default) is the credit for the format's answer marker in the wrong shape (`<answer>`
    in the tag modes; in hashes mode one `####` followed by a number, so that neither copying an
    instruction's literal "#### N" nor a list of "#### N" lines earns anything): a model that writes
    `#### 7` once and goes on gets a signal to stop there.
    Evaluation's format rate counts a score of 1 only.

    >>> Format()(["Q"], ["<think>\\n1 + 1 = 2\\n</think>\\n<answer>2</answer>"])
    [1.0]
    >>> Format()(["Q"], ["<think>x</think><answer>2</answer> and more"])
    [0.0]
    >>> Format(mode="lenient")(["Q"], ["Sure! <think>x</think> so <answer>2</answer> done"])
    [1.0]
    >>> Format(mode="hashes", partial=0.5)(["Q"] * 4, ["3 + 4 = 7\\n#### 7", "#### 7\\nSo 7.", "#### 7\\n#### 8", "#### N."])
    [1.0, 0.5, 0.0, 0.0]
    """

    def __init__(self, mode: str = "strict", think: str = "think", answer: str = "answer", partial: float = 0.0):
        if mode not in ("strict", "lenient", "hashes"):
            raise RewardError(f"format: mode must be 'strict', 'lenient' or 'hashes', got {mode!r}")
        if not 0.0 <= partial < 1.0:
            raise RewardError(f"format: partial must be in [0, 1), got {partial!r}")
        self.mode, self.tags, self.partial = mode, _tags(think, answer), float(partial)
        t0, t1, a0, a1 = map(re.escape, self.tags)
        self.strict = re.compile(rf"\s*{t0}(.*?){t1}\s*{a0}(.*?){a1}\s*", re.S)
        self.lenient = re.compile(rf"{t0}(.*?){t1}.*?{a0}(.*?){a1}", re.S)

    def score(self, prompt: str, completion: str, row: dict[str, Any]) -> Score:
        if self.mode == "hashes":
            return self._hashes(completion)
        counts = {t: completion.count(t) for t in self.tags}
        info: dict[str, Any] = {"mode": self.mode, "tag_counts": counts}
        if self.mode == "strict":
            m = self.strict.fullmatch(completion)
            if m and all(c == 1 for c in counts.values()):
                return Score(1.0, info)
            tail = re.search(re.escape(self.tags[3]) + r"(.*)\Z", completion, re.S)
            info["reason"] = ("text after the answer" if tail and tail.group(1).strip() and
                              all(c == 1 for c in counts.values()) else "structure not matched")
            return self._miss(info, counts[self.tags[2]] > 0)
        m = self.lenient.search(completion)
        if m:
            return Score(1.0, info)
        info["reason"] = "no think block followed by an answer block"
        return self._miss(info, counts[self.tags[2]] > 0)

    def _hashes(self, completion: str) -> Score:
        marks = completion.count("####")
        info: dict[str, Any] = {"mode": "hashes", "markers": marks}
        if marks == 1 and _FINAL_LINE.search(completion.rstrip()):
            return Score(1.0, info)
        info["reason"] = ("no #### line" if marks == 0 else "#### more than once" if marks > 1
                          else "#### N is not the last line")
        return self._miss(info, marks == 1 and bool(_NUMBERED_MARK.search(completion)))

    def _miss(self, info: dict[str, Any], marker: bool) -> Score:
        """The score of a completion without the format: `partial` when it shows the answer marker."""
        return Score(self.partial if marker else 0.0, info)


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
