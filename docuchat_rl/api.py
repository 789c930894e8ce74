"""The Python API: what `docuchat-rl train`, `sft`, `eval` and `generate` run, for a script or a notebook, with
TRL's trainers' arguments as they are.

    from trl import GRPOConfig
    from docuchat_rl import RLTrainer as GRPOTrainer          # a TRL script: its import changed, nothing else

    trainer = GRPOTrainer(model="data/model", reward_funcs=reward_len, train_dataset=dataset,
                          args=GRPOConfig(output_dir="runs/grpo", max_steps=20, use_cpu=True))
    trainer.train()                                           # TrainOutput: eval.json's numbers, global_step, ...

    import docuchat_rl as dr                                  # our own form: a recipe, rewards, overrides
    trainer = dr.RLTrainer("default", rewards=["correctness", brevity], train_dataset=rows,
                           overrides={"run.steps": 20, "run.output_dir": "runs/api"})

A recipe is a `Config`, a path, or a built-in name (`docuchat-rl recipes`); `overrides` are the CLI's `--set` as
a dict; TRL's `args` (GRPOConfig, SFTConfig) become overrides through `trl_args.py` (a field we cannot honour is
one line). Rewards are the recipe's unless given: names, spec dicts and Python callables, traced under their
`__name__`, kept by their trainer (rewards.base.own_objects). Data is the recipe's unless given: a
`datasets.Dataset` or a list of dicts, checked as a file's rows are. `model` is a name or folder, or a model
already loaded (with its `processing_class`). The evaluation before and after training and the stop rules
(`stop_after`, SIGTERM/SIGINT at a safe point, a callback's `should_training_stop`, exact resume) are the CLI's,
from `workflow.py`; the CLI is a layer of messages over the same calls. Errors name the API's words.

Deliberately left out: a trainer for several processes from a notebook (launch a script with `torchrun`), TRL's
`optimizers=` and `reward_processing_classes=` (the recipe's optim; learned reward models are a reward), and the
hub (`push_to_hub` says so).
"""

from __future__ import annotations

import re
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rewards.base import RewardError, check_function, own_objects

from .config import Config, ConfigError, config_from_dict, load_config
from .data import DataError, Example, check_held_out_rows, examples_of, load_split
from .errors import Preempted
from .evaluation import compare
from .workflow import evaluation


def recipe(source: str | Path | Config | None = "default", overrides: dict[str, Any] | list[str] | None = None) -> Config:
    """A recipe as a `Config`: a built-in name, a path, or a Config; `overrides` as {key: value} or ["key=value"]."""
    sets = _sets(overrides)
    if isinstance(source, Config):
        return config_from_dict(source.to_dict(), sets) if sets else source
    return load_config(source, sets)  # (a path, or a built-in recipe's name: recipes.resolve_recipe)


def _sets(overrides) -> list[str]:
    import json

    if overrides is None:
        return []
    if isinstance(overrides, dict):  # (values as YAML reads them back: JSON is YAML)
        return [f"{k}={json.dumps(v)}" for k, v in overrides.items()]
    return list(overrides)


def reward_specs(rewards: list, objects: dict | None = None) -> list[dict]:
    """The rewards section for `rewards`: names and specs as they are; callables put in `objects` under their name
    (the trainer's own: rewards.base.own_objects, never a process-wide registry another trainer could change)."""
    specs, seen = [], set()
    objects = {} if objects is None else objects

    def own(name: str, fn) -> None:
        try:
            check_function(name, fn)
        except RewardError as e:
            raise ConfigError(f"rewards: {e}") from None
        objects[name] = fn

    for item in rewards:
        if isinstance(item, dict) and callable(item.get("function")):  # {"function": fn, "weight": 0.1}
            spec = {k: v for k, v in item.items() if k != "function"}
            spec.setdefault("name", getattr(item["function"], "__name__", "function"))
            own(spec["name"], item["function"])
        elif isinstance(item, dict):
            spec = dict(item)
        elif isinstance(item, str):
            spec = {"name": item}
        elif isinstance(item, tuple) and len(item) == 2 and callable(item[1]):
            own(item[0], item[1])
            spec = {"name": item[0]}
        elif callable(item):
            name = getattr(item, "__name__", None) or type(item).__name__
            own(name, item)
            spec = {"name": name}
        else:
            raise ConfigError(f"rewards: {item!r} is neither a reward name, a spec dict, a callable nor a (name, "
                              "callable) pair")
        if spec["name"] in seen:
            raise ConfigError(f"rewards: two rewards named {spec['name']!r} (give one a name: (name, fn))")
        seen.add(spec["name"])
        specs.append(spec)
    return specs


