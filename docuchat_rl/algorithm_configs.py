"""One config model per algorithm, selected by `algorithm.name` (a discriminated union).

Each model holds only the keys its algorithm reads, so a key of another algorithm (`n_steps` under PPO,
`vf_clip` under A2C, `scale` under PPO, `kl_in_reward` under GRPO) fails at load naming the key and the
algorithm. The algorithm classes in `algorithms.py` name their config type when they register; this
module stays free of torch so that `docuchat-rl config` loads without it.

`check(shape)` holds an algorithm's demands on the batch's shape (GRPO needs groups of 2 or more; A2C
makes one update per rollout) and returns one line naming the key at fault, or None.

`ALGORITHMS` is the one registry of algorithms: `@register_config` puts a config model under its
`name`, and `algorithms.register_algorithm` attaches the class that runs it (`implementation`), so a
name, its keys and its code are found in one place; the config's discriminated union is built from it.

Deliberately left out: user-defined algorithm configs through entry points; a new algorithm adds its
decorated model here and its decorated class in `algorithms.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError


@dataclass(frozen=True)
class BatchShape:
    """The rollout batch's shape as an algorithm's checks see it (built by `Config` from its sections)."""

    num_generations: int  # rollout.num_generations: the group size
    batch_rows: int  # completions per step (prompts_per_step * num_generations)
    minibatch_rows: int  # completions per optimizer step


def _takes(annotation, kinds: tuple[type, ...]) -> bool:
    """Whether a field's annotation admits one of `kinds` (through unions, Annotated and Optional)."""
    if annotation in kinds or annotation is Any:
        return True
    return any(_takes(arg, kinds) for arg in get_args(annotation) if not isinstance(arg, (str, int, float)))


