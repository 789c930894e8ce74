"""The errors the command line turns into one `docuchat-rl: error: ...` line (exit code 2).

Torch-free, so that the command line can name them without loading the engine. ConfigError lives in
`config`, DataError in `data`, AuditError in `audit`, RewardError in `rewards`.
"""


class TrainingError(RuntimeError):
    """A run that cannot start or go on; the message says what to change."""


class ModelError(ValueError):
    """A model or tokenizer that cannot be loaded; the message is one line naming the key and what was tried."""
