"""What `docuchat-rl sft` learns: one `Target` per example, the RL prompt's tokens then the target's, with the
tokens the loss reads.

Every prompt is the RL run's own prompt, token for token: the text the collector samples from (run.py's
`prompt_texts`: the chat template or the plain form with its BOS, the system prompt, data.few_shot, the tools
of a multi-turn recipe, an environment's first observation), encoded as the collector encodes it. Targets end
with the token the chat template writes after an assistant turn (`modeling.end_of_turn`: one of the model's
stops, not the first of its EOS list), the token a sampled completion ends with. Four sources (`sft.source`):

- `answers`: the answer column, as written or through a named template (`sft.answer_template`), of the
  training rows (data.train) or of the rows `sft.path` names (worked solutions RL's own rows may not have);
- `tool_transcripts`: a calculator conversation per row, one call per `<<a op b=c>>` step of its answer, then
  `#### N`. The conversation is made by the RL tool loop itself (`multiturn.run_turns`, with the scripted
  turns in place of the sampler): the tool really runs, its result is rendered, cut and framed by the same
  code, and the limits that would cut a sampled conversation refuse a transcript that does not fit them.
  Tool-result tokens are out of the loss, as in RL (`loss_mask` 0);
- `traces`: a run's traced completions selected by an audit filter (rejection-sampling fine-tuning, STaR),
  their sampled token ids as they are, at most `sft.per_prompt` distinct ones per prompt; a completion cut at
  max_new_tokens is left out (and counted) unless `sft.keep_truncated`;
- `jsonl`: TRL's prompt/completion rows (text or conversational) or `messages` rows (the last assistant
  message is the target, the messages before it the prompt).

Whatever the source, no held-out question (data.test, eval.also) may reach the SFT set (`check_held_out`,
comparing `data.normalized` text: case, spacing and punctuation aside).

Deliberately left out: packing several examples into one sequence, and targets with several trained
assistant turns from a JSONL file (the last one is learned; a tool conversation comes from tool_transcripts).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rewards.correctness import gold_of

from ..data import (DataError, Example, examples_of, load_examples, load_split, normalized, prompt_text,
                    prompt_turns, reasoning_target, render_prompt)
from ..modeling import end_of_turn
from ..outputs import read_jsonl
from ..sampling.generation import Generation
from ..sampling.multiturn import MultiTurn, reset_environments, run_turns, turn_seed

_STEP = re.compile(r"<<\s*([^=<>]+?)\s*=\s*([^<>]*?)\s*>>")
_CALC = re.compile(r"<<[^>]*>>")
_NUMBER = re.compile(r"[-+]?[\d,]*\.?\d+(/\d+)?")  # a final answer the templates' last line can say


@dataclass(frozen=True)
class Target:
    """One supervised example."""

    prompt_id: int  # row of the training split (-1: a JSONL row with its own prompt)
    where: str  # where it came from, for errors and sft_targets.jsonl ("row 12", "step 40 sample 3", "line 7")
    prompt_ids: list[int]  # the prompt's tokens, as RL samples from them
    target_ids: list[int]  # the target's tokens, ending with the end-of-turn token
    loss_mask: list[int]  # per target token: 1 the loss reads it, 0 a tool's result
    question: str = ""  # the prompt's question (the held-out check compares it)
    conversation: bool = False  # a TRL messages row (a language-modeling row: sft.loss_tokens by_format reads it whole)

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.target_ids)

    def record(self, tokenizer) -> dict:
        """The example as a line of sft_targets.jsonl (its text decoded, special tokens kept)."""
        return {"prompt_id": self.prompt_id, "where": self.where, "question": self.question,
                "target": tokenizer.decode(self.target_ids, skip_special_tokens=False),
                "target_tokens": len(self.target_ids), "loss_tokens": sum(self.loss_mask)}


def end_token(model, tokenizer, eos_token: str | None) -> int:
    """The token a text target ends with: sft.eos_token (one token of the vocabulary), else the one the chat
    template ends an assistant turn with (modeling.end_of_turn)."""
    if eos_token is None:
        return end_of_turn(model, tokenizer)
    ids = tokenizer(eos_token, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise DataError(f"sft.eos_token {eos_token!r} is {len(ids)} tokens of this tokenizer, not one")
    return ids[0]


def answer_text(answer: str, template: str) -> str:
    """An answer column's text through `sft.answer_template`.

    >>> a = "4 + 3 = <<4+3=7>>7\\n7 - 2 = <<7-2=5>>5\\n#### 5"
    >>> answer_text(a, "steps")
    '4 + 3 = 7\\n7 - 2 = 5\\n#### 5'
    >>> answer_text(a, "think_answer")
    '<think>\\n4 + 3 = 7\\n7 - 2 = 5\\n</think>\\n<answer>5</answer>'
    """
    if template == "as_written":
        return answer
    if template == "think_answer":
        return reasoning_target(answer)
    body = answer.split("####")[0]
    lines = [_CALC.sub("", line).strip() for line in body.strip().splitlines() if line.strip()]
    return "\n".join(lines + [f"#### {gold_of(answer) or ''}"])


def steps_of(answer: str) -> list[str]:
    """The expressions of an answer's `<<a op b=c>>` calculator notes, in order.

    >>> steps_of("22 / 2 = <<22/2=11>>11\\n11 + 6 = <<11+6=17>>17\\n#### 17")
    ['22 / 2', '11 + 6']
    """
    return [re.sub(r"\s*([-+*/])\s*", r" \1 ", m.group(1)).strip() for m in _STEP.finditer(answer)]


class Builder:
    """Targets on the RL prompts of a recipe: `prompt_ids[i]` is row i's prompt as the run samples it, `eos` the
    token that ends an assistant turn (modeling.end_of_turn)."""

    def __init__(self, tokenizer, examples: list[Example], prompt_ids: list[list[int]], eos: int):
        self.tok, self.examples, self.eos, self.prompt_ids = tokenizer, examples, eos, prompt_ids
        self.left_out = 0  # traces: completions cut at max_new_tokens, not learned (said by the caller)

    def _target(self, i: int, where: str, ids: list[int], mask: list[int] | None = None) -> Target:
        e = self.examples[i]
        return Target(e.prompt_id, where, list(self.prompt_ids[i]), list(ids), mask or [1] * len(ids), e.question)

    def _text(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"] + [self.eos]

    def answers(self, template: str) -> list[Target]:
        """Each training row's answer column through the template."""
        out = []
        for i, e in enumerate(self.examples):
            if not e.answer_text.strip():
                raise DataError(f"sft.source answers: training row {e.prompt_id} has no answer text to learn")
            if template != "as_written" and not _NUMBER.fullmatch(gold_of(e.answer_text) or ""):  # (it would
                # teach "#### " followed by nothing, or by the whole answer)
                raise DataError(f"sft.answer_template {template}: training row {e.prompt_id}'s answer has no final "
                                f"number to end with ('#### N'): {e.answer_text[-60:]!r}")
            if template != "as_written" and not e.answer_text.split("####")[0].strip():  # (a template of the
                # worked steps on a row that has none would teach the bare answer)
                raise DataError(f"sft.answer_template {template}: training row {e.prompt_id}'s answer has no worked "
                                f"steps before its final '#### N' ({e.answer_text.strip()[:40]!r}): the template would "
                                "teach the bare answer; use rows with worked solutions (sft.path), or as_written")
            out.append(self._target(i, f"row {e.prompt_id}", self._text(answer_text(e.answer_text, template))))
        return out

    def tool_transcripts(self, multiturn: MultiTurn | None) -> list[Target]:
        """Each training row's calculator conversation, made by the RL tool loop (see the module docstring)."""
        if multiturn is None:
            raise DataError("sft.source tool_transcripts: the recipe has no tools (rollout.tools: "
                            "[docuchat_rl.toolbox.calculate])")
        schema = next((s for s in multiturn.source.schemas if s["function"]["name"] == "calculate"), None)
        if schema is None:
            names = [s["function"]["name"] for s in multiturn.source.schemas]
            raise DataError(f"sft.source tool_transcripts calls a tool named calculate (docuchat_rl.toolbox."
                            f"calculate); rollout.tools gives {names}")
        arg = next(iter(schema["function"].get("parameters", {}).get("properties", {})), "expression")
        protocol, limits = multiturn.protocol, multiturn.limits
        scripts = []
        for e in self.examples:
            steps = steps_of(e.answer_text)
            if not steps:
                raise DataError(f"sft.source tool_transcripts: training row {e.prompt_id}'s answer has no "
                                "<<a op b=c>> step to call the calculator with")
            scripts.append([self._text(protocol.call_text("calculate", {arg: s})) for s in steps]
                           + [self._text(f"#### {e.answer}")])
        turn_of = [0] * len(scripts)
        row_of = {turn_seed(r, t): r for r in range(len(scripts)) for t in range(1, limits.max_turns + 1)}

        def more(ids: list[list[int]], seeds: list[int], max_new_tokens: int) -> Generation:
            rows = []
            for seed in seeds:  # (row r's seed is r: its turns' seeds name it)
                r = row_of[seed]
                turn_of[r] += 1
                rows.append(scripts[r][turn_of[r]])
            return Generation(ids, [x[:max_new_tokens] for x in rows], [len(x) > max_new_tokens for x in rows],
                              [[0.0] * min(len(x), max_new_tokens) for x in rows])

        first = [s[0][:limits.max_new_tokens] for s in scripts]
        gen = Generation([list(p) for p in self.prompt_ids], first,
                         [len(s[0]) > limits.max_new_tokens for s in scripts], [[0.0] * len(x) for x in first])
        tools = [{f.__name__: f for f in multiturn.source.functions} for _ in scripts]
        done = run_turns(gen, more, list(range(len(scripts))), tools, protocol, limits)
        out = []
        for i, (ids, mask, turns) in enumerate(zip(done.completion_ids, done.model_mask, done.turns)):
            ended = turns[-1].ended
            if ended != "answer" or len(turns) != len(scripts[i]):
                key = {"max_turns": "rollout.max_turns", "max_tool_calls": "rollout.max_tool_calls"}.get(
                    ended, "rollout.max_new_tokens")
                raise DataError(f"sft.source tool_transcripts: training row {self.examples[i].prompt_id}'s "
                                f"{len(scripts[i]) - 1} calls do not fit the RL tool loop's limits ({key} ended it: "
                                f"{ended}); raise {key} so that RL can sample what SFT teaches")
            out.append(self._target(i, f"row {self.examples[i].prompt_id}", ids, mask))
        return out

    def traces(self, run: str, where: str, per_prompt: int, keep_truncated: bool = False) -> list[Target]:
        """The traced completions `where` selects, as sampled, at most `per_prompt` distinct ones a prompt; one
        cut at max_new_tokens (no end-of-turn: a target that never stops) only with `keep_truncated`, the
        others counted in `left_out`."""
        from ..tools.audit import TraceStore

        with TraceStore([run]) as store:
            rows = store.select(where, sort="step DESC, source, lineno",
                                columns="step, sample, prompt_id, prompt, completion_ids, turns, observation, "
                                        "truncated", where_name="sft.where")
        kept: dict[int, list[tuple]] = {}
        out = []
        for r in rows:
            i = r["prompt_id"]
            if i is None or not 0 <= i < len(self.examples) or self.examples[i].question != r["prompt"]:
                raise DataError(f"sft.path {run}: step {r['step']} sample {r['sample']} was sampled from a prompt "
                                f"that is not row {i} of this recipe's data.train: learn from the traces of a run on "
                                "the same training rows")
            if r["observation"]:
                raise DataError(f"sft.path {run}: step {r['step']} prompt {i} began with an environment's "
                                "observation, which the RL prompt does not hold: traces of environments are not "
                                "learned from")
            ids = [int(t) for t in (r["completion_ids"] or [])]
            if not ids:
                raise DataError(f"sft.path {run}: step {r['step']} sample {r['sample']} has no completion_ids")
            if r["truncated"] and not keep_truncated:
                self.left_out += 1
                continue
            seen = kept.setdefault(i, [])
            if tuple(ids) in seen or len(seen) >= per_prompt:
                continue
            seen.append(tuple(ids))
            turns = json.loads(r["turns"]) if isinstance(r["turns"], str) else r["turns"]
            mask = [1] * len(ids)
            if turns:
                mask = [v for t in turns for v in [1] * t["model_tokens"] + [0] * t.get("env_tokens", 0)]
                if len(mask) != len(ids):
                    raise DataError(f"sft.path {run}: step {r['step']} sample {r['sample']}'s turns do not add "
                                    "up to its completion_ids")
            out.append(self._target(i, f"step {r['step']} sample {r['sample']}", ids, mask))
        if not out:
            cut = (f" ({self.left_out} selected completions were cut at max_new_tokens: sft.keep_truncated: true "
                   "learns them)") if self.left_out else ""
            raise DataError(f"sft.path {run}: sft.where {where!r} selects no traced completion{cut}: nothing to learn")
        return out


