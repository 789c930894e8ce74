"""docuchat-rl: teach small language models to reason with reinforcement learning (GRPO, PPO, A2C) on LoRA.

The Python API (docuchat_rl/api.py, docs/api.md): `RLTrainer`, `SFTTrainer`, `recipe`.
"""

from .errors import quiet_bitsandbytes
from .sampling import reward_models  # noqa: F401  (the engine's torch-based reward registers itself under `reward_model`)

quiet_bitsandbytes()  # (before anything imports it: peft does at its import)

__version__ = "0.1.0"
__all__ = ["RLTrainer", "SFTTrainer", "TrainOutput", "recipe", "__version__"]
_API = ("RLTrainer", "SFTTrainer", "TrainOutput", "recipe")


def __getattr__(name: str):  # (the API on first use: `import docuchat_rl` stays what it was)
    if name in _API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'docuchat_rl' has no attribute {name!r}")


def __dir__() -> list[str]:  # (dir() and tab completion list the API, which loads on first use)
    return sorted({*globals(), *__all__})
