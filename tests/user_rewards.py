"""A user's own rewards, loaded by dotted path in tests (`tests.user_rewards:...`)."""

import asyncio
import time


def length_over(prompts, completions, limit=3, **kwargs):
    return [float(len(c) > limit) for c in completions]


def raises(prompts, completions, **kwargs):
    raise RuntimeError("boom")


def wrong_length(prompts, completions, **kwargs):
    return [1.0] * (len(completions) + 1)


def not_finite(prompts, completions, **kwargs):
    return [float("nan"), float("inf")] + [1.0] * (len(completions) - 2)


def not_a_number(prompts, completions, **kwargs):
    return ["high"] * len(completions)


def slow(prompts, completions, **kwargs):
    time.sleep(2.0)
    return [1.0] * len(completions)


def uses_level(prompts, completions, level, **kwargs):
    """Reads a data set column the trainer passes through (`level`)."""
    return [float(x) for x in level]


def huge(prompts, completions, **kwargs):
    """A finite score whose weighted total overflows float32 (3e38 x weight 10): the loss turns NaN."""
    return [3e38] * len(completions)


def none_on_even(prompts, completions, **kwargs):
    """No value for every other completion, 1.0 for the rest: the valid rewards of a group agree."""
    return [None if i % 2 == 0 else 1.0 for i in range(len(completions))]


# --- reward functions in the signatures TRL's documentation uses, as a TRL user brings them ---------------

def reward_len(completions, **kwargs):
    """TRL's GRPO quick start: completions near 20 characters."""
    return [-abs(20 - len(completion)) for completion in completions]


def accuracy_reward(completions, solution, **kwargs):
    """TRL's docs: a data set column (`solution`) by name."""
    return [1.0 if str(s) in c else 0.0 for c, s in zip(completions, solution)]


async def async_len(prompts, completions, **kwargs):
    """An async reward (TRL runs these with asyncio)."""
    await asyncio.sleep(0)
    return [float(len(p) + len(c)) for p, c in zip(prompts, completions)]


def token_count(completion_ids, **kwargs):
    """Reads the completion's token ids, which TRL passes as `completion_ids`."""
    return [float(len(ids)) for ids in completion_ids]


def only_named(completions, solution):
    """No **kwargs: gets only what it names."""
    return [float(len(c) > len(str(s))) for c, s in zip(completions, solution)]
