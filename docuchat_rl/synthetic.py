"""Deterministic GSM8K-style multi-step arithmetic word problems: the embedded default task.

Each problem follows one quantity through 2-4 operations (add, subtract, multiply, exact divide) and is
written in GSM8K's own format: ``question`` plus an ``answer`` whose steps carry calculator annotations
``<<a+b=c>>`` and end in ``#### N``, so the loader that reads the real GSM8K reads this too.

A `Wording` says how a problem is written: `plain` (the embedded default's few phrases, kept few on purpose
for a tiny model), `varied` (many names, objects, opening and question sentences, phrases per operation and
two number scales, drawn per row: training data that does not teach one phrasing) and `unseen` (pools
disjoint from both, the same operations and number ranges: a held-out set in a wording training never saw,
to tell a learned skill from a learned phrasing). `unseen` writes each operation in several sentence forms
(a verb, a comparison with "before", a fraction or "times as many", a change of "the number of") and in
three sentence orders (the story, the question first, the starting count last); `unseen_v1` is the first,
smaller unseen pool, kept so that `data/task_1op_unseen` is still what the generator writes.

`answer_only` rows (`Problem.answer_only`) keep the question and the final `#### N` line only: data a
supervised stage cannot learn a worked solution from, for RL after SFT (docs/generalization.md).

`diagnose` reads a completion's worked lines against a problem's gold ones: right, a sentence read otherwise
(which way first) or a result miscalculated (scripts/transfer_errors.py, docs/generalization.md).

Deliberately left out: percentages, units conversion and distractor sentences. The task has to be learnable
by a few-million-parameter model on a CPU in minutes; the real GSM8K is one config away.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

from rewards.correctness import Correctness

from .data import normalized

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
    orders: tuple[str, ...] = ("story",)  # sentence orders (ORDERS), drawn per row
    intros: tuple[str, ...] = ()  # the `start_last` order's first sentence (before the operations)
    closings: tuple[str, ...] = ()  # the `start_last` order's starting count, said after the operations

    def forms(self) -> set[str]:
        """Every sentence template of the wording (names and objects are not forms)."""
        return {*self.openings, *self.questions, *self.intros, *self.closings,
                *(p for ps in self.phrases.values() for p in ps)}


# How the sentences of a problem are ordered: `story` (the starting count, the operations, the question),
# `question_first` (the question, then the story), `start_last` (an intro, the operations, then the starting
# count "before all of this", then the question); the training wording `diverse` has two of its own: `ask_first`
# (an intro, the question, the story) and `recap` (the story, the start said again, the question).
ORDERS = ("story", "question_first", "start_last", "ask_first", "recap")

# Words for an operand, in the sentence forms that say it in words: {frac} (keep 1/n), {times} (multiply by n).
# A form that names one is drawn only for an operand it has a word for.
FRACTIONS = {2: "half", 3: "a third", 4: "a quarter", 5: "a fifth", 6: "a sixth", 7: "a seventh",
             8: "an eighth", 9: "a ninth"}
TIMES = {2: "doubles", 3: "triples"}
TIMES_VERB = {2: "doubles", 3: "triples", 4: "quadruples"}  # ({times_verb}: a person doing it, "Ava doubles the x")


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
WORDINGS["unseen_v1"] = WORDINGS["unseen"]  # (data/task_1op_unseen's pools, as they were written)
WORDINGS["unseen"] = Wording(
    ("Aria", "Bruno", "Chloe", "Diego", "Esme", "Felix", "Greta", "Hugo", "Iris", "Jonah", "Kira", "Leo",
     "Maya", "Nico", "Olive", "Priya", "Rafael", "Sofia", "Theo", "Vera", "Yusuf", "Zara", "Ansel", "Bea",
     "Dmitri", "Elif", "Farah", "Gideon", "Halima", "Ines Ruiz", "Mr. Okafor", "Auntie Lou"),
    ("oranges", "bottles", "feathers", "puzzles", "tickets", "candles", "jars", "socks", "magnets",
     "paintbrushes", "nails", "blankets", "acorns", "envelopes", "spoons", "kites", "mugs", "plums",
     "batteries", "corks"),
    ("At first, {name} owns {v} {x}.", "{name}'s collection holds {v} {x}.",
     "In the morning {name} counts {v} {x}.", "{name} begins the day with {v} {x}.",
     "There were {v} {x} on {name}'s shelf.", "{name}'s box contains exactly {v} {x}."),
    {"+": ("{name}'s aunt hands over another {n} {x}.", "Later, {name} collects {n} extra {x}.",
           "{n} more {x} are added to {name}'s pile.", "{name} is given {n} {x} by a cousin.",
           "Now {name} has {n} more {x} than before.", "The number of {x} goes up by {n}.",
           "{n} {x} arrive in the mail for {name}."),
     "-": ("{n} of the {x} get broken.", "{name} donates {n} {x} to a school.",
           "Later, {name} trades away {n} {x}.", "Afterwards {name} has {n} fewer {x} than before.",
           "The number of {x} drops by {n}.", "{name} mails {n} {x} to a pen pal.",
           "{n} {x} roll under the sofa and are never found."),
     "*": ("By evening the pile of {x} has grown to {n} times its size.",
           "{name}'s stock of {x} becomes {n} times bigger.",
           "A week later {name} owns {n} times as many {x} as before.",
           "Each of the {x} is swapped for {n} new ones.", "The number of {x} {times}."),
     "/": ("The {x} are packed equally into {n} crates, and {name} keeps only one crate.",
           "{name} keeps one of {n} equal shares of the {x}.", "{name} keeps only {frac} of the {x}.",
           "{name} gives away all but {frac} of the {x}.",
           "Only one of {n} equal piles of {x} stays with {name}.")},
    ("What is the final count of {x}?", "How many {x} are left with {name} at the end?",
     "How many {x} does {name} hold once all this is done?", "In total, how many {x} remain?",
     "Can you work out how many {x} {name} ends with?"),
    orders=("story", "story", "question_first", "start_last"),
    intros=("{name}'s {x} change a few times.", "Here is what happens to {name}'s {x}."),
    closings=("Before all of this, {name} had {v} {x}.", "{name} started out with {v} {x}."))
# RL's training wording for transfer (docs/generalization.md): varied's pools and more constructs, each in forms of
# its own: comparisons, fractions and multipliers in words, a change said of the pile, two more sentence orders.
# No form is an unseen one (tested): a model trained on it meets unseen's forms for the first time.
_V = WORDINGS["varied"]
WORDINGS["diverse"] = Wording(
    _V.names, _V.items,
    _V.openings + ("Exactly {v} {x} belong to {name}.", "{name} keeps {v} {x} in a drawer.",
                   "To begin with, {name} has a stack of {v} {x}."),
    {"+": _V.phrases["+"] + ("{name}'s {x} increase by {n}.", "{n} {x} are bought for {name}.",
                             "{name} ends up with {n} {x} more than a moment ago."),
     "-": _V.phrases["-"] + ("{name}'s {x} decrease by {n}.", "{name} has to throw out {n} {x}.",
                             "{name} is left with {n} {x} fewer than a moment ago."),
     "*": _V.phrases["*"] + ("{name} makes the stack {n} times larger.", "{name} {times_verb} the {x}.",
                             "Each {x} turns into {n} {x}."),
     "/": _V.phrases["/"] + ("{name} divides the {x} by {n}.", "{name} ends with {frac} as many {x} as a moment ago.",
                             "After sharing, {name} has just {frac} of the {x} left.")},
    _V.questions + ("What number of {x} does {name} have at the finish?", "Tell how many {x} {name} has left."),
    scales=_V.scales,
    orders=("story", "story", "ask_first", "recap"),
    intros=("A puzzle about {name}'s {x}.",),
    closings=("All of that started from {v} {x}.",))


@dataclass(frozen=True)
class Problem:
    """One synthetic word problem with its GSM8K-style worked answer."""

    question: str
    answer: str  # GSM8K format: annotated steps, then "#### N"
    value: int
    forms: tuple[str, ...] = ()  # the sentence templates it was written with, in order, and its order's name

    def as_record(self) -> dict:
        return {"question": self.question, "answer": self.answer}

    def answer_only(self) -> Problem:
        """The problem with its final answer only (`#### N`, no worked solution)."""
        return Problem(self.question, f"#### {self.value}", self.value, self.forms)


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


def _sayable(form: str, n: int) -> bool:
    """Whether `form` can say operand `n` (a form with {frac}, {times} or {times_verb} has words for some
    operands only)."""
    return (("{frac}" not in form or n in FRACTIONS) and ("{times}" not in form or n in TIMES)
            and ("{times_verb}" not in form or n in TIMES_VERB))


def make_problem(rng: random.Random, ops: tuple[int, int] = (2, 4), wording: str = "plain") -> Problem:
    """A random word problem of ops[0]-ops[1] operations (2-4: the embedded default task), drawn from `rng`,
    written from the pools of `WORDINGS[wording]`."""
    w = WORDINGS[wording]
    name, item = rng.choice(w.names), rng.choice(w.items)
    n_ops = rng.randint(*ops)
    scale = _pick(rng, w.scales)
    value = start = rng.randint(2, 30) * scale
    order = _pick(rng, w.orders)
    opening = _pick(rng, w.closings if order == "start_last" else w.openings)
    forms = [opening]
    middle, steps = [], []
    for _ in range(n_ops):
        op, n = _next_op(rng, value)
        n = n * scale if op == "+" else n
        new = _apply(op, value, n)
        phrase = _pick(rng, [f for f in w.phrases[op] if _sayable(f, n)])
        forms.append(phrase)
        middle.append(phrase.format(name=name, n=n, x=item, frac=FRACTIONS.get(n, ""), times=TIMES.get(n, ""),
                                    times_verb=TIMES_VERB.get(n, "")))
        steps.append(f"{value} {op} {n} = <<{value}{op}{n}={new}>>{new}")
        value = new
    question = _pick(rng, w.questions)
    forms.append(question)
    start_text, ask = opening.format(name=name, v=start, x=item), question.format(name=name, x=item)
    if order in ("question_first", "ask_first"):  # (ask_first: the intro, the question, then the story)
        head = [] if order == "question_first" else [_pick(rng, w.intros)]
        forms[:0] = head
        sentences = [*(h.format(name=name, x=item) for h in head), ask, start_text, *middle]
    elif order == "start_last":
        intro = _pick(rng, w.intros)
        forms.insert(0, intro)
        sentences = [intro.format(name=name, x=item), *middle, start_text, ask]
    elif order == "recap":  # (the story, then the start said again in other words, then the question)
        recap = _pick(rng, w.closings)
        forms.append(recap)
        sentences = [start_text, *middle, recap.format(name=name, v=start, x=item), ask]
    else:
        sentences = [start_text, *middle, ask]
    answer = "\n".join(steps) + f"\n#### {value}"
    return Problem(question=" ".join(x[0].upper() + x[1:] for x in sentences), answer=answer, value=value,
                   forms=(*forms, order))


MAX_OPS = 16  # the longest chain make_problem is asked for (the tasks here use at most 8)


def make_split(seed: int, n: int, exclude: set[str] | None = None, ops: tuple[int, int] = (2, 4),
               wording: str = "plain") -> list[Problem]:
    """`n` distinct problems from `seed` (see make_problem), none of whose questions is in `exclude`; a ValueError
    when the draws run out of new questions (the wording and operations cannot make `n` distinct ones)."""
    if not 1 <= ops[0] <= ops[1] <= MAX_OPS:
        raise ValueError(f"operations {ops[0]}-{ops[1]}: between 1 and {MAX_OPS}, the first not above the second")
    rng = random.Random(seed)
    seen = set(exclude or ())
    out: list[Problem] = []
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 50 * n + 10_000:  # (a bound, not a hang: each draw is new with high probability until then)
            raise ValueError(f"{len(out)} distinct problems after {tries - 1} draws, not {n}: this wording and these "
                             "operations make fewer new questions; ask for fewer rows")
        p = make_problem(rng, ops, wording)
        key = normalized(p.question)
        if key in seen or p.question in seen:
            continue
        seen.update((key, p.question))
        out.append(p)
    return out


def make_task(seed: int = 1234, n_train: int = 6000, n_test: int = 500,
              ops: tuple[int, int] = (2, 4), exclude: set[str] | None = None,
              wording: str = "plain", answer_only: bool = False) -> dict[str, list[Problem]]:
    """Disjoint train and test splits, neither holding a question of `exclude` (another task's held-out rows,
    compared as `normalized` text); the test split is drawn first so its size never shifts it. `answer_only`:
    every row's answer is its final `#### N` only."""
    held = {normalized(q) for q in exclude or ()}
    test = make_split(seed + 1, n_test, exclude=held, ops=ops, wording=wording)
    train = make_split(seed, n_train, exclude={normalized(p.question) for p in test} | held, ops=ops,
                       wording=wording)
    if answer_only:
        test, train = [p.answer_only() for p in test], [p.answer_only() for p in train]
    return {"train": train, "test": test}



