"""The supervised stage (`docuchat-rl sft`): fine-tune the recipe's LoRA adapter on targets after the RL prompts.

One step takes `sft.batch_size` examples in a seeded epoch-wise order, scores their target tokens (each
example one right-padded sequence, positions as RL's, the RL learner's logit chunking and length buckets, at
temperature 1: `loss.nll_sum`), and takes one optimizer step on the mean negative log-likelihood per loss token
(prompt and tool-result tokens carry none). The run folder is a run folder like `train`'s: checkpoints
(adapter, tokenizer, run_config.json, trainer_state.json, accelerate's optimizer/scheduler/RNG states,
manifest, `latest`), `metrics.jsonl` (one line a step), `eval.json` (the held-out set before and after),
and `sft_targets.jsonl` (every example learned, decoded). A checkpoint holds everything the next step reads
(the adapter, the optimizer and the step; the order is a function of run.seed and the step), so a run
killed anywhere resumes to the same weights.

Why not TRL's SFTTrainer (a dependency already): it would tokenize the prompts itself, and the point of this
stage is that its prompts are RL's, token for token, with the tool results masked as the RL loop masks them;
it would also write checkpoints that are not ours (no manifest, no `latest`, no atomic rename), so neither
`--resume` after kill -9 nor `train`'s start from the adapter could keep their promises.

Deliberately left out: several processes (one process trains; `train` is the stage that scales out), packing,
and NEFTune-style noise.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import uuid
from pathlib import Path

import numpy as np
import torch

from ..checkpoint import (
    TrainerState,
    SFT_MARK,
    check_stage,
    check_resumable,
    latest_step,
    load_training_state,
    read_trainer_state,
    resolve_adapter,
    resolve_resume,
    save_checkpoint,
    write_training_state,
)
from ..config import Config, ConfigError, saves_at
from ..data import load_examples, load_split
from ..errors import CheckpointError, Preempted, TrainingError
from ..learning.fused_lora import fuse_lora
from ..modeling import eos_ids
from ..outputs import JsonlWriter, undo_start
from ..preemption import Preemption
from ..progress import Progress
from ..run import agree_on_main, build_optimizer, launch, lock_output_dir, policy_model
from ..sampling.multiturn import ToolError, multiturn_from_config
from .loss import nll_sum
from .targets import (Builder, Target, check_held_out, check_lengths, end_token, fingerprint, jsonl_targets,
                      loss_over, memory_targets, rl_prompt_ids)

TARGETS_FILE = SFT_MARK  # (every example learned; its presence marks the folder an SFT stage's: check_stage)


def build_targets(cfg: Config, tokenizer, model, rows: list[dict] | None = None,
                  held_out: list | None = None) -> list[Target]:
    """The SFT set of the recipe (sft.source), checked: no held-out question, none longer than sft.max_length
    or the model's context. `rows`: a data set in memory in place of the source's file (the Python API's
    train_dataset): TRL's rows (prompt/completion, messages) as source jsonl reads them, or rows with the
    recipe's question and answer columns as source answers (or tool_transcripts) reads them."""
    s, d = cfg.sft, cfg.data
    context = getattr(model.config, "max_position_embeddings", None)
    try:
        multiturn = multiturn_from_config(cfg, tokenizer, stop_ids=eos_ids(model, tokenizer), context_len=context)
    except ToolError as e:
        raise TrainingError(str(e)) from None
    eos = end_token(model, tokenizer, s.eos_token)
    if rows is not None:
        targets = memory_targets(cfg, tokenizer, rows, eos, multiturn)
    elif s.source == "jsonl":
        targets = jsonl_targets(s.path, tokenizer, eos, d.system_prompt, d.few_shot_turns, multiturn,
                                d.prompt_format == "as_given")
    else:
        examples = (load_split(d, "train") if s.source == "traces" or not s.path else
                    load_examples(s.path, d.train_split, d.prompt_column, d.answer_column, revision=d.revision,
                                  subset=d.subset, key="sft.path"))
        build = Builder(tokenizer, examples, rl_prompt_ids(cfg, tokenizer, examples, multiturn), eos)
        targets = (build.answers(s.answer_template) if s.source == "answers" else
                   build.tool_transcripts(multiturn) if s.source == "tool_transcripts" else
                   build.traces(s.path, s.where, s.per_prompt, s.keep_truncated))
        if build.left_out:
            print(f"docuchat-rl: sft.source traces: {build.left_out} selected completion"
                  f"{'s were' if build.left_out != 1 else ' was'} cut at max_new_tokens and not learned "
                  "(sft.keep_truncated: true learns them)", file=sys.stderr, flush=True)
    check_held_out(targets, cfg, held_out)
    targets = loss_over(targets, s.loss_tokens)
    limit = min(x for x in (s.max_length, context) if x is not None) if (s.max_length or context) else None
    return check_lengths(targets, limit, s.truncation) if limit is not None else targets


