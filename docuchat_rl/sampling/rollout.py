"""Rollout and scoring: sample a step's groups, score them, and keep one typed record per completion.

`Collector.collect` samples `prompts_per_step` prompts x `num_generations` completions, scores them with
the composite reward and, under DAPO dynamic sampling, drops groups whose rewards all agree and samples
more prompts until the step is full (or the resample rounds run out). The result is a `Rollout`: one
`Completion` per sampled completion, in sampling order, from which both the training `Batch` (the used
groups, as tensors) and the trace records are made, so the two can never disagree.

Completions are scored by `scoring.score`, as in evaluation; trace records are built by `traces.py`.

With tools or an environment (`multiturn.py`) a completion is several assistant turns with tool results
between them; the engine samples each turn, the collector's `multiturn` runs the loop.

An engine must return what `generation.Generation` holds, the sampler's per-token log-probs included.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from rewards import CompositeReward
from rewards.composite import RewardRecord

from ..config import RolloutConfig
from ..data import DifficultySampler, Example, PromptSampler
from ..distributed import Dist
from ..learning.batch import Batch, build_batch
from ..traces import NOT_DRAWN_BY_DIFFICULTY, TraceRecord, completion_fields
from .decoding import Decoding
from .engines import Engine, sample_rows
from .generation import Generation, completion_texts, row_seed
from .multiturn import turns_json
from .scoring import score


class Timer:
    """Seconds per named phase of one step (a phase may be entered several times)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        yield
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0


@dataclass(frozen=True)
class Completion:
    """One sampled completion and everything the later phases read about it."""

    example: Example
    slot: int  # its prompt's position among the step's sampled prompts (all processes, all rounds)
    sample: int  # index within its group
    seed: int  # its random stream's seed (generation.row_seed of run seed, step, slot, sample)
    prompt_ids: list[int]  # the prompt's tokens, unpadded
    ids: list[int]  # the completion's tokens, EOS included when emitted
    sampler_logps: list[float]  # the sampler's log-prob of each of `ids`
    text: str  # decoded, special tokens skipped
    truncated: bool  # no EOS within max_new_tokens
    reward: RewardRecord
    used: bool  # False when dynamic sampling dropped its group (traced, not trained on)
    group: int | None  # index among the step's used groups (of all processes); None when not used
    model_mask: list[int] | None = None  # multi-turn: 1 on the tokens the model sampled, 0 on tool tokens
    turns: list | None = None  # multi-turn: its multiturn.Turn records
    observation: str | None = None  # multi-turn: its environment's first observation as appended to the prompt
    prompt_pass_rate: float | None = NOT_DRAWN_BY_DIFFICULTY  # data.difficulty: its prompt's pass rate when drawn
    # (None: its first draw; NOT_DRAWN_BY_DIFFICULTY without data.difficulty: not traced)


@dataclass
class Rollout:
    """This process's share of a step's completions, in sampling order, and the step's totals over all
    processes: prompts sampled and groups used."""

    completions: list[Completion]
    prompts_sampled: int
    groups_used: int
    reward_metrics: dict[str, list[float]] = field(default_factory=dict)  # user functions' log_metric values
    adapter_sha256: str | None = None  # the sampling policy's adapter digest (modeling.adapter_digest)
    policy_version: int | None = None  # the sampling policy: the adapter after this step (Trainer.collect)
    sampler_seconds: float | None = None  # sampled ahead (a fixed lag): the engine's seconds, overlapping the update
    data_metrics: dict[str, float | None] = field(default_factory=dict)  # data.difficulty's (DifficultySampler.metrics)
    prefill: tuple[int, int] | None = None  # multi-turn: (prompt tokens prefilled, taken from kept keys/values)
    # by this process over the step's turns (turn_cache.py)

    @property
    def used(self) -> list[Completion]:
        return [c for c in self.completions if c.used]

    @property
    def global_groups(self) -> list[int]:
        """The step-wide index of each of this process's used groups, in batch order (Batch.group k is
        the group global_groups[k])."""
        return sorted({c.group for c in self.used})

    def batch(self, pad_id: int, mask_truncated: bool = False) -> Batch:
        """The used completions as tensors, groups contiguous in sampling order and numbered from 0 on
        this process (no rows when dynamic sampling kept none of this process's groups); with
        `mask_truncated`, completions cut at max_new_tokens are out of the loss (not of their group)."""
        used = self.used
        local = {g: k for k, g in enumerate(self.global_groups)}
        nan = float("nan")
        return build_batch([c.prompt_ids for c in used], [c.ids for c in used], [c.reward.total for c in used],
                           [local[c.group] for c in used], pad_id, sampler_logps=[c.sampler_logps for c in used],
                           reward_valid=[not c.reward.total_missing for c in used],
                           trained=[not (mask_truncated and c.truncated) for c in used],
                           model_masks=[c.model_mask for c in used] if any(c.model_mask for c in used) else None,
                           component_rewards=[[nan if r.raw is None or r.error else r.raw
                                               for r in c.reward.components.values()] for c in used])

    def trace_records(self, step: int, run_id: str, per_row: dict[str, list],
                      coordinate: dict | None = None) -> list[tuple[int, TraceRecord]]:
        """One (slot, trace record) per completion; `per_row` holds the algorithm's trace fields for the
        used rows, in order; `coordinate` the run's part of the replay coordinate (sampling, versions).
        Sorting every process's pairs by slot (stably) gives the one-process order."""
        records, used_i = [], 0
        for c in self.completions:
            algo = {k: values[used_i] if c.used else None for k, values in per_row.items()}
            used_i += c.used
            records.append((c.slot, TraceRecord(
                run_id=run_id, step=step, group=c.group, used=c.used, algorithm=algo, slot=c.slot, seed=c.seed,
                completion_ids=list(c.ids), adapter_sha256=self.adapter_sha256, turns=turns_json(c.turns),
                observation=c.observation, prompt_pass_rate=c.prompt_pass_rate,
                policy_version=step - 1 if self.policy_version is None else self.policy_version,
                **(coordinate or {}),
                **completion_fields(c.example, c.sample, c.text, len(c.ids), c.truncated, c.reward))))
        return records