def write_jsonl(problems: list[Problem], path: Path) -> str:
    """Write records one per line; returns the file's sha256 (recorded for reproducibility checks)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(p.as_record(), ensure_ascii=False) + "\n" for p in problems)
    path.write_text(text, encoding="utf-8")
    return hashlib.sha256(text.encode()).hexdigest()


# Where a completion of this task goes wrong, read off its worked lines against the gold's (scripts/transfer_errors.py).
# Written here, not taken from a library: it reads this generator's own line format ("a op b = <<a op b=c>>c").
_STEP = re.compile(r"(-?\d+)\s*([-+*/])\s*(-?\d+)\s*=\s*(?:<<[^>]*>>)?\s*(-?\d+)")


@dataclass(frozen=True)
class Step:
    """One worked line, `a op b = result` (the result as written, right or not)."""

    a: int
    op: str
    b: int
    result: int

    def right(self) -> bool:
        """Whether the result is right for its own operands (a division only when exact)."""
        if self.op == "/":
            return self.b != 0 and self.a == self.b * self.result
        return _apply(self.op, self.a, self.b) == self.result


def worked_steps(text: str) -> list[Step]:
    """The `a op b = c` lines of a worked solution, gold (with `<<...>>` annotations) or a model's (without).

    >>> worked_steps("17 - 12 = <<17-12=5>>5\\n5 * 3 = 14\\n#### 14")
    [Step(a=17, op='-', b=12, result=5), Step(a=5, op='*', b=3, result=14)]
    """
    return [Step(int(m[1]), m[2], int(m[3]), int(m[4])) for m in _STEP.finditer(text)]


@dataclass(frozen=True)
class Diagnosis:
    """What a completion did with a problem: `kind` is right (its final answer is the gold's), arithmetic (it read
    every sentence as the gold does: the same start, operations and operands, and got a result wrong) or reading
    (it read a sentence otherwise: `misread` says the first way, e.g. "- read as +", "start value", "operand",
    "steps missing or extra"); `start_first`: whether the question says the starting count before any other
    number (the `start_last` order does not); `slips`: its lines whose result is wrong for their own operands."""

    kind: str
    misread: str | None
    start_first: bool
    slips: int


def diagnose(question: str, completion: str, gold_answer: str) -> Diagnosis:
    """The `Diagnosis` of a completion against the gold worked answer of its question (right: as the
    `correctness` reward, and so evaluation's accuracy, judges it).

    >>> gold = "17 - 12 = <<17-12=5>>5\\n5 + 4 = <<5+4=9>>9\\n#### 9"
    >>> q = "Gideon mails 12 plums away. 4 plums arrive. Before all of this, Gideon had 17 plums. How many now?"
    >>> diagnose(q, "17 + 12 = 29\\n29 + 4 = 33\\n#### 33", gold)
    Diagnosis(kind='reading', misread='- read as +', start_first=False, slips=0)
    >>> diagnose(q, "17 - 12 = 5\\n5 + 4 = 8\\n#### 8", gold).kind
    'arithmetic'
    """
    gold, mine = worked_steps(gold_answer), worked_steps(completion)
    numbers = re.findall(r"\d+", question)
    start_first = bool(gold) and bool(numbers) and int(numbers[0]) == gold[0].a
    slips = sum(not s.right() for s in mine)
    # right as evaluation's accuracy judges it: the correctness reward's own extraction and math-verify
    if Correctness().score(question, completion, {"answer": gold_answer}).value == 1.0:
        return Diagnosis("right", None, start_first, slips)
    if not mine or not gold or mine[0].a != gold[0].a:
        return Diagnosis("reading", "start value", start_first, slips)
    for g, m in zip(gold, mine):
        if g.op != m.op:
            return Diagnosis("reading", f"{g.op} read as {m.op}", start_first, slips)
        if g.b != m.b:
            return Diagnosis("reading", "operand", start_first, slips)
    if len(gold) != len(mine):
        return Diagnosis("reading", "steps missing or extra", start_first, slips)
    return Diagnosis("arithmetic", None, start_first, slips)