def jsonl_targets(path: str, tokenizer, eos: int, system_prompt: str | None, few_shot: list[dict],
                  multiturn: MultiTurn | None, as_given: bool = False) -> list[Target]:
    """A JSONL file of TRL's rows: {"prompt", "completion"} (text or messages) or {"messages"}."""
    p = Path(path)
    if p.is_dir():
        raise DataError(f"sft.path {path} is a folder: source jsonl reads a file of rows")
    if not p.is_file():
        raise DataError(f"sft.path {path}: no such file")
    skipped: list[int] = []
    why: dict[int, str] = {}
    rows = read_jsonl(p, skipped, why)
    if skipped:
        raise DataError(f"{path}: line {skipped[0]} is {why[skipped[0]]}")
    if not rows:
        raise DataError(f"{path}: no rows")
    return trl_targets(rows, lambda n: f"{path}: line {n}", tokenizer, eos, system_prompt, few_shot, multiturn,
                       as_given)


def is_trl_rows(rows: list[dict]) -> bool:
    """Whether rows are in TRL's SFT formats (prompt/completion or messages) rather than question/answer ones."""
    return bool(rows) and all(isinstance(r, dict) and ("messages" in r or ("prompt" in r and "completion" in r))
                              for r in rows)


def trl_targets(rows: list[dict], where: Callable[[int], str], tokenizer, eos: int, system_prompt: str | None,
                few_shot: list[dict], multiturn: MultiTurn | None, as_given: bool = False) -> list[Target]:
    """Targets of TRL's rows (a file's or a data set's in memory; `where(n)` names row n, 1-based): each row
    checked (trl_row), its prompt rendered as RL renders one, its completion ended with the end-of-turn token."""
    out = []
    for n, row in enumerate(rows, 1):
        prompt, completion = trl_row(row, where(n))
        messages = tuple(prompt) if isinstance(prompt, list) else None
        question = (next((m["content"] for m in reversed(messages) if m.get("role") == "user"), "")
                    if messages else str(prompt))
        if multiturn is not None and multiturn.source.environment is not None:
            _observation_free(multiturn, row, where(n))
        turns = prompt_turns(question, system_prompt, messages, few_shot)
        text = (multiturn.render(turns) if multiturn is not None else
                render_prompt(tokenizer, question, system_prompt, messages, few_shot, as_given))
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        target = tokenizer(completion, add_special_tokens=False)["input_ids"] + [eos]
        if as_given and messages is not None and multiturn is None:  # (TRL's: the whole conversation through the
            # template, so the target ends as the template ends the turn, not at its end-of-turn token)
            whole = list(messages) + [{"role": "assistant", "content": completion}]
            full = tokenizer(tokenizer.apply_chat_template(whole, tokenize=False), add_special_tokens=False)["input_ids"]
            if full[:len(ids)] == ids and len(full) > len(ids):
                target = full[len(ids):]
        out.append(Target(-1, where(n).rsplit(": ", 1)[-1], ids, target, [1] * len(target), question,
                          conversation="messages" in row))
    return out


