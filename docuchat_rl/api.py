"""The Python API: what `docuchat-rl train`, `sft`, `eval` and `generate` run, for a script or a notebook.

    import docuchat_rl as dr

    def brevity(completions, **kw):              # any reward function TRL accepts; a lambda too
        return [-len(c) / 100 for c in completions]

    trainer = dr.RLTrainer("default", rewards=["correctness", brevity], train_dataset=rows,
                           overrides={"run.steps": 20, "run.output_dir": "runs/api"})
    report = trainer.train()                      # {"before": {...}, "after": {...}}: eval.json's numbers
    trainer.generate(["Ann has 3 cats and gets 2 more. How many cats does Ann have now?"])
    trainer.close()

A recipe is a `Config`, a path, or a built-in name (`docuchat-rl recipes` lists them); `overrides` are the
CLI's `--set` as a dict. Rewards are the recipe's unless given: names (registered rewards, dotted paths), spec
dicts (`{"name": "format", "weight": 0.2}`, or `{"function": fn, "weight": 0.1}`) and Python callables, traced
under their `__name__` (or the name of a `(name, fn)` pair). Data is the recipe's
unless given: a `datasets.Dataset` or a list of dicts with the recipe's prompt and answer columns. `model` is
a name or folder, or a model already loaded (with its `tokenizer`). The evaluation before and after training
and the stop rules (`stop_after`, SIGTERM/SIGINT at a safe point, exact resume) are the CLI's, from
`workflow.py`; the CLI is a layer of messages over the same calls.

What a resume needs and cannot get is said when training starts, in one warning line: a reward given as a
Python object has no importable path, so another process (`docuchat-rl train --resume`) cannot find it; a
resume through this API, given the same rewards, can.

Deliberately left out: a trainer for several processes from a notebook (launch a script with `torchrun`), and
callbacks into the loop (the metrics file and wandb carry every step's numbers).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from rewards.base import add_function, is_object

from .config import Config, ConfigError, config_from_dict, load_config
from .data import Example, examples_of
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


def reward_specs(rewards: list) -> list[dict]:
    """The rewards section for `rewards`: names and specs as they are; callables registered under their name."""
    specs, seen = [], set()
    for item in rewards:
        if isinstance(item, dict) and callable(item.get("function")):  # {"function": fn, "weight": 0.1}
            spec = {k: v for k, v in item.items() if k != "function"}
            spec.setdefault("name", getattr(item["function"], "__name__", "function"))
            add_function(spec["name"], item["function"])
        elif isinstance(item, dict):
            spec = dict(item)
        elif isinstance(item, str):
            spec = {"name": item}
        elif isinstance(item, tuple) and len(item) == 2 and callable(item[1]):
            add_function(item[0], item[1])
            spec = {"name": item[0]}
        elif callable(item):
            name = getattr(item, "__name__", None) or type(item).__name__
            add_function(name, item)
            spec = {"name": name}
        else:
            raise ConfigError(f"rewards: {item!r} is neither a reward name, a spec dict, a callable nor a (name, "
                              "callable) pair")
        if spec["name"] in seen:
            raise ConfigError(f"rewards: two rewards named {spec['name']!r} (give one a name: (name, fn))")
        seen.add(spec["name"])
        specs.append(spec)
    return specs


def rows_of(data, cfg: Config, what: str) -> list[Example]:
    """A `datasets.Dataset` or a list of dicts as checked `Example`s, with the recipe's columns."""
    if isinstance(data, list):
        from datasets import Dataset

        data = Dataset.from_list(data)
    return examples_of(data, f"{what} (in memory)", cfg.data.prompt_column, cfg.data.answer_column)