def rows_of(data, cfg: Config, what: str, limit: int | None = None) -> list[Example]:
    """A `datasets.Dataset` or a list of dicts as checked `Example`s, with the recipe's columns, as a file's rows
    are checked (no rows, a missing column, a cell of the wrong type: one line naming the argument); the first
    `limit` of them (eval.limit, for held-out rows)."""
    from datasets import Dataset

    if isinstance(data, list):
        if not all(isinstance(r, dict) for r in data):
            bad = next(r for r in data if not isinstance(r, dict))
            raise ConfigError(f"{what}: a list of dicts (one per row) or a datasets.Dataset, and it holds "
                              f"{type(bad).__name__} {str(bad)[:40]!r}")
        try:
            data = Dataset.from_list(data)
        except Exception as e:  # (pyarrow: rows whose columns disagree in type)
            raise ConfigError(f"{what}: its rows cannot form a table ({type(e).__name__}: {e})") from None
    elif not isinstance(data, Dataset):
        raise ConfigError(f"{what}: a list of dicts (one per row) or a datasets.Dataset, not {type(data).__name__}")
    if len(data) == 0:
        raise ConfigError(f"{what}: the data set is empty (no rows)")
    prompt, answer = cfg.data.prompt_column, cfg.data.answer_column
    if prompt not in data.column_names and "prompt" in data.column_names:  # (TRL's column names: "prompt", and
        prompt = "prompt"  # its answers as "solution" where a data set has them)
        answer = answer if answer in data.column_names else "solution" if "solution" in data.column_names else None
    try:
        return examples_of(data, f"{what} (in memory)", prompt, answer, limit)
    except DataError as e:
        raise ConfigError(str(e)) from None


_CLI_WORDS = [  # (a message of the engine, which the CLI and the API share, in the API's words)
    (re.compile(r"--set ([\w.]+)=(\S*?)([),;]|$|\s)"), lambda m: f"overrides={{{m.group(1)!r}: {m.group(2) or '...'}}}{m.group(3)}"),
    (re.compile(r"--stop-after (\d+)"), lambda m: f"stop_after={m.group(1)}"),
    (re.compile(r"--stop-after"), lambda m: "stop_after"),
    (re.compile(r"--resume latest"), lambda m: 'resume="latest"'),
    (re.compile(r"--resume"), lambda m: "resume="),
]


def in_api_words(text: str) -> str:
    """A message that names the CLI's flags, in the API's words.

    >>> print(in_api_words("resume it into a new folder (--set run.output_dir=...), or --stop-after 3"))
    resume it into a new folder (overrides={'run.output_dir': ...}), or stop_after=3
    """
    for pattern, words in _CLI_WORDS:
        text = pattern.sub(words, text)
    return text


@contextmanager
def _api_words():
    """Errors raised inside, in the API's words (in_api_words); the same exception type."""
    from .errors import CheckpointError, ModelError, ToolError, TrainingError

    try:
        yield
    except (ConfigError, DataError, TrainingError, CheckpointError, ModelError, ToolError, FileNotFoundError,
            FileExistsError) as e:
        text = in_api_words(str(e))
        if text == str(e):
            raise
        raise type(e)(text) from None


