"""Replay and rescore: debug one traced completion.

`replay` answers "would the policy of that step really produce this again?": it rebuilds the policy that
sampled a traced completion (the checkpoint of step S - 1, or the nearest earlier one run forward exactly as
a resume would), checks it against the trace's adapter digest, samples step S again and compares the
completion token for token (the first divergence with the rebuilt policy's log-prob of both tokens), and
scores it with today's reward code beside the traced scores. A multi-turn completion is replayed with the
traced tool results (while the model makes the traced calls) and its divergence named by turn. The whole step is sampled again, in the same
generate calls as in training: a row sampled alone would sit in batches of another shape, whose float
sums may round differently.

`rescore` answers "what would my fixed reward have given it, and which completions change?": every traced
completion scored again with the current reward code and a config (the run's own, or a new one), without a
model: totals, per-component deltas and, for a critic-free algorithm (GRPO), the group advantages they
would have had. Its output file is trace lines (the same schema, new values, the old ones under `before`),
so `docuchat-rl audit` reads it like a run.

A fixed lag's run (`rollout.async_lag`) is rebuilt with its own sampling arrangement (the worker process and
the thread counts it trained with), whose numbers the learner's weights depend on.

Deliberately left out: replaying a multi-process run bit-exactly (each process sampled its share in
batches of its own; a one-process replay samples them in one), and rescoring a reward that reads
`trainer_state.epoch` (rescore passes the step, not the data position).
"""

from __future__ import annotations

import itertools
import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..checkpoint import list_checkpoints, saved_config, verify_checkpoint
from ..config import Config, config_from_dict
from ..data import DataError, Example
from ..errors import ReplayError
from ..outputs import read_jsonl
from ..traces import REQUIRED, library_versions, mistyped


def _where(t: dict) -> str:
    return f"step {t.get('step')} prompt {t.get('prompt_id')} sample {t.get('sample')}"


def run_config(run_dir: Path) -> dict:
    """The run's recipe: run_config.json of its newest intact checkpoint."""
    for folder in reversed(list_checkpoints(run_dir)):
        if verify_checkpoint(folder) is None and (folder / "run_config.json").exists():
            return saved_config(folder)
    raise ReplayError(f"{run_dir}: no intact checkpoint holds the run's config (run_config.json)")


def select(run_dir: Path, step: int, prompt_id: int, sample: int) -> list[dict]:
    """The trace lines of (step, prompt row, sample) in the run's traces.jsonl."""
    path = Path(run_dir) / "traces.jsonl"
    if not path.exists():
        raise ReplayError(f"{run_dir}: no traces.jsonl")
    found = [t for t in read_jsonl(path)
             if (t.get("step"), t.get("prompt_id"), t.get("sample")) == (step, prompt_id, sample)]
    if not found:
        raise ReplayError(f"{path}: no completion of step {step} prompt {prompt_id} sample {sample}")
    return found


# ------------------------------------------------------------------------------------------------- replay
@dataclass
class Replayed:
    """One traced completion sampled again by the policy that sampled it."""

    trace: dict
    ids: list[int]  # the completion sampled now
    diverges_at: int | None  # the first token index that differs (None: token for token the traced one)
    traced_logp: float | None  # at the divergence: the rebuilt policy's log-prob of the traced token
    new_logp: float | None  # ... and of the token it samples now
    traced_piece: str | None  # at the divergence: the traced token's text (repr), "(ended)" past its end
    new_piece: str | None  # ... and the text of the token sampled now
    now: dict[str, float | None]  # each component's raw score now (today's reward code)
    total_now: float
    text: str
    diverges_in: str | None = None  # multi-turn: "turn K model" or "turn K tool" (K from 0) at the divergence

    @property
    def same(self) -> bool:
        return self.diverges_at is None

    def as_dict(self) -> dict:
        t = self.trace
        return {"step": t["step"], "prompt_id": t["prompt_id"], "sample": t["sample"], "same": self.same,
                "diverges_at": self.diverges_at, "traced_logp": self.traced_logp, "new_logp": self.new_logp,
                "traced_piece": self.traced_piece, "new_piece": self.new_piece,
                "tokens_traced": len(t["completion_ids"]), "tokens_now": len(self.ids),
                "traced": {k: c["raw"] for k, c in t["rewards"].items()}, "now": self.now,
                "total_traced": t["total"], "total_now": self.total_now, "completion_now": self.text,
                **({"diverges_in": self.diverges_in} if t.get("turns") else {})}


