"""Deterministic GSM8K-style multi-step arithmetic word problems: the embedded default task.

Each problem follows one quantity through 2-4 operations (add, subtract, multiply, exact divide) and is
written in GSM8K's own format: ``question`` plus an ``answer`` whose steps carry calculator annotations
``<<a+b=c>>`` and end in ``#### N``, so the loader that reads the real GSM8K reads this too.

Deliberately left out: fractions, percentages, units conversion and distractor sentences. The task has to
be learnable by a few-million-parameter model on a CPU in minutes; the real GSM8K is one config away.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass
from pathlib import Path

NAMES = ["Ava", "Ben", "Cara", "Dan", "Eli", "Fay", "Gus", "Hana", "Ivan", "Jade", "Kai", "Lena",
         "Milo", "Nora", "Omar", "Pia", "Quinn", "Rosa", "Sam", "Tara", "Uma", "Vic", "Wes", "Zoe"]
ITEMS = ["apples", "marbles", "stickers", "books", "coins", "pencils", "cookies", "shells", "cards",
         "stamps", "beads", "eggs", "toys", "flowers", "candies", "rocks"]

# One phrase per operation kind; {n} is the operand, {x} the item. Kept few on purpose (a tiny model).
PHRASES = {
    "+": ["{name} buys {n} more {x}.", "{name} finds {n} more {x}.", "A friend gives {name} {n} {x}."],
    "-": ["{name} gives away {n} {x}.", "{name} loses {n} {x}.", "{name} uses {n} of the {x}."],
    "*": ["{name} ends up with {n} times as many {x}.", "The number of {x} is multiplied by {n}."],
    "/": ["{name} splits the {x} into {n} equal groups and keeps one group.",
          "{name} shares the {x} equally among {n} boxes and keeps one box."],
}


@dataclass(frozen=True)
class Problem:
    """One synthetic word problem with its GSM8K-style worked answer."""

    question: str
    answer: str  # GSM8K format: annotated steps, then "#### N"
    value: int

    def as_record(self) -> dict:
        return {"question": self.question, "answer": self.answer}


def _next_op(rng: random.Random, value: int) -> tuple[str, int]:
    """Pick an operation and operand that keep the value a small non-negative integer."""
    choices = ["+", "*"]
    if value > 1:
        choices.append("-")
    divisors = [d for d in range(2, 10) if value % d == 0 and value // d >= 1]
    if divisors:
        choices.append("/")
    if value > 60:  # keep numbers small: shrink rather than grow
        choices = [c for c in choices if c in "-/"] or ["-"]
    op = rng.choice(choices)
    if op == "+":
        return op, rng.randint(1, 20)
    if op == "-":
        return op, rng.randint(1, min(value - 1, 20))
    if op == "*":
        return op, rng.randint(2, 5 if value <= 20 else 3)
    return op, rng.choice(divisors)


def _apply(op: str, a: int, b: int) -> int:
    return {"+": a + b, "-": a - b, "*": a * b, "/": a // b}[op]


def make_problem(rng: random.Random, ops: tuple[int, int] = (2, 4)) -> Problem:
    """A random word problem of ops[0]-ops[1] operations (2-4: the embedded default task), drawn from `rng`."""
    name, item = rng.choice(NAMES), rng.choice(ITEMS)
    n_ops = rng.randint(*ops)
    value = rng.randint(2, 30)
    sentences = [f"{name} has {value} {item}."]
    steps = []
    for _ in range(n_ops):
        op, n = _next_op(rng, value)
        new = _apply(op, value, n)
        sentences.append(rng.choice(PHRASES[op]).format(name=name, n=n, x=item))
        steps.append(f"{value} {op} {n} = <<{value}{op}{n}={new}>>{new}")
        value = new
    sentences.append(f"How many {item} does {name} have now?")
    answer = "\n".join(steps) + f"\n#### {value}"
    return Problem(question=" ".join(sentences), answer=answer, value=value)


def make_split(seed: int, n: int, exclude: set[str] | None = None, ops: tuple[int, int] = (2, 4)) -> list[Problem]:
    """`n` distinct problems from `seed` (see make_problem), none of whose questions is in `exclude`."""
    rng = random.Random(seed)
    seen = set(exclude or ())
    out: list[Problem] = []
    while len(out) < n:
        p = make_problem(rng, ops)
        if p.question in seen:
            continue
        seen.add(p.question)
        out.append(p)
    return out


def make_task(seed: int = 1234, n_train: int = 6000, n_test: int = 500,
              ops: tuple[int, int] = (2, 4), exclude: set[str] | None = None) -> dict[str, list[Problem]]:
    """Disjoint train and test splits, neither holding a question of `exclude` (another task's held-out rows);
    the test split is drawn first so its size never shifts it."""
    test = make_split(seed + 1, n_test, exclude=exclude, ops=ops)
    train = make_split(seed, n_train, exclude={p.question for p in test} | set(exclude or ()), ops=ops)
    return {"train": train, "test": test}


def write_jsonl(problems: list[Problem], path: Path) -> str:
    """Write records one per line; returns the file's sha256 (recorded for reproducibility checks)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(p.as_record(), ensure_ascii=False) + "\n" for p in problems)
    path.write_text(text, encoding="utf-8")
    return hashlib.sha256(text.encode()).hexdigest()