def _check_arguments(recipe_, rewards, model, tokenizer, overrides, resume) -> None:
    """Each public argument's type, at the call: one line naming the argument and what it takes."""
    def refuse(name: str, takes: str, value) -> None:
        raise ConfigError(f"{name}: {takes}, not {type(value).__name__} {str(value)[:40]!r}")

    if recipe_ is not None and not isinstance(recipe_, (str, Path, Config)):
        refuse("recipe", "a built-in recipe's name, a path or a Config", recipe_)
    if rewards is not None and not isinstance(rewards, (list, tuple)) and not callable(rewards):
        refuse("rewards", "a list of rewards (names, spec dicts, callables, (name, callable) pairs)", rewards)
    if overrides is not None and not isinstance(overrides, (dict, list, tuple)):
        refuse("overrides", 'a dict {"section.key": value} (or a list of "section.key=value")', overrides)
    if isinstance(overrides, (list, tuple)) and not all(isinstance(x, str) and "=" in x for x in overrides):
        refuse("overrides", 'a dict {"section.key": value} (or a list of "section.key=value")', overrides)
    if resume is not None and not isinstance(resume, (str, Path)):
        refuse("resume", '"latest", a run folder or a checkpoint folder', resume)
    if model is not None and not isinstance(model, (str, Path)):
        import torch

        if not isinstance(model, torch.nn.Module) or not hasattr(model, "config"):
            refuse("model", "a model name or folder, or a loaded transformers model", model)
        if tokenizer is None:
            raise ConfigError("model: a loaded model needs its tokenizer (processing_class=... or tokenizer=...)")
    if tokenizer is not None:
        from transformers import PreTrainedTokenizerBase

        if not isinstance(tokenizer, PreTrainedTokenizerBase):
            refuse("processing_class", "the model's transformers tokenizer", tokenizer)
        if model is None or isinstance(model, (str, Path)):
            raise ConfigError("processing_class: given with a loaded model only (model=the model, processing_class="
                              "its tokenizer)")


def _is_recipe(source) -> bool:
    """Whether the first argument names a recipe (a Config, a .yaml path, a built-in recipe's name) rather than a
    model (TRL's first argument: a name, a folder or a loaded model)."""
    if isinstance(source, Config):
        return True
    if not isinstance(source, (str, Path)):
        return False
    from .recipes import builtin_recipes

    return str(source).endswith((".yaml", ".yml")) or str(source) in builtin_recipes()


def _start_folder(start) -> str:
    """The hand-off: an SFTTrainer (its output folder), a run folder, a checkpoint or any adapter folder."""
    if isinstance(start, _Stage):
        return str(start.out)
    if isinstance(start, (str, Path)):
        return str(start)
    raise ConfigError(f"start_from: an SFTTrainer, its output folder or an adapter folder, not {type(start).__name__}")


class TrainOutput(dict):
    """What `train()` returns: eval.json's numbers ("before", "after", "change", as far as they got) as a dict, and
    TRL's TrainOutput attributes: `global_step` (optimizer steps under a TRL config, as TRL counts them; else our
    steps), `training_loss` (as transformers computes it: the mean loss of the optimizer steps this call took) and
    `metrics` (the last step's metrics record)."""

    def __init__(self, report: dict, global_step: int, history: list[dict]):
        super().__init__(report)
        self.global_step, self.metrics = global_step, history[-1] if history else {}
        losses = [m["loss"] for m in history if m.get("loss") is not None]  # (each step's: the mean of its optimizer
        # steps', the same number a step, so the mean of these is the mean over the optimizer steps)
        self.training_loss = sum(losses) / len(losses) if losses else None


class _Callbacks:
    """transformers.TrainerCallback objects, given TRL's arguments (args, state, control) at each event; a callback
    that raises ends the call in one line naming it."""

    def __init__(self, callbacks: list, args):
        from transformers import TrainerControl, TrainerState

        callbacks = [cb() if isinstance(cb, type) else cb for cb in callbacks]  # (a class is made, as TRL makes it)
        for cb in callbacks:
            if not any(callable(getattr(cb, e, None)) for e in EVENTS):
                raise ConfigError(f"callbacks: {cb!r} has none of {', '.join(EVENTS)} (a transformers.TrainerCallback)")
        self.callbacks, self.args = list(callbacks), args
        self.state, self.control = TrainerState(), TrainerControl()

    def fire(self, event: str, **kw) -> None:
        from .errors import TrainingError

        for cb in self.callbacks:
            fn = getattr(cb, event, None)
            if fn is None:
                continue
            try:
                fn(self.args, self.state, self.control, **kw)
            except Exception as e:  # noqa: BLE001 (the user's code: named, the run's last checkpoint intact)
                raise TrainingError(f"callback {type(cb).__name__}.{event} raised {type(e).__name__}: {e}") from None