def _turn_at(turns: list[dict] | None, j: int | None) -> str | None:
    """Which turn, and which part of it (the model's tokens or the tool results), token `j` is in."""
    if not turns or j is None:
        return None
    at = 0
    for k, t in enumerate(turns):
        for part, n in (("model", t["model_tokens"]), ("tool", t["env_tokens"])):
            if j < at + n:
                return f"turn {k} {part}"
            at += n
    return f"turn {len(turns) - 1} (past the traced end)"


RESCORED = (*REQUIRED, "sample", "prompt", "completion_tokens", "truncated")  # the fields a traced completion
# must hold to be rescored (or replayed): every trace line's, and what rebuilds its row


def _check_replayable(traces: list[dict], cfg: dict) -> None:
    """Refuse, naming why, what cannot be replayed exactly: no coordinate, other library versions."""
    now = library_versions()
    for t in traces:
        if t.get("seed") is None or t.get("completion_ids") is None or t.get("sampling") is None:
            raise ReplayError(f"{_where(t)}: the trace line has no replay coordinate (seed, completion_ids, "
                              "sampling): it was written by a docuchat-rl that did not record them")
        _check_types(t)
        engine = t["sampling"].get("engine")
        for lib in ("torch", "transformers") + (("vllm",) if engine == "vllm" else ()):
            was = (t.get("versions") or {}).get(lib)
            if was != now[lib]:
                raise ReplayError(f"{_where(t)} was sampled with {lib} {was}, this environment has {now[lib]}: "
                                  f"the numbers would differ; replay where {lib} {was} is installed")
        if engine is not None and engine != cfg["rollout"]["engine"]:  # (a saved config's engine is decided)
            raise ReplayError(f"{_where(t)} was sampled by the {engine} engine, the run's config says "
                              f"{cfg['rollout']['engine']}")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_types(t: dict) -> None:
    """A trace line's replay fields hold what a trace writes (a hand-edited line is one line of error)."""
    problem = mistyped(t, RESCORED)
    if problem:
        raise ReplayError(f"{_where(t)}: {problem}")
    for key in ("step", "prompt_id", "sample", "slot", "seed"):
        if not _is_int(t.get(key)) or t[key] < (1 if key == "step" else 0):
            raise ReplayError(f"{_where(t)}: field {key} is {t.get(key)!r}, not a trace's "
                              f"{'step (an integer from 1)' if key == 'step' else 'non-negative integer'}")
    ids = t["completion_ids"]
    if not isinstance(ids, list) or not all(_is_int(i) and i >= 0 for i in ids):
        raise ReplayError(f"{_where(t)}: field completion_ids is not a list of token ids (non-negative integers)")
    if not isinstance(t.get("sampling"), dict):
        raise ReplayError(f"{_where(t)}: field sampling is not an object")


def _start_step(run_dir: Path, target: int, first_traced: int) -> tuple[Path | None, int]:
    """(checkpoint to resume, its step) nearest at or before `target` (None, 0: the run's start)."""
    kept = [(int(c.name.split("-")[1]), c) for c in list_checkpoints(run_dir) if verify_checkpoint(c) is None]
    before = [(s, c) for s, c in kept if s <= target]
    if before:
        step, folder = max(before)
        return folder, step
    if first_traced > 1:  # the run began from a checkpoint of another folder: no chain back to step 0 here
        raise ReplayError(f"no checkpoint at or before step {target} in {run_dir}, and the run's traces begin at "
                          f"step {first_traced} (it was resumed from elsewhere): the chain back to the policy of "
                          f"step {target} is missing")
    return None, 0