def trl_row(row: dict, where: str) -> tuple[str | list[dict], str]:
    """(the prompt: text or messages, the completion's text) of one of TRL's rows: {"prompt", "completion"} (text
    or messages) or {"messages"} (the last assistant message is the completion), every field checked for its
    type; one line naming `where` and the field otherwise."""
    if "messages" in row:
        msgs = _messages(row["messages"], f"{where}: 'messages'")
        last = max((k for k, m in enumerate(msgs) if m["role"] == "assistant"), default=None)
        if last is None or last == 0:
            raise DataError(f"{where}: 'messages' needs turns before an assistant message")
        return list(msgs[:last]), msgs[last]["content"]
    if "prompt" not in row or "completion" not in row:
        raise DataError(f"{where} has neither 'messages' nor 'prompt' and 'completion' (TRL's formats); it has "
                        f"{sorted(row)}")
    prompt, completion = row["prompt"], row["completion"]
    if isinstance(prompt, list):
        prompt = list(_messages(prompt, f"{where}: 'prompt'"))
    elif not isinstance(prompt, str) or not prompt.strip():
        raise DataError(f"{where}: 'prompt' holds {type(prompt).__name__} {str(prompt)[:40]!r}, not text or a list "
                        "of messages")
    if isinstance(completion, list):
        msgs = _messages(completion, f"{where}: 'completion'")
        completion = next((m["content"] for m in msgs if m["role"] == "assistant"), None)
    if not isinstance(completion, str) or not completion.strip():
        raise DataError(f"{where}: the completion is not text ({type(completion).__name__} "
                        f"{str(completion)[:40]!r})")
    return prompt, completion