def batch_order(n: int, batch_size: int, step: int, seed: int) -> list[int]:
    """The examples of step `step` (1-based): positions (step-1)*B .. step*B-1 of the epochs' seeded
    permutations laid end to end, so that any step's batch is known from the seed alone (exact resume).

    >>> batch_order(5, 2, 3, seed=0) == batch_order(5, 2, 3, seed=0), len(batch_order(5, 2, 3, seed=0))
    (True, 2)
    """
    out, pos = [], (step - 1) * batch_size
    while len(out) < batch_size:
        epoch, k = divmod(pos, n)
        perm = np.random.default_rng([seed, epoch]).permutation(n)
        take = perm[k:k + batch_size - len(out)].tolist()
        out += take
        pos += len(take)
    return out


class SupervisedTrainer:
    """A started SFT run: `train()` runs the steps, `evaluate()` the held-out set; the same surface as the RL
    Trainer, so that the command runs both stages alike (`step`, `steps`, `is_main`, `preemption`, `close`)."""

    def __init__(self, cfg: Config, resume: str | None = None, held_out: list | None = None,
                 rows: list[dict] | None = None):
        self.given_held_out = held_out  # (the API's eval_dataset: in place of data.test's rows)
        self.given_rows = rows  # (the API's train_dataset: in place of the source's file; build_targets)
        self.on_step = self.on_checkpoint = None  # (the API's callbacks: Trainer's seams of the same names)
        if cfg.sft is None:
            raise ConfigError("the recipe has no sft section: add one (docs/sft.md), e.g. --set sft.source=answers")
        self.out_dir = Path(cfg.sft_dir)
        resume_dir = resolve_resume(resume, self.out_dir) if resume else None
        self.place = place = launch(cfg)
        if place.dist.world > 1 or place.sharding:
            raise TrainingError("docuchat-rl sft trains in one process (train is the stage that runs on several)")
        cfg = cfg.for_device(place.dist.device.type)
        self.cfg = cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"dtype": place.dtype})})
        if resume_dir is not None:
            check_stage(resume_dir, "sft")
        applied = check_resumable(resume_dir, cfg.to_dict(), ("sft.output_dir",)) if resume_dir else []
        self.dist, self.is_main = place.dist, True
        undo, self.lock = undo_start(self.out_dir), None
        try:
            self.lock = agree_on_main(place.dist, lock_output_dir, self.out_dir, cfg.run.overwrite, resume_dir, True,
                                      "sft.output_dir")
            if applied:
                print(f"docuchat-rl: resuming {resume_dir.name} with changed settings (applied): {'; '.join(applied)}",
                      file=sys.stderr, flush=True)
            self._build(resume_dir)
        except BaseException:
            if self.lock is not None:
                self.lock.release()
            undo()  # (a refused start leaves the folder as it found it)
            raise

    def _build(self, resume_dir: Path | None) -> None:
        from transformers import set_seed

        cfg, s = self.cfg, self.cfg.sft
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        set_seed(cfg.run.seed)
        start = resolve_adapter(cfg.lora.init_from, "lora.init_from") if cfg.lora.init_from and not resume_dir else None
        self.model, self.tokenizer = policy_model(cfg, self.place, start)
        if cfg.lora.fused:
            fuse_lora(self.model)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.targets = build_targets(cfg, self.tokenizer, self.model, self.given_rows, self.given_held_out)
        data = fingerprint(self.targets)
        self.steps = s.steps or max(1, math.ceil((s.epochs or 1.0) * math.ceil(len(self.targets) / s.batch_size)))
        optim = cfg.optim.model_copy(update={"lr": s.lr, "schedule": s.schedule, "schedule_kwargs": s.schedule_kwargs,
                                             "warmup_steps": s.warmup_steps})
        opt, sched = build_optimizer(self.params, optim, self.steps)
        acc = self.place.accelerator
        self.optimizer, self.scheduler = acc.prepare(opt, sched)
        acc.register_save_state_pre_hook(lambda models, weights, d: weights.clear())
        acc.register_load_state_pre_hook(lambda models, d: models.clear())
        self.state = TrainerState(step=0, run_id=uuid.uuid4().hex[:12], data=data)
        if resume_dir:
            saved = read_trainer_state(resume_dir).data
            if saved and saved != data:
                raise CheckpointError(f"the SFT set changed since {resume_dir.name} was written ({saved['rows']} "
                                      f"examples then, {data['rows']} now, or other tokens): resuming exactly needs "
                                      "the examples it learned from; start a new run")
            self.state = load_training_state(resume_dir, model=self.model, critic=None, separate_critic=False,
                                             accelerator=acc)
        self.step, self.run_id = self.state.step, self.state.run_id
        self.metrics = JsonlWriter(self.out_dir / "metrics.jsonl", self.state.offsets.get("metrics"))
        if not resume_dir or not (self.out_dir / TARGETS_FILE).exists():  # (a resume into a new folder: written)
            tmp = self.out_dir / (TARGETS_FILE + ".tmp")  # (whole or not at all: renamed into place)
            with open(tmp, "w", encoding="utf-8") as f:
                for t in self.targets:
                    f.write(json.dumps(t.record(self.tokenizer), ensure_ascii=False) + "\n")
            os.replace(tmp, self.out_dir / TARGETS_FILE)
        vocab = self.model.get_output_embeddings().weight.shape[0]
        self.chunk = cfg.optim.logit_chunk if cfg.optim.logit_chunk is not None else (1024 if vocab > 32768 else 0)
        self.micro = s.micro_batch_size or s.batch_size
        self.preemption = Preemption(self.dist)
        self.last_eval = None
        self.held_out = None  # (the evaluation's rows and eval.also's, read at the first)
        self.started = time.perf_counter()

    @property
    def policy_model(self):
        """The peft model being trained."""
        return self.model

    @property
    def total_steps(self) -> int:
        """The run's steps (sft.steps, or its epochs' worth)."""
        return self.steps

    # ------------------------------------------------------------------ one step
    def _step(self, step: int) -> dict:
        cfg, s = self.cfg, self.cfg.sft
        t0 = time.perf_counter()
        chosen = [self.targets[i] for i in batch_order(len(self.targets), s.batch_size, step, cfg.run.seed)]
        tokens = sum(sum(t.loss_mask) for t in chosen)
        self.model.train()
        total = 0.0
        for k in range(0, len(chosen), self.micro):
            nll, _ = nll_sum(self.model, chosen[k:k + self.micro], self.tokenizer.pad_token_id, self.chunk,
                             cfg.optim.length_buckets)
            (nll / tokens).backward()  # (the batch's mean over its loss tokens, whatever the micro-batches)
            total += float(nll.detach())
        norm = float(self.place.accelerator.clip_grad_norm_(self.params, cfg.optim.max_grad_norm or float("inf")))
        if not (math.isfinite(total) and math.isfinite(norm)):
            raise TrainingError(f"sft step {step}: the loss or its gradient is not finite (loss {total / tokens}, "
                                f"gradient norm {norm}): lower sft.lr")
        lr = float(self.scheduler.get_last_lr()[0])  # (the rate this step uses: what TRL logs)
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        m = {"step": step, "loss": total / tokens, "tokens": tokens, "examples": len(chosen),
             "epoch": round(step * s.batch_size / len(self.targets), 4), "lr": lr,
             "grad_norm": norm, "time/step": time.perf_counter() - t0}
        self.metrics.write([m])
        self.step = step
        return m

    def checkpoint(self, step: int) -> Path:
        state = TrainerState(step=step, run_id=self.run_id, offsets={"metrics": self.metrics.offset},
                             data=self.state.data, seconds=self.state.seconds + time.perf_counter() - self.started)

        def write_into(folder: Path) -> None:
            write_training_state(folder, model=self.model, tokenizer=self.tokenizer, critic=None,
                                 accelerator=self.place.accelerator, config=self.cfg.to_dict(), trainer_state=state)

        folder = save_checkpoint(self.out_dir, step, write_into, self.cfg.checkpoint.keep_last)
        if self.on_checkpoint is not None:
            self.on_checkpoint(step)
        return folder

    # ------------------------------------------------------------------ the loop
    def train(self, stop_after: int | None = None) -> list[dict]:
        """Run to the last step (or stop after `stop_after`, checkpointed); Preempted after SIGTERM/SIGINT, at the
        next step's end, with that step checkpointed."""
        if stop_after is not None and not self.step < stop_after <= self.steps:
            raise TrainingError(f"--stop-after {stop_after}: must come after the run's last step ({self.step}) "
                                f"and not beyond its {self.steps} steps")
        history = []
        progress = Progress(self.steps, self.step, enabled=self.cfg.logging.progress, name="sft")
        try:
            with self.preemption.handling():
                for step in range(self.step + 1, self.steps + 1):
                    m = self._step(step)
                    history.append(m)
                    progress.show(step, {"loss": f"{m['loss']:.3f}", "epoch": f"{m['epoch']:.2f}"})
                    last = step in (self.steps, stop_after) or bool(self.on_step and self.on_step(m))  # (the API's
                    # callbacks may stop the run after any step: it is checkpointed, as at stop_after)
                    if saves_at(step, self.cfg.checkpoint.every, self.steps) or last:
                        self.checkpoint(step)
                    if self.preemption.requested():
                        if latest_step(self.out_dir) != step:
                            self.checkpoint(step)
                        sig = self.preemption.signal
                        raise Preempted(sig.name, int(sig), step, f"checkpoint-{step}")
                    if last:
                        break
        finally:
            progress.close()
        return history

    def evaluate(self) -> dict:
        """The held-out numbers of the adapter as it is now (evaluation.py); the rows are read once a run."""
        from ..evaluation import also_sets, evaluate

        if self.held_out is None:
            rows = (self.given_held_out if self.given_held_out is not None else
                    load_split(self.cfg.data, "test", self.cfg.eval.limit))
            self.held_out = rows, also_sets(self.cfg)
        rows, also = self.held_out
        return evaluate(self.model, self.tokenizer, self.cfg, rows, self.dist, also=also)

    def close(self) -> None:
        self.metrics.close()
        self.lock.release()

