"""The training loop: rollout -> score -> advantages -> update -> log -> checkpoint, one step at a time.

One step samples `prompts_per_step` prompts, `num_generations` completions each, scores them with the
composite reward (`Trainer.collect`, through sampling.rollout.Collector), puts the used groups into a batch
(`prepare`), runs the no-grad passes the algorithm needs and its advantages (`advantages`), updates the
LoRA adapter (and critic) over `num_iterations` passes of minibatches (`update`, through
learning.learner.Learner), writes one trace record per completion and one metrics record (`log`), and
checkpoints every `checkpoint.every` steps (`checkpoint`). What a run holds before its first step is built
by run.start_run; SIGTERM/SIGINT stops at a safe point (preemption.py).

Exact resume: a checkpoint holds everything the next step reads (adapter, critic, optimizer,
scheduler, RNG states, data order and position, output file offsets). Checkpoints are taken between
steps, so a run stopped anywhere inside a step (inside a mu-cycle included) resumes by replaying that
step from the same state, and output files are truncated back to the checkpoint's offsets first.

Several processes (`torchrun`, `accelerate launch`): every process draws the step's prompt list and
samples, scores and trains its share of the groups; the main process writes the traces, metrics and
checkpoint files. Under FSDP2, rollout and evaluation run on gathered weights (or, with
`rollout.sharded_generation`, decode in lockstep on the sharded ones).

Where completions come from is the collector's business: an engine in the trainer's processes, a fixed
lag's worker process beside each (sampling/lag.py), vLLM's own servers (sampling/vllm_server.py), and the
tool loop around any of them (sampling/multiturn.py); the loop never asks which.

Deliberately left out: a step that overlaps its own rollout with its update (a fixed lag overlaps the
next steps' rollouts instead).
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Callable

import torch

from .checkpoint import TrainerState, latest_step, save_checkpoint, write_training_state
from .config import Config, saves_at
from .data import Example, load_split, make_sampler
from .distributed import gathered
from .errors import Preempted, TrainingError
from .learning.batch import Batch
from .evaluation import also_sets, evaluate
from .memory import reset_peak
from .preemption import Preemption, RandomState
from .progress import Progress
from .run import start_run
from .sampling.lag import SamplingPolicy
from .sampling.rollout import Rollout, Timer
from .step_log import StepLog
from .traces import RewardWatch

__all__ = ["MEASURED", "Trainer", "TrainingError", "Timer"]

# metrics that measure the machine (seconds, speed, memory), not the run: the only keys in which two runs
# with the same seed may differ (a resumed run and an uninterrupted one compare everything else)
MEASURED = ("time/", "memory/", "rollout_tokens_per_s", "rollout_sampler_s")


def no_group_error(cfg: Config) -> TrainingError:
    """Why a step has no group to train on, in one line."""
    resets = "rollout.environment_factory's reset raised for every prompt (the warnings above say why)"
    if not cfg.rollout.dynamic_sampling:
        return TrainingError(f"no group of the step is left to train on: {resets}")
    band = " and a pass rate inside data.difficulty's band" if cfg.data.difficulty is not None else ""
    return TrainingError(f"dynamic sampling found no group with varied rewards{band} in "
                         f"{cfg.rollout.max_resample_rounds + 1} rounds" + (f", or {resets}" if cfg.rollout.multi_turn
                                                                             else ""))


class Trainer:
    """The loop over a started run (run.Run): `train()` runs the steps, `evaluate()` the held-out set.

    `on_phase(name)`, when given, is called as the loop enters each phase (rollout, update, eval, log,
    checkpoint, idle): the seam the fault soak uses to know where to kill a run.
    """

    def __init__(self, cfg: Config, resume: str | None = None, examples: list[Example] | None = None,
                 on_phase: Callable[[str], None] | None = None, quiet: bool = False, model=None,
                 held_out: list[Example] | None = None):
        also = also_sets(cfg) if cfg.eval.also else {}  # (loaded now: a bad path fails before step 1)
        sets = {f"eval.also.{name}": rows for name, rows in also.items()}
        if held_out is not None:
            sets["eval_dataset"] = held_out
        elif cfg.data.test and (cfg.eval.before_and_after or cfg.eval.every):
            held_out = sets["data.test"] = load_split(cfg.data, "test", cfg.eval.limit)
        self.run = start_run(cfg, resume, examples, quiet, model, sets)  # (each set new to the training rows)
        self.cfg = self.run.cfg  # (its `auto` switches decided for the run's device)
        self.learner, self.collector = self.run.learner, self.run.collector
        self.dist, self.is_main = self.run.place.dist, self.run.place.dist.is_main
        self.step, self.run_id = self.run.state.step, self.run.state.run_id
        self.preemption = Preemption(self.dist)
        self.policy = SamplingPolicy(self.learner.model, self.run.lagged, self.collector.ahead)
        self.rewards = RewardWatch(self.run.reward.names, self.cfg.rewards.max_failed_steps,
                                   self.run.state.no_reward_streak)
        self.progress = Progress(self.cfg.run.steps)  # (train() shows a bar or lines; this one only says)
        self.on_phase = on_phase or (lambda name: None)
        self.on_step: Callable[[dict], bool] | None = None  # after each step: True stops the run there (the API)
        self.on_checkpoint: Callable[[int], None] | None = None  # after each checkpoint is written (the API)
        self._held_out: list[Example] | None = held_out  # (None: data.test's first eval.limit rows, when asked)
        self._also = also
        self.last_eval: dict | None = None  # the latest periodic evaluation (eval.every)
        self.step_log = StepLog(self.run, self.rewards, lambda: self.progress)

    total_steps = property(lambda self: self.cfg.run.steps, doc="The run's steps (run.steps).")
    policy_model = property(lambda self: self.learner.model, doc="The peft model being trained (its adapter active).")
    tokenizer = property(lambda self: self.run.tokenizer, doc="The run's tokenizer.")
    out_dir = property(lambda self: self.run.out_dir, doc="The run folder (a Path).")

    # ---------------------------------------------------------------- phases
    def collect(self, timer: Timer) -> Rollout:
        """Rollout and score phases of the next step (see rollout.Collector), on gathered weights when sharded."""
        place, step = self.run.place, self.step + 1
        version, digest = self.policy.of(step)
        # (a fixed lag's worker samples with its own copy: the learner's model keeps its weights)
        with self.policy.holding(step) if self.collector.ahead is None else contextlib.nullcontext():
            with gathered(place.gather_for_generation, place.sharding):
                rollout = self.collector.collect(self.learner.model, timer, step, version)
        rollout.adapter_sha256, rollout.policy_version = digest, version
        return rollout

    def rewind(self, rng: RandomState, data: dict) -> None:
        """Put the random draws and the data position back to where a step began (it is sampled again)."""
        rng.restore()
        self.collector.sampler = make_sampler(len(self.run.examples), self.cfg.run.seed, data, self.run.curriculum,
                                              self.cfg.data.difficulty)

    def prepare(self, rollout: Rollout) -> Batch:
        """This process's used groups as a batch on the training device (it may have none of them)."""
        if not rollout.groups_used:  # (without dynamic sampling only failed environment resets drop groups)
            raise no_group_error(self.cfg)
        return rollout.batch(self.run.tokenizer.pad_token_id,
                             self.cfg.algorithm.mask_truncated_completions).to(self.dist.device)

    def advantages(self, batch: Batch, timer: Timer) -> dict[str, float]:
        """The no-grad passes the algorithm needs (old and reference log-probs, values), then its advantages."""
        with timer("advantages"):
            self.learner.score_rollout(batch)
            return self.learner.algo.advantages(batch)

    def update(self, batch: Batch, timer: Timer, global_groups: list[int] | None = None) -> dict[str, float]:
        """The step's optimizer steps over the batch (learner.Learner.update)."""
        with timer("update"):
            return self.learner.update(batch, self.step + 1, global_groups)

    def log(self, step: int, rollout: Rollout, batch: Batch, metrics: dict, timer: Timer) -> dict:
        """Write the step's trace records and its metrics record (step_log.StepLog)."""
        return self.step_log.write(step, rollout, batch, metrics, timer)

    def seconds(self) -> float:
        """Training wall-clock seconds so far: this process's since train() began, plus what the checkpoint it
        resumed from had counted (so a resumed run's evaluation minutes go on from where it left off)."""
        return self.run.state.seconds + time.perf_counter() - self.progress.started

    def checkpoint(self, step: int) -> Path:
        """Every process takes part (each saves its random states); the main process writes the rest and
        completes the folder (see checkpoint.py)."""
        run, learner = self.run, self.learner
        state = TrainerState(step=step, run_id=self.run_id, sampler=self.collector.data_state(step),
                             offsets=run.outputs.offsets(), nonfinite_streak=learner.nonfinite_streak,
                             no_reward_streak=self.rewards.streak, world_size=self.dist.world,
                             data=run.state.data, curriculum=run.curriculum.state() if run.curriculum else {},
                             seconds=self.seconds())

        def write_into(folder: Path) -> None:
            write_training_state(folder, model=learner.model, tokenizer=run.tokenizer, critic=learner.algo.critic,
                                 accelerator=run.place.accelerator, config=self.cfg.to_dict(), trainer_state=state,
                                 main=self.is_main)
            if run.lagged and self.is_main:
                run.lagged.save(folder, step)

        folder = save_checkpoint(run.out_dir, step, write_into, self.cfg.checkpoint.keep_last, self.dist)
        if self.on_checkpoint is not None:
            self.on_checkpoint(step)
        return folder

    def evaluate(self) -> dict:
        """Held-out evaluation, each process a share of the rows, the numbers over all of them on every
        process (greedy, and pass@k from its own streams: the run's random state is unchanged by it)."""
        if self._held_out is None:
            self._held_out = load_split(self.cfg.data, "test", self.cfg.eval.limit)
        place = self.run.place
        with gathered(place.gather_for_generation, place.sharding):
            return evaluate(self.learner.model, self.run.tokenizer, self.cfg, self._held_out, self.dist,
                            place.lockstep, self._also)

    # ---------------------------------------------------------------- the loop
    def train(self, stop_after: int | None = None) -> list[dict]:
        """Run to `run.steps`, or stop after step `stop_after` with its checkpoint written (the schedule
        still spans run.steps: a long run split over several jobs). Returns the metric records.
        Raises Preempted after SIGTERM/SIGINT, at the next safe point: before a step's update (the step is
        dropped and replayed on resume, its random draws and data position rewound) or after a step."""
        cfg, history = self.cfg, []
        if stop_after is not None and not self.step < stop_after <= cfg.run.steps:
            raise TrainingError(f"--stop-after {stop_after}: must come after the run's last step ({self.step}) "
                                f"and not beyond run.steps ({cfg.run.steps})")
        self.progress = Progress(cfg.run.steps, self.step, enabled=cfg.logging.progress and self.is_main)
        try:
            with self.preemption.handling():
                for step in range(self.step + 1, cfg.run.steps + 1):
                    history.append(self._step(step, last=step in (cfg.run.steps, stop_after)))
                    self.progress.step(step, history[-1])
                    if self.preemption.requested():  # safe point: the step is finished
                        self._stop()
                    asked = self._asked_to_stop(history[-1])  # (first: every step fires its events, the last too)
                    if asked or (stop_after is not None and step >= stop_after):
                        break
        finally:
            self.progress.close()
        return history

    def _step(self, step: int, last: bool = False) -> dict:
        """One whole step, phase by phase; -> its metrics record. A `last` step is always checkpointed."""
        timer, rng, data = Timer(), RandomState.capture(), self.collector.sampler.state()
        reset_peak(self.dist.device)
        self.on_phase("rollout")
        rollout = self.collect(timer)  # rollout + score
        with timer("prepare"):
            batch = self.prepare(rollout)
        extra = self.advantages(batch, timer)
        if self.preemption.requested():  # safe point: nothing of this step is applied or written yet
            self.rewind(rng, data)
            self._stop()
        self.on_phase("update")
        extra.update(self.update(batch, timer, rollout.global_groups))
        extra.update(self.policy.updated(step))  # (a fixed lag keeps the new version; its worker gets it)
        if self.cfg.eval.every and (self.cfg.data.test or self._held_out) and \
                saves_at(step, self.cfg.eval.every, self.cfg.run.steps):
            self.on_phase("eval")
            result = self.evaluate()  # (on every process: each evaluates a share of the rows)
            minutes = round(self.seconds() / 60, 3)
            self.last_eval = {"step": step, "minutes": minutes, **result}
            if self.run.outputs.evals is not None:
                self.run.outputs.evals.write([self.last_eval])
            for name in ("", *(f"{n}/" for n in self._also)):
                extra[f"eval/{name}accuracy"] = self.last_eval.get(f"{name}accuracy")
        self.on_phase("log")
        m = self.log(step, rollout, batch, extra, timer)
        self.step = step
        if saves_at(step, self.cfg.checkpoint.every, self.cfg.run.steps) or last:
            self.on_phase("checkpoint")
            self.checkpoint(step)
        self.on_phase("idle")
        return m

    def _asked_to_stop(self, m: dict) -> bool:
        """`on_step(m)` (the Python API's callbacks) asked to stop after this step: then it is checkpointed."""
        if self.on_step is None or not self.on_step(m) or self.step >= self.cfg.run.steps:
            return False
        if latest_step(self.run.out_dir) != self.step:
            self.checkpoint(self.step)
        return True

    def _stop(self) -> None:
        """Checkpoint the last finished step if `latest` is older, and raise Preempted."""
        mine = latest_step(self.run.out_dir) if self.is_main else None  # the main process's view of the folder
        latest = int(self.dist.max(torch.tensor([-1 if mine is None else mine])))
        latest = None if latest < 0 else latest
        folder = None
        if self.step > 0 and (latest is None or latest < self.step):
            folder = self.checkpoint(self.step).name
        elif latest is not None:
            folder = f"checkpoint-{latest}"
        signal = self.preemption.signal
        raise Preempted(signal.name, int(signal), self.step, folder)

    def close(self) -> None:
        """Close the run's files and wandb, release its folder."""
        self.run.close()
