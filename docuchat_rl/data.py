"""Prompt/answer data: one loader on top of `datasets` for hub names and local JSONL/CSV/Parquet files.

A data set is any table with a prompt column and an answer column (names set in config). GSM8K-style
answers ("... #### 72") are reduced to their final answer for scoring by `rewards.correctness.gold_of`,
the one rule used everywhere. A prompt is either text (one user turn) or, as in TRL's conversational
data sets, a list of `{"role", "content"}` messages (any turns); both are rendered through the
tokenizer's chat template, with the configured system prompt put first when the messages carry none (a
tokenizer with no template, a base model's: a plain `Question: ... Answer: ...` text, with its BOS).
`PromptSampler` gives the data order (epoch-wise permutations); with `data.curriculum`, `CurriculumSampler`
draws from the rows up to the current difficulty level and `Curriculum` decides, from the run's own
training accuracy, when the next level joins.

Deliberately left out: streaming data sets; tool calls and images inside messages (text content only).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rewards.correctness import gold_of

if TYPE_CHECKING:
    from .config import CurriculumConfig, DataConfig

LOCAL_FORMATS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
_CALC = re.compile(r"<<[^>]*>>")


class DataError(ValueError):
    """A data set that cannot be used: the message names the file, split or column at fault."""


def reasoning_target(answer: str) -> str:
    """A GSM8K answer as a `<think>…</think><answer>…</answer>` completion (calculator notes removed).

    >>> reasoning_target("4 + 3 = <<4+3=7>>7\\n#### 7")
    '<think>\\n4 + 3 = 7\\n</think>\\n<answer>7</answer>'
    """
    body = answer.split("####")[0]
    lines = [_CALC.sub("", line).strip() for line in body.strip().splitlines() if line.strip()]
    return "<think>\n" + "\n".join(lines) + "\n</think>\n<answer>" + (gold_of(answer) or "") + "</answer>"


def normalized(question: str) -> str:
    """A question as the held-out checks compare it: lower case, punctuation dropped, spaces collapsed (one
    rule for the generator's splits, SFT's held-out check and the API's data sets).

    >>> normalized("  Ava has 3 apples.  How many apples does AVA have now? ")
    'ava has 3 apples how many apples does ava have now'
    """
    return " ".join("".join(c if c.isalnum() else " " for c in question.lower()).split())


def check_held_out_rows(train: list[Example], held_out: dict[str, list[Example]], what: str = "training") -> None:
    """Refuse (DataError, one line naming the set's key and its first such row) a held-out set that asks a question
    of the training rows, as `normalized` text: its accuracy would measure recall, not skill. `held_out`: each set
    by the key that names it (data.test, eval.also.NAME, eval_dataset)."""
    seen = {normalized(e.question) for e in train}
    for key, rows in held_out.items():
        shared = [e for e in rows if normalized(e.question) in seen]
        if shared:
            raise DataError(f"{key}: {len(shared)} of its {len(rows)} rows ask a question of the {what} rows (first: "
                            f"row {shared[0].prompt_id}, {shared[0].question[:60]!r}): held-out rows must be new to "
                            "training")


def prompt_turns(question: str, system_prompt: str | None, messages: tuple[dict, ...] | None = None,
                 few_shot: list[dict] | tuple = ()) -> list[dict]:
    """A prompt's chat messages: `messages` (a conversational prompt) or the one user turn `question`, after
    the `few_shot` demonstration turns, the system prompt first unless the messages start with their own."""
    turns = list(messages) if messages else [{"role": "user", "content": question}]
    head = 1 if turns[0]["role"] == "system" else 0
    turns[head:head] = [dict(m) for m in few_shot]
    if system_prompt and turns[0]["role"] != "system":
        turns.insert(0, {"role": "system", "content": system_prompt})
    return turns


def prompt_text(tokenizer: Any, d, example) -> str:
    """An example's (`data.Example`'s) prompt as the run renders it under the data section `d` (config.DataConfig):
    its system prompt, demonstrations and prompt format (render_prompt)."""
    return render_prompt(tokenizer, example.question, d.system_prompt, example.messages, d.few_shot_turns,
                         d.prompt_format == "as_given")


def render_prompt(tokenizer: Any, question: str, system_prompt: str | None,
                  messages: tuple[dict, ...] | None = None, few_shot: list[dict] | tuple = (),
                  as_given: bool = False) -> str:
    """The model-ready prompt text: the chat template with the generation prompt appended. `messages`
    (a conversational prompt) replaces the one user turn `question`; `few_shot` turns go before it; the
    system prompt goes first unless the messages already start with their own. `as_given` (data.prompt_format,
    TRL's rule): a text prompt is the text itself after the BOS the tokenizer adds, as TRL tokenizes it; a
    conversation goes through the chat template as it is."""
    if as_given and messages is None:
        return _bos(tokenizer) + question
    turns = prompt_turns(question, system_prompt, messages, few_shot)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    # A base model with no template: plain text, the system prompt as a preamble, a blank line after each
    # answered example (as few-shot prompts are usually written), so that a base model that goes on with a
    # question of its own first writes "\n\n", which model.stop_tokens can make its stop.
    system = "".join(f"{t['content']}\n\n" for t in turns if t["role"] == "system")
    body = "".join(f"Question: {t['content']}\n" if t["role"] == "user" else f"Answer: {t['content']}\n\n"
                   for t in turns if t["role"] != "system")
    return _bos(tokenizer) + system + body + "Answer: "


def _bos(tokenizer: Any) -> str:
    """The BOS token's text when the tokenizer puts one before every text it encodes (Gemma, Llama), else "".
    A chat template writes its own; prompts are encoded without special tokens (the template's are in the
    text), so a plain prompt must carry it too: Gemma 3 270M without its BOS answered 7% of held-out
    one-operation problems right, with it 37% (docs/gemma3.md)."""
    bos = getattr(tokenizer, "bos_token", None)
    if not bos or not callable(tokenizer):
        return ""
    return bos if tokenizer("1", add_special_tokens=True)["input_ids"][:1] == [tokenizer.bos_token_id] else ""


@dataclass(frozen=True)
class Example:
    """One prompt of the data set as the trainer sees it."""

    prompt_id: int  # row index in the (unshuffled) split
    question: str  # the prompt's text (a conversational prompt's last user turn)
    answer: str  # the gold final answer used for scoring ("" when the row has none)
    columns: dict = field(default_factory=dict)  # the row's other columns, passed on to the rewards
    messages: tuple[dict, ...] | None = None  # a conversational prompt's messages, as the data set gave them
    answer_text: str = ""  # the answer column's text as the data set wrote it (GSM8K: the worked solution too)


def check_utf8(path: Path) -> None:
    """Refuse a text data file that is not UTF-8, naming its first bad line (datasets reads such a file and
    fails only later, when a row is read, with a traceback that names neither the file nor the row)."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}: line {number} is not UTF-8 text (byte {line[e.start:e.start + 1]!r} at "
                                f"column {e.start + 1}); save the file as UTF-8") from None


def json_rows(path: Path, who: str = "") -> list[dict]:
    """A JSON lines file's rows (a .json file may hold one array of them), each line checked: one that is not a JSON
    object is one line naming it (datasets would fail with a message that names neither)."""
    text = path.read_bytes()
    if path.suffix.lower() == ".json" and text.lstrip().startswith(b"["):
        try:
            rows = json.loads(text)
        except (ValueError, RecursionError) as e:
            raise DataError(f"{who}{path}: not JSON ({str(e)[:80]})") from None
        bad = next((i for i, r in enumerate(rows) if not isinstance(r, dict)), None)
        if bad is not None:
            raise DataError(f"{who}{path}: item {bad} holds a JSON {type(rows[bad]).__name__}, not an object")
        return rows
    rows = []
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            row = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise DataError(f"{who}{path}: line {number} is not JSON ({str(e)[:80]})") from None
        if not isinstance(row, dict):
            raise DataError(f"{who}{path}: line {number} holds a JSON {type(row).__name__}, not an object (one row "
                            "a line: {\"question\": ..., \"answer\": ...})")
        rows.append(row)
    return rows


class Rows:
    """A local file's rows in memory, as the readers use a `datasets.Dataset` (column_names, len, select, rows as
    dicts): read without datasets' builder, whose cache writes an Arrow copy of every file read under the user's
    home (and needs disk space to read a file), and whose type unification across rows turns a cell of the wrong
    type into a parser error naming no row (here each row's cells reach examples_of's checks as written). A row
    without a column has None there, as datasets gives it."""

    def __init__(self, rows: list[dict]):
        self.rows = rows
        self.column_names = list(dict.fromkeys(k for r in rows for k in r))

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> dict:
        return {k: self.rows[i].get(k) for k in self.column_names}

    def __iter__(self):
        return (self[i] for i in range(len(self.rows)))

    def select(self, indices) -> Rows:
        return Rows([self.rows[i] for i in indices])


def load_table(source: str, split: str, revision: str | None = None, subset: str | None = None,
               key: str | None = None):
    """A data set's rows: a local file's (by extension) as `Rows`, in memory; a hub name's as a `datasets.Dataset`.
    Errors name the source, after the config key or argument that named it (`key`) when given."""
    path = Path(source)
    who = f"{key}: " if key else ""
    if path.suffix.lower() in LOCAL_FORMATS or path.exists():
        if not path.exists():
            raise DataError(f"{who}data file not found: {source}")
        if path.is_dir():
            raise DataError(f"{who}data path is a folder, expected a .jsonl/.csv/.parquet file: {source}")
        fmt = LOCAL_FORMATS.get(path.suffix.lower())
        if fmt is None:
            raise DataError(f"{who}unsupported data file type {path.suffix!r} for {source}; "
                            f"use one of {sorted(LOCAL_FORMATS)}")
        if fmt != "parquet":
            check_utf8(path)
        if fmt == "json":
            table = Rows(json_rows(path, who))
            if not len(table):
                raise DataError(f"{who}data file is empty: {source}")
        else:
            if path.stat().st_size == 0:
                raise DataError(f"{who}data file is empty: {source}")
            try:
                import pyarrow.csv
                import pyarrow.parquet

                arrow = pyarrow.csv.read_csv(path) if fmt == "csv" else pyarrow.parquet.read_table(path)
            except Exception as e:  # (pyarrow's parsers raise several types)
                raise DataError(f"could not read {source} as {fmt}: {str(e).splitlines()[0][:200]}") from e
            table = Rows(arrow.to_pylist())
    else:
        import datasets

        try:
            table = datasets.load_dataset(source, subset, revision=revision, split=split)
        except Exception as e:
            raise DataError(f"could not load data set {source!r} split {split!r}: {e}") from e
    if len(table) == 0:
        raise DataError(f"data set {source} (split {split}) has no rows")
    return table


def load_examples(source: str, split: str, prompt_column: str, answer_column: str,
                  limit: int | None = None, revision: str | None = None,
                  subset: str | None = None, key: str | None = None) -> list[Example]:
    """Rows of a data set as `Example`s, in file order; missing columns fail naming them (and `key`, the setting
    that names the source)."""
    return examples_of(load_table(source, split, revision, subset, key), source, prompt_column, answer_column, limit)


def examples_of(table, source: str, prompt_column: str, answer_column: str | None,
                limit: int | None = None) -> list[Example]:
    """A table's rows (a `datasets.Dataset`, or anything with `column_names`, `select` and rows as dicts) as
    `Example`s, checked; `source` names it in errors."""
    for role, col in (("prompt_column", prompt_column), ("answer_column", answer_column)):
        if col is not None and col not in table.column_names:
            raise DataError(f"{source}: column {col!r} (data.{role}) not found; "
                            f"columns are {table.column_names}")
    taken = [c for c in table.column_names if c in REWARD_ARGUMENTS and not (c == "answer" and c == answer_column)]
    if taken:  # (reward_inputs would replace the column's values with ours, silently)
        raise DataError(f"{source}: column {taken[0]!r} has the name of an argument docuchat-rl gives every reward "
                        f"({REWARD_ARGUMENTS[taken[0]]}), which would replace its values: rename the column"
                        + (" or name it as data.answer_column" if taken[0] == "answer" else ""))
    if limit is not None:
        table = table.select(range(min(limit, len(table))))
    out = []
    for i, row in enumerate(table):
        q, a = row[prompt_column], (row[answer_column] if answer_column is not None else None)
        messages = _messages(q, f"{source}: row {i} column {prompt_column!r}") if isinstance(q, list) else None
        if messages is not None:
            q = next((m["content"] for m in reversed(messages) if m["role"] == "user"), messages[-1]["content"])
        if q is not None and not isinstance(q, str):  # (a number would train on prompts like "1035")
            raise DataError(f"{source}: row {i} column {prompt_column!r} (data.prompt_column) holds "
                            f"{type(q).__name__} {str(q)[:40]!r}, not text or a list of messages: is it the "
                            "right column?")
        if q is None or not q.strip():
            raise DataError(f"{source}: row {i} has an empty {prompt_column!r}")
        if a is not None and not isinstance(a, (str, int, float)) or isinstance(a, bool):  # (a list or a dict
            # would be scored as its printed form, a boolean as the word)
            raise DataError(f"{source}: row {i} column {answer_column!r} (data.answer_column) holds "
                            f"{type(a).__name__} {str(a)[:40]!r}, not text or a number")
        a = "" if a is None else str(a)
        extra = {k: v for k, v in row.items() if k != prompt_column}  # (the answer column under its own name
        # too, raw, as TRL passes it: `def accuracy_reward(completions, solution, **kw)` reads `solution`)
        out.append(Example(prompt_id=i, question=str(q), answer=gold_of(a) or "", columns=extra, messages=messages,
                           answer_text=a))
    if answer_column is not None and out and not any(e.answer for e in out):  # (a column without values: every
        # answer-reading reward would score None on every row, and the run would train on format alone)
        raise DataError(f"{source}: column {answer_column!r} (data.answer_column) holds no answer in any of its "
                        f"{len(out)} rows: name the column that has them, or set data.answer_column: null for "
                        "data without answers")
    return out


def _messages(value: list, where: str) -> tuple[dict, ...]:
    """A conversational prompt's messages, checked: a non-empty list of {"role", "content"} with text
    content and a role among system/user/assistant."""
    if not value:
        raise DataError(f"{where}: an empty list of messages")
    for j, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or \
                m.get("role") not in ("system", "user", "assistant"):
            raise DataError(f"{where}: message {j} is not a {{'role': system|user|assistant, 'content': text}} "
                            f"message: {str(m)[:80]}")
    return tuple({"role": m["role"], "content": m["content"]} for m in value)


def load_split(d: DataConfig, which: str, limit: int | None = None) -> list[Example]:
    """The configured training (`which="train"`) or held-out (`"test"`) rows, the first `limit` of them."""
    source, split = (d.train, d.train_split) if which == "train" else (d.test, d.test_split)
    if source is None:
        raise DataError(f"data.{which} is null: there are no {which} rows")
    return load_examples(source, split, d.prompt_column, d.answer_column, limit=limit, revision=d.revision,
                         subset=d.subset, key=f"data.{which}")


def fingerprint(examples: list[Example]) -> dict:
    """What identifies the training rows a run draws from: their count and a sha256 over every row's
    prompt, messages, gold answer and other columns (whatever the source: a file or a hub data set), so
    that a resume notices a data file changed under the same name."""
    h = hashlib.sha256()
    for e in examples:
        h.update(json.dumps([e.question, e.messages, e.answer, e.columns], sort_keys=True, default=str,
                            ensure_ascii=False).encode("utf-8", "surrogatepass"))
        h.update(b"\n")
    return {"rows": len(examples), "sha256": h.hexdigest()[:16]}


REWARD_ARGUMENTS = {  # the keywords reward_inputs adds to a row's columns (a data set's column of the name is refused)
    "answer": "the gold final answer of data.answer_column", "answer_text": "the answer column as written",
    "completion_tokens": "the completion's length in tokens", "truncated": "whether the completion was cut",
    "prompt_id": "the row's index", "model_tokens": "the tokens the model wrote",
    "prompts": "the prompts", "completions": "the completions", "completion_ids": "the completions' token ids",
    "trainer_state": "the trainer's state", "log_extra": "the trace logger", "log_metric": "the metric logger",
}


def reward_inputs(examples: list[Example], completion_tokens: list[int], truncated: list[bool],
                  model_tokens: list[int] | None = None) -> dict[str, list]:
    """The keyword columns every reward receives, one entry per completion (examples repeated per
    completion): the data set's other columns, then ours, which win a name clash: `answer` (the gold
    final answer), `answer_text` (the answer column as written: a GSM8K answer's worked solution, which a
    data set's own `answer` column would otherwise lose to ours), `completion_tokens` (every token, as
    TRL's completion_ids: a multi-turn completion's tool results too), `truncated`, `prompt_id` and, for a
    multi-turn completion, `model_tokens` (the tokens the model wrote, in every turn: tool results out).
    Built here only, for training and evaluation alike.

    >>> ex = [Example(0, "Q", "4", {"level": 2, "answer": "ignored"}, answer_text="2 + 2 = <<2+2=4>>4\\n#### 4")]
    >>> reward_inputs(ex, [5], [False])  # doctest: +NORMALIZE_WHITESPACE
    {'level': [2], 'answer': ['4'], 'answer_text': ['2 + 2 = <<2+2=4>>4\\n#### 4'], 'completion_tokens': [5],
     'truncated': [False], 'prompt_id': [0]}
    """
    keys = list(dict.fromkeys(k for e in examples for k in e.columns))
    columns = {k: [e.columns.get(k) for e in examples] for k in keys}
    columns.update(answer=[e.answer for e in examples], answer_text=[e.answer_text for e in examples],
                   completion_tokens=list(completion_tokens),
                   truncated=list(truncated), prompt_id=[e.prompt_id for e in examples])
    if model_tokens is not None:
        columns["model_tokens"] = list(model_tokens)
    return columns


class PromptSampler:
    """Epoch-wise permutations of the data set from (seed, epoch): its whole state is two integers."""

    def __init__(self, n: int, seed: int, epoch: int = 0, position: int = 0):
        self.n, self.seed, self.epoch, self.position = n, seed, epoch, position
        self._order = self._perm()

    def _perm(self) -> list[int]:
        order = list(range(self.n))
        random.Random(f"{self.seed}-{self.epoch}").shuffle(order)
        return order

    def take(self, k: int, step: int = 0) -> list[int]:
        """The next `k` row indices in the data order (a new epoch's permutation when one runs out); `step`, the
        training step they are drawn for, matters to the samplers that remember draws (DifficultySampler)."""
        out = []
        while len(out) < k:
            if self.position == self.n:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._perm()
            out.append(self._order[self.position])
            self.position += 1
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}


