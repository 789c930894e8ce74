"""docuchat-rl: teach small language models to reason with reinforcement learning (GRPO, PPO, A2C) on LoRA."""

__version__ = "0.1.0"
