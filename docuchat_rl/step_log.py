"""The loop's log phase: a step's trace records (one per completion, every process's, in the one-process order)
and its metrics record (computed over all of them), written by the main process to traces.jsonl,
metrics.jsonl and wandb; the reward watch's warnings; a curriculum's promotion, decided on those metrics.

Deliberately left out: metrics sinks other than the file and wandb (the file is the record of truth).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from .learning.batch import Batch
from .memory import peak_mb
from .sampling.generation import eos_ids
from .sampling.rollout import Rollout, Timer
from .traces import RewardWatch, replay_coordinate, step_metrics


class StepLog:
    """Writes each step's records for a started run (run.Run)."""

    def __init__(self, run, rewards: RewardWatch, progress: Callable[[], object]):
        self.run, self.rewards, self.progress = run, rewards, progress  # (progress: the loop's display, now)
        self.dist, self.cfg = run.place.dist, run.cfg
        r = self.cfg.rollout
        self.coordinate = replay_coordinate({  # (what a replay needs to know of how the step was sampled)
            "engine": r.engine, "temperature": r.temperature, "top_k": r.top_k, "top_p": r.top_p,
            "max_new_tokens": r.max_new_tokens, "min_new_tokens": r.min_new_tokens,
            "stop_ids": eos_ids(run.learner.model, run.tokenizer)})

    def write(self, step: int, rollout: Rollout, batch: Batch, metrics: dict, timer: Timer) -> dict:
        """Write every process's trace records and the step's metrics record; -> the metrics record."""
        run, dist = self.run, self.dist
        with timer("log"):  # the trace records' writing (the metrics record carries these timings)
            pairs = dist.gather(rollout.trace_records(step, run.state.run_id, run.learner.algo.trace_fields(batch),
                                                      self.coordinate))
            records = [rec for _, rec in sorted(pairs, key=lambda pair: pair[0])]  # one-process order (stable)
            if run.outputs.traces is not None:
                run.outputs.traces.write([r.to_json() for r in records])
        logged: dict[str, list[float]] = {}  # what user reward functions logged (log_metric), every process
        for key, values in dist.gather(list(rollout.reward_metrics.items())):
            logged.setdefault(key, []).extend(values)
        m = {"step": step, **step_metrics(records, run.reward.names, self.cfg.rewards.accuracy_component),
             "prompts_sampled": rollout.prompts_sampled, "groups_used": rollout.groups_used, "kl": None,
             **rollout.data_metrics, **metrics}
        for key, values in logged.items():  # (under "user/<name>" where the name is one of ours)
            m[key if key not in m else f"user/{key}"] = sum(values) / len(values)
        if run.curriculum is not None:  # (the same records on every process: each decides the same)
            self.curriculum(m)
        # (sampled ahead, the learner's rollout time is its wait: tokens/s is over the engine's own seconds)
        sampling = rollout.sampler_seconds if rollout.sampler_seconds is not None else timer.seconds.get("rollout", 0.0)
        rollout_s, peak = dist.max(torch.tensor([sampling, peak_mb(dist.device)], dtype=torch.float64)).tolist()
        m["memory/peak_mb"] = round(peak, 1)  # the step's peak, the largest process's (memory.py)
        if rollout.sampler_seconds is not None:
            m["rollout_sampler_s"] = rollout_s  # (the engine's, overlapping the update before; time/rollout: the wait)
        # the tokens the model sampled: a multi-turn completion's tool results are not the engine's output (and TRL
        # counts model tokens only: its tool_mask)
        sampled, = dist.sum_floats([float(sum(sum(c.model_mask) if c.model_mask else len(c.ids)
                                               for c in rollout.completions))])
        m["rollout_tokens_per_s"] = sampled / rollout_s if rollout_s else None
        if self.cfg.rollout.multi_turn:  # (the prompt tokens the model ran over, every turn of every process; and
            # those a kept cache spared it: turn_cache.py; None where the engine counts none, vLLM's)
            pairs = [p for p in dist.gather([rollout.prefill]) if p is not None]
            m["rollout/prefill_tokens"] = sum(p for p, _ in pairs) if pairs else None
            m["rollout/cached_tokens"] = sum(c for _, c in pairs) if pairs else None
        for phase, s in timer.seconds.items():
            m[f"time/{phase}"] = s
        if run.outputs.metrics is not None:
            run.outputs.metrics.write([m])
        if run.wandb is not None:
            run.wandb.log({k: v for k, v in m.items() if v is not None}, step=step)
        for line in self.rewards.check(records, m):
            if dist.is_main:
                self.progress().say(f"docuchat-rl: warning: {line}")
        self.rewards.stop_if_starved(records)  # (rewards.max_failed_steps steps in a row without a value)
        return m

    def curriculum(self, m: dict) -> None:
        """data.curriculum: record the step's level, and let the next level join once the training accuracy
        has reached promote_at (the next step draws from the new level's rows)."""
        c, conf = self.run.curriculum, self.cfg.data.curriculum
        m["curriculum/level"] = c.level  # (the level this step's prompts were drawn up to)
        if c.observe(m.get("accuracy")):
            self.run.collector.sampler.promote(c.level)
            if self.dist.is_main:
                self.progress().say(f"step {m['step']}: curriculum level {c.level} joins (training accuracy reached "
                                    f"{conf.promote_at} over {conf.window} steps)")
        m["curriculum/next_level"] = c.level
