"""Length shaping: cosine-scaled by correctness ("Demystifying Long CoT", arXiv 2502.03373) or DAPO's
soft overlong punishment (arXiv 2503.14476).

Lengths are in tokens from the `completion_tokens` column (our trainer passes it) or TRL's
`completion_ids`; `unit: chars` uses characters instead, for callers that have no token counts. Either unit
means what the model wrote: in a multi-turn completion, every assistant turn and no tool result (tokens: the
`model_tokens` column; characters: the assistant messages' text).

Deliberately left out: Kimi 1.5's group-relative length reward (it needs the whole group at once).
"""

from __future__ import annotations

import math
from typing import Any

from .base import Reward, RewardError, Score, register, text_of
from .correctness import Correctness


def own_chars(completion: Any) -> int:
    """The characters the model wrote: a text's, or a conversation's assistant messages' (tool results out).

    >>> own_chars([{"role": "assistant", "content": "<tool_call>x</tool_call>"}, {"role": "tool", "content": "4" * 50},
    ...            {"role": "assistant", "content": "#### 4"}])
    30
    """
    if isinstance(completion, list):
        return sum(len(str(m.get("content", ""))) for m in completion if isinstance(m, dict)
                   and m.get("role") == "assistant")
    return len(text_of(completion))


def completion_length(completion: str, row: dict[str, Any], unit: str) -> int:
    """A completion's length in characters or tokens (the trainer's count when it is given), of what the model
    wrote (a multi-turn completion's tool results out)."""
    if unit == "chars":
        return int(row["own_chars"]) if row.get("own_chars") is not None else len(completion)
    if row.get("model_tokens") is not None:
        return int(row["model_tokens"])
    if row.get("completion_tokens") is not None:
        return int(row["completion_tokens"])
    if row.get("completion_ids") is not None:
        return len(row["completion_ids"])
    raise RewardError("length (unit: tokens) needs a 'completion_tokens' or 'completion_ids' column; "
                      "set params.unit: chars to measure characters instead")


@register("length")
class Length(Reward):
    """Length shaping in [-1, 1] (cosine) or [-1, 0] (overlong).

    shape cosine: correct answers earn max_correct at length 0 falling to min_correct at max_len; wrong
    answers earn min_wrong at length 0 rising to max_wrong at max_len (short wrong answers are punished
    most). shape overlong: 0 up to max_len - cache, then linearly down to -1 at max_len, -1 beyond.

    >>> cos = Length(shape="cosine", max_len=100)
    >>> cos(["Q"], ["<answer>4</answer>"], answer=["4"], completion_tokens=[0])
    [1.0]
    >>> cos(["Q"], ["<answer>5</answer>"], answer=["4"], completion_tokens=[100])
    [-0.5]
    >>> Length(shape="overlong", max_len=100, cache=20)(["Q"] * 3, ["a", "b", "c"], completion_tokens=[80, 90, 120])
    [0.0, -0.5, -1.0]
    """

    low, high = -1.0, 1.0

    def __init__(self, shape: str = "cosine", max_len: int = 512, cache: int = 64, unit: str = "tokens",
                 min_correct: float = 0.5, max_correct: float = 1.0, min_wrong: float = -1.0,
                 max_wrong: float = -0.5, correctness: dict[str, Any] | None = None):
        if shape not in ("cosine", "overlong"):
            raise RewardError(f"length: shape must be 'cosine' or 'overlong', got {shape!r}")
        if unit not in ("tokens", "chars"):
            raise RewardError(f"length: unit must be 'tokens' or 'chars', got {unit!r}")
        if max_len < 1 or not 0 < cache <= max_len:
            raise RewardError(f"length: need max_len >= 1 and 0 < cache <= max_len (got {max_len}, {cache})")
        self.shape, self.max_len, self.cache, self.unit = shape, int(max_len), int(cache), unit
        self.values = (min_correct, max_correct, min_wrong, max_wrong)
        self.correct = Correctness(**(correctness or {})) if shape == "cosine" else None

    def explain(self, prompts: list, completions: list, **columns: Any) -> list[Score]:
        if self.unit == "chars":  # (the whole conversation's own text: the base class hands score its last message)
            columns = {**columns, "own_chars": [own_chars(c) for c in completions]}
        return super().explain(prompts, completions, **columns)

    def score(self, prompt: str, completion: str, row: dict[str, Any]) -> Score:
        n = completion_length(completion, row, self.unit)
        if self.shape == "overlong":
            soft = self.max_len - self.cache
            value = 0.0 if n <= soft else (-1.0 if n > self.max_len else (soft - n) / self.cache)
            return Score(value, {"length": n, "max_len": self.max_len, "cache": self.cache})
        judged = self.correct.score(prompt, completion, row)
        if judged.value is None:
            return Score(None, {"length": n, "reason": "correctness not applicable"})
        lo_c, hi_c, lo_w, hi_w = self.values
        lo, hi = (lo_c, hi_c) if judged.value == 1.0 else (hi_w, lo_w)  # wrong: swapped, longer is better
        cosine = math.cos(min(n, self.max_len) / self.max_len * math.pi)
        value = lo + 0.5 * (hi - lo) * (1.0 + cosine)
        return Score(value, {"length": n, "correct": judged.value == 1.0, "max_len": self.max_len})
