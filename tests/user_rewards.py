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


def conversational_len(completions, **kwargs):
    """TRL's conversational form: each completion is a list of messages, `completion[0]["content"]`."""
    return [-abs(20 - len(completion[0]["content"])) for completion in completions]


def system_turns(prompts, completions, **kwargs):
    """Reads a conversational prompt's messages (a list of {role, content} per completion)."""
    return [float(sum(m["role"] == "system" for m in p)) + len(p) / 10 for p in prompts]


def uses_trl_hooks(completions, trainer_state, log_extra, log_metric, **kwargs):
    """TRL's extra keywords: the trainer's state, a per-completion column and a scalar metric."""
    log_extra("chars", [len(c) for c in completions])
    log_metric("mean_chars", sum(len(c) for c in completions) / len(completions))
    log_metric("loss", -1.0)  # one of the trainer's own names: logged beside it, not over it
    return [float(trainer_state.global_step) + trainer_state.max_steps / 100 for _ in completions]