def _messages(value, where: str) -> tuple[dict, ...]:
    """Chat messages checked (data._messages' rule, naming `where`)."""
    from ..data import _messages as checked

    if not isinstance(value, list):
        raise DataError(f"{where} holds {type(value).__name__}, not a list of messages")
    return checked(value, where)


def _observation_free(multiturn: MultiTurn, row: dict, where: str) -> None:
    """Refuse (one line) a JSONL row whose RL prompt would hold an environment's observation: the row's own
    prompt does not say it, so SFT's prompt would not be RL's."""
    _, observations, failed = reset_environments(multiturn.source.environment, [row], 1, quiet=True)
    if failed or observations[0]:
        said = f"reset raised {failed[0]}" if failed else "its reset returns an observation"
        raise DataError(f"{where}: rollout.environment_factory's {said}, which the row's prompt does not hold: "
                        "RL would sample after another prompt than SFT learns (use sft.source answers, which "
                        "renders each training row's observation)")


def memory_targets(cfg, tokenizer, rows: list[dict], eos: int, multiturn) -> list[Target]:
    """Targets of a data set in memory (build_targets' `rows`), checked as a file's rows are."""
    s, d = cfg.sft, cfg.data
    if not rows:
        raise DataError("train_dataset: the data set is empty (no rows)")
    if s.source in ("traces", "jsonl") and s.path:
        raise DataError(f"train_dataset and sft.path both name the SFT rows (sft.source {s.source}): give one")
    if is_trl_rows(rows):
        return trl_targets(rows, lambda n: f"train_dataset: row {n - 1}", tokenizer, eos, d.system_prompt,
                           d.few_shot_turns, multiturn, d.prompt_format == "as_given")
    from datasets import Dataset

    examples = examples_of(Dataset.from_list(rows), "train_dataset (in memory)", d.prompt_column, d.answer_column)
    build = Builder(tokenizer, examples, rl_prompt_ids(cfg, tokenizer, examples, multiturn), eos)
    return build.tool_transcripts(multiturn) if s.source == "tool_transcripts" else build.answers(s.answer_template)


