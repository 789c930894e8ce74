"""The training loop: rollout -> score -> advantages -> update -> log -> checkpoint, one step at a time.

One step samples `prompts_per_step` prompts, `num_generations` completions each, scores them with the
composite reward (`Trainer.collect`, through rollout.Collector), puts the used groups into a batch
(`prepare`), runs the no-grad passes the algorithm needs and its advantages (`advantages`), updates the
LoRA adapter (and critic) over `num_iterations` passes of minibatches (`update`, through learner.Learner),
writes one trace record per completion and one metrics record (`log`), and checkpoints every
`checkpoint.every` steps (`checkpoint`). What a run holds before its first step is built by
run.start_run; SIGTERM/SIGINT stops at a safe point (preemption.py).

Exact resume: a checkpoint holds everything the next step reads (adapter, critic, optimizer,
scheduler, RNG states, data order and position, output file offsets). Checkpoints are taken between
steps, so a run stopped anywhere inside a step (inside a mu-cycle included) resumes by replaying that
step from the same state, and output files are truncated back to the checkpoint's offsets first.

Several processes (`torchrun`, `accelerate launch`): every process draws the step's prompt list and
samples, scores and trains its share of the groups; the main process writes the traces, metrics and
checkpoint files. Under FSDP2, rollout and evaluation run on gathered weights (or, with
`rollout.sharded_generation`, decode in lockstep on the sharded ones).

Deliberately left out: serving engines (vLLM, SGLang) for the rollout.
"""

from __future__ import annotations

import contextlib
import sys
import time
from pathlib import Path
from typing import Callable

import torch

from .batch import Batch
from .checkpoint import TrainerState, latest_step, save_checkpoint, write_training_state
from .config import Config
from .data import Example, PromptSampler, load_split
from .distributed import gathered
from .errors import Preempted, TrainingError
from .generation import eos_ids
from .memory import peak_mb, reset_peak
from .modeling import adapter_digest
from .preemption import Preemption, RandomState
from .rollout import Rollout, Timer
from .run import start_run
from .traces import library_versions, reward_failures, signal_warnings, step_metrics

__all__ = ["MEASURED", "Trainer", "TrainingError", "Timer"]

# metrics that measure the machine (seconds, speed, memory), not the run: the only keys in which two runs
# with the same seed may differ (a resumed run and an uninterrupted one compare everything else)
MEASURED = ("time/", "memory/", "rollout_tokens_per_s")


