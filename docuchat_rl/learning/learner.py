"""The learner: every forward and backward over a step's batch, and the optimizer steps.

Before the update it runs the no-grad passes the algorithm asks for (`Algorithm.needs`): the policy's
log-probs and the critic's values at rollout time in one forward, the reference model's log-probs in
another (the adapter disabled). The update then runs `num_iterations` passes of a fixed number of
minibatches, each accumulated over micro-batches, its gradients summed over processes, clipped and
applied; a non-finite step is skipped (`optim.max_nonfinite_steps` in a row stop the run). Metrics are
combined over micro-batches and processes by `MetricAccumulator`, with each metric's own reduction.

Under FSDP2 every forward through the sharded layers is a collective, so a process with fewer
micro-batches runs placeholder rows that train nothing (`micro_batches`).

Under rollout.async_lag the update is decoupled PPO: the ratio and its clip are taken against the proximal
policy (the learner at the step's start), each token weighted once by pi_prox / pi_sampler (`behaviour`).

Deliberately left out: gradient accumulation across rollouts.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace

import numpy as np
import torch

from ..config import OptimConfig
from ..distributed import Dist
from ..errors import TrainingError
from ..modeling import CRITIC_ADAPTER, REFERENCE_ADAPTER, active_adapter
from .algorithms import Algorithm, RolloutNeeds
from .batch import Batch
from .forward import PolicyOutput, policy_forward
from .losses import Normalisers, behaviour_correction


class MetricAccumulator:
    """Loss metrics over a step's micro-batches and processes: a token-weighted mean unless the
    algorithm names another reduction ("max") for the metric. Values stay tensors on the device until
    `result`, which reads them back once (one wait for the GPU per step, not one per metric and micro-batch)."""

    def __init__(self, reductions: dict[str, str], device: torch.device | str = "cpu"):
        self.reductions, self.device = reductions, torch.device(device)
        self.sums: dict[str, torch.Tensor] = {}
        self.maxima: dict[str, torch.Tensor] = {}
        self.weight = 0.0

    def add(self, metrics: dict[str, torch.Tensor | float], weight: float) -> None:
        """One micro-batch's metrics (0-dim tensors or floats); `weight` is its number of completion tokens."""
        for k, v in metrics.items():
            v = torch.as_tensor(v, dtype=torch.float64, device=self.device)
            if self.reductions.get(k) == "max":
                self.maxima[k] = torch.maximum(self.maxima[k], v) if k in self.maxima else v
            else:
                self.sums[k] = self.sums[k] + v * weight if k in self.sums else v * weight
        self.weight += weight

    def result(self, dist: Dist) -> dict[str, float]:
        """Every process's metrics combined (the union of their keys: a process may have had no rows);
        the one read back: each kind stacked on the device, then one `tolist`."""
        keys = sorted(set(dist.gather(list(self.sums))))
        mkeys = sorted(set(dist.gather(list(self.maxima))))

        def fill(value: float) -> torch.Tensor:
            return torch.tensor(value, dtype=torch.float64, device=self.device)

        sums = torch.stack([fill(self.weight)] + [self.sums.get(k, fill(0.0)) for k in keys])  # [1 + keys]
        packed = dist.sum(sums).tolist()
        out = {k: v / max(packed[0], 1.0) for k, v in zip(keys, packed[1:])}
        if mkeys:
            top = torch.stack([self.maxima.get(k, fill(-math.inf)) for k in mkeys])  # [mkeys]
            out.update(zip(mkeys, dist.max(top).tolist()))
        return out


