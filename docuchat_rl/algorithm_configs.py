"""One config model per algorithm, selected by `algorithm.name` (a discriminated union).

Each model holds only the keys its algorithm reads, so a key of another algorithm (`n_steps` under PPO,
`vf_clip` under A2C, `scale` under PPO, `kl_in_reward` under GRPO) fails at load naming the key and the
algorithm. The algorithm classes in `algorithms.py` name their config type when they register; this
module stays free of torch so that `docuchat-rl config` loads without it.

`check(cfg)` holds an algorithm's cross-section demands (GRPO needs groups of 2 or more; A2C makes one
update per rollout) and returns one line naming the key at fault, or None.

Deliberately left out: user-defined algorithm configs through entry points; a new algorithm adds its
model here and to `AlgorithmConfig`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from .config import Config


class _Algo(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)

    name: str
    loss_aggregation: Literal["grpo", "dapo", "dr_grpo"] = "grpo"
    """grpo: mean of per-sequence token means; dapo: mean over all tokens; dr_grpo: sum / (rows * max_new_tokens)."""
    beta: float = Field(0.0, ge=0)
    """KL penalty weight against the reference (adapter-disabled) model, k3 estimator; 0 skips it."""

    def check(self, cfg: Config) -> str | None:
        """One line naming the key at fault when this algorithm cannot run with `cfg`, else None."""
        return None


class _Clipped(_Algo):
    """Keys of the clipped-surrogate algorithms (GRPO, PPO)."""

    ratio_level: Literal["token", "sequence"] = "token"
    """Importance ratio per token, or per sequence as the exp of the mean token log-ratio (GSPO)."""
    epsilon_low: float = Field(0.2, ge=0)
    """Lower clip range: ratios below 1 - epsilon_low are clipped."""
    epsilon_high: float = Field(0.2, ge=0)
    """Upper clip range: ratios above 1 + epsilon_high are clipped (DAPO clip-higher uses 0.28)."""
    num_iterations: int = Field(1, ge=1)
    """Policy updates (mu, or PPO epochs) per rollout, all against the log-probs recorded at rollout time."""


class _ActorCritic(_Algo):
    """Keys of the algorithms with a critic (PPO, A2C)."""

    gamma: float = Field(1.0, ge=0, le=1)
    """Discount per completion token (1 = undiscounted, the usual choice for LMs)."""
    whiten_advantages: bool = True
    """Normalise advantages to mean 0, std 1 over the batch's tokens."""
    vf_coef: float = Field(0.5, ge=0)
    """Weight of the value loss."""
    ent_coef: float = Field(0.0, ge=0)
    """Weight of the entropy bonus (0 skips the entropy gradient, which costs a full softmax)."""
    kl_in_reward: bool = False
    """With beta > 0: subtract beta * (log pi_old - log pi_ref) from each token's reward instead of a k3 KL loss."""
    critic_gain: float = Field(0.01, gt=0)
    """Orthogonal-init gain of the value head (small, so initial values are near 0)."""
    critic_backbone: Literal["shared", "separate"] = "shared"
    """The value head reads the policy adapter's hidden states (shared) or its own LoRA adapter's (separate)."""


class GRPOConfig(_Clipped):
    name: Literal["grpo"] = "grpo"
    """Registered algorithm (grpo, ppo, a2c); it selects which of the keys below apply."""
    scale: Literal["group", "batch", "none"] = "group"
    """Advantage scaling: divide by the group's std, the batch's std, or not at all (Dr. GRPO)."""
    std_epsilon: float = Field(1e-4, gt=0)
    """Added to the std before dividing the advantages."""

    def check(self, cfg: Config) -> str | None:
        if cfg.rollout.num_generations < 2:
            return ("config key 'rollout.num_generations': grpo compares completions within a group, "
                    f"so it needs at least 2 (got {cfg.rollout.num_generations})")
        return None


class PPOConfig(_Clipped, _ActorCritic):
    name: Literal["ppo"] = "ppo"
    """Registered algorithm (grpo, ppo, a2c); it selects which of the keys below apply."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE lambda."""
    vf_clip: float | None = Field(0.2, gt=0)
    """Clip range of the value update around the rollout-time value (null: unclipped)."""


class A2CConfig(_ActorCritic):
    name: Literal["a2c"] = "a2c"
    """Registered algorithm (grpo, ppo, a2c); it selects which of the keys below apply."""
    n_steps: int | None = Field(None, ge=1)
    """Bootstrap from the critic after n tokens (null: return to the end of the completion)."""
    num_iterations: int = Field(1, ge=1)
    """Updates per rollout: always 1 for a2c (a single on-policy update; use ppo for several epochs)."""

    def check(self, cfg: Config) -> str | None:
        if self.num_iterations != 1:
            return ("config key 'algorithm.num_iterations': a2c makes a single on-policy update per rollout "
                    f"(got {self.num_iterations}); use ppo for several epochs")
        if cfg.minibatch_rows != cfg.rollout.batch_rows:
            return (f"config key 'optim.minibatch_size': a2c makes a single update per rollout, so the "
                    f"minibatch is the whole batch ({cfg.rollout.batch_rows}), got {cfg.minibatch_rows}; "
                    "use optim.micro_batch_size to bound memory")
        return None


AlgorithmConfig = Annotated[Union[GRPOConfig, PPOConfig, A2CConfig], Field(discriminator="name")]
ALGORITHM_CONFIGS: dict[str, type[_Algo]] = {c.model_fields["name"].default: c
                                             for c in (GRPOConfig, PPOConfig, A2CConfig)}