EVENTS = ("on_train_begin", "on_step_end", "on_log", "on_evaluate", "on_save", "on_train_end")


class _Stage:
    """What RLTrainer and SFTTrainer share: the arguments (TRL's, and our own), the run, its surface."""

    kind = "grpo"

    def __init__(self, model=None, reward_funcs=None, args=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, peft_config=None, callbacks=None, *, recipe=None, rewards=None,
                 tokenizer=None, overrides: dict[str, Any] | list[str] | None = None, resume: str | None = None,
                 start_from=None, recipe_=None):
        if recipe_ is not None:  # (the first version's keyword)
            recipe = recipe_
        if _is_recipe(model) and recipe is None:  # (RLTrainer("default", ...): a recipe, not a model)
            recipe, model = model, None
        if reward_funcs is not None and rewards is not None:
            raise ConfigError("reward_funcs and rewards name the same thing: give one")
        rewards = reward_funcs if reward_funcs is not None else rewards
        if processing_class is not None and tokenizer is not None:
            raise ConfigError("processing_class and tokenizer name the same thing: give one")
        tokenizer = processing_class if processing_class is not None else tokenizer
        _check_arguments(recipe if recipe is not None else "default", rewards, model, tokenizer, overrides, resume)
        if callbacks is not None and not isinstance(callbacks, (list, tuple)):
            raise ConfigError(f"callbacks: a list of transformers.TrainerCallback objects, not {type(callbacks).__name__}")
        self._trainer, self._closed, self._objects, self._said_done = None, False, {}, False
        with _api_words(), own_objects(self._objects):  # (the rewards are checked by name while the recipe loads)
            self._setup(recipe if recipe is not None else "default", rewards, args, train_dataset, eval_dataset,
                        model, tokenizer, peft_config, list(callbacks or []), overrides, resume, start_from)

    def _setup(self, recipe_, rewards, args, train_dataset, eval_dataset, model, tokenizer, peft_config, callbacks,
               overrides, resume, start_from) -> None:
        from .trl_args import kind_of, kept_from_recipe, lora_of, needs_rows, translate

        mine = dict(overrides) if isinstance(overrides, dict) else overrides
        trl, translation, given = {}, None, set()
        if args is not None:
            if kind_of(args) != self.kind:
                raise ConfigError(f"args: {type(self).__name__} takes TRL's "
                                  f"{'SFTConfig' if self.kind == 'sft' else 'GRPOConfig'}, not {type(args).__name__}")
            rows = None
            if needs_rows(args):  # (a run counted in epochs: its training rows, given or the recipe's)
                rows = (len(train_dataset) if train_dataset is not None else
                        len(load_split(recipe(recipe_, mine).data, "train")))
            translation = translate(args, rows)
            trl = dict(translation.overrides)
        if peft_config is not None:
            trl.update(lora_of(peft_config))
        if start_from is not None:
            trl["lora.init_from"] = _start_folder(start_from)
        cfg = recipe(recipe_, {**trl, **mine} if isinstance(mine, dict) else [*_sets(trl), *(mine or [])])
        if rewards is not None:  # (callables go into self._objects, this trainer's own: own_objects)
            rewards = list(rewards) if isinstance(rewards, (list, tuple)) else [rewards]
            specs = reward_specs(rewards, self._objects)
            given.add("rewards")
        else:
            specs = [c.model_dump() for c in cfg.rewards.components]
        weights = getattr(args, "reward_weights", None) if args is not None else None
        if weights is not None:  # (TRL's reward_weights: one per reward function, in order)
            if len(weights) != len(specs):
                raise ConfigError(f"args.reward_weights: {len(weights)} weights for {len(specs)} reward functions "
                                  f"({', '.join(s['name'] for s in specs)})")
            specs = [{**spec, "weight": float(w)} for spec, w in zip(specs, weights)]
        if rewards is not None or weights is not None:
            cfg = config_from_dict({**cfg.to_dict(), "rewards": {**cfg.rewards.model_dump(), "components": specs}})
        loaded = None
        if model is not None and not isinstance(model, (str, Path)):
            name = getattr(getattr(model, "config", None), "_name_or_path", None) or cfg.model.name_or_path
            cfg = config_from_dict(cfg.to_dict(), [f"model.name_or_path={name}"])
            loaded = (model, tokenizer)
        elif model is not None:
            cfg = config_from_dict(cfg.to_dict(), [f"model.name_or_path={model}"])
        given |= {"model.name_or_path"} if model is not None else set()
        given |= {"data.train", "data.prompt_column", "data.answer_column"} if train_dataset is not None else set()
        given |= {"data.test"} if eval_dataset is not None else set()
        self._rows(cfg, train_dataset, eval_dataset)
        if translation is not None:
            source = recipe_ if isinstance(recipe_, (str, Path)) else "the given Config"
            kept = kept_from_recipe(recipe(recipe_), set(trl), given | set(mine or {}) if isinstance(mine, dict)
                                    else given | {x.split("=", 1)[0] for x in mine or []}, str(source),
                                    peft_config is not None or start_from is not None)
            said = [*translation.notes, *([kept] if kept else [])]
            if said:
                warnings.warn(f"{type(args).__name__}, run as TRL runs it: " + "; ".join(said), stacklevel=3)
        self.cfg, self._resume, self._loaded = cfg, resume, loaded
        self._per_generation = translation.per_generation if translation is not None else 1
        self._calls, self._saves = _Callbacks(callbacks, args), []
        self._accuracy_said()

    @property
    def trainer(self):
        """The running stage (our Trainer or SupervisedTrainer), started at its first use: the recipe, the rows and
        the arguments are checked when this object is made; the run folder is claimed and the model loaded when it
        is first trained, evaluated or asked (so `train(resume_from_checkpoint=...)`, as TRL scripts call it, can
        still choose what it resumes). None once closed."""
        if self._trainer is None and not self._closed:
            with _api_words(), own_objects(self._objects):
                self._trainer = self._start()
            self._trainer.on_step, self._trainer.on_checkpoint = self._on_step, self._on_save
        return self._trainer

    @property
    def out(self) -> Path:
        """The run folder."""
        return Path(self.trainer.out_dir)

    def _rows(self, cfg, train_dataset, eval_dataset) -> None:
        self.examples = rows_of(train_dataset, cfg, "train_dataset") if train_dataset is not None else None
        self.held_out = (rows_of(eval_dataset, cfg, "eval_dataset", cfg.eval.limit) if eval_dataset is not None
                         else None)
        if self.examples is not None and self.held_out is not None:  # (both known now: said at the call; the
            # Trainer checks every path again, the recipe's files included)
            try:
                check_held_out_rows(self.examples, {"eval_dataset": self.held_out}, "train_dataset")
            except DataError as e:
                raise ConfigError(str(e)) from None

    def _accuracy_said(self) -> None:
        """Custom rewards without the recipe's accuracy component: said once, with how to name one."""
        names = [c.name for c in self.cfg.rewards.components]
        acc = self.cfg.rewards.accuracy_component
        if acc is not None and acc not in names and self.kind == "grpo":
            warnings.warn(f"no reward is named {acc!r} (rewards.accuracy_component): train(), evaluate() and the "
                          "progress line report no accuracy; name the reward that scores 1 for a right answer with "
                          f'overrides={{"rewards.accuracy_component": "<name>"}} (rewards here: {", ".join(names)})',
                          stacklevel=4)

    def _resume_said(self) -> None:
        """A run stopped before its end, with rewards given as Python objects: the CLI's resume cannot find them
        (no importable path); said once, where it matters (never when the run finishes)."""
        objects = [c.name for c in self.cfg.rewards.components if c.name in self._objects]
        if objects and not getattr(self, "_said_resume", False):
            self._said_resume = True
            many = len(objects) > 1
            warnings.warn(f"reward{'s' * many} {', '.join(objects)} {'are' if many else 'is a'} Python object"
                          f"{'s' * many} without an importable path: `docuchat-rl train --resume` cannot find "
                          f"{'them' if many else 'it'}; resume through this API with the same rewards "
                          '(resume="latest"), or name it by its path (module:function)', stacklevel=4)

    # ---------------------------------------------------------------------------- the loop's events
    def _global(self, step: int) -> int:
        """Our step as TRL's state.global_step: optimizer steps under a TRL config (a step here is a generation and
        its `_per_generation` optimizer steps), else the step itself."""
        return step * self._per_generation

    def _on_step(self, m: dict) -> bool:
        calls = self._calls
        calls.state.global_step, calls.state.max_steps = self._global(m["step"]), self._global(self.trainer.total_steps)
        calls.state.log_history.append(dict(m))
        calls.fire("on_step_end")
        calls.fire("on_log", logs=dict(m))
        if self.trainer.last_eval and self.trainer.last_eval.get("step") == m["step"]:
            calls.fire("on_evaluate", metrics=dict(self.trainer.last_eval))
        self._saves, saved = [], self._saves
        for _ in saved:  # (the step's checkpoint, written inside it: said after on_step_end, as TRL orders them)
            calls.fire("on_save")
        return bool(calls.control.should_training_stop)

    def _on_save(self, step: int) -> None:
        if self._global(step) == self._calls.state.global_step:  # (after the step's events: a stop a callback asked for)
            self._calls.fire("on_save")
        else:
            self._saves.append(step)

    def _open(self):
        """The running trainer, or one line for a closed one; errors inside in the API's words."""
        if self._closed:
            raise ConfigError(f"this {type(self).__name__} is closed (close() ran, or `with` ended): make a new one, "
                              'with resume="latest" to go on from its last checkpoint')
        return _api_words()

    # ---------------------------------------------------------------------------- the surface
    @property
    def step(self) -> int:
        """The last finished step."""
        return self.trainer.step

    @property
    def state(self):
        """TRL's `trainer.state`: a transformers.TrainerState with `global_step`, `max_steps` and `log_history`
        (each step's metrics record, as metrics.jsonl has it: the run's whole history, resumes included)."""
        from transformers import TrainerState

        return TrainerState(global_step=self._global(self.trainer.step), max_steps=self._global(self.trainer.total_steps),
                            log_history=self._history())

    def _history(self) -> list[dict]:
        """Every step's metrics record so far, as metrics.jsonl has them (a resumed run's included)."""
        from .outputs import read_jsonl

        path = self.out / "metrics.jsonl"
        return [r for r in read_jsonl(path) if isinstance(r.get("step"), int)] if path.exists() else []

    def train(self, stop_after: int | None = None, resume_from_checkpoint: bool | str | Path | None = None,
              **trl_kwargs) -> TrainOutput:
        """The held-out set before (at step 0), the steps to the end (or `stop_after`, checkpointed; or a callback's
        `control.should_training_stop`, checkpointed), the held-out set after (a finished run). Returns a
        TrainOutput: eval.json's numbers ("before", "after", "change": each accuracy's difference after - before
        with its 95% interval, as far as they got), the step and the last loss. Raises errors.Preempted after
        SIGTERM/SIGINT, with the last finished step checkpointed."""
        report: dict = {}
        do_eval = bool(self.cfg.eval.before_and_after and (self.cfg.data.test or self.held_out is not None))
        if stop_after is not None and (isinstance(stop_after, bool) or not isinstance(stop_after, int)):
            raise ConfigError(f"stop_after: a step number, not {type(stop_after).__name__} {stop_after!r}")
        if trl_kwargs:  # (TRL's train() takes trial= and ignore_keys_for_eval= too: no search or eval keys here)
            raise ConfigError(f"train({next(iter(trl_kwargs))}=...): not supported here (train takes stop_after and "
                              "resume_from_checkpoint)")
        self._resume_from(resume_from_checkpoint)
        calls = self._calls
        with self._open(), own_objects(self._objects):
            if self.trainer.step >= self.trainer.total_steps and not self._said_done:
                self._said_done = True
                warnings.warn(f"this run is finished (step {self.trainer.step} of run.steps {self.trainer.total_steps}): "
                              "train() trains nothing more; resume it with more steps, or make a new trainer",
                              stacklevel=2)
            calls.state.global_step = self._global(self.trainer.step)
            calls.state.max_steps = self._global(self.trainer.total_steps)
            calls.state.log_history = self._history()  # (after a resume: the whole run's, as TRL restores it)
            calls.control.should_training_stop = False
            calls.fire("on_train_begin")
            if do_eval and self.trainer.step == 0:
                report["before"] = evaluation(self.trainer, self.out, "before")
                calls.fire("on_evaluate", metrics=dict(report["before"]))
            try:
                history = self.trainer.train(stop_after=stop_after)
            except Preempted:
                self._resume_said()
                raise
            if self.trainer.step < self.trainer.total_steps:
                self._resume_said()
            if do_eval and self.trainer.step >= self.trainer.total_steps:
                report["after"] = evaluation(self.trainer, self.out, "after")
                calls.fire("on_evaluate", metrics=dict(report["after"]))
            calls.fire("on_train_end")
        if "before" in report and "after" in report:  # (eval.json's change: each accuracy's difference, its interval)
            report["change"] = compare(report["after"], report["before"])
        return TrainOutput(report, self._global(self.trainer.step), history)

    def _resume_from(self, value) -> None:
        """TRL's train(resume_from_checkpoint=): True is the run folder's latest checkpoint, a path that checkpoint
        (or run folder); taken before the run starts, as our resume= (one line if it started otherwise)."""
        if value is None or value is False:
            return
        if not isinstance(value, (bool, str, Path)):
            raise ConfigError(f"resume_from_checkpoint: True (the latest checkpoint) or a checkpoint folder, not "
                              f"{type(value).__name__} {str(value)[:40]!r}")
        want = "latest" if value is True else str(value)
        if self._trainer is not None and self._resume != want:
            raise ConfigError(f"resume_from_checkpoint={value!r}: this {type(self).__name__} has started its run "
                              f"already ({'resumed from ' + str(self._resume) if self._resume else 'fresh'}); make a new "
                              f"one with resume={want!r}, or pass resume_from_checkpoint to its first train()")
        self._resume = want

    def evaluate(self) -> dict:
        """The held-out numbers of the adapter as it is now (greedy accuracy, pass@k, each reward's mean)."""
        with self._open(), own_objects(self._objects):
            return self.trainer.evaluate()

    def generate(self, prompts: list[str], max_new_tokens: int | None = None, temperature: float | None = None,
                 top_p: float = 1.0, top_k: int = 0) -> list[str]:
        """Completions of `prompts` with the adapter as it is now, through the recipe's template and system prompt
        (`generate`'s records); greedy unless a `temperature` is given."""
        from .config import out_of_bounds
        from .tools.inference import sample_records

        if isinstance(prompts, str) or not isinstance(prompts, (list, tuple)) or \
                not all(isinstance(p, str) for p in prompts):
            raise ConfigError(f"prompts: a list of texts, not {type(prompts).__name__} {str(prompts)[:40]!r}")
        given = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p, "top_k": top_k}
        for name, value in given.items():  # (the CLI's bounds: config.BOUNDS)
            problem = value is not None and out_of_bounds(name, value)
            if problem:
                greedy = " (for greedy decoding leave temperature out)" if name == "temperature" else ""
                raise ConfigError(f"{name}: {problem}, not {value!r}{greedy}")
        self._open()
        rows = [Example(i, q, "") for i, q in enumerate(prompts)]
        records = sample_records(self.trainer.policy_model, self.trainer.tokenizer, self.cfg, rows,
                                 do_sample=temperature is not None, temperature=temperature or 1.0, top_p=top_p,
                                 top_k=top_k, max_new_tokens=max_new_tokens if max_new_tokens is not None else
                                 (self.cfg.eval.max_new_tokens or self.cfg.rollout.max_new_tokens))
        return [r["completion"] for r in records]

    def save_model(self, output_dir: str | Path | None = None, merged: bool = False) -> Path:
        """The adapter as it is now into `output_dir` (default: the run folder's `model/`): peft's adapter files and
        the tokenizer, which PeftModel.from_pretrained loads; with `merged`, the adapter merged into the base
        weights as `docuchat-rl export` writes it (a plain model folder). A folder that holds files is refused."""
        out = Path(output_dir) if output_dir is not None else self.out / "model"
        with self._open():
            if out.exists() and (not out.is_dir() or any(out.iterdir())):
                raise FileExistsError(f"save_model: {out} is {'a file' if not out.is_dir() else 'not empty'}; give a "
                                      "new folder")
            if not merged:
                self.trainer.policy_model.save_pretrained(str(out))
                self.trainer.tokenizer.save_pretrained(str(out))
                return out
            import tempfile

            from .tools.inference import export_merged

            with tempfile.TemporaryDirectory() as tmp:  # (export merges a saved adapter, as the command does)
                self.trainer.policy_model.save_pretrained(tmp)
                return export_merged(self.cfg, tmp, out)

    def push_to_hub(self, *args, **kwargs):
        """Not here: no model hub is reachable offline (save_model writes the folder a push would upload)."""
        raise ConfigError("push_to_hub: docuchat-rl runs offline and pushes nothing; save_model(folder) writes what "
                          "`huggingface-cli upload` would push")

    def close(self) -> None:
        """Release the run folder and close its files (a second close does nothing); a model the caller loaded
        loses the LoRA layers put into it (peft's unload), as it was given."""
        if self._trainer is not None and not self._closed:
            self._trainer.close()
            if self._loaded is not None and hasattr(self._trainer.policy_model, "unload"):
                self._trainer.policy_model.unload()
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class RLTrainer(_Stage):
    """A run of the recipe's algorithm (GRPO, PPO, A2C) from Python, as TRL's GRPOTrainer is called:
    `RLTrainer(model, reward_funcs=..., args=GRPOConfig(...), train_dataset=..., eval_dataset=...,
    processing_class=tok, peft_config=LoraConfig(...), callbacks=[...])`, or with a recipe and our own
    `overrides`; `train()`, `evaluate()`, `generate()`, `state`, `save_model()`."""

    kind = "grpo"

    def _start(self):
        from .trainer import Trainer

        self.cfg.check_run()
        return Trainer(self.cfg, resume=self._resume, examples=self.examples, model=self._loaded,
                       held_out=self.held_out)


