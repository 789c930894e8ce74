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


def test_a_reward_object_is_said_unresumable_where_a_run_stops_and_the_cli_resume_fails_in_one_line(tmp_path):
    """Said when the run stops before its end (where the CLI's resume would be reached for), not at the start nor
    after a finished run."""
    def mine(completions, **kw):
        return [0.0 for _ in completions]

    out = tmp_path / "r"
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        trainer = dr.RLTrainer("default", rewards=["correctness", mine],
                               overrides={**FAST, "run.output_dir": str(out), "eval.before_and_after": False})
    assert not [w for w in said if "importable path" in str(w.message)]  # (nothing said at the start)
    with trainer:
        with pytest.warns(UserWarning, match="mine is a Python object without an importable path"):
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
        trainer = dr.RLTrainer(recipe=dr.recipe("default"), model=model, tokenizer=AutoTokenizer.from_pretrained(MODEL),
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
    with pytest.raises(ConfigError, match="model: a model name or folder, or a loaded transformers model, not Linear"):
        dr.RLTrainer(recipe="default", model=torch.nn.Linear(1, 1), overrides={"run.output_dir": str(tmp_path / "b")})
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


def test_rewards_belong_to_their_trainer_when_another_names_a_function_alike(tmp_path):
    """Two trainers in one process, each with its own function under the same name: the first one's evaluation
    still scores with its own function (a process-wide registry let the second replace it)."""
    over = {**FAST, "eval.max_new_tokens": 8, "eval.limit": 4}
    first = dr.RLTrainer("default", rewards=[("verdict", lambda completions, **kw: [1.0] * len(completions))],
                         overrides={**over, "run.output_dir": str(tmp_path / "a")})
    try:
        assert first.evaluate()["verdict/mean"] == 1.0
        second = dr.RLTrainer("default", rewards=[("verdict", lambda completions, **kw: [-1.0] * len(completions))],
                              overrides={**over, "run.output_dir": str(tmp_path / "b")})
        with second:
            assert second.evaluate()["verdict/mean"] == -1.0
        assert first.evaluate()["verdict/mean"] == 1.0
    finally:
        first.close()


def test_in_memory_data_is_checked_as_files_are_and_sft_evaluates_its_eval_dataset(tmp_path):
    """eval_dataset reaches SFTTrainer's evaluation and honours eval.limit; an empty data set, a row that is not a
    dict, and an eval_dataset that repeats a training question (in other case or spacing) are one line naming
    the argument; eval.every runs on an eval_dataset alone (data.test null)."""
    over = {**FAST, "eval.max_new_tokens": 8, "run.output_dir": str(tmp_path / "s"), "sft.steps": 1,
            "sft.batch_size": 4, "eval.limit": 3}
    held = rows(5, "test")
    with dr.SFTTrainer("default", eval_dataset=held, overrides=over) as sft:
        report = sft.train()
    assert report["before"]["rows"] == report["after"]["rows"] == 3
    for bad, said in (([], "eval_dataset: the data set is empty"), ([{"question": "Q", "answer": "#### 1"}, "x"],
                                                                    "a list of dicts"),
                      ({"question": ["Q"]}, "not dict")):
        with pytest.raises(ConfigError, match=said):
            dr.RLTrainer("default", eval_dataset=bad, overrides={**FAST, "run.output_dir": str(tmp_path / "x")})
    with pytest.raises(ConfigError, match="train_dataset: the data set is empty"):
        dr.RLTrainer("default", train_dataset=[], overrides={**FAST, "run.output_dir": str(tmp_path / "y")})
    train = rows(12)
    leak = [{**train[3], "question": "  " + train[3]["question"].upper().replace(" ", "  ")}]
    with pytest.raises(ConfigError, match="eval_dataset: 1 of its 1 rows ask a question of the train_dataset rows"):
        dr.RLTrainer("default", train_dataset=train, eval_dataset=leak,
                     overrides={**FAST, "run.output_dir": str(tmp_path / "z")})
    with dr.RLTrainer("default", train_dataset=train, eval_dataset=held,
                      overrides={**FAST, "run.output_dir": str(tmp_path / "e"), "data.test": None, "eval.every": 1,
                                 "eval.before_and_after": False, "eval.max_new_tokens": 8}) as t:
        t.train()
    evals = [json.loads(x) for x in (tmp_path / "e" / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [1, 2] and all(e["rows"] == 5 for e in evals)


@pytest.mark.parametrize("argument,value,said", [
    ("rewards", "correctness", "rewards: a list of rewards"),
    ("overrides", "run.steps=2", "overrides: a dict"),
    ("overrides", ["run.steps"], "overrides: a dict"),
    ("train_dataset", {"question": ["Q"], "answer": ["#### 1"]}, "train_dataset: a list of dicts"),
    ("eval_dataset", "rows.jsonl", "eval_dataset: a list of dicts"),
    ("resume", 3, "resume: \"latest\", a run folder"),
    ("tokenizer", "data/model", "processing_class: the model's transformers tokenizer"),
    ("recipe_", 42, "recipe: a built-in recipe's name"),
])
def test_every_public_argument_is_checked_at_the_call_in_one_line_naming_it(tmp_path, argument, value, said):
    with pytest.raises(ConfigError, match=said) as e:
        dr.RLTrainer(**{"recipe_": "default", "overrides": {"run.output_dir": str(tmp_path / "r")}, argument: value})
    assert "\n" not in str(e.value)


def test_a_closed_trainer_and_bad_call_arguments_are_one_line_in_the_apis_words(tmp_path):
    """After close(): train, evaluate and generate say the trainer is closed; generate(str) and train(stop_after=
    "2") name the argument; an engine error that names a CLI flag says the API's words (stop_after=, resume=)."""
    t = dr.RLTrainer("default", overrides={**FAST, "run.output_dir": str(tmp_path / "r")})
    with pytest.raises(ConfigError, match="prompts: a list of texts, not str"):
        t.generate("Ann has 3 cats.")
    with pytest.raises(ConfigError, match="stop_after: a step number"):
        t.train(stop_after="2")
    from docuchat_rl.errors import TrainingError

    with pytest.raises(TrainingError, match=r"^stop_after=9: must come after") as e:
        t.train(stop_after=9)
    assert "--" not in str(e.value)
    t.close()
    t.close()  # (a second close does nothing)
    for call in (t.train, t.evaluate, lambda: t.generate(["hi"])):
        with pytest.raises(ConfigError, match="this RLTrainer is closed"):
            call()


@pytest.mark.parametrize("kwargs,said", [
    ({"temperature": 0}, "temperature: must be above 0, not 0 (for greedy decoding leave temperature out)"),
    ({"max_new_tokens": 0}, "max_new_tokens: must be at least 1, not 0"),
    ({"temperature": 1.0, "top_p": 0.0}, "top_p: must be above 0 and at most 1, not 0.0"),
    ({"temperature": 1.0, "top_k": -3}, "top_k: must be at least 0, not -3"),
])
def test_generate_bounds_its_arguments_as_the_cli_does(tmp_path, kwargs, said):
    """RLTrainer.generate takes what `docuchat-rl generate` takes (config.BOUNDS), refused before the run starts."""
    t = dr.RLTrainer("default", overrides={**FAST, "run.output_dir": str(tmp_path / "r")})
    with pytest.raises(ConfigError) as e:
        t.generate(["Ava has 2 apples."], **kwargs)
    assert str(e.value) == said and not (tmp_path / "r").exists()
    t.close()


def test_a_grpo_config_runs_as_the_same_recipe_does(tmp_path):
    """RLTrainer(args=GRPOConfig(...), peft_config=LoraConfig(...)) trains the very run that the recipe with TRL's
    meaning written out as our keys trains (what TRL's fields and defaults mean here: docs/from_trl.md): the same
    traces, line for line."""
    from peft import LoraConfig
    from trl import GRPOConfig

    args = GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, max_steps=2, learning_rate=1e-3,
                      num_generations=4, per_device_train_batch_size=16, max_completion_length=24, beta=0.0,
                      loss_type="dr_grpo", disable_tqdm=True, seed=3, gradient_checkpointing=False)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with dr.RLTrainer(args=args, peft_config=LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
                          overrides={"eval.before_and_after": False, "run.threads": 1}) as t:
            out = t.train()
            history = t.state.log_history
    assert out.global_step == 2 and out.training_loss is not None and len(history) == 2
    ours = {"run.output_dir": str(tmp_path / "ours"), "run.steps": 2, "optim.lr": 1e-3, "rollout.num_generations": 4,
            "rollout.prompts_per_step": 4, "optim.minibatch_size": 16, "optim.micro_batch_size": 16,
            "rollout.max_new_tokens": 24, "algorithm.beta": 0.0, "algorithm.loss_aggregation": "dr_grpo",
            "logging.progress": False, "run.seed": 3, "lora.r": 8, "lora.alpha": 16.0,
            "lora.target_modules": ["q_proj", "v_proj"], "eval.before_and_after": False, "run.threads": 1,
            # (TRL's defaults, as they are here)
            "optim.schedule": "linear", "model.dtype": "float32", "model.disable_dropout": False,
            "data.prompt_format": "as_given", "data.system_prompt": None, "algorithm.kl_bias_correction": True,
            "checkpoint.every": 500, "checkpoint.keep_last": None}
    with dr.RLTrainer("default", overrides=ours) as t:
        t.train()

    def lines(run):
        return [{k: v for k, v in json.loads(x).items() if k not in ("run_id", "versions")}
                for x in (run / "traces.jsonl").read_text().splitlines()]

    assert lines(tmp_path / "trl") == lines(tmp_path / "ours")


def test_callbacks_see_each_steps_metrics_and_can_stop_the_run_which_then_resumes_exactly(tmp_path):
    """transformers.TrainerCallback objects: on_train_begin, on_step_end, on_log (the metrics.jsonl record),
    on_save, on_evaluate, on_train_end; control.should_training_stop stops after that step with a checkpoint,
    and resume="latest" then gives the uninterrupted run's traces. A callback that raises is one line naming it."""
    from transformers import TrainerCallback

    from docuchat_rl.errors import TrainingError

    class Watch(TrainerCallback):
        def __init__(self, stop_at=None):
            self.events, self.logs, self.stop_at = [], [], stop_at

        def on_train_begin(self, args, state, control, **kw):
            self.events.append("begin")

        def on_step_end(self, args, state, control, **kw):
            self.events.append(f"step{state.global_step}")
            if state.global_step == self.stop_at:
                control.should_training_stop = True

        def on_log(self, args, state, control, logs=None, **kw):
            self.logs.append(logs)

        def on_save(self, args, state, control, **kw):
            self.events.append(f"save{state.global_step}")

        def on_evaluate(self, args, state, control, metrics=None, **kw):
            self.events.append("eval")

        def on_train_end(self, args, state, control, **kw):
            self.events.append("end")

    over = {**FAST, "run.steps": 4, "checkpoint.every": 3, "eval.before_and_after": False}
    whole = Watch()
    with dr.RLTrainer("default", callbacks=[whole], overrides={**over, "run.output_dir": str(tmp_path / "w")}) as t:
        t.train()
    metrics = [json.loads(x) for x in (tmp_path / "w" / "metrics.jsonl").read_text().splitlines()]
    assert [{k: v for k, v in m.items() if not k.startswith(("time/", "memory/", "rollout_tokens"))} for m in whole.logs] \
        == [{k: v for k, v in m.items() if not k.startswith(("time/", "memory/", "rollout_tokens"))} for m in metrics]
    assert whole.events == ["begin", "step1", "step2", "step3", "save3", "step4", "save4", "end"]
    stopper = Watch(stop_at=2)
    with dr.RLTrainer("default", callbacks=[stopper], overrides={**over, "run.output_dir": str(tmp_path / "c")}) as t:
        assert t.train().global_step == 2
    assert (tmp_path / "c" / "checkpoint-2").exists()
    with dr.RLTrainer("default", overrides={**over, "run.output_dir": str(tmp_path / "c")}, resume="latest") as t:
        t.train()

    def lines(run):
        return [{k: v for k, v in json.loads(x).items() if k != "run_id"} for x in (run / "traces.jsonl").read_text().splitlines()]

    assert lines(tmp_path / "c") == lines(tmp_path / "w")

    class Broken(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            raise ValueError("no such metric")

    with dr.RLTrainer("default", callbacks=[Broken()], overrides={**over, "run.output_dir": str(tmp_path / "b")}) as t:
        with pytest.raises(TrainingError, match="callback Broken.on_step_end raised ValueError: no such metric"):
            t.train()


def test_the_step_a_run_stops_at_fires_its_events_and_a_resume_sees_the_whole_history(tmp_path):
    """As TRL: train(stop_after=2) fires on_step_end, on_log and on_save for step 2 and on_train_end at step 2;
    training_loss is the mean loss of the call's optimizer steps; a resume by TRL's train(resume_from_checkpoint=
    True), with a callback given as a class (TRL makes it), starts with the whole run's log_history."""
    from transformers import TrainerCallback

    class Watch(TrainerCallback):
        def __init__(self):
            self.events, self.history_at_start = [], None

        def on_train_begin(self, args, state, control, **kw):
            self.events.append("begin")
            self.history_at_start = [m["step"] for m in state.log_history]

        def on_step_end(self, args, state, control, **kw):
            self.events.append(f"step{state.global_step}")

        def on_log(self, args, state, control, logs=None, **kw):
            self.events.append(f"log{logs['step']}")

        def on_save(self, args, state, control, **kw):
            self.events.append(f"save{state.global_step}")

        def on_train_end(self, args, state, control, **kw):
            self.events.append(f"end{state.global_step}")

    over = {**FAST, "run.steps": 4, "checkpoint.every": 1, "eval.before_and_after": False,
            "run.output_dir": str(tmp_path / "r")}
    first = Watch()
    with dr.RLTrainer("default", callbacks=[first], overrides=over) as t:
        out = t.train(stop_after=2)
    assert first.events == ["begin", "step1", "log1", "save1", "step2", "log2", "save2", "end2"]
    losses = [json.loads(x)["loss"] for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert out.global_step == 2 and out.training_loss == pytest.approx(sum(losses) / 2)
    with dr.RLTrainer("default", callbacks=[Watch], overrides=over) as t:
        again = t.train(resume_from_checkpoint=True)
        second = t._calls.callbacks[0]
        assert [m["step"] for m in t.state.log_history] == [1, 2, 3, 4]
    assert second.history_at_start == [1, 2]
    assert second.events == ["begin", "step3", "log3", "save3", "step4", "log4", "save4", "end4"]
    losses = [json.loads(x)["loss"] for x in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()][2:]
    assert again.training_loss == pytest.approx(sum(losses) / 2)  # (this call's steps, as transformers counts)
    with dr.RLTrainer("default", overrides=over) as t:  # (a finished run: a train() that trains nothing says so)
        with pytest.warns(UserWarning, match="this run is finished"):
            assert t.train(resume_from_checkpoint=True).global_step == 4
    assert len((tmp_path / "r" / "metrics.jsonl").read_text().splitlines()) == 4


def test_sft_from_a_dataset_equals_sft_from_the_same_rows_in_a_file_and_hands_off_to_rl(tmp_path):
    """SFTTrainer(train_dataset=Dataset of TRL's messages rows) learns the targets and adapter that sft.source
    jsonl learns from the same rows in a file; RLTrainer(start_from=it) starts from its adapter and says so;
    save_model writes an adapter peft loads."""
    import datasets
    from safetensors.torch import load_file

    convs = [{"messages": [{"role": "user", "content": r["question"]}, {"role": "assistant", "content": r["answer"]}]}
             for r in rows(8)]
    f = tmp_path / "rows.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in convs))
    over = {**FAST, "sft.steps": 2, "sft.batch_size": 4, "eval.before_and_after": False}
    with dr.SFTTrainer("default", train_dataset=datasets.Dataset.from_list(convs),
                       overrides={**over, "run.output_dir": str(tmp_path / "mem")}) as mem:
        mem.train()
        saved = mem.save_model(tmp_path / "saved")
    with dr.SFTTrainer("default", overrides={**over, "run.output_dir": str(tmp_path / "file"), "sft.source": "jsonl",
                                             "sft.path": str(f)}) as fromfile:
        fromfile.train()
    for name in ("sft_targets.jsonl",):
        assert (tmp_path / "mem-sft" / name).read_text().replace("row ", "line ") != ""
    a = [json.loads(x)["target"] for x in (tmp_path / "mem-sft" / "sft_targets.jsonl").read_text().splitlines()]
    b = [json.loads(x)["target"] for x in (tmp_path / "file-sft" / "sft_targets.jsonl").read_text().splitlines()]
    assert a == b
    wa = load_file(str(tmp_path / "mem-sft" / "checkpoint-2" / "adapter_model.safetensors"))
    wb = load_file(str(tmp_path / "file-sft" / "checkpoint-2" / "adapter_model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert (saved / "adapter_config.json").exists()
    with pytest.raises(ConfigError, match="push_to_hub: docuchat-rl runs offline"):
        mem.push_to_hub()
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err):  # (said when the run starts: at its first train())
        rl = dr.RLTrainer("default", start_from=mem, overrides={**FAST, "run.output_dir": str(tmp_path / "rl"),
                                                                 "eval.before_and_after": False, "run.steps": 1})
        with rl:
            rl.train()
    assert "the adapter starts from" in err.getvalue() and "mem-sft" in err.getvalue()


@pytest.mark.slow
@pytest.mark.parametrize("script", ["trl_grpo_quickstart.py", "trl_sft_quickstart.py"])
def test_trls_quickstarts_run_with_their_import_changed(tmp_path, script):
    """TRL's GRPO and SFT quickstarts, as examples/ holds them (the import changed; the embedded model and rows for
    the hub's), run to the end; the SFT one then hands its adapter to RL in one argument."""
    done = subprocess.run([sys.executable, f"examples/{script}", "--max-steps", "2", "--output-dir",
                           str(tmp_path / "run")], capture_output=True, text=True, cwd=ROOT, timeout=900)
    assert done.returncode == 0, done.stderr[-1500:]
    assert (tmp_path / "run" / "checkpoint-2" / "adapter_model.safetensors").exists()
    if "sft" in script:
        assert f"the adapter starts from {tmp_path / 'run'}" in done.stderr
        assert (tmp_path / "run-grpo" / "checkpoint-2").exists()
    else:
        assert "no reward is named 'correctness'" in done.stderr  # (said once: the accuracy's key)
