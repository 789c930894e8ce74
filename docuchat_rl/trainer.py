"""The training loop: rollout -> score -> advantages -> update -> log -> checkpoint, one step at a time.

One step samples `prompts_per_step` prompts, `num_generations` completions each, scores them with the
composite reward, lets the algorithm turn rewards into per-token advantages, runs `num_iterations`
passes of minibatch updates over the LoRA adapter (and critic), writes one trace record per
completion and one metrics record, and checkpoints every `checkpoint.every` steps.

Exact resume: a checkpoint holds everything the next step reads (adapter, critic, optimizer,
scheduler, RNG states, data order and position, output file offsets). Checkpoints are taken between
steps, so a run stopped anywhere inside a step (inside a mu-cycle included) resumes by replaying that
step from the same state, and output files are truncated back to the checkpoint's offsets first.

Where things live: sampling, scoring and the per-completion records in `rollout.py`; the batch and the
policy forward in `batch.py`; advantages and losses in `algorithms.py`; LoRA and critic adapters in
`modeling.py`; checkpoint files in `checkpoint.py`. This module keeps the loop, the update and the
calls that tie them together.

Several processes (`torchrun`, `accelerate launch`): every process draws the step's prompt list and
samples, scores and trains its share of the groups; gradients are summed across processes per minibatch
(distributed.py); the main process writes the traces, metrics and checkpoint files.

With an FSDP accelerate config the decoder layers' frozen weights are sharded (distributed.py): rollout
and evaluation run on gathered weights (or, with `rollout.sharded_generation`, decode in lockstep on the
sharded ones), and every process runs the same number of forwards through the sharded layers.

Deliberately left out: serving engines (vLLM, SGLang) for the rollout.
"""

from __future__ import annotations

import contextlib
import math
import os
import random
import signal
import sys
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from rewards import CompositeReward

from .algorithms import get_algorithm_class
from .batch import Batch, policy_forward
from .checkpoint import latest_step, load_training_state, resolve_resume, save_checkpoint, write_training_state
from .config import Config
from .data import DataError, Example, PromptSampler, load_examples, render_prompt
from .distributed import (Dist, ShardingError, gathered, held_bytes, on_cpu, shard_layers,
                          sharding_from_launcher, without_fsdp_env)
from .errors import Preempted, TrainingError
from .losses import Normalisers
from .modeling import (CRITIC_ADAPTER, active_adapter, add_critic_adapter, build_lora, disable_dropout,
                       load_model_and_tokenizer)
from .outputs import JsonlWriter, RunLock, check_writable, claim_output_dir
from .rollout import Collector, Rollout, Timer

__all__ = ["Trainer", "TrainingError", "Timer"]


def build_optimizer(params, cfg: Config, total_updates: int):
    from transformers import get_scheduler

    o = cfg.optim
    if o.name == "adamw":
        opt = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    else:
        opt = torch.optim.RMSprop(params, lr=o.lr, alpha=o.alpha, eps=o.eps, weight_decay=o.weight_decay)
    name = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[o.schedule]
    sched = get_scheduler(name, opt, num_warmup_steps=o.warmup_steps, num_training_steps=total_updates)
    return opt, sched


