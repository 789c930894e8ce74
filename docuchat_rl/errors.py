"""The errors the command line turns into one `docuchat-rl: error: ...` line (exit code 2).

Torch-free, so that the command line can name them without loading the engine. ConfigError lives in
`config`, DataError in `data`, AuditError in `audit`, RewardError in `rewards`. Also here, torch-free too: the
messages of a library that say nothing to act on, silenced once (`quiet_bitsandbytes`).
"""


class TrainingError(RuntimeError):
    """A run that cannot start or go on; the message says what to change."""


class ModelError(ValueError):
    """A model or tokenizer that cannot be loaded; the message is one line naming the key and what was tried."""


class CheckpointError(RuntimeError):
    """No checkpoint that can be resumed from, or one that cannot be written; the message says which and why."""


class Preempted(Exception):
    """The run stopped at a safe point after SIGTERM or SIGINT, with its last finished step checkpointed."""

    def __init__(self, signal_name: str, signal_number: int, step: int, checkpoint: str | None):
        self.signal_name, self.signal_number, self.step, self.checkpoint = signal_name, signal_number, step, checkpoint
        super().__init__(f"stopped by {signal_name} after step {step}"
                         + (f"; {checkpoint} holds it" if checkpoint else "; no step had finished"))


class CheckpointWarning(UserWarning):
    """A damaged checkpoint was skipped on resume (the command line prints it as one line)."""


class ReplayError(ValueError):
    """A traced completion that cannot be replayed (or a run that cannot be rescored) exactly; the message
    says why."""


class ToolError(ValueError):
    """Tools or an environment (rollout.tools, rollout.environment_factory) that cannot be loaded or described,
    named by their recipe key."""


def quiet_bitsandbytes() -> None:
    """bitsandbytes' messages that say nothing a user can act on, left unsaid (called at the package's import,
    before peft imports bitsandbytes): on an AVX512-BF16 CPU, at import, that an optional kernel package
    (`kernels`, fetched from a hub) is missing; int8's note at every call that it casts float32 inputs to float16;
    and torch's warning that a CPU 4-bit kernel has no autograd kernel of its own (that kernel is kept out of the
    run: modeling._no_cpu_packing)."""
    import logging
    import warnings

    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=r"bitsandbytes::\w+: an autograd kernel was not registered")
    warnings.filterwarnings("ignore", message=r"MatMul8bitLt: inputs will be cast from")
