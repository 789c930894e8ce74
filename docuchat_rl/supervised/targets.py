"""What `docuchat-rl sft` learns: one `Target` per example, the RL prompt's tokens then the target's, with the
tokens the loss reads.

Every prompt is the RL run's own prompt, token for token: the text the collector samples from (run.py's
`prompt_texts`: the chat template or the plain form with its BOS, the system prompt, data.few_shot, the tools
of a multi-turn recipe), encoded as the collector encodes it. Targets end with the model's end-of-turn token
(its first EOS id), the token a sampled completion ends with. Four sources (`sft.source`):

- `answers`: the answer column, as written or through a named template (`sft.answer_template`);
- `tool_transcripts`: a calculator conversation per row, one call per `<<a op b=c>>` step of its answer, then
  `#### N`. The conversation is made by the RL tool loop itself (`multiturn.run_turns`, with the scripted
  turns in place of the sampler): the tool really runs, its result is rendered, cut and framed by the same
  code, and the limits that would cut a sampled conversation refuse a transcript that does not fit them.
  Tool-result tokens are out of the loss, as in RL (`loss_mask` 0);
- `traces`: a run's traced completions selected by an audit filter (rejection-sampling fine-tuning, STaR),
  their sampled token ids as they are, at most `sft.per_prompt` distinct ones per prompt;
- `jsonl`: TRL's prompt/completion rows (text or conversational) or `messages` rows (the last assistant
  message is the target, the messages before it the prompt).

Whatever the source, no held-out question (data.test, eval.also) may reach the SFT set (`check_held_out`).

Deliberately left out: packing several examples into one sequence, and targets with several trained
assistant turns from a JSONL file (the last one is learned; a tool conversation comes from tool_transcripts).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from rewards.correctness import gold_of

from ..data import DataError, Example, load_examples, load_split, prompt_turns, reasoning_target, render_prompt
from ..outputs import read_jsonl
from ..sampling.generation import Generation
from ..sampling.multiturn import MultiTurn, run_turns, turn_seed

_STEP = re.compile(r"<<\s*([^=<>]+?)\s*=\s*([^<>]*?)\s*>>")
_CALC = re.compile(r"<<[^>]*>>")


@dataclass(frozen=True)
class Target:
    """One supervised example."""

    prompt_id: int  # row of the training split (-1: a JSONL row with its own prompt)
    where: str  # where it came from, for errors and sft_targets.jsonl ("row 12", "step 40 sample 3", "line 7")
    prompt_ids: list[int]  # the prompt's tokens, as RL samples from them
    target_ids: list[int]  # the target's tokens, ending with the end-of-turn token
    loss_mask: list[int]  # per target token: 1 the loss reads it, 0 a tool's result
    question: str = ""  # the prompt's question (the held-out check compares it)

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.target_ids)

    def record(self, tokenizer) -> dict:
        """The example as a line of sft_targets.jsonl (its text decoded, special tokens kept)."""
        return {"prompt_id": self.prompt_id, "where": self.where, "question": self.question,
                "target": tokenizer.decode(self.target_ids, skip_special_tokens=False),
                "target_tokens": len(self.target_ids), "loss_tokens": sum(self.loss_mask)}


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
    """Targets on the RL prompts of a recipe: `prompt_texts[i]` is training row i's prompt as the run samples it."""

    def __init__(self, tokenizer, examples: list[Example], prompt_texts: list[str], eos: int):
        self.tok, self.examples, self.eos = tokenizer, examples, eos
        self.prompt_ids = tokenizer(prompt_texts, add_special_tokens=False)["input_ids"] if prompt_texts else []

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

    def traces(self, run: str, where: str, per_prompt: int) -> list[Target]:
        """The traced completions `where` selects, as sampled, at most `per_prompt` distinct ones a prompt."""
        from ..tools.audit import TraceStore

        with TraceStore([run]) as store:
            rows = store.select(where, sort="step DESC, source, lineno",
                                columns="step, sample, prompt_id, prompt, completion_ids, turns, observation")
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
            raise DataError(f"sft.path {run}: --where {where!r} selects no traced completion: nothing to learn")
        return out