class Trainer:
    def __init__(self, cfg: Config, resume: str | None = None, examples: list[Example] | None = None):
        self.cfg = cfg
        self.out_dir = Path(cfg.run.output_dir)
        # every check of the output folder and the checkpoint comes before anything is loaded
        resume_dir = resolve_resume(resume, self.out_dir) if resume else None
        # several processes (accelerate launch / torchrun): the main one holds the folder and writes the files
        # (the schedule steps once per optimizer step, whatever the number of processes)
        from accelerate import Accelerator

        try:  # FSDP2 when the launcher's accelerate config asks for it (the trainer shards; distributed.py)
            self.sharding = sharding_from_launcher()
        except ShardingError as e:
            raise TrainingError(str(e)) from None
        with without_fsdp_env():
            self.accelerator = Accelerator(cpu=on_cpu(cfg.model.device), step_scheduler_with_optimizer=False)
        if self.accelerator.mixed_precision != "no":  # (it would be ignored: the model is not prepared)
            raise TrainingError(f"the accelerate config's mixed_precision ({self.accelerator.mixed_precision}) is not "
                                "used by docuchat-rl, whose model runs in model.dtype: set model.dtype (bfloat16) "
                                "instead and mixed_precision: 'no'")
        self.dist = Dist.from_accelerator(self.accelerator)
        self.is_main = self.dist.is_main
        self._lock = None
        try:
            self._agree(self._claim, resume_dir)
            self._setup(cfg, resume_dir, examples)
        except BaseException:
            if self._lock is not None:
                self._lock.release()  # a run that failed to start holds nothing
            raise

    def _agree(self, fn, *args) -> None:
        """Run `fn` (which may fail on one process only, e.g. the main one's folder checks) and fail on every
        process if it failed on any, so that none is left waiting in a collective."""
        error = None
        try:
            fn(*args)
        except (RuntimeError, ValueError) as e:
            error = str(e)
        if int(self.dist.max(torch.tensor([float(error is not None)]))):
            raise TrainingError(error or "the main process could not start the run (see its error)")

    def _claim(self, resume_dir: Path | None) -> None:
        """The output folder is writable, locked by this run, and (a new run) empty or overwritable."""
        check_writable(self.out_dir)
        if self.is_main:
            self._lock = RunLock(self.out_dir)
            if resume_dir is None:
                claim_output_dir(self.out_dir, self.cfg.run.overwrite)

    def _setup(self, cfg: Config, resume_dir: Path | None, examples: list[Example] | None) -> None:
        from transformers import set_seed

        if cfg.logging.wandb:
            try:
                import wandb  # noqa: F401  (fail before loading anything)
            except ImportError:
                raise TrainingError("logging.wandb is on but wandb is not installed: pip install "
                                    "'docuchat-rl[wandb]'") from None
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        set_seed(cfg.run.seed)
        if cfg.rollout.sharded_generation and not self.sharding:
            raise TrainingError("rollout.sharded_generation applies only to runs sharded by an FSDP accelerate "
                                "config (accelerate launch --config_file config/accelerate/fsdp2.yaml)")
        if cfg.rollout.prompts_per_step % self.dist.world:
            raise TrainingError(f"rollout.prompts_per_step ({cfg.rollout.prompts_per_step}) must divide by the "
                                f"number of processes ({self.dist.world}): each process samples whole groups")
        model, self.tokenizer = load_model_and_tokenizer(
            cfg.model.name_or_path, cfg.model.dtype, str(self.accelerator.device),
            cfg.model.trust_remote_code, cfg.model.revision)
        if cfg.model.disable_dropout:
            disable_dropout(model)
        self.context_len = getattr(model.config, "max_position_embeddings", None)
        chunk = cfg.optim.logit_chunk
        vocab = model.get_output_embeddings().weight.shape[0]
        self.logit_chunk = chunk if chunk is not None else (1024 if vocab > 32768 else 0)
        self.model = build_lora(model, cfg.lora)
        self.algo = get_algorithm_class(cfg.algorithm.name)(cfg, model.config.hidden_size)
        self.algo.reduce = self.dist.sum
        critic = self.algo.critic
        self.separate_critic = critic is not None and cfg.algorithm.critic_backbone == "separate"
        if critic is not None:
            critic.to(self.accelerator.device)
        if self.separate_critic:
            add_critic_adapter(self.model, cfg.lora)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        if critic is not None:
            self.params += list(critic.parameters())
        # the decoder layers' frozen weights split across processes; every trainable parameter stays whole
        self.sharded_layers = shard_layers(self.model, self.sharding) if self.sharding else []
        # generation on gathered weights, or (rollout.sharded_generation) on the sharded ones in lockstep
        sharded_generation = bool(self.sharded_layers) and cfg.rollout.sharded_generation
        self.gather_for_generation = [] if sharded_generation else self.sharded_layers
        self.lockstep = self.dist.any if sharded_generation else None
        if self.sharded_layers and self.is_main:
            mine, whole = held_bytes(self.model)
            layer = type(self.sharded_layers[0]).__name__.removeprefix("FSDP")  # (fully_shard renames the class)
            print(f"docuchat-rl: FSDP2 over {len(self.sharded_layers)} {layer} modules on {self.dist.world} "
                  f"processes: each holds {mine / 2**20:.1f} MB of the model's {whole / 2**20:.1f} MB of parameters",
                  file=sys.stderr, flush=True)
        self.n_minibatches = cfg.rollout.batch_rows // cfg.minibatch_rows
        self.updates_per_step = cfg.algorithm.num_iterations * self.n_minibatches
        opt, sched = build_optimizer(self.params, cfg, cfg.run.steps * self.updates_per_step)
        # the model is not wrapped (no DDP): gradients are summed across processes per minibatch (distributed.py)
        self.optimizer, self.scheduler = self.accelerator.prepare(opt, sched)
        # accelerate saves optimizer, scheduler and RNG states; the adapter is saved by peft instead
        self.accelerator.register_save_state_pre_hook(lambda models, weights, d: weights.clear())
        self.accelerator.register_load_state_pre_hook(lambda models, d: models.clear())

        self.examples = examples if examples is not None else load_examples(
            cfg.data.train, cfg.data.train_split, cfg.data.prompt_column, cfg.data.answer_column,
            revision=cfg.data.revision, subset=cfg.data.subset)
        if not self.examples:
            raise DataError(f"{cfg.data.train}: no training rows")
        prompt_texts = [render_prompt(self.tokenizer, e.question, cfg.data.system_prompt) for e in self.examples]
        self._check_lengths(prompt_texts)
        self.reward = CompositeReward([c.model_dump() for c in cfg.rewards.components],
                                      strict=cfg.rewards.strict, timeout_s=cfg.rewards.timeout_s)
        self.step, self.nonfinite_streak = 0, 0
        self.run_id = self.dist.gather([uuid.uuid4().hex[:12]])[0]  # the main process's id, on every process
        sampler = PromptSampler(len(self.examples), cfg.run.seed)
        offsets = {}
        if resume_dir:
            state = load_training_state(resume_dir, model=self.model, critic=critic,
                                        separate_critic=self.separate_critic, accelerator=self.accelerator)
            self.step, self.run_id, offsets = state["step"], state["run_id"], state["offsets"]
            self.nonfinite_streak = state.get("nonfinite_streak", 0)
            sampler = PromptSampler(len(self.examples), cfg.run.seed, **state["sampler"])
            if state.get("world_size", 1) != self.dist.world and self.is_main:
                import warnings

                from .errors import CheckpointWarning

                wrote = state.get("world_size", 1)
                warnings.warn(f"{resume_dir.name} was written by {wrote} process{'es' * (wrote != 1)} and resumes "
                              f"on {self.dist.world}: the run goes on, but not bit-exactly (sums run in "
                              "another order)", CheckpointWarning, stacklevel=2)
        self.collector = Collector(cfg.rollout, self.tokenizer, self.examples, prompt_texts, self.reward, sampler,
                                   cfg.run.seed, self.dist, self.lockstep)
        self.traces = self.metrics = self.evals = None  # the main process writes every process's records
        if self.is_main:
            self.traces = JsonlWriter(self.out_dir / "traces.jsonl", offsets.get("traces"))
            self.metrics = JsonlWriter(self.out_dir / "metrics.jsonl", offsets.get("metrics"))
            self.evals = JsonlWriter(self.out_dir / "eval.jsonl", offsets.get("evals"))
        phase_file = os.environ.get("DOCUCHAT_RL_PHASE_FILE")
        self._phase_fd = os.open(phase_file, os.O_WRONLY | os.O_CREAT, 0o644) if phase_file else None
        self._stop: signal.Signals | None = None
        self._eval_examples: list[Example] | None = None
        self.last_eval: dict | None = None  # the latest periodic evaluation (eval.every)
        self.wandb = self._init_wandb()

    # ---------------------------------------------------------------- set-up checks
    def _check_lengths(self, prompt_texts: list[str]) -> None:
        limit = self.cfg.data.max_prompt_tokens
        budget = None if self.context_len is None else self.context_len - self.cfg.rollout.max_new_tokens
        if budget is not None and budget < 1:
            raise TrainingError(f"rollout.max_new_tokens ({self.cfg.rollout.max_new_tokens}) leaves no room "
                                f"for a prompt in the model's context of {self.context_len} tokens")
        lengths = [len(x) for x in self.tokenizer(prompt_texts, add_special_tokens=False)["input_ids"]]
        for i, n in enumerate(lengths):
            if n > limit or (budget is not None and n > budget):
                raise TrainingError(
                    f"{self.cfg.data.train}: row {self.examples[i].prompt_id} has a prompt of {n} tokens; "
                    f"data.max_prompt_tokens is {limit} and the model's context leaves {budget} after "
                    f"rollout.max_new_tokens; shorten it, filter the data, or raise the limit")

    def _init_wandb(self):
        if not self.cfg.logging.wandb or not self.is_main:
            return None
        import wandb

        return wandb.init(project=self.cfg.logging.wandb_project, mode=self.cfg.logging.wandb_mode,
                          dir=str(self.out_dir), config=self.cfg.to_dict(), id=self.run_id, resume="allow")

    # ---------------------------------------------------------------- phases
    def collect(self, timer: Timer) -> Rollout:
        """Rollout and score phases of the next step (see rollout.Collector), on gathered weights when sharded."""
        with gathered(self.gather_for_generation, self.sharding):
            return self.collector.collect(self.model, timer, self.step + 1)

    def _micro_batches(self, batch: Batch, rows: torch.Tensor) -> list[tuple[torch.Tensor | None, Batch]]:
        """(row indices, micro-batch) for `rows` of `batch`; when sharded, padded with (None, a placeholder
        row that trains nothing) to the count of the process with the most, since each forward through the
        sharded layers is a collective."""
        chunks = list(rows.split(self.cfg.optim.micro_batch_size)) if len(rows) else []
        out: list[tuple[torch.Tensor | None, Batch]] = [(r, batch.select(r)) for r in chunks]
        missing = self.dist.steps(len(chunks)) - len(chunks) if self.sharded_layers else 0
        if missing:
            out += [(None, batch.placeholder(self.tokenizer.pad_token_id))] * missing
        return out

    def prepare(self, rollout: Rollout) -> Batch:
        """This process's used groups as a batch on the training device (it may have none of them)."""
        if not rollout.groups_used:
            raise TrainingError("dynamic sampling found no group with varied rewards in "
                                f"{self.cfg.rollout.max_resample_rounds + 1} rounds")
        return rollout.batch(self.tokenizer.pad_token_id).to(self.accelerator.device)

    def forward(self, mb: Batch, with_critic: bool = True, **kw):
        """policy_forward with the run's settings, plus (`with_critic`, when the algorithm has a critic) the
        hidden states the critic reads: the same forward's (shared backbone) or a second forward through
        the critic's own adapter (separate backbone)."""
        critic = with_critic and self.algo.critic is not None
        # (sharded: no shared-prompt forward, whose number of model calls depends on the rows)
        kw.update(temperature=self.cfg.rollout.temperature, logit_chunk=self.logit_chunk,
                  share_prompt=self.cfg.optim.share_prompt and not self.sharded_layers)
        out = policy_forward(self.model, mb, with_hidden=critic and not self.separate_critic, **kw)
        if critic and self.separate_critic:
            with active_adapter(self.model, CRITIC_ADAPTER, self.params):
                out.hidden = policy_forward(self.model, mb, with_hidden=True, **kw).hidden  # [r, T, H]
        return out

    def _rollout_pass(self, batch: Batch, logps_into: str | None, values: bool,
                      disable_adapter: bool = False) -> None:
        """One no-grad pass over the batch, micro-batch by micro-batch, filling batch.<logps_into> [R, T]
        with log-probs and, with a critic, batch.values [R, T] from the same forward's hidden states."""
        logps = torch.zeros_like(batch.completion_mask)  # [R, T]
        vals = torch.zeros_like(batch.completion_mask)  # [R, T]
        ctx = self.model.disable_adapter() if disable_adapter else contextlib.nullcontext()
        with torch.no_grad(), ctx:
            for rows, mb in self._micro_batches(batch, torch.arange(batch.rows)):
                out = self.forward(mb, with_critic=values)
                if rows is None:  # (sharded: a placeholder, run to join the other processes' forward)
                    continue
                logps[rows, :out.logps.shape[1]] = out.logps
                if values:
                    vals[rows, :out.logps.shape[1]] = self.algo.critic(out.hidden)
        if logps_into:
            setattr(batch, logps_into, logps)
        if values:
            batch.values = vals * batch.completion_mask

    def advantages(self, batch: Batch, timer: Timer) -> dict[str, float]:
        with timer("advantages"):
            need_old = (self.cfg.algorithm.num_iterations > 1 or self.n_minibatches > 1
                        or self.algo.needs_rollout_logps)
            critic = self.algo.critic is not None
            if need_old or critic:  # old log-probs and values share one forward
                self._rollout_pass(batch, "old_logps" if need_old else None, values=critic)
            if self.cfg.algorithm.beta > 0:
                self._rollout_pass(batch, "ref_logps", values=False, disable_adapter=True)
            return self.algo.advantages(batch)

    def minibatches(self, batch: Batch, global_groups: list[int] | None = None) -> list[torch.Tensor]:
        """The rows of each of the step's `n_minibatches` minibatches: group g (its step-wide index,
        `global_groups[batch.group]`) goes to minibatch g mod n. The same groups make up a minibatch whatever
        the number of processes, every process gets its share of each, and an under-filled batch still
        makes n minibatches."""
        g = batch.group if global_groups is None else torch.tensor(global_groups, dtype=torch.long,
                                                                    device=batch.group.device)[batch.group]  # [R]
        return [torch.nonzero(g % self.n_minibatches == k).squeeze(-1) for k in range(self.n_minibatches)]

    def update(self, batch: Batch, timer: Timer, global_groups: list[int] | None = None) -> dict[str, float]:
        """`num_iterations` passes of a fixed number of optimizer steps over the batch. An under-filled
        batch (dynamic sampling out of rounds) is split into as many minibatches as a full one, so the
        schedule's horizon and the steps per rollout never change. A minibatch whose loss or gradient
        norm is not finite is not applied (`nonfinite_skipped`); `optim.max_nonfinite_steps` of them in a
        row stop the run. On several processes each minibatch's loss is normalised by its rows and tokens
        on all processes, and the gradients are summed across them before the step."""
        cfg, dist = self.cfg, self.dist
        sums: dict[str, float] = defaultdict(float)
        maxima: dict[str, float] = {}
        weight = 0.0
        grad_norms, losses, skipped = [], [], 0
        self.model.train()
        with timer("update"):
            for _ in range(cfg.algorithm.num_iterations):
                for mb_rows in self.minibatches(batch, global_groups):
                    mask = batch.completion_mask[mb_rows]
                    n_rows, tokens = dist.sum(torch.tensor([float(len(mb_rows)), float(mask.sum())])).tolist()
                    norm = Normalisers(rows=max(int(n_rows), 1), tokens=tokens,
                                       max_new_tokens=cfg.rollout.max_new_tokens)
                    total = 0.0
                    for rows, mb in self._micro_batches(batch, mb_rows):
                        out = self.forward(mb, with_entropy=True,
                                           entropy_grad=self.algo.entropy_grad)
                        loss, m = self.algo.loss(out, mb, norm)
                        if rows is None:  # sharded: join the other processes' forward and backward, add nothing
                            self.accelerator.backward(loss * 0.0)
                            continue
                        self.accelerator.backward(loss)
                        total += float(loss.detach())
                        w = float(mb.completion_mask.sum())  # every metric is token-weighted, maxima are maxima
                        for k, v in m.items():
                            if k.endswith("_max"):
                                maxima[k] = max(maxima.get(k, v), v)
                            else:
                                sums[k] += v * w
                        weight += w
                    if n_rows:  # (a minibatch with no rows on any process leaves every gradient None, as on one)
                        dist.sum_grads(self.params)
                    total = float(dist.sum(torch.tensor([total], dtype=torch.float64)))
                    max_norm = cfg.optim.max_grad_norm or float("inf")
                    grad_norm = float(self.accelerator.clip_grad_norm_(self.params, max_norm))
                    if math.isfinite(grad_norm) and math.isfinite(total):
                        self.optimizer.step()
                        self.nonfinite_streak = 0
                        grad_norms.append(grad_norm)
                        losses.append(total)
                    else:  # skip: no weight or optimizer-state change; the schedule keeps its pace
                        skipped += 1
                        self.nonfinite_streak += 1
                        if self.nonfinite_streak >= cfg.optim.max_nonfinite_steps:
                            raise TrainingError(
                                f"step {self.step + 1}: {self.nonfinite_streak} optimizer steps in a row had a "
                                f"non-finite loss ({total}) or gradient norm ({grad_norm}); stopped (the last "
                                f"checkpoint is intact; optim.max_nonfinite_steps is {cfg.optim.max_nonfinite_steps})")
                    self.scheduler.step()
                    self.optimizer.zero_grad(set_to_none=True)
        # the union of every process's metric keys (a process may have had no rows in this step)
        keys = sorted(set(dist.gather(list(sums))))
        packed = dist.sum(torch.tensor([weight] + [sums[k] for k in keys], dtype=torch.float64)).tolist()
        out = {k: v / max(packed[0], 1.0) for k, v in zip(keys, packed[1:])}
        mkeys = sorted(set(dist.gather(list(maxima))))
        if mkeys:
            top = torch.tensor([maxima.get(k, -math.inf) for k in mkeys], dtype=torch.float64)
            out.update(zip(mkeys, dist.max(top).tolist()))
        out.update(loss=float(np.mean(losses)) if losses else None,
                   grad_norm=float(np.mean(grad_norms)) if grad_norms else None,
                   lr=float(self.scheduler.get_last_lr()[0]), optimizer_steps=len(losses), nonfinite_skipped=skipped)
        return out

    # ---------------------------------------------------------------- log and checkpoint
    def log(self, step: int, rollout: Rollout, batch: Batch, metrics: dict, timer: Timer) -> dict:
        """Write every process's trace records (the main process, in the one-process order) and the step's
        metrics record, computed over all of them."""
        with timer("log"):  # the trace records' writing (the metrics record carries these timings)
            pairs = self.dist.gather(rollout.trace_records(step, self.run_id, self.algo.trace_fields(batch)))
            records = [rec for _, rec in sorted(pairs, key=lambda pair: pair[0])]  # one-process order (stable)
            if self.traces is not None:
                self.traces.write(records)
        totals = np.array([r["total"] for r in records])
        lengths = np.array([r["completion_tokens"] for r in records])
        m = {"step": step, "reward/mean": float(totals.mean()), "reward/std": float(totals.std())}
        for name in self.reward.names:
            vals = [r["rewards"][name]["raw"] for r in records if r["rewards"][name]["raw"] is not None]
            m[f"rewards/{name}/mean"] = float(np.mean(vals)) if vals else None
            m[f"rewards/{name}/errors"] = sum(r["rewards"][name]["error"] is not None for r in records)
        acc_name = self.cfg.rewards.accuracy_component
        if acc_name in self.reward.names:
            m["accuracy"] = m[f"rewards/{acc_name}/mean"]
        m.update({"completion_len/mean": float(lengths.mean()), "completion_len/max": int(lengths.max()),
                  "truncated_frac": float(np.mean([r["truncated"] for r in records])),
                  "reward_missing": sum(r["total_missing"] for r in records),
                  "prompts_sampled": rollout.prompts_sampled,
                  "groups_used": rollout.groups_used, "kl": None})
        m.update(metrics)
        rollout_s = float(self.dist.max(torch.tensor([timer.seconds.get("rollout", 0.0)])))
        m["rollout_tokens_per_s"] = float(lengths.sum() / rollout_s) if rollout_s else None
        for phase, s in timer.seconds.items():
            m[f"time/{phase}"] = s
        if self.metrics is not None:
            self.metrics.write([m])
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in m.items() if v is not None}, step=step)
        return m

    def checkpoint(self, step: int) -> Path:
        """Every process takes part (each saves its random states); the main process writes the rest and
        completes the folder (see checkpoint.py)."""
        trainer_state = {"step": step, "run_id": self.run_id, "sampler": self.collector.sampler.state(),
                         "nonfinite_streak": self.nonfinite_streak, "world_size": self.dist.world,
                         "offsets": {"traces": self.traces.offset, "metrics": self.metrics.offset,
                                     "evals": self.evals.offset} if self.is_main else {}}

        def write_into(folder: Path) -> None:
            write_training_state(folder, model=self.model, tokenizer=self.tokenizer, critic=self.algo.critic,
                                 accelerator=self.accelerator, config=self.cfg.to_dict(),
                                 trainer_state=trainer_state, main=self.is_main)

        return save_checkpoint(self.out_dir, step, write_into, self.cfg.checkpoint.keep_last, self.dist)

    def held_out(self) -> list[Example]:
        """The held-out rows (eval.limit of them), read once per run."""
        if self._eval_examples is None:
            d = self.cfg.data
            self._eval_examples = load_examples(d.test, d.test_split, d.prompt_column, d.answer_column,
                                                limit=self.cfg.eval.limit, revision=d.revision, subset=d.subset)
        return self._eval_examples

    def evaluate(self) -> dict:
        """Held-out evaluation, each process a share of the rows, the numbers over all of them on every
        process (greedy, and pass@k from its own streams: the run's random state is unchanged by it)."""
        from .evaluate import evaluate

        with gathered(self.gather_for_generation, self.sharding):
            return evaluate(self.model, self.tokenizer, self.cfg, self.held_out(), self.dist, self.lockstep)

    # ---------------------------------------------------------------- preemption
    @contextlib.contextmanager
    def _signals(self):
        """SIGTERM / SIGINT (Slurm and Kubernetes send SIGTERM before killing) ask the loop to stop at its
        next safe point; a second signal stops at once (KeyboardInterrupt), the last checkpoint intact."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def ask(signum, frame):
            if self._stop is not None:
                signal.signal(signal.SIGINT, signal.default_int_handler)
                raise KeyboardInterrupt
            self._stop = signal.Signals(signum)
            print(f"docuchat-rl: {self._stop.name} received: stopping at the next safe point "
                  "(send it again to stop at once)", file=sys.stderr, flush=True)

        previous = {s: signal.signal(s, ask) for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for s, handler in previous.items():
                signal.signal(s, handler)

    def _snapshot(self) -> dict:
        """What a step draws from before its update: the random states and the data position."""
        rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        return {"rng": rng, "sampler": self.collector.sampler.state()}

    def _restore(self, snap: dict) -> None:
        rng = snap["rng"]
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if "cuda" in rng:
            torch.cuda.set_rng_state_all(rng["cuda"])
        self.collector.sampler = PromptSampler(len(self.examples), self.cfg.run.seed, **snap["sampler"])

    def _stopping(self) -> bool:
        """Whether any process was asked to stop (all processes stop at the same safe point)."""
        signum = int(self.dist.max(torch.tensor([int(self._stop) if self._stop is not None else 0])))
        if signum and self._stop is None:
            self._stop = signal.Signals(signum)
        return bool(signum)

    def _stop_here(self) -> None:
        """Checkpoint the last finished step if `latest` is older, and raise Preempted."""
        mine = latest_step(self.out_dir) if self.is_main else None  # the main process's view of the folder
        latest = int(self.dist.max(torch.tensor([-1 if mine is None else mine])))
        latest = None if latest < 0 else latest
        folder = None
        if self.step > 0 and (latest is None or latest < self.step):
            folder = self.checkpoint(self.step).name
        elif latest is not None:
            folder = f"checkpoint-{latest}"
        raise Preempted(self._stop.name, int(self._stop), self.step, folder)

    def _phase(self, name: str) -> None:
        """Where the loop is, for the fault soak (scripts/fault_soak.py sets DOCUCHAT_RL_PHASE_FILE)."""
        if self._phase_fd is not None:
            os.pwrite(self._phase_fd, f"{name:<12}".encode(), 0)

    # ---------------------------------------------------------------- the loop
    def train(self, stop_after: int | None = None) -> list[dict]:
        """Run to `run.steps` (or stop after step `stop_after`, for tests). Returns the metric records.
        Raises Preempted after SIGTERM/SIGINT, at the next safe point: before a step's update (the step is
        dropped and replayed on resume, its random draws and data position rewound) or after a step."""
        cfg, history = self.cfg, []
        bar = None
        if cfg.logging.progress and self.is_main:
            from tqdm.auto import tqdm

            bar = tqdm(total=cfg.run.steps, initial=self.step, desc="train", dynamic_ncols=True)
        started = time.perf_counter()
        self._stop = None
        try:
            with self._signals():
                for step in range(self.step + 1, cfg.run.steps + 1):
                    timer, snapshot = Timer(), self._snapshot()
                    self._phase("rollout")
                    rollout = self.collect(timer)  # rollout + score
                    with timer("prepare"):
                        batch = self.prepare(rollout)
                    extra = self.advantages(batch, timer)
                    if self._stopping():  # safe point: nothing of this step is applied or written yet
                        self._restore(snapshot)
                        self._stop_here()
                    self._phase("update")
                    extra.update(self.update(batch, timer, rollout.global_groups))
                    if cfg.eval.every and cfg.data.test and step % cfg.eval.every == 0:
                        self._phase("eval")
                        result = self.evaluate()  # (on every process: each evaluates a share of the rows)
                        self.last_eval = {"step": step,
                                          "minutes": round((time.perf_counter() - started) / 60, 3), **result}
                        if self.is_main:
                            self.evals.write([self.last_eval])
                        extra["eval/accuracy"] = self.last_eval.get("accuracy")
                    self._phase("log")
                    m = self.log(step, rollout, batch, extra, timer)
                    history.append(m)
                    self.step = step
                    if step % cfg.checkpoint.every == 0 or step == cfg.run.steps:
                        self._phase("checkpoint")
                        self.checkpoint(step)
                    self._phase("idle")
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(reward=f"{m['reward/mean']:.3f}", acc=f"{m.get('accuracy') or 0:.3f}",
                                        tok_s=f"{m['rollout_tokens_per_s'] or 0:.0f}")
                    if self._stopping():  # safe point: the step is finished
                        self._stop_here()
                    if stop_after is not None and step >= stop_after:
                        break
        finally:
            if bar is not None:
                bar.close()
        return history

    def close(self) -> None:
        for writer in (self.traces, self.metrics, self.evals):
            if writer is not None:
                writer.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self._phase_fd is not None:
            os.close(self._phase_fd)
            self._phase_fd = None
        if self._lock is not None:
            self._lock.release()