class SFTTrainer(_Stage):
    """The supervised stage from Python (`docuchat-rl sft`), as TRL's SFTTrainer is called: `SFTTrainer(model,
    args=SFTConfig(...), train_dataset=..., eval_dataset=..., processing_class=..., peft_config=...)`. A
    train_dataset in TRL's formats (prompt/completion as text or messages; messages) or with the recipe's question
    and answer columns (the sft section's answers, through its template) is checked as a file's rows are; without
    one, the recipe's sft section says where the targets come from. `RLTrainer(..., start_from=this)` starts RL
    from its adapter."""

    kind = "sft"

    def _rows(self, cfg, train_dataset, eval_dataset) -> None:
        self._sft_rows = None
        if train_dataset is not None:
            self._sft_rows = sft_rows(train_dataset)
        self.examples = None
        self.held_out = (rows_of(eval_dataset, cfg, "eval_dataset", cfg.eval.limit) if eval_dataset is not None
                         else None)

    def _start(self):
        from .supervised.trainer import SupervisedTrainer

        if self._loaded is not None:
            raise ConfigError("SFTTrainer loads the recipe's model itself: pass its name or folder as model")
        if self.cfg.sft is None:  # (TRL's SFTTrainer needs no section: the rows say what to learn)
            self.cfg = config_from_dict({**self.cfg.to_dict(), "sft": {}})
        return SupervisedTrainer(self.cfg, resume=self._resume, held_out=self.held_out, rows=self._sft_rows)


def sft_rows(data) -> list[dict]:
    """A data set for SFT in memory (a datasets.Dataset or a list of dicts) as a list of row dicts."""
    from datasets import Dataset

    if isinstance(data, Dataset):
        return [dict(r) for r in data]
    if isinstance(data, list) and all(isinstance(r, dict) for r in data):
        return [dict(r) for r in data]
    raise ConfigError(f"train_dataset: a list of dicts (one per row) or a datasets.Dataset, not {type(data).__name__}")