CALCULATIONS = "calculations"  # data.curriculum.level: a row's level is the count of <<a op b=c>> in its answer


def levels_of(examples: list[Example], c: CurriculumConfig, answer_column: str | None) -> list[int]:
    """Each training row's difficulty level (data.curriculum.level): the number of GSM8K calculator
    annotations (`<<4+3=7>>`) in its raw answer, or a column of whole numbers; a row without one is an
    error naming it.

    >>> from docuchat_rl.config import CurriculumConfig
    >>> rows = [Example(0, "Q", "5", {"answer": "4 + 3 = <<4+3=7>>7\\n7 - 2 = <<7-2=5>>5\\n#### 5"})]
    >>> levels_of(rows, CurriculumConfig(start=2), "answer")
    [2]
    """
    out = []
    for e in examples:
        if c.level == CALCULATIONS:
            raw = e.columns.get(answer_column) if answer_column else None
            n = len(_CALC.findall(raw)) if isinstance(raw, str) else 0
            if n == 0:
                raise DataError(f"row {e.prompt_id}: data.curriculum.level {CALCULATIONS} counts the <<a op b=c>> "
                                f"annotations of column {answer_column!r}, and this row has none: give the rows a "
                                "level column and name it in data.curriculum.level")
        else:
            n = e.columns.get(c.level)
            if isinstance(n, bool) or not isinstance(n, int):
                raise DataError(f"row {e.prompt_id}: column {c.level!r} (data.curriculum.level) holds {n!r}, not a "
                                "whole number" if c.level in e.columns else
                                f"row {e.prompt_id}: no column {c.level!r} (data.curriculum.level); columns are "
                                f"{sorted(e.columns)}")
        out.append(n)
    if not any(n <= c.start for n in out):
        raise DataError(f"data.curriculum.start {c.start}: no training row is at that level or below (levels "
                        f"{min(out)}-{max(out)})")
    return out