def replay(run_dir: str | Path, traces: list[dict], *, progress: bool = True,
           say: Callable[[str], None] = print) -> list[Replayed]:
    """Sample each traced completion again with the policy that sampled it (see the module docstring)."""
    import torch

    from ..learning.batch import build_batch
    from ..learning.forward import policy_forward
    from ..trainer import Trainer

    run_dir = Path(run_dir)
    raw = run_config(run_dir)
    _check_replayable(traces, raw)
    first = min((t["step"] for t in read_jsonl(run_dir / "traces.jsonl") if isinstance(t.get("step"), int)),
                default=1)
    tmp = Path(tempfile.mkdtemp(prefix="docuchat-replay-"))
    raw = json.loads(json.dumps(raw))
    raw["run"].update(output_dir=str(tmp / "run"), overwrite=True)
    raw["logging"].update(progress=progress, wandb=False)
    raw["eval"].update(every=None, before_and_after=False)
    raw["checkpoint"].update(every=10**9, keep_last=1)
    cfg: Config = config_from_dict(raw)
    out: list[Replayed] = []
    trainer = None
    try:
        for step, group in itertools.groupby(sorted(traces, key=lambda t: t["step"]), key=lambda t: t["step"]):
            group = list(group)
            target = step - 1
            folder, at = _start_step(run_dir, target, first)
            # (a fixed lag's worker took the next steps' prompts ahead: its rebuild serves one step only)
            if trainer is None or not at <= trainer.step <= target or trainer.collector.ahead is not None:
                if trainer is not None:
                    trainer.close()
                    shutil.rmtree(tmp / "run", ignore_errors=True)
                trainer = Trainer(cfg, resume=str(folder) if folder else None, quiet=True)
            vocab = trainer.learner.model.get_output_embeddings().weight.shape[0]
            for t in group:
                if any(i >= vocab for i in t["completion_ids"]):
                    raise ReplayError(f"{_where(t)}: completion_ids holds a token id beyond the model's "
                                      f"vocabulary of {vocab}: the line was not written by this run")
            todo = target - trainer.step
            say(f"docuchat-rl: replay of step {step}: the policy of step {target}, "
                + (f"from {folder.name}" if trainer.step == at and folder else
                   "from the run's start" if trainer.step == 0 else f"from step {trainer.step}")
                + (f", {todo} step{'s' * (todo != 1)} to run first" if todo else ""))
            if todo:
                trainer.train(stop_after=target)
            if trainer.collector.multiturn is not None:  # the traced tool results, not the tools' answers now
                trainer.collector.multiturn.script = {t["seed"]: t["turns"] for t in group if t.get("turns")}
            try:
                rollout = _resample(trainer)  # step `step` sampled and scored again, as in training
            finally:
                if trainer.collector.multiturn is not None:
                    trainer.collector.multiturn.script = None
            traced = {t.get("adapter_sha256") for t in group} - {None}
            if traced and traced != {rollout.adapter_sha256}:
                raise ReplayError(f"the rebuilt policy of step {rollout.policy_version} has adapter "
                                  f"{rollout.adapter_sha256}, the traces say {', '.join(sorted(traced))}: it is not "
                                  f"the policy that sampled step {step} (another model, data or code)")
            sampled = {(c.slot, c.sample): c for c in rollout.completions}
            for t in group:
                c = sampled.get((t["slot"], t["sample"]))
                if c is None or c.example.prompt_id != t["prompt_id"]:
                    raise ReplayError(f"{_where(t)}: step {step} now samples row "
                                      f"{None if c is None else c.example.prompt_id} in that place: the data "
                                      "or its order changed")
                old = list(t["completion_ids"])
                j = next((i for i, (a, b) in enumerate(zip(old, c.ids)) if a != b),
                         None if len(old) == len(c.ids) else min(len(old), len(c.ids)))
                traced_lp = new_lp = None
                tok = trainer.run.tokenizer
                if j is not None and j < len(old) and j < len(c.ids):
                    r = cfg.rollout  # (the traced token under the policy that sampled, as the sampler scores)
                    batch = build_batch([c.prompt_ids], [old], [0.0], [0], tok.pad_token_id)
                    with torch.no_grad(), trainer.policy.holding(step):
                        lp = policy_forward(trainer.learner.model, batch.to(trainer.dist.device),
                                            temperature=r.temperature, top_k=r.top_k, top_p=r.top_p).logps
                    traced_lp, new_lp = float(lp[0, j]), float(c.sampler_logps[j])
                pieces = (None, None) if j is None else tuple(
                    repr(tok.decode(ids[j:j + 1])) if j < len(ids) else "(ended)" for ids in (old, c.ids))
                out.append(Replayed(t, list(c.ids), j, traced_lp, new_lp, *pieces,
                                    {k: v.raw for k, v in c.reward.components.items()}, c.reward.total, c.text,
                                    _turn_at(t.get("turns"), j)))
    finally:
        if trainer is not None:
            trainer.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _resample(trainer):
    """The trainer's next step sampled and scored again, as its loop does it, with the random draws and the
    data position put back after: the loop goes on as if it never ran."""
    from ..preemption import RandomState
    from ..sampling.rollout import Timer

    rng, data = RandomState.capture(), trainer.collector.sampler.state()
    try:
        return trainer.collect(Timer())
    finally:
        trainer.rewind(rng, data)