def pass_rate(group: list[RewardRecord], accuracy: str | None) -> float | None:
    """A group's pass rate: the mean raw score of its accuracy component over the completions that have one
    (None when none has, or no component is named).

    >>> from rewards.composite import ComponentResult, RewardRecord
    >>> rec = lambda raw: RewardRecord(raw or 0.0, {"correctness": ComponentResult(raw, 1.0, raw, {})})
    >>> pass_rate([rec(1.0), rec(0.0), rec(None), rec(1.0)], "correctness")
    0.6666666666666666
    """
    raws = [c.components[accuracy].raw for c in group if accuracy in c.components]
    raws = [x for x in raws if x is not None]
    return sum(raws) / len(raws) if raws else None


def rewards_varied(group: list[RewardRecord]) -> bool:
    """Whether a group's rewards differ, over the completions that have a reward value: a completion whose
    every component returned None or failed is out of the baseline, so it cannot make a group useful.

    >>> from rewards.composite import RewardRecord
    >>> rewards_varied([RewardRecord(1.0, {}), RewardRecord(0.0, {}, total_missing=True), RewardRecord(1.0, {})])
    False
    """
    totals = [r.total for r in group if not r.total_missing]
    return len(totals) > 1 and max(totals) - min(totals) > 1e-8


class Collector:
    """Samples and scores a step's groups with the current model (rollout + score phases).

    Several processes: every process draws each round's global prompt list from the same sampler and
    samples, scores and keeps a contiguous share of it. Under dynamic sampling, which groups are kept is
    decided on the gathered "rewards varied" flags of the whole round, in slot order, so every process
    knows the step's global group numbering and runs the same number of rounds (and so of collectives).
    """

    def __init__(self, cfg: RolloutConfig, tokenizer, examples: list[Example], prompt_texts: list[str],
                 reward: CompositeReward, sampler: PromptSampler, seed: int = 0, dist: Dist | None = None,
                 lockstep=None, max_steps: int = 0, engine: Engine | None = None, stop: list[int] = (),
                 accuracy: str | None = None):
        self.cfg, self.tokenizer, self.examples, self.max_steps = cfg, tokenizer, examples, max_steps
        self.accuracy = accuracy  # the reward component whose raw score is a completion's accuracy (pass rates)
        self.stop = list(stop)  # the ids that end a completion (generation.eos_ids): not part of its text
        self.engine = engine  # what samples (engines.py); None: our engines on the model `collect` is given
        self.prompt_texts, self.reward, self.sampler, self.seed = prompt_texts, reward, sampler, seed
        self.dist = dist or Dist()
        self.lockstep = lockstep  # sharded generation: every process makes the same model calls (generation.py)
        self.ahead = None  # a fixed lag's worker process (lag.Ahead), set by run.start_run
        self.multiturn = None  # tools or an environment (multiturn.MultiTurn), set by run.py
        self.taken: dict[int, dict] = {}  # step -> data position after its prompts were taken

    def sample(self, model, idx: list[int], seeds: list[int], version: int, step: int) -> tuple[Generation, list[str]]:
        """G completions for each prompt index in `idx`, rows prompt-major, and their decoded texts, sampled by
        adapter `version`; `seeds` gives each row its own random stream."""
        model.eval()
        decoding = Decoding.of(self.cfg, model, lockstep=self.lockstep is not None) if self.engine is None else None

        def first(ids: list[int]) -> Generation:
            texts = [self.prompt_texts[i] for i in ids]
            if self.engine is not None:
                return self.engine.generate(texts, seeds, version, step)
            return sample_rows(model, self.tokenizer, decoding, texts, seeds, self.lockstep)

        def more(ids: list[list[int]], row_seeds: list[int], max_new_tokens: int) -> Generation:
            if self.engine is not None:
                return self.engine.continue_rows(ids, row_seeds, version, step, max_new_tokens)
            return sample_rows(model, self.tokenizer, decoding, ids, row_seeds, self.lockstep, max_new_tokens)

        if self.multiturn is not None:
            gen = self.multiturn.sample(idx, [self.examples[i] for i in idx], seeds, first, more)
        else:
            gen = first(idx)
        return gen, completion_texts(self.tokenizer, gen.completion_ids, self.stop)

    def collect(self, model, timer: Timer, step: int, version: int | None = None) -> Rollout:
        """Rollout and score until the step's groups are ready (refilling when dynamic sampling drops some),
        sampled by adapter `version` (default: the one after step - 1)."""
        r, g, dist = self.cfg, self.cfg.num_generations, self.dist
        version = step - 1 if version is None else version
        if self.ahead is not None:  # a fixed lag's worker process sampled this step already (lag.Ahead)
            return self._collect_ahead(timer, step)
        if self.engine is not None:  # (every process: a server engine's loading is a collective)
            with timer("rollout"):
                self.engine.begin_step(model, version)  # (a colocated engine syncs, a server loads the version)
        completions: list[Completion] = []
        logged: dict[str, list[float]] = {}
        kept = rounds = sampled = 0  # over all processes
        prefill = None  # multi-turn: this process's (prefilled, reused) prompt tokens over the rounds
        while True:
            n = r.prompts_per_step - kept if r.dynamic_sampling else r.prompts_per_step
            lo, hi = dist.share(n)
            drawn = self.sampler.take(n, step)  # the round's prompts, every process's
            idx = drawn[lo:hi]  # this process's share of them
            self.taken[step] = self.sampler.state()
            examples = [self.examples[i] for i in idx for _ in range(g)]
            seeds = [row_seed(self.seed, step, sampled + lo + p, s) for p in range(len(idx)) for s in range(g)]
            varied, records = [], []
            if idx or self.lockstep:  # (sharded generation: a process without prompts joins the others' calls)
                with timer("rollout"):
                    gen, texts = self.sample(model, idx, seeds, version, step)
            if idx and gen.prefill_tokens is not None:
                done, spared = prefill or (0, 0)
                prefill = done + gen.prefill_tokens, spared + gen.cached_tokens
            if idx:
                with timer("score"):
                    result = score(self.reward, examples, texts, gen, self.trainer_state(step))
                records = result.records
                for key, values in result.metrics.items():
                    logged.setdefault(key, []).extend(values)
                varied = [(g == 1 or rewards_varied(records[p * g:(p + 1) * g])) and p not in gen.dropped_groups
                          for p in range(len(idx))]
            if isinstance(self.sampler, DifficultySampler):  # (every process records the whole round's rates)
                rates = [pass_rate(records[p * g:(p + 1) * g], self.accuracy) for p in range(len(idx))]
                rates = dist.gather(rates) if dist.active else rates
                self.sampler.observe(step, drawn, rates)
                self.taken[step] = self.sampler.state()
                if r.dynamic_sampling:  # (a group is used when its rewards vary and its pass rate is in the band)
                    varied = [v and self.sampler.in_band(rate) for v, rate in zip(varied, rates[lo:hi])]
            if not r.dynamic_sampling:
                varied = [True] * n  # every group is used (but a failed environment's)
                if self.multiturn is not None:
                    varied = [p not in gen.dropped_groups for p in range(len(idx))]
                    varied = dist.gather(varied) if dist.active else varied
            elif dist.active:
                varied = dist.gather(varied)  # the whole round's flags, in slot order
            unfilled = bool(r.dynamic_sampling and not kept and not any(varied) and rounds >= r.max_resample_rounds)
            if unfilled:  # (an expected condition, not an end: the last round's groups train, their advantages 0,
                # and the step's log says so: traces.signal_warnings)
                varied = [p not in gen.dropped_groups for p in range(len(idx))] if idx else []
                varied = dist.gather(varied) if dist.active else varied
            group_of = []  # the step-wide group of each of the round's prompts (None: dropped)
            for v in varied:
                use = v and kept < r.prompts_per_step
                group_of.append(kept if use else None)
                kept += use
            if idx:
                completions += self._completions(examples, [sampled + lo + p for p in range(len(idx))],
                                                 group_of[lo:lo + len(idx)], seeds, gen, texts, records)
            sampled += n
            rounds += 1
            if kept >= r.prompts_per_step or not r.dynamic_sampling or rounds > r.max_resample_rounds:
                metrics = self.sampler.metrics() if isinstance(self.sampler, DifficultySampler) else {}
                if r.dynamic_sampling:
                    metrics["dynamic_sampling/unfilled"] = float(unfilled)
                return Rollout(completions, sampled, kept, logged, data_metrics=metrics, prefill=prefill)

    def data_state(self, step: int) -> dict:
        """The data position after step `step`'s prompts were taken (what a checkpoint of `step` holds; a
        fixed lag's worker takes prompts of later steps ahead)."""
        for old in [k for k in self.taken if k < step - 1]:
            del self.taken[old]
        return self.taken.get(step, self.sampler.state())

    def take_prompts(self, step: int) -> tuple[list[int], list[int]]:
        """(this process's prompt rows, their row seeds) of `step`, taken now from the data order (lag.Ahead)."""
        g, n = self.cfg.num_generations, self.cfg.prompts_per_step
        lo, hi = self.dist.share(n)
        idx = self.sampler.take(n, step)[lo:hi]  # (every process walks the whole order and keeps its share)
        self.taken[step] = self.sampler.state()
        return idx, [row_seed(self.seed, step, lo + p, s) for p in range(len(idx)) for s in range(g)]

    def _collect_ahead(self, timer: Timer, step: int) -> Rollout:
        """`collect` for a step a fixed lag's worker sampled (no dynamic sampling: every group is used, the
        group of a prompt is its slot)."""
        g, n = self.cfg.num_generations, self.cfg.prompts_per_step
        lo, _ = self.dist.share(n)
        with timer("rollout"):  # (the wait for the worker: 0 when it sampled while the learner updated)
            idx, seeds, gen = self.ahead.take(step)
        texts = completion_texts(self.tokenizer, gen.completion_ids, self.stop)
        examples = [self.examples[i] for i in idx for _ in range(g)]  # (every process has prompts: P divides)
        with timer("score"):
            result = score(self.reward, examples, texts, gen, self.trainer_state(step))
        slots = [lo + p for p in range(len(idx))]  # (every group used: a prompt's group is its slot)
        return Rollout(self._completions(examples, slots, slots, seeds, gen, texts, result.records), n, n,
                       result.metrics, sampler_seconds=gen.seconds)

    def _completions(self, examples: list[Example], slots: list[int], groups: list[int | None], seeds: list[int],
                     gen: Generation, texts: list[str], records: list) -> list[Completion]:
        """The step's records of one round's rows (prompt-major, G a prompt), whichever process sampled them:
        each prompt's slot among the step's sampled prompts and its group (None: dropped by dynamic sampling)."""
        g = self.cfg.num_generations
        drawn = self.sampler.drawn if isinstance(self.sampler, DifficultySampler) else None
        return [Completion(example=examples[i], slot=slots[i // g], sample=i % g, seed=seeds[i],
                           prompt_ids=gen.prompt_ids[i], ids=gen.completion_ids[i], sampler_logps=gen.logps[i],
                           text=texts[i], truncated=gen.truncated[i], reward=records[i],
                           used=groups[i // g] is not None, group=groups[i // g],
                           model_mask=gen.model_mask[i] if gen.model_mask else None,
                           turns=gen.turns[i] if gen.turns else None,
                           observation=gen.observations[i] if gen.observations else None,
                           prompt_pass_rate=NOT_DRAWN_BY_DIFFICULTY if drawn is None else drawn.get(examples[i].prompt_id))
                for i in range(len(examples))]

    def trainer_state(self, step: int):
        """What TRL passes reward functions as `trainer_state` (for shaping by training progress): a
        transformers.TrainerState with the steps completed before this one, the run's steps and the
        epoch reached in the data (fractional)."""
        from transformers import TrainerState

        n, data = max(self.sampler.n, 1), self.taken.get(step, self.sampler.state())
        return TrainerState(global_step=step - 1, max_steps=self.max_steps,
                            epoch=data["epoch"] + data["position"] / n)