class Trainer:
    """The loop over a started run (run.Run): `train()` runs the steps, `evaluate()` the held-out set.

    `on_phase(name)`, when given, is called as the loop enters each phase (rollout, update, eval, log,
    checkpoint, idle): the seam the fault soak uses to know where to kill a run.
    """

    def __init__(self, cfg: Config, resume: str | None = None, examples: list[Example] | None = None,
                 on_phase: Callable[[str], None] | None = None, quiet: bool = False):
        self.run = start_run(cfg, resume, examples, quiet)
        self.cfg = self.run.cfg  # (its `auto` switches decided for the run's device)
        self.learner, self.collector = self.run.learner, self.run.collector
        self.dist, self.is_main = self.run.place.dist, self.run.place.dist.is_main
        self.step, self.run_id = self.run.state.step, self.run.state.run_id
        self.preemption = Preemption(self.dist)
        self.on_phase = on_phase or (lambda name: None)
        self._held_out: list[Example] | None = None
        self._no_reward_steps = self.run.state.no_reward_streak  # steps in a row without any reward value
        self._bar = None  # the progress bar while train() draws one (_say writes around it)
        self.last_eval: dict | None = None  # the latest periodic evaluation (eval.every)
        r = self.cfg.rollout  # the run's part of every trace line's replay coordinate
        self._coordinate = {
            "sampling": {"engine": r.engine, "temperature": r.temperature, "top_k": r.top_k, "top_p": r.top_p,
                         "max_new_tokens": r.max_new_tokens, "min_new_tokens": r.min_new_tokens,
                         "stop_ids": eos_ids(self.learner.model, self.run.tokenizer)},
            "versions": library_versions()}

    # ---------------------------------------------------------------- phases
    def collect(self, timer: Timer) -> Rollout:
        """Rollout and score phases of the next step (see rollout.Collector), on gathered weights when sharded."""
        place, step = self.run.place, self.step + 1
        version, digest = self.policy_of(step)
        # (a fixed lag's worker samples with its own copy: the learner's model keeps its weights)
        with self.sampling_policy(step) if self.collector.ahead is None else contextlib.nullcontext():
            with gathered(place.gather_for_generation, place.sharding):
                rollout = self.collector.collect(self.learner.model, timer, step)
        rollout.adapter_sha256, rollout.policy_version = digest, version
        return rollout

    def policy_of(self, step: int) -> tuple[int, str | None]:
        """(version, adapter digest) of the policy that samples `step`: the adapter after step `version`, the
        current one (step - 1) unless rollout.async_lag keeps an older one (lag.py)."""
        lagged = self.run.lagged
        if lagged:
            version = lagged.version_for(step)
            return version, lagged.digest(version)
        return step - 1, adapter_digest(self.learner.model)

    def sampling_policy(self, step: int):
        """A context in which the learner's model holds the policy that samples `step` (the current weights
        put back after)."""
        lagged = self.run.lagged
        return lagged.active(self.learner.model, lagged.version_for(step)) if lagged else contextlib.nullcontext()

    def resample(self, timer: Timer) -> Rollout:
        """The next step sampled and scored again, as `collect` does it, with the random draws and the data
        position put back after: the loop goes on as if it never ran (docuchat-rl replay)."""
        rng, data = RandomState.capture(), self.collector.sampler.state()
        try:
            return self.collect(timer)
        finally:
            self._rewind(rng, data)

    def _rewind(self, rng: RandomState, data: dict) -> None:
        rng.restore()
        self.collector.sampler = PromptSampler(len(self.run.examples), self.cfg.run.seed, **data)

    def prepare(self, rollout: Rollout) -> Batch:
        """This process's used groups as a batch on the training device (it may have none of them)."""
        if not rollout.groups_used:
            raise TrainingError("dynamic sampling found no group with varied rewards in "
                                f"{self.cfg.rollout.max_resample_rounds + 1} rounds")
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
        """Write every process's trace records (the main process, in the one-process order) and the step's
        metrics record, computed over all of them."""
        run = self.run
        with timer("log"):  # the trace records' writing (the metrics record carries these timings)
            pairs = self.dist.gather(rollout.trace_records(step, self.run_id, self.learner.algo.trace_fields(batch),
                                                           self._coordinate))
            records = [rec for _, rec in sorted(pairs, key=lambda pair: pair[0])]  # one-process order (stable)
            if run.outputs.traces is not None:
                run.outputs.traces.write([r.to_json() for r in records])
        logged: dict[str, list[float]] = {}  # what user reward functions logged (log_metric), every process
        for key, values in self.dist.gather(list(rollout.reward_metrics.items())):
            logged.setdefault(key, []).extend(values)
        m = {"step": step, **step_metrics(records, run.reward.names, self.cfg.rewards.accuracy_component),
             "prompts_sampled": rollout.prompts_sampled, "groups_used": rollout.groups_used, "kl": None, **metrics}
        for key, values in logged.items():  # (under "user/<name>" where the name is one of ours)
            m[key if key not in m else f"user/{key}"] = sum(values) / len(values)
        rollout_s, peak = self.dist.max(torch.tensor([timer.seconds.get("rollout", 0.0),
                                                      peak_mb(self.dist.device)], dtype=torch.float64)).tolist()
        m["memory/peak_mb"] = round(peak, 1)  # the step's peak, the largest process's (memory.py)
        m["rollout_tokens_per_s"] = float(sum(r.completion_tokens for r in records) / rollout_s) if rollout_s else None
        for phase, s in timer.seconds.items():
            m[f"time/{phase}"] = s
        if run.outputs.metrics is not None:
            run.outputs.metrics.write([m])
        if run.wandb is not None:
            run.wandb.log({k: v for k, v in m.items() if v is not None}, step=step)
        self._check_rewards(records, m)
        return m

    def _say(self, line: str) -> None:
        """A line on stderr, on its own line: with the progress bar drawn, through tqdm (which clears the bar,
        writes the line and redraws it; a plain print would land after the bar's text, where the bar's next
        redraw hides it)."""
        if self._bar is not None:
            self._bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def _check_rewards(self, records: list, m: dict) -> None:
        """Say at once when a component failed on every completion or the step had no learning signal
        (traces.signal_warnings), and stop when no component gave any completion a value for
        `rewards.max_failed_steps` steps in a row (the run would train nothing)."""
        if self.is_main:
            for line in reward_failures(records, self.run.reward.names) + signal_warnings(m):
                self._say(f"docuchat-rl: warning: {line}")
        self._no_reward_steps = self._no_reward_steps + 1 if m["reward_missing"] == len(records) else 0
        if self._no_reward_steps >= self.cfg.rewards.max_failed_steps:
            first = next((f"reward {name!r}: {c['error']}" for r in records for name, c in r.rewards.items()
                          if c["error"]), "every component returned None")
            raise TrainingError(f"no reward component produced a value for any completion in {self._no_reward_steps} "
                                f"steps in a row (rewards.max_failed_steps): nothing to learn from; first error: "
                                f"{first}")

    def checkpoint(self, step: int) -> Path:
        """Every process takes part (each saves its random states); the main process writes the rest and
        completes the folder (see checkpoint.py)."""
        run, learner = self.run, self.learner
        state = TrainerState(step=step, run_id=self.run_id, sampler=self.collector.data_state(step),
                             offsets=run.outputs.offsets(), nonfinite_streak=learner.nonfinite_streak,
                             no_reward_streak=self._no_reward_steps, world_size=self.dist.world,
                             data=run.state.data)

        def write_into(folder: Path) -> None:
            write_training_state(folder, model=learner.model, tokenizer=run.tokenizer, critic=learner.algo.critic,
                                 accelerator=run.place.accelerator, config=self.cfg.to_dict(), trainer_state=state,
                                 main=self.is_main)
            if run.lagged and self.is_main:
                run.lagged.save(folder, step)

        return save_checkpoint(run.out_dir, step, write_into, self.cfg.checkpoint.keep_last, self.dist)

    def evaluate(self) -> dict:
        """Held-out evaluation, each process a share of the rows, the numbers over all of them on every
        process (greedy, and pass@k from its own streams: the run's random state is unchanged by it)."""
        from .evaluate import evaluate

        if self._held_out is None:
            self._held_out = load_split(self.cfg.data, "test", self.cfg.eval.limit)
        place = self.run.place
        with gathered(place.gather_for_generation, place.sharding):
            return evaluate(self.learner.model, self.run.tokenizer, self.cfg, self._held_out, self.dist,
                            place.lockstep)

    # ---------------------------------------------------------------- the loop
    def train(self, stop_after: int | None = None) -> list[dict]:
        """Run to `run.steps`, or stop after step `stop_after` with its checkpoint written (the schedule
        still spans run.steps: a long run split over several jobs). Returns the metric records.
        Raises Preempted after SIGTERM/SIGINT, at the next safe point: before a step's update (the step is
        dropped and replayed on resume, its random draws and data position rewound) or after a step."""
        cfg, history, bar = self.cfg, [], None
        if stop_after is not None and not self.step < stop_after <= cfg.run.steps:
            raise TrainingError(f"--stop-after {stop_after}: must come after the run's last step ({self.step}) "
                                f"and not beyond run.steps ({cfg.run.steps})")
        lines = None  # without a terminal: a plain line every this many steps, not a bar's frames in the log
        if cfg.logging.progress and self.is_main:
            if sys.stderr.isatty():
                from tqdm.auto import tqdm

                bar = tqdm(total=cfg.run.steps, initial=self.step, desc="train", dynamic_ncols=True)
            else:
                lines = max(1, cfg.run.steps // 50)
        self._bar = bar
        started = time.perf_counter()
        try:
            with self.preemption.handling():
                for step in range(self.step + 1, cfg.run.steps + 1):
                    m = self._step(step, started, last=step in (cfg.run.steps, stop_after))
                    history.append(m)
                    shown = {"reward": f"{m['reward/mean']:.3f}", "tok_s": f"{m['rollout_tokens_per_s'] or 0:.0f}"}
                    if m.get("accuracy") is not None:  # (no accuracy component: nothing to show)
                        shown["acc"] = f"{m['accuracy']:.3f}"
                    if bar is not None:
                        bar.update(1)
                        bar.set_postfix(shown)
                    elif lines and (step % lines == 0 or step == cfg.run.steps):
                        self._say(f"train step {step}/{cfg.run.steps}: " + ", ".join(f"{k} {v}" for k, v in shown.items())
                                  + f", {time.perf_counter() - started:.0f} s")
                    if self.preemption.requested():  # safe point: the step is finished
                        self._stop()
                    if stop_after is not None and step >= stop_after:
                        break
        finally:
            if bar is not None:
                bar.close()
            self._bar = None
        return history

    def _step(self, step: int, started: float, last: bool = False) -> dict:
        """One whole step, phase by phase; -> its metrics record. A `last` step is always checkpointed."""
        timer, rng, data = Timer(), RandomState.capture(), self.collector.sampler.state()
        reset_peak(self.dist.device)
        self.on_phase("rollout")
        rollout = self.collect(timer)  # rollout + score
        with timer("prepare"):
            batch = self.prepare(rollout)
        extra = self.advantages(batch, timer)
        if self.preemption.requested():  # safe point: nothing of this step is applied or written yet
            self._rewind(rng, data)
            self._stop()
        self.on_phase("update")
        extra.update(self.update(batch, timer, rollout.global_groups))
        if self.run.lagged:
            self.run.lagged.record(step, self.learner.model)
            if self.collector.ahead is not None:  # the worker gets version `step` and samples step step+1+k
                self.collector.ahead.after_update(step)
            extra["async/lag"] = step - 1 - rollout.policy_version  # (steps the sampling policy is behind)
        if self.cfg.eval.every and self.cfg.data.test and step % self.cfg.eval.every == 0:
            self.on_phase("eval")
            result = self.evaluate()  # (on every process: each evaluates a share of the rows)
            self.last_eval = {"step": step, "minutes": round((time.perf_counter() - started) / 60, 3), **result}
            if self.run.outputs.evals is not None:
                self.run.outputs.evals.write([self.last_eval])
            extra["eval/accuracy"] = self.last_eval.get("accuracy")
        self.on_phase("log")
        m = self.log(step, rollout, batch, extra, timer)
        self.step = step
        if step % self.cfg.checkpoint.every == 0 or last:
            self.on_phase("checkpoint")
            self.checkpoint(step)
        self.on_phase("idle")
        return m

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
