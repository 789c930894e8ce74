"""Evaluation: greedy accuracy, sampled pass@1 and pass@k, mean of each reward component, format rate, length.

Accuracy is the raw score of the `rewards.accuracy_component` reward (correctness by default) on the
greedy completion; the format rate is the share of greedy completions with a format score of exactly 1
(partial credit does not count) when a `format` component is configured (strict format otherwise).
With eval.pass_k = k, each prompt is also sampled k times at the rollout's temperature: pass@1 is the mean
accuracy of those samples (what RL's sampled accuracy is, held out), pass@k the share of prompts with at
least one correct sample (k samples per prompt, so the unbiased estimator is this share). Greedy accuracy
says what the policy's mode does; pass@1 what its distribution does; pass@k what it can do at all.

Each of the three comes with its 95% interval (`<name>/ci95`, Wilson's score interval over the `rows`
prompts: `wilson`), and `compare` says the difference between two evaluations with its interval
(Newcombe's hybrid score interval: `difference`). A prompt is the unit: its k samples are not independent
trials, and counting prompts keeps pass@1's interval conservative.
The rewards receive the same inputs as in training (`data.reward_inputs`: the data set's columns,
answer, completion_tokens, truncated, prompt_id), so a custom reward that reads a column scores here too.

Deliberately left out: majority voting (maj@k) and per-difficulty breakdowns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from rewards import CompositeReward

from .config import Config
from .data import DataError, Example, load_examples, load_split, prompt_text
from .distributed import Dist
from .errors import ToolError
from .modeling import eos_ids
from .sampling import static_decode
from .sampling.decoding import Decoding
from .sampling.generation import completion_texts, generate, row_seed
from .sampling.multiturn import multiturn_from_config
from .sampling.scoring import build_reward, score
from .traces import reward_gaps, reward_means

EVAL_STEP = 0  # pass@k's random streams are row_seed(run seed, EVAL_STEP, row, sample); training steps start at 1


@dataclass
class EvalRow:
    """What evaluation keeps of one held-out row (rows travel between processes as these)."""

    raw: dict[str, float | None]  # each reward component's raw score of the greedy completion
    tokens: int  # greedy completion length
    truncated: bool
    hits: list[float | None]  # the accuracy component's raw score of each pass@k sample (None: no value; empty: off)
    calls: int = 0  # multi-turn: tool calls the greedy completion made
    failed_calls: int = 0  # multi-turn: of the calls that ran, those that failed (malformed, unknown tool, the
    # tool's error); a call a limit kept from running is neither
    ran_calls: int = 0  # multi-turn: the calls that ran (ToolCall.ran)
    reset_failed: bool = False  # its environment's reset raised: said, and left out of every number
    errors: dict[str, str | None] = field(default_factory=dict)  # each component's error on the greedy one


def also_sets(cfg: Config) -> dict[str, list[Example]]:
    """eval.also's held-out rows by name, the first eval.limit of each (a missing file or column fails here,
    naming it)."""
    d = cfg.data
    return {name: load_examples(path, d.test_split, d.prompt_column, d.answer_column, limit=cfg.eval.limit,
                                revision=d.revision, subset=d.subset, key=f"eval.also.{name}")
            for name, path in cfg.eval.also.items()}


def evaluate(model, tokenizer, cfg: Config, examples: list[Example] | None = None, dist: Dist | None = None,
             lockstep=None, also: dict[str, list[Example]] | None = None) -> dict:
    """The held-out numbers, then each of eval.also's sets' under `<name>/` (`also`: those sets' rows, loaded
    when None). On several processes (`dist`) each evaluates a contiguous share of the rows
    and every process returns the numbers over all of them; pass@k draws each sample from its own
    stream (row_seed), so the numbers do not depend on how rows are split or batched. `lockstep`: sharded
    generation (see generation.generate)."""
    cfg = cfg.for_device(next(model.parameters()).device.type)
    if examples is None:
        examples = load_split(cfg.data, "test", cfg.eval.limit)
    dist = dist or Dist()
    out = _evaluate_set(model, tokenizer, cfg, examples, dist, lockstep, "data.test")
    for name, rows in (also_sets(cfg) if also is None else also).items():
        out.update({f"{name}/{k}": v for k, v in
                    _evaluate_set(model, tokenizer, cfg, rows, dist, lockstep, f"eval.also.{name}").items()})
    static_decode.release(model)  # (its buffers, sized for evaluation's rows and tokens, are not training's)
    return out


def _evaluate_set(model, tokenizer, cfg: Config, examples: list[Example], dist: Dist, lockstep,
                  key: str = "data.test") -> dict:
    """One held-out set's numbers (see evaluate); `key` names the set in errors."""
    e = cfg.eval
    reward = build_reward(cfg.rewards, with_format=True)
    acc_name = cfg.rewards.accuracy_component
    k = e.pass_k if e.pass_k and acc_name in reward.names else 0
    lo, hi = dist.share(len(examples))
    mine = examples[lo:hi]  # this process's share
    max_new = e.max_new_tokens or cfg.rollout.max_new_tokens
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    rows: list[EvalRow] = []
    if mine or lockstep:
        rows = _evaluate_rows(model, tokenizer, cfg, reward, mine, max_new, k, first=lo, lockstep=lockstep, key=key)
    rows = dist.gather(rows)  # every row, in order, on every process
    model.train(was_training)
    failed = sum(r.reset_failed for r in rows)
    rows = [r for r in rows if not r.reset_failed]  # (said once by reset_environments: not scored, not counted)
    if not rows and examples:
        raise ToolError(f"every one of the {len(examples)} held-out rows failed its environment's reset: "
                        "nothing to evaluate")
    out: dict = {"rows": len(rows), **settings(cfg, examples, k)}
    if failed:
        out["reset_failed"] = failed
    for name, mean in reward_means([r.raw for r in rows], reward.names).items():
        out[f"{name}/mean"] = mean
    gaps = reward_gaps([{n: {"raw": r.raw[n], "error": r.errors.get(n)} for n in reward.names} for r in rows],
                       reward.names, "held-out completions")
    if gaps:  # (said by the command, one line each: traces.reward_gaps)
        out["reward_gaps"] = gaps
    if acc_name in reward.names:  # (a row whose accuracy has no value is left out of the figure and of its n)
        out["accuracy"] = out[f"{acc_name}/mean"]
        out["accuracy/rows"] = sum(r.raw.get(acc_name) is not None for r in rows)
    out["format_rate"] = float(np.mean([r.raw.get("format") == 1.0 for r in rows])) if rows else None  # (a
    # format reward with partial credit scores between 0 and 1: the rate counts the completions that have it)
    out["completion_len/mean"] = float(np.mean([r.tokens for r in rows]))
    out["truncated_frac"] = float(np.mean([r.truncated for r in rows]))
    if cfg.rollout.multi_turn:
        out["tool_calls/mean"] = float(np.mean([r.calls for r in rows]))
        out["tool_call_rate"] = float(np.mean([r.calls > 0 for r in rows]))
        ran = sum(r.ran_calls for r in rows)
        out["tool_call_ok_frac"] = (ran - sum(r.failed_calls for r in rows)) / ran if ran else None
    if k:
        out.update(sampled([r.hits for r in rows]))
    out.update(intervals(out, len(rows)))
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out