def rl_prompt_ids(cfg, tokenizer, examples: list, multiturn) -> list[list[int]]:
    """Each row's prompt tokens as the RL run samples from them: rendered as the collector renders them, with
    an environment's first observation where its `reset` returns one (reset once a row, its observation
    appended and cut as the tool loop does: `MultiTurn.observed_prompts`). A reset that raises is one line
    naming the row: RL would drop that prompt's group, and SFT has no prompt to learn it after."""
    if multiturn is None:
        d = cfg.data
        texts = [prompt_text(tokenizer, d, e) for e in examples]
        return tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    observations = [None] * len(examples)
    if multiturn.source.environment is not None:
        envs, observations, failed = reset_environments(multiturn.source.environment,
                                                        [multiturn.reset_row(e) for e in examples], 1, quiet=True)
        if failed:
            e = examples[min(failed)]
            raise DataError(f"rollout.environment_factory: reset raised for training row {e.prompt_id} "
                            f"({failed[min(failed)]}): RL drops that prompt, and SFT has no prompt to learn it after")
    ids, _ = multiturn.observed_prompts(examples, observations)
    return ids


def fingerprint(targets: list[Target]) -> dict:
    """What identifies an SFT set (a resume must learn the same examples): count and a sha256 of their tokens."""
    h = hashlib.sha256()
    for t in targets:
        h.update(json.dumps([t.prompt_ids, t.target_ids, t.loss_mask]).encode())
    return {"rows": len(targets), "sha256": h.hexdigest()[:16]}