class Keys(BaseModel):
    """A config section's model: unknown keys refused, docs from attribute docstrings, and numbers that are
    numbers (pydantic would read `true` as 1 and accept inf and nan, which train nothing)."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True,
                              allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_bool_as_number(cls, raw):
        for name, value in (raw.items() if isinstance(raw, dict) else ()):
            field = cls.model_fields.get(name)
            if isinstance(value, bool) and field is not None and _takes(field.annotation, (int, float)) \
                    and not _takes(field.annotation, (bool,)):
                raise PydanticCustomError("bool_as_number", "must be a number, not true/false",
                                          {"field": name, "value": value})
        return raw


class _Algo(Keys):
    implementation: ClassVar[Any] = None  # the algorithms.Algorithm subclass that runs it (set on registration)

    name: str
    loss_aggregation: Literal["grpo", "dapo", "bnpo", "dr_grpo", "luspo"] = "grpo"
    """grpo: mean of sequence means; dapo (2503.14476) = bnpo (2506.02864): token mean; dr_grpo (2503.20783): sum / (rows x max_new_tokens); luspo (2602.05261): mean of sums."""
    beta: float = Field(0.0, ge=0)
    """KL penalty weight against the reference (adapter-disabled) model, k3 estimator; 0 skips it."""
    ent_coef: float = Field(0.0, ge=0)
    """Weight of the entropy bonus (TRL's entropy_coef; 0 skips the entropy gradient, which costs a full softmax)."""
    mask_truncated_completions: bool = False
    """Leave completions cut at max_new_tokens out of the loss (they still count in their group's baseline) (DAPO)."""

    def check(self, shape: BatchShape) -> str | None:
        """One line naming the key at fault when this algorithm cannot run on batches of `shape`, else None."""
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
    """Policy updates (mu, or PPO epochs) per rollout, each ratio taken against the policy at the step's start (the proximal policy: under a fixed lag, not the sampler)."""
    kl_bias_correction: bool = False
    """With beta > 0: weight each token's k3 KL by the importance ratio pi / pi_old, not detached (TRL's use_bias_correction_kl, its default): the KL of the current policy, not the sampler's, which changes the gradient on-policy too."""


class _ActorCritic(_Algo):
    """Keys of the algorithms with a critic (PPO, A2C)."""

    gamma: float = Field(1.0, ge=0, le=1)
    """Discount per completion token (1 = undiscounted, the usual choice for LMs)."""
    whiten_advantages: bool = True
    """Normalise advantages to mean 0, std 1 over the batch's tokens."""
    vf_coef: float = Field(0.5, ge=0)
    """Weight of the value loss."""
    kl_in_reward: bool = False
    """With beta > 0: subtract beta * (log pi_old - log pi_ref) from each token's reward instead of a k3 KL loss."""
    critic_gain: float = Field(0.01, gt=0)
    """Orthogonal-init gain of the value head (small, so initial values are near 0)."""
    critic_backbone: Literal["shared", "separate"] = "shared"
    """The value head reads the policy adapter's hidden states (shared) or its own LoRA adapter's (separate)."""
    critic_lr: float | None = Field(None, gt=0)
    """Learning rate of the value head's linear layer in its own optimizer group (null: optim.lr); on SmolLM2 at 1e-3 it chased each batch's mean return, at 1e-4 it moved ~0.04 a step (docs/smollm2.md)."""


ALGORITHMS: dict[str, type[_Algo]] = {}


def register_config(cls: type[_Algo]) -> type[_Algo]:
    """Class decorator: the algorithm config model under its `name` default (the YAML/log name). The model gets an
    implementation of its own (None until `algorithms.register_algorithm` attaches its class), never its parent's:
    a config derived from GRPO's that names no class of its own is found out, not run as GRPO."""
    name = cls.model_fields["name"].default
    if name in ALGORITHMS:
        raise ValueError(f"algorithm {name!r} is already registered")
    cls.implementation = None  # (its own, not inherited)
    ALGORITHMS[name] = cls
    return cls


def unimplemented() -> list[str]:
    """The registered algorithm configs with no class that runs them (`algorithms.register_algorithm`)."""
    return sorted(f"{name} ({c.__name__})" for name, c in ALGORITHMS.items() if c.implementation is None)


@register_config
class GRPOConfig(_Clipped):
    """GRPO's keys: group-relative advantages, the clipped surrogate, no critic."""

    name: Literal["grpo"] = "grpo"
    """Registered algorithm (grpo, ppo, a2c); it selects which of the keys below apply."""
    scale: Literal["group", "batch", "none"] = "group"
    """Advantage scaling: divide by the group's std, the batch's std, or not at all (Dr. GRPO)."""
    std_epsilon: float = Field(1e-4, gt=0)
    """Added to the std before dividing the advantages."""
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = "sum_then_normalize"
    """Weighted sum, then group scaling; or each component group-scaled, summed, batch-scaled (GDPO, 2601.05242)."""
    surrogate: Literal["clip", "cispo", "sapo", "vespo"] = "clip"
    """clip (PPO's); cispo: capped ratio x log-prob (2506.13585); sapo: soft gate (2511.20347); vespo (2602.10693)."""
    delta: float | None = Field(None, gt=1)
    """Cap on the ratio of negative-advantage tokens too (two-sided clip; INTELLECT-2, 2505.07291); null: off."""
    sapo_temperature_pos: float = Field(1.0, gt=0)
    """sapo's gate temperature for tokens with a positive advantage."""
    sapo_temperature_neg: float = Field(1.05, gt=0)
    """sapo's gate temperature for tokens with a zero or negative advantage."""
    vespo_k_pos: float = Field(2.0, ge=0)
    """vespo's gamma power k for a non-negative advantage."""
    vespo_lambda_pos: float = Field(3.0, ge=0)
    """vespo's gamma rate lambda for a non-negative advantage."""
    vespo_k_neg: float = Field(3.0, ge=0)
    """vespo's gamma power k for a negative advantage."""
    vespo_lambda_neg: float = Field(2.0, ge=0)
    """vespo's gamma rate lambda for a negative advantage."""
    top_entropy_quantile: float = Field(1.0, ge=0, le=1)
    """Train on the top share of a micro-batch's tokens by entropy (1: all; the paper uses 0.2; 2506.01939)."""
    off_policy_mask_threshold: float | None = Field(None, gt=0)
    """Drop negative-advantage rows whose mean KL(sampler || policy) exceeds it (DeepSeek-V3.2, 2512.02556)."""

    def check(self, shape: BatchShape) -> str | None:
        if shape.num_generations < 2:
            return ("config key 'rollout.num_generations': grpo compares completions within a group, "
                    f"so it needs at least 2 (got {shape.num_generations})")
        return None

    @model_validator(mode="after")
    def _keys_apply(self) -> GRPOConfig:
        """A knob of another surrogate or aggregation set away from its default is an error, never
        silently ignored (a saved config repeats every default, which is harmless)."""
        owners = {"delta": "clip", **{k: "sapo" for k in ("sapo_temperature_pos", "sapo_temperature_neg")},
                  **{f"vespo_{k}": "vespo" for k in ("k_pos", "lambda_pos", "k_neg", "lambda_neg")}}
        changed = {k for k in self.model_fields_set if getattr(self, k) != type(self).model_fields[k].default}
        for key, surrogate in owners.items():
            if key in changed and self.surrogate != surrogate:
                raise ValueError(f"config key 'algorithm.{key}' applies to algorithm.surrogate {surrogate}, "
                                 f"not {self.surrogate}")
        if self.multi_objective_aggregation == "normalize_then_sum" and "scale" in changed:
            raise ValueError("config key 'algorithm.scale' does not apply with multi_objective_aggregation "
                             "normalize_then_sum (each component is scaled by its group std, the sum by the batch std)")
        return self


@register_config
class PPOConfig(_Clipped, _ActorCritic):
    """PPO's keys: the clipped surrogate and GAE over a value head, clipped value loss."""

    name: Literal["ppo"] = "ppo"
    """Registered algorithm (grpo, ppo, a2c); it selects which of the keys below apply."""
    lam: float = Field(0.95, ge=0, le=1)
    """GAE lambda."""
    vf_clip: float | None = Field(0.2, gt=0)
    """Clip range of the value update around the rollout-time value (null: unclipped)."""


@register_config
class A2CConfig(_ActorCritic):
    """A2C's keys: n-step returns from the critic, one plain policy-gradient update per rollout."""

    name: Literal["a2c"] = "a2c"
    """Registered algorithm (grpo, ppo, a2c); it selects which of the keys below apply."""
    n_steps: int | None = Field(None, ge=1)
    """Bootstrap from the critic after n tokens (null: return to the end of the completion)."""
    num_iterations: int = Field(1, ge=1)
    """Updates per rollout: always 1 for a2c (a single on-policy update; use ppo for several epochs)."""

    def check(self, shape: BatchShape) -> str | None:
        if self.num_iterations != 1:
            return ("config key 'algorithm.num_iterations': a2c makes a single on-policy update per rollout "
                    f"(got {self.num_iterations}); use ppo for several epochs")
        if shape.minibatch_rows != shape.batch_rows:
            return (f"config key 'optim.minibatch_size': a2c makes a single update per rollout, so the "
                    f"minibatch is the whole batch ({shape.batch_rows}), got {shape.minibatch_rows}; "
                    "use optim.micro_batch_size to bound memory")
        return None


AlgorithmConfig = Annotated[Union[tuple(ALGORITHMS.values())], Field(discriminator="name")]