class RLTrainer:
    """A run of the recipe's algorithm (GRPO, PPO, A2C) from Python: `train()`, `evaluate()`, `generate()`."""

    def __init__(self, recipe_: str | Path | Config | None = "default", *, rewards: list | None = None,
                 train_dataset=None, eval_dataset=None, model=None, tokenizer=None,
                 overrides: dict[str, Any] | list[str] | None = None, resume: str | None = None):
        cfg = recipe(recipe_, overrides)
        if rewards is not None:
            cfg = config_from_dict({**cfg.to_dict(), "rewards": {**cfg.rewards.model_dump(), "components":
                                                                 reward_specs(rewards)}})
        loaded = None
        if model is not None and not isinstance(model, (str, Path)):
            if tokenizer is None:
                raise ConfigError("model: a loaded model needs its tokenizer (tokenizer=...)")
            name = getattr(getattr(model, "config", None), "_name_or_path", None) or cfg.model.name_or_path
            cfg = config_from_dict(cfg.to_dict(), [f"model.name_or_path={name}"])
            loaded = (model, tokenizer)
        elif model is not None:
            cfg = config_from_dict(cfg.to_dict(), [f"model.name_or_path={model}"])
        self.examples = rows_of(train_dataset, cfg, "train_dataset") if train_dataset is not None else None
        self.held_out = rows_of(eval_dataset, cfg, "eval_dataset") if eval_dataset is not None else None
        objects = [c.name for c in cfg.rewards.components if is_object(c.name)]
        if objects:
            warnings.warn(f"reward{'s' * (len(objects) > 1)} {', '.join(objects)} {'are' if len(objects) > 1 else 'is a'} "
                          f"Python object{'s' * (len(objects) > 1)} without an importable path: `docuchat-rl train "
                          "--resume` cannot find it; resume through this API with the same rewards, or name it by "
                          "its path (module:function)", stacklevel=2)
        self.cfg, self._resume, self._loaded = cfg, resume, loaded
        self.trainer = self._start()
        self.out = Path(self.trainer.out_dir)

    def _start(self):
        from .trainer import Trainer

        self.cfg.check_run()
        return Trainer(self.cfg, resume=self._resume, examples=self.examples, model=self._loaded,
                       held_out=self.held_out)

    @property
    def step(self) -> int:
        """The last finished step."""
        return self.trainer.step

    def train(self, stop_after: int | None = None) -> dict:
        """The held-out set before (at step 0), the steps to the end (or `stop_after`, checkpointed), the held-out
        set after (a finished run): eval.json's numbers, {"before": ..., "after": ...} as far as they got. Raises
        errors.Preempted after SIGTERM/SIGINT, with the last finished step checkpointed."""
        report = {}
        do_eval = bool(self.cfg.eval.before_and_after and (self.cfg.data.test or self.held_out is not None))
        if do_eval and self.trainer.step == 0:
            report["before"] = evaluation(self.trainer, self.out, "before")
        self.trainer.train(stop_after=stop_after)
        if do_eval and self.trainer.step >= self.trainer.total_steps:
            report["after"] = evaluation(self.trainer, self.out, "after")
        return report

    def evaluate(self) -> dict:
        """The held-out numbers of the adapter as it is now (greedy accuracy, pass@k, each reward's mean)."""
        return self.trainer.evaluate()

    def generate(self, prompts: list[str], max_new_tokens: int | None = None, temperature: float | None = None,
                 top_p: float = 1.0, top_k: int = 0) -> list[str]:
        """Completions of `prompts` with the adapter as it is now, through the recipe's template and system prompt
        (`generate`'s records); greedy unless a `temperature` is given."""
        from .tools.inference import sample_records

        rows = [Example(i, q, "") for i, q in enumerate(prompts)]
        records = sample_records(self.trainer.policy_model, self.trainer.tokenizer, self.cfg, rows,
                                 do_sample=temperature is not None, temperature=temperature or 1.0, top_p=top_p,
                                 top_k=top_k, max_new_tokens=max_new_tokens or self.cfg.eval.max_new_tokens)
        return [r["completion"] for r in records]

    def close(self) -> None:
        """Release the run folder and close its files."""
        self.trainer.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class SFTTrainer(RLTrainer):
    """The supervised stage from Python (`docuchat-rl sft`): the recipe's sft section, with the same surface."""

    def _start(self):
        from .supervised.trainer import SupervisedTrainer

        if self.examples is not None or self._loaded is not None:
            raise ConfigError("SFTTrainer takes its targets from the recipe's sft section (sft.source jsonl reads a "
                              "file): train_dataset and a loaded model are RLTrainer's")
        return SupervisedTrainer(self.cfg, resume=self._resume)

