"""docuchat-rl: teach small language models to reason with reinforcement learning (GRPO, PPO, A2C) on LoRA."""

from .sampling import reward_models  # noqa: F401  (the engine's torch-based reward registers itself under `reward_model`)

__version__ = "0.1.0"
