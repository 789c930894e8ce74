"""The Python API (docuchat_rl/api.py): a recipe by name, rewards as Python objects, data in memory, a model
already loaded; the same run and files as the CLI's; what cannot be resumed said at the start."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

import pytest
import torch
import yaml

import docuchat_rl as dr
from docuchat_rl.config import ConfigError

from .conftest import MODEL, ROOT

FAST = {"run.steps": 2, "logging.progress": False, "run.threads": 1, "eval.limit": 8}


def rows(n: int, split: str = "train") -> list[dict]:
    return [json.loads(x) for x in (ROOT / f"data/task/{split}.jsonl").read_text().splitlines()[:n]]


def test_lambdas_and_rows_in_memory_train_and_are_traced_under_their_names(tmp_path):
    trainer = dr.RLTrainer("default", rewards=["correctness", ("short", lambda completions, **kw: [-len(c) / 100
                                                                                                  for c in completions])],
                           train_dataset=rows(16), eval_dataset=rows(8, "test"),
                           overrides={**FAST, "run.output_dir": str(tmp_path / "r")})
    with trainer:
        report = trainer.train()
        texts = trainer.generate(["Ann has 3 cats. Ann gets 2 more cats. How many cats does Ann have now?"])
    assert report["before"]["rows"] == 8 and "short/mean" in report["after"]
    assert json.loads((tmp_path / "r" / "eval.json").read_text()) == report
    lines = [json.loads(x) for x in (tmp_path / "r" / "traces.jsonl").read_text().splitlines()]
    assert {x["prompt"] for x in lines} <= {r["question"] for r in rows(16)}
    assert all(x["rewards"]["short"]["raw"] == pytest.approx(-len(x["completion"]) / 100) for x in lines)
    assert len(texts) == 1 and isinstance(texts[0], str)


def test_a_reward_object_is_said_unresumable_at_the_start_and_the_cli_resume_fails_in_one_line(tmp_path):
    def mine(completions, **kw):
        return [0.0 for _ in completions]

    out = tmp_path / "r"
    with pytest.warns(UserWarning, match="mine is a Python object without an importable path"):
        trainer = dr.RLTrainer("default", rewards=["correctness", mine],
                               overrides={**FAST, "run.output_dir": str(out), "eval.before_and_after": False})
    with trainer:
        trainer.train(stop_after=1)
    recipe = tmp_path / "recipe.yaml"  # (the run's own recipe, as the checkpoint recorded it)
    recipe.write_text(yaml.safe_dump(json.loads((out / "checkpoint-1" / "run_config.json").read_text())["config"]))
    done = subprocess.run([sys.executable, "-m", "docuchat_rl", "train", "--config", str(recipe), "--resume",
                           "latest"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1
    assert "unknown reward 'mine'" in done.stderr and "through the Python API" in done.stderr


def test_a_loaded_model_and_the_cli_run_give_the_same_traces(tmp_path):
    """The API on a model loaded by the user equals `docuchat-rl train` on its folder, completion for completion."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sets = {**FAST, "eval.before_and_after": False}
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainer = dr.RLTrainer(dr.recipe("default"), model=model, tokenizer=AutoTokenizer.from_pretrained(MODEL),
                               overrides={**sets, "run.output_dir": str(tmp_path / "api")})
    assert not [w for w in said if "Python object" in str(w.message)]  # (rewards by name: nothing to say)
    with trainer:
        trainer.train()
    cli = subprocess.run([sys.executable, "-m", "docuchat_rl", "train", "--config", "default",
                          *[x for k, v in sets.items() for x in ("--set", f"{k}={json.dumps(v)}")],
                          "--set", f"run.output_dir={tmp_path / 'cli'}"], capture_output=True, text=True, cwd=ROOT)
    assert cli.returncode == 0, cli.stderr[-800:]

    def traced(name):
        return [(x["prompt_id"], x["completion_ids"], x["total"]) for x in
                map(json.loads, (tmp_path / name / "traces.jsonl").read_text().splitlines())]

    assert traced("api") == traced("cli")


def test_bad_api_input_is_one_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="two rewards named 'f'"):
        dr.RLTrainer("default", rewards=[("f", len), ("f", len)], overrides={"run.output_dir": str(tmp_path / "a")})
    with pytest.raises(ConfigError, match="needs its tokenizer"):
        dr.RLTrainer("default", model=torch.nn.Linear(1, 1), overrides={"run.output_dir": str(tmp_path / "b")})
    with pytest.raises(ConfigError, match="nor a built-in recipe of that name: a2c, default"):
        dr.recipe("no_such_recipe")
    with pytest.raises(Exception, match="column 'question'"):
        dr.RLTrainer("default", train_dataset=[{"q": "x", "answer": "1"}], overrides={"run.output_dir": str(tmp_path / "c")})


def test_the_example_script_runs(tmp_path):
    done = subprocess.run([sys.executable, "examples/python_api.py", "--steps", "2", "--out", str(tmp_path / "ex")],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr[-800:]
    numbers = json.loads(done.stdout.splitlines()[0])
    assert set(numbers) == {"before", "after"} and 0 <= numbers["after"] <= 1
