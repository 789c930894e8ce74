"""The rollout batch as tensors: the container every phase after the rollout reads and fills.

Layout of a row: [left-padded prompt | completion, right-padded]. The completion starts at the same
column (`prompt_width`) in every row, so its logits are the last T+1 positions shifted by one (the
policy forward in `forward.py` relies on it). Rows come in contiguous groups numbered 0, 1, ...; the
fields after `sampler_logps` are filled by later phases (the learner's no-grad passes, the algorithm's
advantages).

Deliberately left out: sequence packing (no padding at all); micro-batches are trimmed to their own
longest prompt and completion instead.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch


@dataclass(frozen=True)
class RowInfo:
    """What the host knows of each row without reading the device: lengths and groups (set when the batch
    is built, carried through `select`), so slicing and trimming micro-batches never wait for a GPU."""

    prompt_lens: tuple[int, ...]  # prompt tokens of each row
    completion_lens: tuple[int, ...]  # completion tokens of each row
    groups: tuple[int, ...]  # each row's group (the values of Batch.group)
    trained: tuple[bool, ...]  # False: the row's tokens are out of the loss (completion_mask all 0)
    prompts: tuple[int, ...]  # each row's distinct prompt: rows with one value have the same prompt tokens (a
    # group's rows usually do; an environment's per-row observation makes them differ)
    tool_tokens: tuple[int, ...] | None = None  # multi-turn: each row's tool-result tokens (out of the loss)

    def take(self, rows: list[int]) -> RowInfo:
        return RowInfo(*(None if v is None else tuple(v[r] for r in rows)
                         for v in (self.prompt_lens, self.completion_lens, self.groups, self.trained, self.prompts,
                                   self.tool_tokens)))

    @property
    def loss_lens(self) -> tuple[int, ...]:
        """The tokens each row puts into the loss (its completion's model tokens, or none when it is not
        trained on)."""
        tools = self.tool_tokens or (0,) * len(self.trained)
        return tuple(n - k if t else 0 for n, k, t in zip(self.completion_lens, tools, self.trained))


@dataclass
class Batch:
    """One process's rows of a step: token ids and masks, rewards and groups, and the per-token tensors
    the passes and the algorithm add (old/reference log-probs, values, returns, advantages)."""

    input_ids: torch.Tensor  # [R, Lp + T] long
    attention_mask: torch.Tensor  # [R, Lp + T] long
    completion_mask: torch.Tensor  # [R, T] float, 1.0 on the completion tokens the loss trains on
    prompt_width: int  # Lp
    rewards: torch.Tensor  # [R]
    group: torch.Tensor  # [R] long, group index within the step: the one source of truth for groups
    reward_valid: torch.Tensor  # [R] bool, False when no reward component had a value (kept out of baselines)
    sampler_logps: torch.Tensor  # [R, T] the sampler's log-prob of each completion token
    info: RowInfo  # host-side lengths and groups of the rows
    component_rewards: torch.Tensor | None = None  # [R, K] each reward component's raw score, NaN where none
    advantages: torch.Tensor | None = None  # [R, T]
    old_logps: torch.Tensor | None = None  # [R, T]
    ref_logps: torch.Tensor | None = None  # [R, T]
    values: torch.Tensor | None = None  # [R, T] critic estimates at rollout time
    returns: torch.Tensor | None = None  # [R, T] critic targets
    behaviour_weights: torch.Tensor | None = None  # [R, T] pi_prox / pi_sampler, truncated or masked (the learner
    # sets it per micro-batch under rollout.correction or a fixed lag; None: no correction)

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def completion_ids(self) -> torch.Tensor:
        return self.input_ids[:, self.prompt_width:]  # [R, T]

    def select(self, idx: slice | list[int] | torch.Tensor) -> Batch:
        """Rows `idx` (a slice: views, no copy), trimmed to their longest prompt and completion (fewer padded
        columns); the trim widths come from `info`, so selecting reads nothing back from the device."""
        rows = (list(range(self.rows))[idx] if isinstance(idx, slice)
                else idx.tolist() if isinstance(idx, torch.Tensor) else list(idx))
        index = idx if isinstance(idx, slice) else torch.tensor(rows, dtype=torch.long).to(self.input_ids.device)
        sub = {f.name: getattr(self, f.name) for f in fields(self)}
        for k, v in sub.items():
            if isinstance(v, torch.Tensor):
                sub[k] = v[index]
        info = self.info.take(rows)
        lp = self.prompt_width
        t = max(max(info.completion_lens, default=0), 1)  # keep >= 1 completion column
        start = lp - max(info.prompt_lens, default=0)
        for k in ("input_ids", "attention_mask"):
            sub[k] = sub[k][:, start:lp + t]
        for k in ("completion_mask", "sampler_logps", "advantages", "old_logps", "ref_logps", "values", "returns",
                  "behaviour_weights"):
            if sub[k] is not None:
                sub[k] = sub[k][:, :t]
        sub["prompt_width"], sub["info"] = lp - start, info
        return Batch(**sub)

    def placeholder(self, pad_id: int) -> Batch:
        """One row that trains nothing (completion_mask all 0) with every field this batch has: what a
        process short of micro-batches runs so that it joins each forward through sharded layers."""
        if self.rows:
            one = self.select(slice(0, 1))
        else:
            one = build_batch([[pad_id]], [[pad_id]], [0.0], [0], pad_id).to(self.input_ids.device)
            for name in ("advantages", "old_logps", "ref_logps", "values", "returns"):
                if getattr(self, name) is not None:
                    setattr(one, name, torch.zeros_like(one.completion_mask))
        return replace(one, completion_mask=torch.zeros_like(one.completion_mask),
                       reward_valid=torch.zeros_like(one.reward_valid))

    def to(self, device) -> Batch:
        """The same batch with every tensor on `device`."""
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if isinstance(getattr(self, f.name), torch.Tensor)})


def build_batch(prompt_ids: list[list[int]], completion_ids: list[list[int]], rewards: list[float],
                group: list[int], pad_id: int, sampler_logps: list[list[float]] | None = None,
                reward_valid: list[bool] | None = None, trained: list[bool] | None = None,
                component_rewards: list[list[float]] | None = None,
                model_masks: list[list[int] | None] | None = None) -> Batch:
    """Pad rows into a Batch. Groups must be contiguous and numbered 0, 1, ... in order (asserted here,
    once: the shared-prompt forward and the advantage estimators read `group` and nothing else). A row
    with `trained` False keeps its tokens (the forward sees them) but its completion mask is all 0; a
    multi-turn row's `model_masks` entry (1 sampled, 0 a tool's token) keeps its tool tokens out of the mask."""
    if any(b not in (a, a + 1) for a, b in zip([-1] + group[:-1], group)) or (group and group[0] != 0):
        raise ValueError(f"rows must come in contiguous groups numbered 0, 1, ...; got {group}")
    lp = max(map(len, prompt_ids), default=0)  # (no rows: a process whose groups were all dropped)
    t = max(1, max(map(len, completion_ids), default=0))
    r = len(prompt_ids)
    ids = torch.full((r, lp + t), pad_id, dtype=torch.long)  # [R, Lp + T]
    att = torch.zeros((r, lp + t), dtype=torch.long)  # [R, Lp + T]
    cmask = torch.zeros((r, t))  # [R, T]
    slogps = torch.zeros((r, t))  # [R, T]
    trained = [True] * r if trained is None else list(trained)
    for i, (p, c) in enumerate(zip(prompt_ids, completion_ids)):
        ids[i, lp - len(p):lp] = torch.tensor(p)
        att[i, lp - len(p):lp + len(c)] = 1
        if c:
            ids[i, lp:lp + len(c)] = torch.tensor(c)
            cmask[i, :len(c)] = float(trained[i])
            if model_masks is not None and model_masks[i] is not None:
                cmask[i, :len(c)] *= torch.tensor(model_masks[i], dtype=cmask.dtype)  # [len(c)]: tool tokens 0
            if sampler_logps is not None:
                slogps[i, :len(c)] = torch.tensor(sampler_logps[i])
    valid = torch.ones(r, dtype=torch.bool) if reward_valid is None else torch.tensor(reward_valid, dtype=torch.bool)
    tools = None if model_masks is None else tuple(0 if m is None else len(m) - sum(m) for m in model_masks)
    distinct: dict[tuple[int, ...], int] = {}
    prompts = tuple(distinct.setdefault(tuple(p), len(distinct)) for p in prompt_ids)
    info = RowInfo(tuple(map(len, prompt_ids)), tuple(map(len, completion_ids)), tuple(group), tuple(trained),
                   prompts, tools)
    components = None
    if component_rewards is not None:  # (no rows: [0, 0]; the estimator knows K from the config)
        k = len(component_rewards[0]) if component_rewards else 0
        components = torch.tensor(component_rewards, dtype=torch.float32).reshape(r, k)  # [R, K]
    return Batch(ids, att, cmask, lp, torch.tensor(rewards, dtype=torch.float32),
                 torch.tensor(group, dtype=torch.long), valid, slogps, info, component_rewards=components)
