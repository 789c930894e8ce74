"""Deterministic GSM8K-style multi-step arithmetic word problems: the embedded default task.

Each problem follows one quantity through 2-4 operations (add, subtract, multiply, exact divide) and is
written in GSM8K's own format: ``question`` plus an ``answer`` whose steps carry calculator annotations
``<<a+b=c>>`` and end in ``#### N``, so the loader that reads the real GSM8K reads this too.

A `Wording` says how a problem is written: `plain` (the embedded default's few phrases, kept few on purpose
for a tiny model), `varied` (many names, objects, opening and question sentences, phrases per operation and
two number scales, drawn per row: training data that does not teach one phrasing) and `unseen` (pools
disjoint from both, the same operations and number ranges: a held-out set in a wording training never saw,
to tell a learned skill from a learned phrasing).

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
class Wording:
    """The pools a problem's words are drawn from; {name}, {x} (the objects), {v} (the starting count) and
    {n} (an operand) are filled in. A pool of one entry draws nothing from the generator."""

    names: tuple[str, ...]
    items: tuple[str, ...]
    openings: tuple[str, ...]  # the first sentence: {name} has {v} {x}
    phrases: dict[str, tuple[str, ...]]  # per operation
    questions: tuple[str, ...]
    scales: tuple[int, ...] = (1,)  # a row's starting count and added operands are multiplied by one of these


WORDINGS: dict[str, Wording] = {
    "plain": Wording(tuple(NAMES), tuple(ITEMS), ("{name} has {v} {x}.",),
                     {op: tuple(p) for op, p in PHRASES.items()}, ("How many {x} does {name} have now?",)),
    "varied": Wording(
        tuple(NAMES) + ("Liam", "Emma", "Noah", "Mia", "Lucas", "Chen", "Amara", "Kofi", "Ines", "Mateo",
                        "Hiro", "Anya", "Grandpa Joe", "Ms. Park", "the teacher"),
        tuple(ITEMS) + ("balloons", "buttons", "crayons", "seeds", "keys", "ribbons", "pebbles", "muffins",
                        "postcards", "stones", "lemons", "bricks"),
        ("{name} has {v} {x}.", "{name} starts with {v} {x}.", "There are {v} {x} in {name}'s bag.",
         "{name} owned {v} {x} at the start of the week.", "{name} had {v} {x}."),
        {"+": tuple(PHRASES["+"]) + ("{name} gets {n} more {x} as a gift.", "{name} picks up {n} more {x}.",
                                     "Then {name} receives {n} {x} from a neighbour.", "{name} wins {n} {x}."),
         "-": tuple(PHRASES["-"]) + ("{name} sells {n} {x}.", "{name} eats {n} of the {x}.",
                                     "Then {name} hands {n} {x} to a classmate.", "{n} {x} go missing."),
         "*": tuple(PHRASES["*"]) + ("{name} collects until there are {n} times as many {x}.",
                                     "After a busy day, {name} has {n} times the {x}."),
         "/": tuple(PHRASES["/"]) + ("{name} divides the {x} evenly into {n} bags and keeps one bag.",
                                     "The {x} are split fairly between {n} friends, {name} included; "
                                     "{name} keeps one share.")},
        ("How many {x} does {name} have now?", "How many {x} does {name} have in the end?",
         "How many {x} are there now?", "How many {x} does {name} end up with?",
         "Now how many {x} does {name} have?"),
        scales=(1, 1, 2)),
    "unseen": Wording(
        ("Aria", "Bruno", "Chloe", "Diego", "Esme", "Felix", "Greta", "Hugo", "Iris", "Jonah", "Kira", "Leo",
         "Maya", "Nico", "Olive", "Priya", "Rafael", "Sofia", "Theo", "Vera", "Yusuf", "Zara"),
        ("oranges", "bottles", "feathers", "puzzles", "tickets", "candles", "jars", "socks", "magnets",
         "paintbrushes", "nails", "blankets"),
        ("At first, {name} owns {v} {x}.", "{name}'s collection holds {v} {x}.",
         "In the morning {name} counts {v} {x}."),
        {"+": ("{name}'s aunt hands over another {n} {x}.", "Later, {name} collects {n} extra {x}.",
               "{n} more {x} are added to {name}'s pile."),
         "-": ("{n} of the {x} get broken.", "{name} donates {n} {x} to a school.",
               "Later, {name} trades away {n} {x}."),
         "*": ("By evening the pile of {x} has grown to {n} times its size.",
               "{name}'s stock of {x} becomes {n} times bigger."),
         "/": ("The {x} are packed equally into {n} crates, and {name} keeps only one crate.",
               "{name} keeps one of {n} equal shares of the {x}.")},
        ("What is the final count of {x}?", "How many {x} are left with {name} at the end?",
         "How many {x} does {name} hold once all this is done?")),
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


def _pick(rng: random.Random, pool):
    return pool[0] if len(pool) == 1 else rng.choice(pool)  # (one entry: no draw, so plain rows stay as they were)


def make_problem(rng: random.Random, ops: tuple[int, int] = (2, 4), wording: str = "plain") -> Problem:
    """A random word problem of ops[0]-ops[1] operations (2-4: the embedded default task), drawn from `rng`,
    written from the pools of `WORDINGS[wording]`."""
    w = WORDINGS[wording]
    name, item = rng.choice(w.names), rng.choice(w.items)
    n_ops = rng.randint(*ops)
    scale = _pick(rng, w.scales)
    value = rng.randint(2, 30) * scale
    sentences = [_pick(rng, w.openings).format(name=name, v=value, x=item)]
    steps = []
    for _ in range(n_ops):
        op, n = _next_op(rng, value)
        n = n * scale if op == "+" else n
        new = _apply(op, value, n)
        sentences.append(_pick(rng, w.phrases[op]).format(name=name, n=n, x=item))
        steps.append(f"{value} {op} {n} = <<{value}{op}{n}={new}>>{new}")
        value = new
    sentences.append(_pick(rng, w.questions).format(name=name, x=item))
    answer = "\n".join(steps) + f"\n#### {value}"
    return Problem(question=" ".join(x[0].upper() + x[1:] for x in sentences), answer=answer, value=value)


def make_split(seed: int, n: int, exclude: set[str] | None = None, ops: tuple[int, int] = (2, 4),
               wording: str = "plain") -> list[Problem]:
    """`n` distinct problems from `seed` (see make_problem), none of whose questions is in `exclude`."""
    rng = random.Random(seed)
    seen = set(exclude or ())
    out: list[Problem] = []
    while len(out) < n:
        p = make_problem(rng, ops, wording)
        if p.question in seen:
            continue
        seen.add(p.question)
        out.append(p)
    return out


def make_task(seed: int = 1234, n_train: int = 6000, n_test: int = 500,
              ops: tuple[int, int] = (2, 4), exclude: set[str] | None = None,
              wording: str = "plain") -> dict[str, list[Problem]]:
    """Disjoint train and test splits, neither holding a question of `exclude` (another task's held-out rows);
    the test split is drawn first so its size never shifts it."""
    test = make_split(seed + 1, n_test, exclude=exclude, ops=ops, wording=wording)
    train = make_split(seed, n_train, exclude={p.question for p in test} | set(exclude or ()), ops=ops,
                       wording=wording)
    return {"train": train, "test": test}


def write_jsonl(problems: list[Problem], path: Path) -> str:
    """Write records one per line; returns the file's sha256 (recorded for reproducibility checks)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(p.as_record(), ensure_ascii=False) + "\n" for p in problems)
    path.write_text(text, encoding="utf-8")
    return hashlib.sha256(text.encode()).hexdigest()
