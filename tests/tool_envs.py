"""Tools and environments the multi-turn tests name by dotted path (as a user's recipe would)."""

import asyncio
import sys
import time


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


async def slow_double(x: int) -> int:
    """Double a number after a pause.

    Args:
        x: The number.
    """
    await asyncio.sleep(0.5)
    return 2 * x


def hang(x: int) -> str:
    """Never return.

    Args:
        x: Anything.
    """
    time.sleep(3600)
    return "never"


def leave(x: int) -> str:
    """Exit the process.

    Args:
        x: Anything.
    """
    sys.exit(3)


def nothing(x: int) -> None:
    """Return nothing.

    Args:
        x: Anything.
    """


def shout(text: str) -> str:
    """Repeat a text many times.

    Args:
        text: The text.
    """
    return (text + " ") * 500


class Counter:
    """An environment written the way TRL's docs write one: reset(**row), public methods as tools, get_reward."""

    def reset(self, **row) -> str | None:
        self.calls = 0
        self.answer = row.get("answer", "")
        return None

    def increment(self, step: int) -> str:
        """Add to the counter.

        Args:
            step: How much to add.
        """
        self.calls += step
        return f"counter is {self.calls}"

    def get_reward(self) -> float:
        return float(self.calls > 0)


class BrokenReset(Counter):
    def reset(self, **row):
        if "7" in str(row.get("question", "")):
            raise RuntimeError("no room for this row")
        return super().reset(**row)


class Oracle(Counter):
    """A tool that hands the model the gold answer: a completion cut before its result is shown must never be
    scored on it (the reward hack of a run that learns to be cut off after a call)."""

    def reset(self, **row) -> None:
        super().reset(**row)
        self.gold = row["answer"].split("####")[-1].strip()  # (the answer column as written: the worked solution)

    def add(self, a: int, b: int) -> str:
        """Add two integers.

        Args:
            a: The first number.
            b: The second number.
        """
        self.calls += 1
        return f"<answer>{self.gold}</answer>"


class RandomStart(Counter):
    """A random start: each instance's first observation is its own (the rows of a group see different
    prompts)."""

    made = 0

    def reset(self, **row) -> str:
        super().reset(**row)
        RandomStart.made += 1
        return f" You start at {RandomStart.made * 37 % 101}."


class Briefing(Counter):
    """A first observation that is a function of the row (the same for every completion of a prompt)."""

    def reset(self, **row) -> str:
        super().reset(**row)
        return f" (Hint: the answer has {len(str(row.get('answer', '')))} characters.)"


class Flood(Counter):
    """An environment that returns far more text than the model's context holds, from reset and from a tool."""

    def reset(self, **row) -> str:
        super().reset(**row)
        self.row = row
        return " start" * 6_000

    def add(self, a: int, b: int) -> str:
        """Add two integers.

        Args:
            a: The first number.
            b: The second number.
        """
        return "9" * 12_000_000


class NanReward(Counter):
    def get_reward(self) -> float:
        return float("nan")


class NeverResets(Counter):
    def reset(self, **row):
        raise RuntimeError("the board is out of pieces")


class CalculatorToo(Counter):
    """An environment whose method has the name of a tool function (docuchat_rl.toolbox.calculate)."""

    def calculate(self, expression: str) -> str:
        """Evaluate an expression.

        Args:
            expression: The expression.
        """
        return "0"


class DictStart(Counter):
    """A reset that returns a dict, not the text or None TRL's contract asks for."""

    def reset(self, **row):
        super().reset(**row)
        return {"hint": "start"}
