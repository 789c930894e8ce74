"""Language consistency: the share of the reasoning written in the target language (DeepSeek-R1's reward).

Uses lingua (github.com/pemistahl/lingua-py): maintained, ships its n-gram models inside the wheel (no
download, runs offline), and is built for short and mixed-language text, which is what a chain of
thought is. Math, code, tags and numbers are removed before detection so equations never count against
the score.

Deliberately left out: per-word detection by default (single words are too short to identify reliably;
`unit: words` exists but is noisier) and script-only heuristics.
"""

from __future__ import annotations

import re
import threading
from functools import lru_cache
from typing import Any

from .base import Reward, RewardError, Score, register

DEFAULT_LANGUAGES = ["en", "zh", "es", "fr", "de", "ru", "ja", "ko", "pt", "it", "ar", "hi", "nl", "tr",
                     "pl", "vi", "id", "sv", "uk", "fa"]
_STRIP = [
    re.compile(r"```.*?(```|\Z)", re.S),  # fenced code
    re.compile(r"`[^`\n]*`"),  # inline code
    re.compile(r"\$\$.*?\$\$|\$[^$\n]*\$", re.S),  # LaTeX $…$ and $$…$$
    re.compile(r"\\\(.*?\\\)|\\\[.*?\\\]", re.S),  # \( … \) and \[ … \]
    re.compile(r"</?\w+>"),  # tags such as <think>
    re.compile(r"\S*[\d=+*/^<>\\_{}|]\S*"),  # tokens holding digits or operators: numbers, equations
]
_SENTENCE = re.compile(r"[^.!?。！？\n]+[.!?。！？]*")
_LETTER = re.compile(r"[^\W\d_]", re.U)
_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af]")  # kana, Han, hangul
_lock = threading.Lock()


@lru_cache(maxsize=4)
def detector(codes: tuple[str, ...]):
    """One lingua detector per language set, built once per process (lazy models, ~0.1 s)."""
    from lingua import IsoCode639_1, Language, LanguageDetectorBuilder

    langs = []
    for c in codes:
        try:
            langs.append(Language.from_iso_code_639_1(getattr(IsoCode639_1, c.upper())))
        except AttributeError:
            raise RewardError(f"language: unknown ISO 639-1 code {c!r}") from None
    if len(langs) < 2:
        raise RewardError("language: give at least two candidate languages")
    return LanguageDetectorBuilder.from_languages(*langs).build()


def strip_non_language(text: str) -> str:
    """Text with code, math, tags and number/operator tokens removed."""
    for pattern in _STRIP:
        text = pattern.sub(" ", text)
    return text


@register("language")
class LanguageConsistency(Reward):
    """Share (by letters) of the reasoning's sentences detected as the target language, in [0, 1].

    `target` is an ISO 639-1 code, or "auto" to use the prompt's detected language. Only `<think>` is
    scored when present (`scope: think`), else the whole completion. Sentences with fewer than
    `min_letters` letters are skipped (too short to identify; a Han, kana or hangul character counts 3),
    and the score is None when none is left (nothing to judge, e.g. pure equations).

    >>> r = LanguageConsistency(target="en")
    >>> r(["Q"], ["<think>First we add the apples. Then we count them again.</think>"])
    [1.0]
    >>> r(["Q"], ["<think>First we add the apples. Ensuite nous comptons toutes les pommes.</think>"])[0] < 0.7
    True
    >>> r(["Q"], ["<think>3 + 4 = 7</think><answer>7</answer>"])
    [None]
    """

    def __init__(self, target: str = "en", unit: str = "sentences", scope: str = "think",
                 min_letters: int = 12, languages: list[str] | None = None):
        if unit not in ("sentences", "words"):
            raise RewardError(f"language: unit must be 'sentences' or 'words', got {unit!r}")
        if scope not in ("think", "all"):
            raise RewardError(f"language: scope must be 'think' or 'all', got {scope!r}")
        self.codes = tuple(dict.fromkeys([c.lower() for c in (languages or DEFAULT_LANGUAGES)]))
        self.target = target.lower()
        if self.target != "auto" and self.target not in self.codes:
            self.codes += (self.target,)
        self.unit, self.scope, self.min_letters = unit, scope, int(min_letters)

    def _detect(self, text: str) -> str | None:
        with _lock:  # lingua's lazy model loading is not documented as thread-safe
            lang = detector(self.codes).detect_language_of(text)
        return lang.iso_code_639_1.name.lower() if lang else None

    def _units(self, text: str) -> list[str]:
        if self.unit == "words":
            return text.split()
        return [s.strip() for s in _SENTENCE.findall(text) if s.strip()]

    def score(self, prompt: str, completion: str, row: dict[str, Any]) -> Score:
        target = self.target
        if target == "auto":
            target = self._detect(strip_non_language(prompt)) or "en"
        text = completion
        if self.scope == "think":
            m = re.search(r"<think>(.*?)(?:</think>|\Z)", completion, re.S)
            text = m.group(1) if m else completion
        letters: dict[str, int] = {}
        for unit in self._units(strip_non_language(text)):
            n = len(_LETTER.findall(unit))
            # a logographic character carries about a word: it counts 3 towards the minimum
            if n + 2 * len(_CJK.findall(unit)) < (self.min_letters if self.unit == "sentences" else 1):
                continue
            lang = self._detect(unit) or "unknown"
            letters[lang] = letters.get(lang, 0) + n
        total = sum(letters.values())
        if total == 0:
            return Score(None, {"target": target, "reason": "no natural-language text to judge"})
        share = {k: round(v / total, 4) for k, v in sorted(letters.items(), key=lambda kv: -kv[1])}
        return Score(letters.get(target, 0) / total, {"target": target, "letters": total, "detected": share})