def _check_fits(tokenizer, prompts: list[str], examples: list[Example], context: int | None, max_new: int,
                key: str) -> int:
    """Every held-out prompt, with the completion length, fits the model's context (as training's prompts must):
    one line naming the set and row before anything is generated, never a prompt scored past the model's positions.
    -> the longest prompt's tokens."""
    if not prompts:
        return 0
    lengths = [len(ids) for ids in tokenizer(prompts, add_special_tokens=False)["input_ids"]]
    if context is None:
        return max(lengths)
    over = [(n, e) for n, e in zip(lengths, examples) if n + max_new > context]
    if over:
        n, e = over[0]
        raise DataError(f"{key}: row {e.prompt_id} has a prompt of {n} tokens, and the model's context of {context} "
                        f"leaves {context - n} for its completion of up to {max_new} (eval.max_new_tokens): "
                        f"{len(over)} of the {len(examples)} rows do not fit; lower eval.max_new_tokens or filter the set")
    return max(lengths)


def _check_rows(model, rows: int, positions: int, device) -> None:
    """eval.batch_size rows at `positions` fit the memory free now (memory.rows_that_fit), or one line naming the
    key before anything is generated."""
    from .memory import bytes_per_row, free_bytes, rows_that_fit

    per_row, free = bytes_per_row(model, positions), free_bytes(device)
    if rows_that_fit(free, per_row, rows, 1) < rows:
        raise DataError(f"eval.batch_size {rows}: {rows} rows at {positions} positions need "
                        f"{per_row * rows / 2**30:.2f} GiB of keys, values and logits, more than half the "
                        f"{free / 2**30:.2f} GiB free on {device}: lower eval.batch_size (or eval.pass_k with it)")