class CurriculumSampler(PromptSampler):
    """`PromptSampler`'s order over the rows whose level is at most `level` (their own permutations, seeded
    by the level too); `promote` starts the next level's pool at its first epoch. Its state: the level,
    epoch and position."""

    def __init__(self, levels: list[int], seed: int, level: int, epoch: int = 0, position: int = 0):
        self.levels, self.level, self.base_seed = levels, level, seed
        self.pool = [i for i, n in enumerate(levels) if n <= level]  # row indices in file order
        super().__init__(len(self.pool), f"{seed}-level{level}", epoch, position)

    def take(self, k: int, step: int = 0) -> list[int]:
        return [self.pool[i] for i in super().take(k)]

    def state(self) -> dict:
        return {**super().state(), "level": self.level}

    def promote(self, level: int) -> None:
        """Draw from the rows up to `level` from now on (a new permutation, from its start)."""
        self.__init__(self.levels, self.base_seed, level)


BAND, MASTERED, OUT_OF_REACH = "band", "mastered", "out_of_reach"  # a prompt's standing (DifficultySampler)


class DifficultySampler(PromptSampler):
    """Online difficulty filtering (data.difficulty): the data order, less the prompts retired from it, with the
    prompts of the band drawn again.

    Each prompt's pass rate is its last group's mean accuracy (`observe`, after the step's scoring). A rate
    inside the band (low < rate < high) keeps the prompt in the band: up to `replay` of each step's prompts are
    drawn again, band prompts first, the longest-waiting first, once `replay_after` steps have passed since
    their last draw. A rate at or below `low` retires it as out of reach, at or above `high` as mastered: the
    data order skips it, and `revisit_after` steps after its last draw it is due: drawn again and measured anew,
    in the `revisit` share of each step (with what the band left of the replay share), the longest-due first, or
    when the order reaches it. Due prompts are drawn in the order they fell due, so one waits at most
    ceil(due before it / revisit slots) steps; `metrics` counts the backlog. A prompt never drawn is
    unknown, and drawn when the order reaches it. The whole state (the order's
    position, every drawn prompt's rate, groups, last draw and standing) is in `state()`, so a checkpoint
    resumes the same draws. The rule is hand-written: prime-rl's easy/hard pools and the filtering papers
    are algorithms, not a library we could call.

    >>> from docuchat_rl.config import DifficultyConfig
    >>> s = DifficultySampler(6, 0, DifficultyConfig(replay=0.5, replay_after=1, revisit_after=50))
    >>> first = s.take(2, step=1)
    >>> s.observe(1, first, [1.0, 0.5])  # the first mastered, the second in the band
    >>> second = s.take(2, step=2)
    >>> second[0] == first[1] and first[0] not in second  # the band prompt again, the mastered one rests
    True
    """

    def __init__(self, n: int, seed: int, config, epoch: int = 0, position: int = 0,
                 difficulty: dict | None = None):
        super().__init__(n, seed, epoch, position)
        self.config = config
        self.prompts: dict[int, dict] = {int(i): dict(r) for i, r in (difficulty or {}).items()}
        self.step, self.drawn = 0, {}  # the step being drawn: its prompts -> their pass rate when drawn
        self.counts = {"replayed": 0, "revisited": 0}

    def take(self, k: int, step: int = 0) -> list[int]:
        c = self.config
        if step != self.step:
            self.step, self.drawn, self.counts = step, {}, {"replayed": 0, "revisited": 0}
        quota = round(c.replay * k)
        band = sorted((r["drawn"], i) for i, r in self.prompts.items()
                      if r["standing"] == BAND and step - r["drawn"] >= c.replay_after and i not in self.drawn)
        chosen = [i for _, i in band[:quota]]
        due = self.due(step)
        slots = min(k - len(chosen), round(c.revisit * k) + quota - len(chosen))  # (and what the band left)
        revisits = due[:max(slots, 0)]  # (retired prompts whose rest is over, the longest-due first)
        self.counts["replayed"] += len(chosen)
        self.counts["revisited"] += len(revisits)
        chosen += revisits
        skipped = 0
        while len(chosen) < k:
            i = super().take(1)[0]
            r = self.prompts.get(i)
            if (i in chosen or i in self.drawn) and len(self.drawn) + len(chosen) < self.n:
                continue  # (drawn this step already)
            if r is not None and r["standing"] != BAND and step - r["drawn"] < c.revisit_after and skipped < self.n:
                skipped += 1  # (retired and resting; after a whole order of them, drawn all the same)
                continue
            self.counts["revisited"] += r is not None and r["standing"] != BAND
            chosen.append(i)
        for i in chosen:
            r = self.prompts.setdefault(i, {"rate": None, "groups": 0, "drawn": step, "standing": BAND})
            self.drawn[i] = r["rate"]
            r["drawn"] = step
        return chosen

    def due(self, step: int) -> list[int]:
        """The retired prompts whose rest is over at `step`, not drawn in it yet, the longest-due first."""
        c = self.config
        return [i for _, i in sorted((r["drawn"], i) for i, r in self.prompts.items()
                                     if r["standing"] != BAND and step - r["drawn"] >= c.revisit_after
                                     and i not in self.drawn)]

    def observe(self, step: int, idx: list[int], rates: list[float | None]) -> None:
        """Record each drawn prompt's group pass rate (None: no accuracy value, nothing learned of it)."""
        c = self.config
        for i, rate in zip(idx, rates):
            if rate is None:
                continue
            r = self.prompts[i]
            r["rate"], r["groups"] = rate, r["groups"] + 1
            r["standing"] = OUT_OF_REACH if rate <= c.low else MASTERED if rate >= c.high else BAND

    def in_band(self, rate: float | None) -> bool:
        """Whether a group's pass rate is inside the band (None: unknown, not inside)."""
        return rate is not None and self.config.low < rate < self.config.high

    def metrics(self) -> dict[str, float]:
        """The step's draws and the standing of every prompt drawn so far (metrics.jsonl, `difficulty/...`)."""
        standing = [r["standing"] for r in self.prompts.values()]
        drawn = [self.prompts[i]["rate"] for i in self.drawn]
        return {"difficulty/band_share": sum(map(self.in_band, drawn)) / len(drawn) if drawn else None,
                "difficulty/replayed": self.counts["replayed"], "difficulty/revisited": self.counts["revisited"],
                "difficulty/due": len(self.due(self.step)),
                "difficulty/known": len(standing), "difficulty/in_band": standing.count(BAND),
                "difficulty/mastered": standing.count(MASTERED), "difficulty/out_of_reach": standing.count(OUT_OF_REACH)}

    def state(self) -> dict:
        return {**super().state(), "difficulty": {str(i): dict(r) for i, r in sorted(self.prompts.items())}}


