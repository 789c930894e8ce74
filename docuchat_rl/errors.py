"""The errors the command line turns into one `docuchat-rl: error: ...` line (exit code 2).

Torch-free, so that the command line can name them without loading the engine. ConfigError lives in
`config`, DataError in `data`, AuditError in `audit`, RewardError in `rewards`.
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
