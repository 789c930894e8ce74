"""A tool that kills its own process (SIGKILL, as `kill -9` does) at a chosen call: a crash in the middle of a
multi-turn step, between the turns of its conversations (tests/test_turn_cache.py)."""

import os
import signal

CALLS = [0]  # calls made in this process


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    CALLS[0] += 1
    if str(CALLS[0]) == os.environ.get("DOCUCHAT_TEST_KILL_AT_CALL"):
        os.kill(os.getpid(), signal.SIGKILL)
    return a + b
