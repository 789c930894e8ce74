"""A user's own rewards, loaded by dotted path in tests (`tests.user_rewards:...`)."""

import asyncio
import sys
import time


def length_over(prompts, completions, limit=3, **kwargs):
    return [float(len(c) > limit) for c in completions]


def raises(prompts, completions, **kwargs):
    raise RuntimeError("boom")


def wrong_length(prompts, completions, **kwargs):
    return [1.0] * (len(completions) + 1)


async def async_wrong_length(prompts, completions, **kwargs):
    return [1.0] * (len(completions) - 1)


def not_finite(prompts, completions, **kwargs):
    return [float("nan"), float("inf")] + [1.0] * (len(completions) - 2)


def not_a_number(prompts, completions, **kwargs):
    return ["high"] * len(completions)


def slow(prompts, completions, **kwargs):
    time.sleep(2.0)
    return [1.0] * len(completions)


def slow_marked(prompts, completions, **kwargs):
    """`slow`, after creating the file named by $DOCUCHAT_TEST_MARK (a test's sign that a step's scoring began);
    once the file exists (a later call, or the test's second run), without the wait."""
    import os

    mark = os.environ["DOCUCHAT_TEST_MARK"]
    if os.path.exists(mark):
        return [1.0] * len(completions)
    open(mark, "a").close()
    return slow(prompts, completions)


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


def long_enough(prompts, completions, **kwargs):
    """TRL's own style: a list of bools."""
    return [len(c) > 3 for c in completions]


def numpy_and_torch(prompts, completions, **kwargs):
    """One value of each kind TRL's torch.tensor(..., float32) reads, then one it refuses (several values)."""
    import numpy as np
    import torch

    return [np.float32(0.5), np.int64(2), torch.tensor(0.25), torch.tensor([1.5]), np.array([1.0, 2.0])]


def exits(prompts, completions, **kwargs):
    import sys

    sys.exit(3)


def stuck(prompts, completions, **kwargs):
    time.sleep(60)
    return [1.0] * len(completions)


_JUDGE: dict = {}  # what an async judge keeps between calls: its client's loop-bound state


async def async_judge(prompts, completions, **kwargs):
    """Keeps a module-level asyncio.Queue (bound to the loop it is first used on, as an AsyncOpenAI or httpx
    client is): a second call on another loop would fail "bound to a different event loop"."""
    if "queue" not in _JUDGE:
        _JUDGE["queue"] = asyncio.Queue()
    queue = _JUDGE["queue"]
    getter = asyncio.ensure_future(queue.get())  # waits on the queue: binds it to the running loop
    await asyncio.sleep(0)
    for c in completions:
        queue.put_nowait(float(len(c)))
    first = await getter
    return [first] + [queue.get_nowait() for _ in completions[1:]]


def ctrl_c(prompts, completions, **kwargs):
    """Ctrl-C, for real: SIGINT to this process while the reward runs (here: the evaluation's scoring)."""
    import os
    import signal
    import time

    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)  # (the handler runs at the next bytecode boundary: it interrupts the sleep)
    return [0.0] * len(completions)


_CALLS = {"raises_keyboard_interrupt": 0}


def raises_keyboard_interrupt(prompts, completions, **kwargs):
    """A reward whose code raises KeyboardInterrupt itself, from its second call on: no signal was sent."""
    _CALLS["raises_keyboard_interrupt"] += 1
    if _CALLS["raises_keyboard_interrupt"] > 1:
        raise KeyboardInterrupt
    return [0.0] * len(completions)


def openr1_accuracy(completions, solution, **kwargs):
    """open-r1's accuracy reward as its users write it: math_verify's parse and verify with their default,
    signal-based timeouts (which refuse to run outside the main thread)."""
    from math_verify import parse, verify

    return [float(verify(parse(sol), parse(c))) for c, sol in zip(completions, solution)]


CANCELLED: list = []  # async_stuck's calls that were cancelled


async def async_stuck(prompts, completions, **kwargs):
    try:
        await asyncio.sleep(60)
    except asyncio.CancelledError:
        CANCELLED.append(len(completions))
        raise
    return [1.0] * len(completions)


HANDSHAKE: dict = {}  # the two halves of a handshake between two async components, made per call


async def _meet(me: str, other: str, completions) -> list[float]:
    """Says it is here, then waits for the other component: awaited one after the other, the first would
    wait forever (until its time limit); awaited together, as TRL gathers async rewards, both finish."""
    HANDSHAKE.setdefault(me, asyncio.Event()).set()
    await HANDSHAKE.setdefault(other, asyncio.Event()).wait()
    return [1.0] * len(completions)


async def meets_b(prompts, completions, **kwargs):
    return await _meet("a", "b", completions)


async def meets_a(prompts, completions, **kwargs):
    return await _meet("b", "a", completions)


async def async_exits(prompts, completions, **kwargs):
    sys.exit(3)


def numpy_scalars(completions, **kwargs):
    """numpy scalars, one per completion (np.float32 and np.int64 alternate)."""
    import numpy as np

    return [np.float32(len(c) % 7) / 7 if i % 2 else np.int64(len(c) % 3) for i, c in enumerate(completions)]


def zero_d_tensors(completions, **kwargs):
    """0-d torch tensors, one per completion."""
    import torch

    return [torch.tensor(float(c.count(" ")) / 10) for c in completions]


def whole_numpy(prompts, completions, **kwargs):
    """The whole return a numpy array (TRL iterates any sequence), with a NaN for the last completion."""
    import numpy as np

    return np.array([float(len(c)) for c in completions[:-1]] + [float("nan")])


def whole_torch(prompts, completions, **kwargs):
    import torch

    return torch.tensor([float(len(c)) for c in completions[:-1]] + [float("nan")])


def chatty(completions, **kwargs):
    """A reward that prints as it scores (a user's debugging line): never on a command's machine output."""
    print("scoring", len(completions), "completions")
    return [1.0 for _ in completions]


def always_none(completions, **kwargs):
    """No value for any completion (a reward that never applies)."""
    return [None] * len(completions)