# ------------------------------------------------------------------------------------------------ rescore
@dataclass
class Rescored:
    """Every traced completion scored again: the new trace lines (old values under `before`), and which
    changed."""

    lines: list[dict]
    changed: list[dict] = field(default_factory=list)  # the lines whose total or advantage changed
    advantages: bool = True  # False when the algorithm's advantages need its critic (not recomputed)
    skipped: int = 0  # lines of the file that are not trace lines (torn, not JSON objects, mistyped)
    first_skipped: str | None = None  # where the first of them is, and why
    kept: list[str] = field(default_factory=list)  # components that cannot be rescored: their traced scores kept


class TracedEnvironment:
    """A traced completion's environment, gone with its run: `get_reward()` gives the traced score back, so
    the `environment` component is kept as training scored it (rescore says so) instead of failing."""

    def __init__(self, raw: float | None):
        self.raw = raw

    def get_reward(self) -> float | None:
        return self.raw


def rescore(run_dir: str | Path, cfg: Config | None = None) -> Rescored:
    """Score every completion of the run's traces with today's reward code and `cfg` (default: the run's own
    config), step by step as in training; recompute GRPO-style group advantages from the new totals."""
    from transformers import TrainerState

    from ..data import load_split
    from ..learning.algorithms import ActorCritic, get_algorithm_class
    from ..sampling.generation import Generation
    from ..sampling.multiturn import conversation_of
    from ..sampling.rollout import Completion, Rollout
    from ..sampling.scoring import build_reward, score

    run_dir = Path(run_dir)
    path = run_dir / "traces.jsonl" if run_dir.is_dir() else run_dir
    if not path.exists():
        raise ReplayError(f"{run_dir}: no traces.jsonl")
    cfg = cfg or config_from_dict(run_config(path.parent))
    unreadable: list[int] = []
    lines = read_jsonl(path, unreadable)
    traces = [t for t in lines if mistyped(t, RESCORED) is None]
    skipped = [f"line {n}: not a JSON object" for n in unreadable[:1]]
    skipped += [f"{_where(t)}: {mistyped(t, RESCORED)}" for t in lines if mistyped(t, RESCORED)][:1]
    if not traces:
        raise ReplayError(f"{path}: no trace lines" + (f" ({skipped[0]})" if skipped else ""))
    rows: dict[int, Example] = {}
    try:  # the data rows give the rewards their columns (a `solution` column, say); the traces keep the text
        rows = {e.prompt_id: e for e in load_split(cfg.data, "train")}
    except DataError:
        pass
    reward = build_reward(cfg.rewards)
    cls = get_algorithm_class(cfg.algorithm.name)
    critic_free = not issubclass(cls, ActorCritic)  # (a critic's advantages need its values: the model)
    algo = cls(cfg.algorithm, reward_weights=cfg.rewards.weights) if critic_free else None
    result = Rescored([], advantages=critic_free, skipped=len(unreadable) + len(lines) - len(traces),
                      first_skipped=skipped[0] if skipped else None)
    for step, group in itertools.groupby(traces, key=lambda t: t.get("step")):
        group = list(group)
        examples = []
        for t in group:
            e = rows.get(t["prompt_id"])
            if e is None or e.question != t["prompt"]:  # (the data file changed or is elsewhere: the trace's own)
                e = Example(t["prompt_id"], t["prompt"], t.get("gold") or "")
            examples.append(e)
        ids = [t.get("completion_ids") or [0] * t["completion_tokens"] for t in group]
        gen = Generation([[]] * len(group), ids, [t["truncated"] for t in group], [[]] * len(group))
        if any(t.get("turns") for t in group):  # multi-turn: the conversations as training scored them
            gen.conversations = [conversation_of(t["turns"]) if t.get("turns") else
                                 [{"role": "assistant", "content": t["completion"]}] for t in group]
            gen.model_mask = [[v for turn in t["turns"] for v in [1] * turn["model_tokens"] + [0] * turn.get(
                "env_tokens", 0)] if t.get("turns") else [1] * len(i) for t, i in zip(group, ids)]
            if "environment" in reward.names:  # (its instances are gone: the traced scores are kept, said)
                gen.environments = [TracedEnvironment((t["rewards"].get("environment") or {}).get("raw"))
                                    for t in group]
                result.kept = ["environment"]
        state = TrainerState(global_step=step - 1, max_steps=cfg.run.steps)
        new = score(reward, examples, [t["completion"] for t in group], gen, state).records
        adv: list[float | None] = [None] * len(group)
        if result.advantages:  # the new totals through the run's own batch and estimator (Rollout.batch)
            comps = [Completion(e, t.get("slot") or 0, t["sample"], t.get("seed") or 0, [0], i, [0.0] * len(i),
                                t["completion"], t["truncated"], rec,
                                t.get("used", True) and t.get("group") is not None, t.get("group"))
                     for e, t, i, rec in zip(examples, group, ids, new)]
            rollout = Rollout(comps, len(group), 0)
            if rollout.used:
                batch = rollout.batch(0, cfg.algorithm.mask_truncated_completions)
                algo.advantages(batch)
                values = iter(algo.trace_fields(batch)["advantage"])
                adv = [float(next(values)) if c.used else None for c in comps]
        for t, rec, a in zip(group, new, adv):
            line = {**t, "rewards": {k: c.as_dict() for k, c in rec.components.items()}, "total": rec.total,
                    "total_missing": rec.total_missing,
                    "before": {"total": t["total"], "advantage": t.get("advantage"),
                               "rewards": t["rewards"]}}
            if result.advantages:
                line["advantage"] = a
            result.lines.append(line)
            if abs(rec.total - t["total"]) > 1e-9 or (result.advantages and not _same(a, t.get("advantage"))):
                result.changed.append(line)
    return result


def _same(a: float | None, b: float | None) -> bool:
    """Two advantages agree (to float noise; None only with None)."""
    return a is None and b is None or (a is not None and b is not None and abs(a - b) <= 1e-6)


def component_deltas(line: dict) -> dict[str, tuple[float | None, float | None]]:
    """(before, now) contribution (weight x raw) of each component whose contribution changed, a new or
    removed component included."""
    before, after = line["before"]["rewards"], line["rewards"]
    out = {}
    for name in dict.fromkeys([*before, *after]):
        b, a = before.get(name, {}).get("weighted"), after.get(name, {}).get("weighted")
        if b != a:
            out[name] = (b, a)
    return out