def check_held_out(targets: list[Target], cfg, given: list | None = None) -> None:
    """Refuse an SFT set that holds a held-out question (data.test's, eval.also's, or the `given` rows: the API's
    eval_dataset, in data.test's place): its held-out accuracy would measure recall, not skill. Questions are
    compared as `data.normalized` text (case, spacing and punctuation aside). One line naming the first such
    example."""
    d, sets = cfg.data, {}
    if given is not None:
        sets["eval_dataset"] = given
    elif d.test:
        sets["data.test"] = load_split(d, "test")
    for name, path in cfg.eval.also.items():
        sets[f"eval.also.{name}"] = load_examples(path, d.test_split, d.prompt_column, d.answer_column,
                                                  revision=d.revision, subset=d.subset)
    for key, rows in sets.items():
        held = {normalized(e.question) for e in rows}
        hit = next((t for t in targets if normalized(t.question) in held), None)
        if hit is not None:
            n = sum(normalized(t.question) in held for t in targets)
            raise DataError(f"the SFT set holds {n} question{'s' * (n != 1)} of the held-out set {key} (first: "
                            f"{hit.where}, {hit.question[:60]!r}): SFT learns from training rows only")


def loss_over(targets: list[Target], loss_tokens: str) -> list[Target]:
    """sft.loss_tokens: `target` as built; `all` (and `by_format` for a conversation row, TRL's language-modeling
    loss) every token after the first, the prompt's included, a tool result's still out."""
    out = []
    for t in targets:
        if loss_tokens == "all" or (loss_tokens == "by_format" and t.conversation):
            ids = t.prompt_ids + t.target_ids
            mask = [1] * (len(t.prompt_ids) - 1) + t.loss_mask
            t = dataclasses.replace(t, prompt_ids=ids[:1], target_ids=ids[1:], loss_mask=mask)
        out.append(t)
    return out


def check_lengths(targets: list[Target], max_length: int, truncation: str = "refuse") -> list[Target]:
    """sft.truncation for an example longer than `max_length` (sft.max_length, or the model's context): refused in
    one line (`refuse`: a cut target teaches a completion that stops mid-way), or cut to its first (`keep_start`,
    TRL's) or last (`keep_end`) max_length tokens; a cut that leaves no loss token drops the example, said once."""
    long = [t for t in targets if t.length > max_length]
    if long and truncation == "refuse":
        raise DataError(f"sft.max_length {max_length}: {len(long)} example{'s' * (len(long) != 1)} longer (first: "
                        f"{long[0].where}, {long[0].length} tokens): raise sft.max_length, drop them, or cut them "
                        "(sft.truncation keep_start)")
    out, dropped = [], 0
    for t in targets:
        if t.length > max_length:
            n = len(t.prompt_ids)
            keep = range(max_length) if truncation == "keep_start" else range(t.length - max_length, t.length)
            ids, mask = t.prompt_ids + t.target_ids, [0] * n + t.loss_mask
            ids, mask = [ids[i] for i in keep], [mask[i] for i in keep]
            cut = max(1, min(n - keep.start, len(ids) - 1)) if truncation == "keep_end" else min(n, len(ids) - 1)
            t = dataclasses.replace(t, prompt_ids=ids[:cut], target_ids=ids[cut:], loss_mask=mask[cut:])
            if not any(t.loss_mask):
                dropped += 1
                continue
        out.append(t)
    if dropped:
        print(f"docuchat-rl: sft.truncation {truncation}: {dropped} example{'s' * (dropped != 1)} had no target token "
              f"left within sft.max_length {max_length} and {'were' if dropped != 1 else 'was'} left out",
              file=sys.stderr, flush=True)
    if not out:
        raise DataError(f"sft.max_length {max_length}: no example keeps a target token after sft.truncation "
                        f"{truncation}")
    return out