def sampled(hits: list[list[float | None]]) -> dict[str, float | int | None]:
    """pass@1 (the mean accuracy of the samples) and pass@k (the share of prompts with a correct one) of `hits`,
    each prompt's k samples' accuracy scores, with the rule greedy accuracy has: a sample without a value (None) is
    left out, and so is a prompt none of whose samples has one; each figure's n is `<figure>/rows` (prompts).

    >>> sampled([[1, 0, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]])
    {'pass@1': 0.5, 'pass@1/rows': 3, 'pass@4': 0.666667, 'pass@4/rows': 3}
    >>> sampled([[1, None], [None, None], [0, 0]])
    {'pass@1': 0.333333, 'pass@1/rows': 2, 'pass@2': 0.5, 'pass@2/rows': 2}
    """
    k = max(len(h) for h in hits) if hits else 0
    scored = [[x for x in h if x is not None] for h in hits]
    samples = [x for h in scored for x in h]
    prompts = [h for h in scored if h]
    return {"pass@1": round(float(np.mean(samples)), 6) if samples else None, "pass@1/rows": len(prompts),
            f"pass@{k}": round(float(np.mean([max(h) > 0 for h in prompts])), 6) if prompts else None,
            f"pass@{k}/rows": len(prompts)}


def settings(cfg: Config, examples: list[Example], k: int | None = None) -> dict:
    """What makes two evaluations of a set comparable (`incomparable`): its rows (a digest), completion length,
    pass@k and, with pass@k, the sampling; known before anything is evaluated. `k`: pass@k as evaluated (None: as
    the recipe asks, when its accuracy reward is there)."""
    e, r = cfg.eval, cfg.rollout
    if k is None:
        k = e.pass_k if e.pass_k and cfg.rewards.accuracy_component in [c.name for c in cfg.rewards.components] else 0
    out = {"set": rows_digest(examples), "max_new_tokens": e.max_new_tokens or r.max_new_tokens, "pass_k": k}
    if k:
        out.update({"sampled_temperature": r.temperature, "sampled_top_p": r.top_p, "sampled_top_k": r.top_k})
    return out


def rows_digest(examples: list[Example]) -> str:
    """What identifies a held-out set's rows (their questions and answers, in order): a sha256's first 16 digits."""
    import hashlib

    h = hashlib.sha256()
    for e in examples:
        h.update(f"{e.question}\x00{e.answer}\x01".encode())
    return h.hexdigest()[:16]


def intervals(out: dict, n: int) -> dict[str, list[float]]:
    """The 95% interval (`wilson`, over the figure's own n: `<name>/rows` where given, else the `n` prompts) of each
    accuracy-like number in `out`, as `<name>/ci95`.

    >>> intervals({"accuracy": 0.5, "pass@4": 2 / 3, "pass@4/rows": 3, "rows": 4}, 4)
    {'accuracy/ci95': [0.150039, 0.849961], 'pass@4/ci95': [0.20766, 0.938508]}
    """
    return {f"{key}/ci95": list(wilson(v, out.get(f"{key}/rows", n))) for key, v in out.items()
            if (key == "accuracy" or key.startswith("pass@")) and not key.endswith("/rows")
            and isinstance(v, (int, float)) and out.get(f"{key}/rows", n)}