def jsonl_targets(path: str, tokenizer, eos: int, system_prompt: str | None, few_shot: list[dict],
                  multiturn: MultiTurn | None) -> list[Target]:
    """A JSONL file of TRL's rows: {"prompt", "completion"} (text or messages) or {"messages"}."""
    p = Path(path)
    if not p.is_file():
        raise DataError(f"sft.path {path}: no such file")
    skipped: list[int] = []
    rows = read_jsonl(p, skipped)
    if skipped:
        raise DataError(f"{path}: line {skipped[0]} is not a JSON object")
    out = []
    for n, row in enumerate(rows, 1):
        if "messages" in row:
            msgs = row["messages"]
            last = max((k for k, m in enumerate(msgs) if isinstance(m, dict) and m.get("role") == "assistant"),
                       default=None) if isinstance(msgs, list) else None
            if last is None or last == 0:
                raise DataError(f"{path}: line {n}: 'messages' needs turns before an assistant message")
            prompt, completion = msgs[:last], msgs[last]["content"]
        elif "prompt" in row and "completion" in row:
            prompt, completion = row["prompt"], row["completion"]
            if isinstance(completion, list):
                completion = next((m["content"] for m in completion if m.get("role") == "assistant"), None)
        else:
            raise DataError(f"{path}: line {n} has neither 'messages' nor 'prompt' and 'completion' (TRL's "
                            f"formats); it has {sorted(row)}")
        if not isinstance(completion, str) or not completion.strip():
            raise DataError(f"{path}: line {n}: the completion is not text")
        messages = tuple(prompt) if isinstance(prompt, list) else None
        question = (next((m["content"] for m in reversed(messages) if m.get("role") == "user"), "")
                    if messages else str(prompt))
        turns = prompt_turns(question, system_prompt, messages, few_shot)
        text = (multiturn.render(turns) if multiturn is not None else
                render_prompt(tokenizer, question, system_prompt, messages, few_shot))
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        target = tokenizer(completion, add_special_tokens=False)["input_ids"] + [eos]
        out.append(Target(-1, f"line {n}", ids, target, [1] * len(target), question))
    if not out:
        raise DataError(f"{path}: no rows")
    return out


def check_held_out(targets: list[Target], cfg) -> None:
    """Refuse an SFT set that holds a held-out question (data.test's, eval.also's): its held-out accuracy would
    measure recall, not skill. One line naming the first such example."""
    d, sets = cfg.data, {}
    if d.test:
        sets["data.test"] = load_split(d, "test")
    for name, path in cfg.eval.also.items():
        sets[f"eval.also.{name}"] = load_examples(path, d.test_split, d.prompt_column, d.answer_column,
                                                  revision=d.revision, subset=d.subset)
    for key, rows in sets.items():
        held = {e.question.strip() for e in rows}
        hit = next((t for t in targets if t.question.strip() in held), None)
        if hit is not None:
            n = sum(t.question.strip() in held for t in targets)
            raise DataError(f"the SFT set holds {n} question{'s' * (n != 1)} of the held-out set {key} (first: "
                            f"{hit.where}, {hit.question[:60]!r}): SFT learns from training rows only")


def check_lengths(targets: list[Target], max_length: int) -> None:
    """Refuse (one line) an example longer than sft.max_length: it is never cut, as a cut target teaches a
    completion that stops mid-way."""
    long = [t for t in targets if t.length > max_length]
    if long:
        raise DataError(f"sft.max_length {max_length}: {len(long)} example{'s' * (len(long) != 1)} longer (first: "
                        f"{long[0].where}, {long[0].length} tokens): raise sft.max_length or drop them")