@dataclass(frozen=True)
class Handed:
    """What the learner is handed beside its own section (optim): the settings of other sections it obeys,
    each decided once where the run is assembled (run.py), none re-derived here."""

    num_iterations: int  # passes over a step's batch (the algorithm's)
    n_minibatches: int  # optimizer steps per pass (rollout.batch_rows // the minibatch's rows)
    temperature: float  # the sampler's distribution, under which the log-probs are taken
    top_k: int
    top_p: float
    max_new_tokens: int  # the fixed-length normaliser of a loss that asks for it
    correction: str | None  # the sampler correction in effect (RolloutConfig.correction_in_effect; None: none)
    correction_min: float
    correction_max: float
    decoupled: bool  # a fixed lag: decoupled PPO (the current policy's log-probs go to the correction)
    gradient_checkpointing: bool  # (the shared-prompt forward is off under it in train mode)
    separate_critic: bool  # the critic reads hidden states of its own adapter (a second forward)
    pad_id: int  # a placeholder row's token (sharded: micro-batches padded to every process's count)
    logit_chunk: int  # positions a logits chunk covers (0: all at once)
    sharded: bool  # FSDP2-sharded layers: no shared prompt, no length buckets, padded micro-batches


def rollout_passes(algo: Algorithm, updates_per_step: int) -> RolloutNeeds:
    """The no-grad passes before an update: what the algorithm reads, and the proximal log-probs (the policy at
    the update's start, whose ratio the loss clips) when the policy moves before the last minibatch is scored
    (several optimizer steps per rollout); with one the loss reads them off its own forward, detached."""
    needs = algo.needs()
    return replace(needs, old_logps=needs.old_logps or updates_per_step > 1)


