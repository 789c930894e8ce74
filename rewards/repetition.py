"""Repetition: penalise repeated word n-grams (degenerate loops are a classic RL failure).

Deliberately left out: token-level n-grams (the reward stays tokenizer-free and pure Python).
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from .base import Reward, RewardError, Score, register

_WORD = re.compile(r"\w+|[^\w\s]", re.U)


@register("repetition")
class Repetition(Reward):
    """max_penalty * (share of word n-grams that repeat an earlier one); 0 when nothing repeats.

    The score lies in [max_penalty, 0]; texts shorter than n words score 0.

    >>> r = Repetition(n=2, max_penalty=-1.0)
    >>> r(["Q"], ["the cat sat on the mat"])
    [0.0]
    >>> r(["Q"], ["go go go go go"])
    [-0.75]
    """

    low, high = -1.0, 0.0

    def __init__(self, n: int = 3, max_penalty: float = -1.0):
        if n < 1:
            raise RewardError(f"repetition: n must be >= 1, got {n}")
        if max_penalty > 0:
            raise RewardError(f"repetition: max_penalty must be <= 0, got {max_penalty}")
        self.n, self.max_penalty = int(n), float(max_penalty)
        self.low = min(self.max_penalty, 0.0)

    def score(self, prompt: str, completion: str, row: dict[str, Any]) -> Score:
        words = _WORD.findall(completion.lower())
        grams = [tuple(words[i:i + self.n]) for i in range(len(words) - self.n + 1)]
        if not grams:
            return Score(0.0, {"ngrams": 0})
        counts = Counter(grams)
        repeated = len(grams) - len(counts)
        share = repeated / len(grams)
        top = [{"ngram": " ".join(g), "count": c} for g, c in counts.most_common(3) if c > 1]
        return Score(self.max_penalty * share + 0.0, {"ngrams": len(grams), "repeated_share": share, "top": top})
