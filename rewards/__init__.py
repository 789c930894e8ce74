"""docuchat-rl rewards: composable, traced, fault-isolated reward functions. No torch, no trainer.

Every reward is a callable in TRL's convention, so it can be passed as-is to `trl.GRPOTrainer`:

    from rewards import build_reward
    trainer = GRPOTrainer(..., reward_funcs=[build_reward("correctness"), build_reward("format")])
"""

from . import (  # noqa: F401  (registration)
    arithmetic, correctness, environment, format, language, length, reasoning, repetition,
)
from .base import (
                   FunctionReward,
                   Reward,
                   RewardError,
                   Score,
                   build_reward,
                   register,
                   registered,
                   resolve_reward,
                   text_of,
)
from .composite import BatchResult, ComponentResult, CompositeReward, RewardFailure, RewardRecord

__all__ = ["BatchResult", "ComponentResult", "CompositeReward", "FunctionReward", "Reward", "RewardError",
           "RewardFailure", "RewardRecord", "Score", "build_reward", "register", "registered",
           "resolve_reward", "text_of"]
