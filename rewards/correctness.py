"""Correctness: extract the final answer and compare it with the gold answer by math-verify.

Deliberately left out: multiple-choice letter matching and code execution; those are separate rewards.
"""

from __future__ import annotations

import logging
import re
import unicodedata
from functools import lru_cache
from typing import Any

from .base import Reward, RewardError, Score, register

logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns on every call with timeouts off

_ANSWER_TAG = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.S)  # innermost: no <answer> inside
_HASHES = re.compile(r"####\s*([^\n]+)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")


def _boxed(text: str) -> str | None:
    """Content of the last \\boxed{...}, braces balanced (a regex cannot balance nested braces)."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    i, depth = start + len("\\boxed{"), 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def _last_match(pattern: re.Pattern, text: str) -> str | None:
    found = pattern.findall(text)
    return found[-1].strip() if found else None


EXTRACTORS = {
    "answer_tag": lambda t: _last_match(_ANSWER_TAG, t),
    "boxed": _boxed,
    "hashes": lambda t: _last_match(_HASHES, t),
    "last_number": lambda t: _last_match(_NUMBER, t),
}


def gold_of(answer: Any) -> str | None:
    """The gold final answer, the one rule for training data, evaluation and this reward: the text after
    the last '####' of a GSM8K-style answer with thousands separators removed, else the stripped text;
    None when empty.

    >>> gold_of("Natalia sold 48/2 = <<48/2=24>>24 clips.\\n#### 72"), gold_of("#### 1,000"), gold_of("Paris")
    ('72', '1000', 'Paris')
    >>> gold_of("  "), gold_of(None)
    (None, None)
    """
    if answer is None:
        return None
    text = str(answer)
    if "####" in text:
        text = _THOUSANDS.sub("", text.split("####")[-1])
    text = text.strip()
    return text or None


def normalise(text: str) -> str:
    """Case-, accent-, space- and punctuation-insensitive form for non-math answers."""
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode() or text
    text = re.sub(r"[^\w\s]", " ", text.casefold())
    return " ".join(text.split())


_LATEX = re.compile(r"[\\^_{}]")  # a backslash command, a power, a subscript or braces: LaTeX, not plain math


@lru_cache(maxsize=4096)
def _parse(text: str) -> tuple:
    from math_verify import parse

    text = _THOUSANDS.sub("", text)
    if "$" not in text and _LATEX.search(text):
        # math-verify reads LaTeX only between delimiters: bare "2^{3}" parses as 2 and "2 \cdot 4" as 4
        text = f"${text}$"
    # Timeouts off: math-verify's use signal.alarm, which fails outside the main thread; the
    # composite reward enforces its own per-call time limit instead.
    return tuple(parse(text, parsing_timeout=None))


def equivalent(gold: str, pred: str) -> tuple[bool, str]:
    """(equal?, method): math-verify when the gold parses as math, else normalised string match."""
    from math_verify import verify

    g = _parse(gold)
    if g:
        p = _parse(pred)
        return bool(p) and bool(verify(list(g), list(p), timeout_seconds=None)), "math_verify"
    return normalise(gold) == normalise(pred) and bool(normalise(gold)), "string"


@register("correctness")
class Correctness(Reward):
    """1.0 when the extracted final answer equals the gold answer, else 0.0; None when there is no gold.

    Extractors are tried in order: the last `<answer>…</answer>`, the last `\\boxed{}`, `#### N`,
    the last number. Comparison uses math-verify (0.5 = 1/2 = \\frac{1}{2}, 1,000 = 1000), falling
    back to a normalised string match when the gold is not math.

    >>> r = Correctness()
    >>> r(["Q"], ["<think>2+2=4</think><answer>4</answer>"], answer=["#### 4"])
    [1.0]
    >>> r(["Q"], ["<answer>\\\\frac{1}{2}</answer>"], answer=["0.5"])
    [1.0]
    >>> r(["Q"], ["<answer>141</answer>"], answer=["14"])
    [0.0]
    >>> r(["Q"], ["anything"], answer=[""])
    [None]
    """

    def __init__(self, extractors: list[str] | None = None, answer_key: str = "answer"):
        self.extractors = list(extractors or EXTRACTORS)
        unknown = [e for e in self.extractors if e not in EXTRACTORS]
        if unknown:
            raise RewardError(f"correctness: unknown extractors {unknown}; valid: {list(EXTRACTORS)}")
        self.answer_key = answer_key

    def extract(self, completion: str) -> tuple[str | None, str | None]:
        """(the final answer, the extractor that found it) from the first configured extractor that matches."""
        for name in self.extractors:
            found = EXTRACTORS[name](completion)
            if found:
                return found, name
        return None, None

    def score(self, prompt: str, completion: str, row: dict[str, Any]) -> Score:
        if self.answer_key not in row:
            raise RewardError(f"correctness needs the column {self.answer_key!r}; got {sorted(row)}")
        gold = gold_of(row[self.answer_key])
        if gold is None:
            return Score(None, {"gold": None, "reason": "no gold answer"})
        pred, how = self.extract(completion)
        if pred is None:
            return Score(0.0, {"gold": gold, "extracted": None, "reason": "no answer found"})
        ok, method = equivalent(gold, pred)
        return Score(float(ok), {"gold": gold, "extracted": pred, "extractor": how, "method": method})