# Wilson's and Newcombe's intervals are a few lines each; scipy and statsmodels have them, but neither is a
# dependency of ours, and these lines are all we would use of them.
Z95 = 1.959963984540054  # the standard normal's 97.5th percentile


def wilson(p: float, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson's score interval of a proportion `p` observed in `n` trials (95% by default): unlike the normal
    approximation it stays inside [0, 1] and is honest at 0% and 100%.

    >>> [round(x, 4) for x in wilson(0.5, 100)]
    [0.4038, 0.5962]
    >>> [round(x, 4) for x in wilson(0.0, 20)]
    [0.0, 0.1611]
    """
    if n <= 0:
        return (0.0, 1.0)
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (round(float(max(0.0, centre - half)), 6), round(float(min(1.0, centre + half)), 6))


def difference(p1: float, n1: int, p2: float, n2: int, z: float = Z95) -> tuple[float, float, float]:
    """(p1 - p2, and its 95% interval) for two proportions from independent samples: Newcombe's hybrid score
    interval (his method 10), built from each one's Wilson interval. On the same held-out rows the two are
    positively correlated, which makes this interval conservative (wider than a paired one).

    >>> [round(x, 4) for x in difference(56 / 70, 70, 48 / 80, 80)]  # (Newcombe 1998's examples: 0.0524 to 0.3339
    [0.2, 0.0524, 0.3339]
    >>> [round(x, 4) for x in difference(9 / 10, 10, 3 / 10, 10)]  # and 0.1705 to 0.8090, method 10)
    [0.6, 0.1705, 0.809]
    """
    l1, u1 = wilson(p1, n1, z)
    l2, u2 = wilson(p2, n2, z)
    d = p1 - p2
    lo = d - np.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2)
    hi = d + np.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)
    return (round(d, 6), round(float(lo), 6), round(float(hi), 6))


COMPARED = ("set", "max_new_tokens", "pass_k", "sampled_temperature", "sampled_top_p", "sampled_top_k")


def incomparable(new: dict, old: dict) -> list[str]:
    """Why two evaluations' numbers cannot be compared, one phrase a difference (empty: they can): another set of
    rows (their digest), completion length, pass@k, or sampling, for the main set and each eval.also set both hold.
    An evaluation older than a setting says nothing of it (not counted as a difference)."""
    out = []
    names = {k.rsplit("/", 1)[0] for k in new if k.endswith("/set")} & {k.rsplit("/", 1)[0] for k in old}
    for prefix in ("", *(f"{n}/" for n in sorted(names))):
        for key in COMPARED:
            a, b = new.get(prefix + key), old.get(prefix + key)
            if a is not None and b is not None and a != b:
                out.append(f"{prefix}{key} {a!r} here, {b!r} there")
    return out


def compare(new: dict, old: dict) -> dict:
    """Every accuracy-like number (accuracy, pass@1, pass@k, of each set) the two evaluations share, as the
    difference new - old with its 95% interval (`difference`) and whether the interval excludes 0."""
    out = {}
    for key, value in new.items():
        name, _, metric = key.rpartition("/")
        if not (metric == "accuracy" or metric.startswith("pass@")) or key.endswith("/ci95"):
            continue
        if key.endswith("/rows"):
            continue
        rows_key = f"{name}/rows" if name else "rows"
        if not isinstance(value, (int, float)) or not isinstance(old.get(key), (int, float)):
            continue
        n_new, n_old = new.get(f"{key}/rows", new.get(rows_key)), old.get(f"{key}/rows", old.get(rows_key))
        if not n_new or not n_old:
            continue
        d, lo, hi = difference(value, n_new, old[key], n_old)
        out[key] = {"new": value, "old": old[key], "difference": d, "ci95": [lo, hi],
                    "beyond_noise": bool(lo > 0 or hi < 0)}
    return out


def _evaluate_rows(model, tokenizer, cfg: Config, reward: CompositeReward, examples: list[Example], max_new: int,
                   k: int, first: int, lockstep=None, key: str = "data.test") -> list[EvalRow]:
    """Greedy completions (and k samples each for pass@k) of `examples`, the rows `first`, first + 1, ...
    of the held-out set, scored."""
    e, r, acc_name = cfg.eval, cfg.rollout, cfg.rewards.accuracy_component
    multiturn = multiturn_from_config(cfg, tokenizer, max_new, group_size=1, stop_ids=eos_ids(model, tokenizer),
                                      context_len=getattr(model.config, "max_position_embeddings", None))
    prompts = [multiturn.prompt_text(x) if multiturn else
               prompt_text(tokenizer, cfg.data, x)
               for x in examples]
    longest = _check_fits(tokenizer, prompts, examples, getattr(model.config, "max_position_embeddings", None),
                          max_new, key)
    _check_rows(model, e.batch_size, longest + max_new, next(model.parameters()).device)

    # the rollout's sampling (its loop, switches, merged adapter), greedy, eval's batch size and length
    greedy_decoding = Decoding.of(r, model, lockstep=lockstep is not None, do_sample=False, batch_size=e.batch_size,
                                  num_return_sequences=1, max_new_tokens=max_new, min_new_tokens=0)

    def greedy(texts, n=max_new):
        return generate(model, tokenizer, texts, greedy_decoding, max_new_tokens=n, lockstep=lockstep)

    if multiturn is not None:  # the tool loop, greedy (a turn's seed draws nothing)
        gen = multiturn.sample(list(range(len(examples))), examples, [0] * len(examples), lambda _: greedy(prompts),
                               lambda ids, seeds, n: greedy(ids, n))
    else:
        gen = greedy(prompts)
    sampling = greedy_decoding.with_(do_sample=True, num_return_sequences=k)
    if k and not examples:  # (sharded generation, no rows here: join the others' sampling calls)
        generate(model, tokenizer, [], sampling, row_seeds=[], lockstep=lockstep)
    if not examples:
        return []
    texts = completion_texts(tokenizer, gen.completion_ids, eos_ids(model, tokenizer))
    res = score(reward, examples, texts, gen)
    hits: list[list[float]] = [[] for _ in examples]
    if k:
        seeds = [row_seed(cfg.run.seed, EVAL_STEP, first + i, s) for i in range(len(examples)) for s in range(k)]

        def sampled(texts, row_seeds, n=max_new, per_prompt=k):
            return generate(model, tokenizer, texts, sampling, max_new_tokens=n, num_return_sequences=per_prompt,
                            row_seeds=row_seeds, lockstep=lockstep)

        with torch.random.fork_rng():  # eval must not shift the training run's random stream
            if multiturn is not None:  # k conversations a prompt, each turn from its own seed
                sgen = multiturn.sample(list(range(len(examples))), examples, seeds, lambda _: sampled(prompts, seeds),
                                        lambda ids, row_seeds, n: sampled(ids, row_seeds, n, 1), group_size=k)
            else:
                sgen = sampled(prompts, seeds)
        stexts = completion_texts(tokenizer, sgen.completion_ids, eos_ids(model, tokenizer))
        sres = score(reward, [x for x in examples for _ in range(k)], stexts, sgen)
        flat = [rec.components[acc_name].raw for rec in sres.records]  # (None: no value, left out as greedy's)
        hits = [flat[i * k:(i + 1) * k] for i in range(len(examples))]
    calls = [[c for t in turns for c in t.calls] for turns in gen.turns] if gen.turns else [[]] * len(examples)
    reset_failed = set(gen.dropped_groups) | (set(sgen.dropped_groups) if k else set())  # (one row a group)
    return [EvalRow(raw={n: rec.components[n].raw for n in reward.names},
                    errors={n: rec.components[n].error for n in reward.names}, tokens=len(ids), truncated=bool(trunc),
                    hits=h, calls=len(cs), failed_calls=sum(c.ran and c.error is not None for c in cs),
                    ran_calls=sum(c.ran for c in cs), reset_failed=i in reset_failed)
            for i, (rec, ids, trunc, h, cs) in enumerate(zip(res.records, gen.completion_ids, gen.truncated, hits,
                                                             calls))]