class Learner:
    """The trainable side of a run: the peft model (and the algorithm's critic), the optimizer and the
    schedule; it scores batches and updates the adapter."""

    def __init__(self, optim: OptimConfig, handed: Handed, model, algo: Algorithm, params: list[torch.nn.Parameter],
                 optimizer, scheduler, accelerator, dist: Dist, nonfinite_streak: int = 0):
        self.optim, self.handed, self.model, self.algo, self.params = optim, handed, model, algo, params
        self.optimizer, self.scheduler, self.accelerator, self.dist = optimizer, scheduler, accelerator, dist
        self.sharded, self.separate_critic = handed.sharded, handed.separate_critic
        self.n_minibatches = handed.n_minibatches
        self.updates_per_step = handed.num_iterations * self.n_minibatches
        self.nonfinite_streak = nonfinite_streak  # optimizer steps skipped in a row (checkpointed)

    # ---------------------------------------------------------------- forward
    def forward(self, mb: Batch, with_critic: bool = True, **kw) -> PolicyOutput:
        """policy_forward with the run's settings, plus (`with_critic`, when the algorithm has a critic) the
        hidden states the critic reads: the same forward's (shared backbone) or a second forward through
        the critic's own adapter (separate backbone)."""
        critic = with_critic and self.algo.critic is not None
        # no shared-prompt forward and no length buckets when sharded (their number of model calls depends on
        # the rows); no shared prompt under gradient checkpointing in train mode (transformers' checkpointed
        # layers drop the KV cache it hands on)
        h = self.handed  # (the sampler's distribution: temperature and truncation)
        checkpointed = h.gradient_checkpointing and self.model.training
        kw.update(temperature=h.temperature, top_k=h.top_k, top_p=h.top_p, logit_chunk=h.logit_chunk,
                  share_prompt=self.optim.share_prompt and not self.sharded and not checkpointed,
                  length_buckets=1 if self.sharded else self.optim.length_buckets)
        out = policy_forward(self.model, mb, with_hidden=critic and not self.separate_critic, **kw)
        if critic and self.separate_critic:
            with active_adapter(self.model, CRITIC_ADAPTER, self.params):
                out.hidden = policy_forward(self.model, mb, with_hidden=True, **kw).hidden  # [r, T, H]
        return out

    def micro_batches(self, batch: Batch, rows: slice) -> list[tuple[slice | None, Batch]]:
        """(rows, micro-batch) for the contiguous `rows` of `batch`, `micro_batch_size` at a time; when
        sharded, padded with (None, a placeholder row that trains nothing) to the count of the process with
        the most, since each forward through the sharded layers is a collective."""
        size = self.optim.micro_batch_size
        parts = [slice(a, min(a + size, rows.stop)) for a in range(rows.start, rows.stop, size)]
        out: list[tuple[slice | None, Batch]] = [(r, batch.select(r)) for r in parts]
        missing = self.dist.steps(len(out)) - len(out) if self.sharded else 0
        if missing:
            out += [(None, batch.placeholder(self.handed.pad_id))] * missing
        return out

    # ---------------------------------------------------------------- the no-grad passes
    @property
    def needs(self) -> RolloutNeeds:
        """The no-grad passes this learner runs before the update (`rollout_passes`)."""
        return rollout_passes(self.algo, self.updates_per_step)

    def score_rollout(self, batch: Batch) -> None:
        """Fill what the algorithm needs before its advantages and update, in eval mode (the rollout's own
        mode, LoRA dropout off, whichever process sampled): batch.old_logps and batch.values from one forward
        with the adapter, batch.ref_logps from one without it."""
        needs = self.needs
        self.model.eval()
        if needs.old_logps or needs.values:
            logps, values = self._pass(batch, values=needs.values)
            batch.old_logps = logps if needs.old_logps else None
            batch.values = values
        if needs.ref_logps:
            batch.ref_logps = self._pass(batch, values=False, reference=True)[0]

    def reference(self):
        """The KL reference's context: the starting adapter when the run started from one (REFERENCE_ADAPTER,
        run.start_adapters), else the base model (the adapter disabled)."""
        if REFERENCE_ADAPTER in getattr(self.model, "peft_config", {}):
            return active_adapter(self.model, REFERENCE_ADAPTER, self.params)
        return self.model.disable_adapter()

    def _pass(self, batch: Batch, values: bool, reference: bool = False):
        """One no-grad pass over the batch, micro-batch by micro-batch -> (log-probs [R, T], values [R, T]
        masked to the completion, or None)."""
        logps = torch.zeros_like(batch.completion_mask)  # [R, T]
        vals = torch.zeros_like(batch.completion_mask)  # [R, T]
        ctx = self.reference() if reference else contextlib.nullcontext()
        with torch.no_grad(), ctx:
            for rows, mb in self.micro_batches(batch, slice(0, batch.rows)):
                out = self.forward(mb, with_critic=values)
                if rows is None:  # (sharded: a placeholder, run to join the other processes' forward)
                    continue
                logps[rows, :out.logps.shape[1]] = out.logps
                if values:
                    vals[rows, :out.logps.shape[1]] = self.algo.values(out.hidden)
        return logps, (vals * batch.completion_mask if values else None)

    # ---------------------------------------------------------------- the update
    def minibatches(self, batch: Batch, global_groups: list[int] | None = None) -> list[list[int]]:
        """The rows of each of the step's `n_minibatches` minibatches: group g (its step-wide index,
        `global_groups[batch.group]`) goes to minibatch g mod n. The same groups make up a minibatch whatever
        the number of processes, every process gets its share of each, and an under-filled batch still
        makes n minibatches. Read from the host's copy of the groups (no device read)."""
        step_group = [g if global_groups is None else global_groups[g] for g in batch.info.groups]
        return [[r for r, g in enumerate(step_group) if g % self.n_minibatches == k] for k in range(self.n_minibatches)]

    def update(self, batch: Batch, step: int, global_groups: list[int] | None = None) -> dict[str, float]:
        """`num_iterations` passes of a fixed number of optimizer steps over the batch (an under-filled
        batch still makes as many minibatches, so the schedule never changes pace); -> the step's metrics.
        Each minibatch's loss is normalised by its rows and tokens on all processes, and the gradients are
        summed across them before the step. The rows are put in minibatch order once, so every minibatch
        and micro-batch is a contiguous slice (a view: no copy, no device read)."""
        order = self.minibatches(batch, global_groups)
        bounds = [sum(map(len, order[:k])) for k in range(len(order) + 1)]
        batch = batch.select([r for rows in order for r in rows])
        acc = MetricAccumulator(self.algo.metric_reductions, batch.input_ids.device)
        grad_norms, losses, skipped = [], [], 0
        self.model.train()
        for _ in range(self.handed.num_iterations):
            for k in range(self.n_minibatches):
                lr = float(self.scheduler.get_last_lr()[0])  # (the rate this optimizer step uses: what TRL logs)
                total = self._accumulate(batch, slice(bounds[k], bounds[k + 1]), acc)
                grad_norm = self._step(total, step)
                if grad_norm is None:
                    skipped += 1
                else:
                    grad_norms.append(grad_norm)
                    losses.append(total)
        out = acc.result(self.dist)
        out.update(loss=float(np.mean(losses)) if losses else None,
                   grad_norm=float(np.mean(grad_norms)) if grad_norms else None,
                   lr=lr, optimizer_steps=len(losses), nonfinite_skipped=skipped)
        return out

    def _accumulate(self, batch: Batch, rows: slice, acc: MetricAccumulator) -> float:
        """Forward and backward over one minibatch's micro-batches -> its loss summed over processes (the one
        read from the device per optimizer step, with the gradient norm)."""
        dist = self.dist
        lens = batch.info.loss_lens[rows]
        n_rows, tokens = dist.sum_floats([float(len(lens)), float(sum(lens))])
        norm = Normalisers(rows=max(int(n_rows), 1), tokens=tokens, max_new_tokens=self.handed.max_new_tokens)
        total = torch.zeros((), dtype=torch.float64, device=batch.input_ids.device)
        for sub, mb in self.micro_batches(batch, rows):
            out = self.forward(mb, with_entropy=True, entropy_grad=self.algo.entropy_grad)
            mb.behaviour_weights, behaviour = self.behaviour(out, mb)
            loss, m = self.algo.loss(out, mb, norm)
            m.update(behaviour)
            if sub is None:  # sharded: join the other processes' forward and backward, add nothing
                self.accelerator.backward(loss * 0.0)
                continue
            self.accelerator.backward(loss)
            total = total + loss.detach()
            acc.add(m, float(sum(mb.info.loss_lens)))  # (the tokens the loss reads: no tool tokens, no untrained rows)
        if n_rows:  # (a minibatch with no rows on any process leaves every gradient None, as on one)
            dist.sum_grads(self.params)
        return float(dist.sum(total.reshape(1)))

    def behaviour(self, out: PolicyOutput, mb: Batch) -> tuple[torch.Tensor | None, dict]:
        """The sampler's side of a micro-batch (losses.behaviour_correction): the mismatch between the proximal
        policy and the sampler, and the weights pi_prox / pi_sampler that the correction in effect asks for
        (under a fixed lag by default decoupled PPO's truncated weight in [correction_min, correction_max]);
        applied once, by the algorithm's loss."""
        h = self.handed
        prox = mb.old_logps if mb.old_logps is not None else out.logps.detach()
        return behaviour_correction(prox, mb.sampler_logps, mb.completion_mask, h.correction, h.correction_min,
                                    h.correction_max, current_logps=out.logps if h.decoupled else None)

    def _step(self, total: float, step: int) -> float | None:
        """Clip and apply the summed gradients -> the gradient norm, or None when the loss or the norm is
        not finite (no weight or optimizer-state change; the schedule keeps its pace)."""
        cfg = self.optim
        grad_norm = float(self.accelerator.clip_grad_norm_(self.params, cfg.max_grad_norm or float("inf")))
        applied = math.isfinite(grad_norm) and math.isfinite(total)
        if applied:
            self.optimizer.step()
            self.nonfinite_streak = 0
        else:
            self.nonfinite_streak += 1
            if self.nonfinite_streak >= cfg.max_nonfinite_steps:
                raise TrainingError(
                    f"step {step}: {self.nonfinite_streak} optimizer steps in a row had a non-finite loss "
                    f"({total}) or gradient norm ({grad_norm}); stopped (the last checkpoint is intact; "
                    f"optim.max_nonfinite_steps is {cfg.max_nonfinite_steps})")
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm if applied else None