def make_sampler(n: int, seed: int, state: dict, curriculum: Curriculum | None = None,
                 difficulty=None) -> PromptSampler:
    """The run's data order at `state` (a sampler's `state()`); with a curriculum, over its rows up to its level
    (a level it reached after `state` was taken starts that level's order afresh); with `difficulty`
    (data.difficulty), the order with its retired and replayed prompts (DifficultySampler)."""
    if difficulty is not None:
        return DifficultySampler(n, seed, difficulty, **state)
    state = {k: v for k, v in state.items() if k != "difficulty"}  # (a run resumed with data.difficulty off)
    if curriculum is None:
        return PromptSampler(n, seed, **state)
    sampler = CurriculumSampler(curriculum.levels, seed, **{"level": curriculum.level, **state})
    if curriculum.level > sampler.level:
        sampler.promote(curriculum.level)
    return sampler


@dataclass
class Curriculum:
    """When the next level joins: once the mean training accuracy of the last `window` steps at the current
    level reaches `promote_at` (every process sees the same step metrics, so each decides the same)."""

    config: CurriculumConfig
    levels: list[int]  # each training row's level (levels_of)
    level: int  # the current level
    recent: list[float] = field(default_factory=list)  # the current level's last `window` step accuracies

    @classmethod
    def start(cls, config: CurriculumConfig, levels: list[int], state: dict) -> Curriculum:
        """At the run's start (`state` empty) or where a checkpoint left it (`state()`)."""
        return cls(config, levels, state.get("level", config.start), list(state.get("recent", [])))

    def observe(self, accuracy: float | None) -> bool:
        """Record a step's training accuracy; True when the next level joins now."""
        above = sorted({n for n in self.levels if n > self.level})  # (the levels the data has above this one)
        if accuracy is None or not above:
            return False
        self.recent = (self.recent + [accuracy])[-self.config.window:]
        if len(self.recent) < self.config.window or sum(self.recent) / len(self.recent) < self.config.promote_at:
            return False
        self.level, self.recent = above[0], []  # (the next level the data has)
        return True

    def state(self) -> dict:
        return {"level": self.level, "recent": list(self.recent)}
