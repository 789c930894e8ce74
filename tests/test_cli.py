"""The console command: subcommands, config errors as one line with exit code 2, eval JSON."""

import json
import subprocess
import sys

import pytest

from docuchat_rl.cli import main
from docuchat_rl.outputs import claim_output_dir

from .conftest import ROOT


def test_help_lists_the_subcommands():
    out = subprocess.run(["docuchat-rl", "--help"], capture_output=True, text=True, check=True).stdout
    for cmd in ("train", "eval", "audit", "config"):
        assert cmd in out
    mod = subprocess.run([sys.executable, "-m", "docuchat_rl", "--help"], capture_output=True, text=True)
    assert mod.returncode == 0 and "train" in mod.stdout


def test_config_error_is_one_line_and_exit_2(capsys):
    assert main(["train", "--config", str(ROOT / "config/default.yaml"), "--set", "optim.lrr=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("docuchat-rl: error: config key 'optim.lrr' is unknown") and "\n" not in err


def test_config_explain_and_resolved(capsys):
    assert main(["config", "--explain"]) == 0
    assert "epsilon_high" in capsys.readouterr().out
    assert main(["config", "--config", str(ROOT / "config/default.yaml"), "--set", "run.steps=7"]) == 0
    assert "steps: 7" in capsys.readouterr().out


@pytest.mark.slow
def test_eval_prints_json_and_writes_file(tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert main(["eval", "--config", str(ROOT / "config/default.yaml"), "--set", "eval.limit=16",
                 "--set", "eval.pass_k=2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    for key in ("accuracy", "pass@2", "format_rate", "correctness/mean", "completion_len/mean"):
        assert key in result
    assert result["rows"] == 16 and 0 <= result["mean@2"] <= result["pass@2"] <= 1  # pass@k >= mean@k


def test_run_errors_are_one_line_and_exit_2(tmp_path, capsys):
    assert main(["train", "--resume", str(tmp_path / "nothing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("docuchat-rl: error: no checkpoint to resume at") and "\n" not in err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["train", "--set", f"data.train={empty}", "--set", f"run.output_dir={tmp_path}"]) == 2
    assert "data file is empty" in capsys.readouterr().err
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"question": "1 + 1?", "answer": "2"}) + "\n")
    assert main(["train", "--set", f"data.train={one}", "--set", f"run.output_dir={tmp_path / 'one'}",
                 "--set", "rollout.prompts_per_step=2"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("1 training row, fewer than rollout.prompts_per_step (2): a step would sample a prompt "
                        "twice; lower rollout.prompts_per_step or add rows") and "\n" not in err
    claim_output_dir(tmp_path / "one", overwrite=False)  # nothing there blocks the corrected re-run
    missing = tmp_path / "no-such-model"
    assert main(["eval", "--set", f"model.name_or_path={missing}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"docuchat-rl: error: model.name_or_path '{missing}' could not be loaded") and "\n" not in err


@pytest.mark.slow
def test_train_reports_before_and_after_and_reuses_the_final_periodic_eval(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(["train", "--config", str(ROOT / "config/default.yaml"), "--set", f"run.output_dir={out}",
                 "--set", "run.steps=2", "--set", "rollout.prompts_per_step=2", "--set", "rollout.num_generations=2",
                 "--set", "rollout.max_new_tokens=16", "--set", "eval.limit=8", "--set", "eval.every=2",
                 "--set", "logging.progress=false"]) == 0
    report = json.loads((out / "eval.json").read_text())
    final = json.loads((out / "eval.jsonl").read_text().splitlines()[-1])
    assert report["before"]["rows"] == report["after"]["rows"] == 8
    assert {k: v for k, v in final.items() if k not in ("step", "minutes")} == report["after"]
    assert "eval before:" in capsys.readouterr().out
    # a second fresh run into the same folder would append to its files: refused before loading anything
    assert main(["train", "--set", f"run.output_dir={out}"]) == 2
    err = capsys.readouterr().err
    assert "already holds a run" in err and "--resume latest" in err and "run.overwrite=true" in err


def test_stop_after_checkpoints_mid_schedule_says_how_to_go_on_and_refuses_a_step_already_done(tmp_path, capsys):
    out = tmp_path / "run"
    sets = [f"run.output_dir={out}", "run.steps=3", "checkpoint.every=50", "rollout.prompts_per_step=2",
            "rollout.num_generations=2", "rollout.max_new_tokens=8", "eval.before_and_after=false",
            "logging.progress=false"]
    argv = ["train", *[x for s in sets for x in ("--set", s)]]
    assert main([*argv, "--stop-after", "1"]) == 0
    err = capsys.readouterr().err
    assert "stopped after step 1 of 3; go on with: docuchat-rl train" in err and err.rstrip().endswith("--resume latest")
    assert (out / "latest").read_text().strip() == "checkpoint-1"  # written although checkpoint.every is 50
    assert main([*argv, "--resume", "latest", "--stop-after", "1"]) == 2
    assert "--stop-after 1: must come after the run's last step (1)" in capsys.readouterr().err


def test_resume_refuses_a_changed_recipe_key_and_applies_a_changed_watching_key_saying_so(tmp_path, capsys):
    """One rule (checkpoint.check_resumable): optim.lr or rollout.num_generations changed on resume is refused
    in one line naming the key and both values (the saved optimizer and run_config would misstate it); a changed
    checkpoint cadence, or run.steps under a constant schedule, is applied and said; nothing is written first."""
    out = tmp_path / "run"
    sets = [f"run.output_dir={out}", "run.steps=2", "rollout.prompts_per_step=2", "rollout.num_generations=2",
            "rollout.max_new_tokens=8", "eval.before_and_after=false", "logging.progress=false"]
    argv = ["train", *[x for s in sets for x in ("--set", s)]]
    assert main([*argv, "--stop-after", "1"]) == 0
    capsys.readouterr()
    for key, value, was in (("optim.lr", "0.001", "0.0005"), ("rollout.num_generations", "4", "2")):
        assert main([*argv, "--set", f"{key}={value}", "--resume", "latest"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("docuchat-rl: error: checkpoint-1 was trained with a different recipe") and "\n" not in err
        assert f"{key}={was} -> {value}" in err
    assert (out / "latest").read_text().strip() == "checkpoint-1"
    assert main([*argv, "--set", "checkpoint.every=1", "--set", "run.steps=3", "--resume", "latest"]) == 0
    err = capsys.readouterr().err
    assert "resuming checkpoint-1 with changed settings (applied): run.steps: 2 -> 3; checkpoint.every: 50 -> 1" in err
    saved = json.loads((out / "checkpoint-3" / "run_config.json").read_text())["config"]
    assert saved["run"]["steps"] == 3 and saved["checkpoint"]["every"] == 1 and (out / "checkpoint-2").exists()
    linear = [*argv, "--set", "optim.schedule=linear"]
    assert main([*linear, "--set", "run.output_dir=" + str(tmp_path / "lin"), "--stop-after", "1"]) == 0
    assert main([*linear, "--set", "run.output_dir=" + str(tmp_path / "lin"), "--set", "run.steps=3",
                 "--resume", "latest"]) == 2
    assert "run.steps=2 -> 3" in capsys.readouterr().err


@pytest.mark.slow
def test_a_start_that_fails_before_step_1_leaves_nothing_that_blocks_the_corrected_rerun(tmp_path, capsys):
    """A missing held-out file with evaluation on fails at start in one line; the same command with the file
    corrected then runs (no 'already holds a run', no run.overwrite needed)."""
    out = tmp_path / "run"
    sets = ["--set", f"run.output_dir={out}", "--set", "run.steps=1", "--set", "rollout.prompts_per_step=2",
            "--set", "rollout.num_generations=2", "--set", "rollout.max_new_tokens=8", "--set", "eval.limit=4",
            "--set", "logging.progress=false"]
    assert main(["train", *sets, "--set", f"data.test={tmp_path / 'nope.jsonl'}"]) == 2
    assert "nope.jsonl" in capsys.readouterr().err
    assert main(["train", *sets]) == 0
    assert (out / "latest").exists()


@pytest.mark.slow
def test_ctrl_c_during_the_evaluation_before_training_is_one_line_and_the_rerun_starts(tmp_path, capsys):
    out = tmp_path / "run"
    sets = ["--set", f"run.output_dir={out}", "--set", "run.steps=1", "--set", "rollout.prompts_per_step=2",
            "--set", "rollout.num_generations=2", "--set", "rollout.max_new_tokens=8", "--set", "eval.limit=4",
            "--set", "logging.progress=false"]
    assert main(["train", *sets, "--set", "rewards=[{name: 'tests.user_rewards:ctrl_c'}]",
                 "--set", "rewards.accuracy_component=null"]) == 130
    err = capsys.readouterr().err
    assert "interrupted during the evaluation before training" in err and "Traceback" not in err
    assert main(["train", *sets]) == 0
