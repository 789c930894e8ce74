"""The rollout batch as tensors, and the policy forward pass that scores completion tokens.

Layout of a row: [left-padded prompt | completion, right-padded]. The completion starts at the same
column (`prompt_width`) in every row, so its logits are the last T+1 positions shifted by one and
`logits_to_keep` spares the prompt positions. Position ids come from the attention mask, exactly as
`generate` computed them for left-padded prompts.

Deliberately left out: sequence packing (no padding at all); micro-batches are trimmed to their own
longest prompt and completion instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace

import torch

from .losses import token_entropy, token_logprobs


@dataclass
class Batch:
    input_ids: torch.Tensor  # [R, Lp + T] long
    attention_mask: torch.Tensor  # [R, Lp + T] long
    completion_mask: torch.Tensor  # [R, T] float, 1.0 on completion tokens
    prompt_width: int  # Lp
    rewards: torch.Tensor  # [R]
    group: torch.Tensor  # [R] long, group index within the step
    advantages: torch.Tensor | None = None  # [R, T]
    old_logps: torch.Tensor | None = None  # [R, T]
    ref_logps: torch.Tensor | None = None  # [R, T]
    values: torch.Tensor | None = None  # [R, T] critic estimates at rollout time
    returns: torch.Tensor | None = None  # [R, T] critic targets
    extra: dict = field(default_factory=dict)

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def completion_ids(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_width:]  # [R, T]

    def select(self, idx: torch.Tensor | slice) -> Batch:
        """Rows `idx`, trimmed to their longest prompt and completion (fewer padded columns)."""
        sub = {f.name: getattr(self, f.name) for f in fields(self)}
        for k, v in sub.items():
            if isinstance(v, torch.Tensor):
                sub[k] = v[idx]
        am, cm = sub["attention_mask"], sub["completion_mask"]
        lp = self.prompt_width
        t = int(cm.sum(0).nonzero().max()) + 1 if cm.any() else 1  # keep >= 1 completion column
        start = int(am[:, :lp].sum(0).nonzero().min()) if am[:, :lp].any() else lp
        for k in ("input_ids", "attention_mask"):
            sub[k] = sub[k][:, start:lp + t]
        for k in ("completion_mask", "advantages", "old_logps", "ref_logps", "values", "returns"):
            if sub[k] is not None:
                sub[k] = sub[k][:, :t]
        sub["prompt_width"] = lp - start
        return Batch(**sub)

    def to(self, device) -> Batch:
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})


def build_batch(prompt_ids: list[list[int]], completion_ids: list[list[int]], rewards: list[float],
                group: list[int], pad_id: int) -> Batch:
    lp = max(map(len, prompt_ids))
    t = max(1, max(map(len, completion_ids)))
    r = len(prompt_ids)
    ids = torch.full((r, lp + t), pad_id, dtype=torch.long)  # [R, Lp + T]
    att = torch.zeros((r, lp + t), dtype=torch.long)  # [R, Lp + T]
    cmask = torch.zeros((r, t))  # [R, T]
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        ids[i, lp - len(p):lp] = torch.tensor(p)
        att[i, lp - len(p):lp + len(c)] = 1
        if c:
            ids[i, lp:lp + len(c)] = torch.tensor(c)
            cmask[i, :len(c)] = 1.0
    return Batch(ids, att, cmask, lp, torch.tensor(rewards, dtype=torch.float32),
                 torch.tensor(group, dtype=torch.long))


@dataclass
class PolicyOutput:
    logps: torch.Tensor  # [R, T] log-probs of the completion tokens (with grad if enabled)
    entropy: torch.Tensor | None  # [R, T] no grad
    hidden: torch.Tensor | None  # [R, T, H] last hidden states at the positions that predict each token


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counted over real tokens only (left padding does not shift them). [R, L] -> [R, L]"""
    return (attention_mask.cumsum(-1) - 1).clamp(min=0)


def policy_forward(model, batch: Batch, temperature: float = 1.0, with_entropy: bool = False,
                   with_hidden: bool = False, entropy_grad: bool = False) -> PolicyOutput:
    """Log-probs of each completion token under `model`; logits only for completion positions.

    The entropy is a diagnostic (no grad) unless `entropy_grad`, for losses with an entropy bonus.
    """
    t = batch.completion_mask.shape[1]
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                position_ids=position_ids(batch.attention_mask), logits_to_keep=t + 1,
                output_hidden_states=with_hidden, use_cache=False)
    logits = out.logits[:, :-1, :] / temperature  # [R, T, V]: position j predicts completion token j
    logps = token_logprobs(logits, batch.completion_ids)  # [R, T]
    entropy = None
    if with_entropy or entropy_grad:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = token_entropy(logits)  # [R, T]
    hidden = out.hidden_states[-1][:, -t - 1:-1, :] if with_hidden else None  # [R, T, H]
    return PolicyOutput(logps, entropy, hidden)
