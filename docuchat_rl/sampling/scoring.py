"""Scoring completions: the composite reward a config names, called with the inputs every reward gets.

`build_reward` is the one place a `CompositeReward` is made from `rewards:` (training, evaluation and
`docuchat-rl generate --score`); `score` calls it on decoded completions with the reward inputs of
`data.reward_inputs` (the data set's columns, answer, completion_tokens, truncated, prompt_id).

Deliberately left out: remote reward servers; a reward is a Python callable (see `rewards/`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rewards import CompositeReward
from rewards.composite import BatchResult

from ..data import Example, reward_inputs

if TYPE_CHECKING:
    from ..config import RewardsConfig
    from .generation import Generation


def build_reward(cfg: RewardsConfig, with_format: bool = False) -> CompositeReward:
    """The configured components as one composite reward; `with_format` adds the format reward at weight
    0 when it is not configured (evaluation reports the format rate either way)."""
    specs = [c.model_dump() for c in cfg.components]
    if with_format and "format" not in {s["name"] for s in specs}:
        specs.append({"name": "format", "weight": 0.0})
    return CompositeReward(specs, strict=cfg.strict, timeout_s=cfg.timeout_s)


def score(reward: CompositeReward, examples: list[Example], texts: list[str], gen: Generation,
          trainer_state: object | None = None) -> BatchResult:
    """The composite reward of each completion; `examples` holds each completion's example (repeated).
    `trainer_state` (training: a transformers.TrainerState, as TRL passes) reaches the rewards by name."""
    columns = reward_inputs(examples, [len(c) for c in gen.completion_ids], gen.truncated,
                            [sum(m) for m in gen.model_mask] if gen.model_mask else None)
    if trainer_state is not None:
        columns["trainer_state"] = trainer_state
    if gen.conversations is not None:  # multi-turn: TRL's conversational shapes, the environments as a column
        prompts = [list(e.messages or [{"role": "user", "content": e.question}]) for e in examples]
        if gen.environments is not None and any(env is not None for env in gen.environments):
            columns["environments"] = gen.environments
        return reward(prompts, gen.conversations, completion_ids=gen.completion_ids, **columns)
    if any(e.messages for e in examples):  # a conversational data set: TRL's shapes (our rewards read either)
        prompts: list = [list(e.messages or [{"role": "user", "content": e.question}]) for e in examples]
        completions: list = [[{"role": "assistant", "content": t}] for t in texts]
        return reward(prompts, completions, completion_ids=gen.completion_ids, **columns)
    return reward([e.question for e in examples], texts, completion_ids=gen.completion_ids, **columns)
