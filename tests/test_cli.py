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
    assert result["rows"] == 16 and 0 <= result["pass@1"] <= result["pass@2"] <= 1  # pass@k >= pass@1


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
    assert f"docuchat-rl: train writes {out} (from step 1 of 3)" in err.splitlines()[0]
    assert (f"stopped after step 1 of 3 (eval.json has no \"after\" yet: docuchat-rl eval --adapter {out} evaluates "
            "it now); go on with: docuchat-rl train") in err and err.rstrip().endswith("--resume latest")
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
    assert "SIGINT during the evaluation before training: nothing was trained; run the same command to start " \
           "again" in err and "Traceback" not in err
    assert main(["train", *sets]) == 0


# ------------------------------------------------------------------ nothing lost: run folders, resumes, outputs
def _train(out, *sets, extra=()):
    """`docuchat-rl train` on the default recipe shrunk to seconds, in `out` (exit code)."""
    base = [f"run.output_dir={out}", "rollout.prompts_per_step=2", "rollout.num_generations=2",
            "rollout.max_new_tokens=8", "eval.before_and_after=false", "logging.progress=false", "run.threads=2"]
    return main(["train", *[a for s in [*base, *sets] for a in ("--set", s)], *extra])


def _files(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_resume_never_cuts_another_runs_folder_and_into_a_new_folder_continues_the_run_whole(tmp_path, capsys):
    """`--resume A/checkpoint-2` into B, which holds a run: refused, B byte for byte as it was (it used to be cut
    back to A's offsets and its new checkpoints pruned at once). Into a new folder C: C starts with A's history up
    to step 2 and ends equal to A (an exact resume)."""
    from docuchat_rl.outputs import read_jsonl

    from .test_trainer import untimed

    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    assert _train(a, "run.steps=4", "checkpoint.every=1", "checkpoint.keep_last=4") == 0
    assert _train(b, "run.steps=6", "checkpoint.every=1") == 0
    held = _files(b)
    capsys.readouterr()
    assert _train(b, "run.steps=4", "checkpoint.every=1", extra=["--resume", str(a / "checkpoint-2")]) == 2
    err = capsys.readouterr().err.strip()
    assert "already holds another run" in err and "would cut its files: choose a new run.output_dir" in err
    assert "\n" not in err and _files(b) == held
    assert _train(c, "run.steps=4", "checkpoint.every=1", extra=["--resume", str(a / "checkpoint-2")]) == 0
    for name in ("traces.jsonl", "metrics.jsonl"):
        assert untimed(read_jsonl(c / name)) == untimed(read_jsonl(a / name)), name
    assert (c / "latest").read_text().strip() == "checkpoint-4"


@pytest.mark.slow
def test_resuming_an_older_checkpoint_inside_its_own_run_is_refused_and_changes_nothing(tmp_path, capsys):
    a = tmp_path / "a"
    assert _train(a, "run.steps=3", "checkpoint.every=1", "checkpoint.keep_last=3") == 0
    held = _files(a)
    capsys.readouterr()
    assert _train(a, "run.steps=3", "checkpoint.every=1", extra=["--resume", str(a / "checkpoint-1")]) == 2
    err = capsys.readouterr().err.strip()
    assert "checkpoint-1 is older than checkpoint-2, checkpoint-3 in" in err and "into a new folder" in err
    assert _files(a) == held


@pytest.mark.slow
def test_a_resume_notices_a_changed_data_file_and_a_dtype_that_auto_would_change(tmp_path, capsys):
    """The resume rule compares `auto` by what it decides (float32 here) and the training rows by count and
    content (the same path, other rows)."""
    rows = (ROOT / "data" / "task" / "train.jsonl").read_text().splitlines()[:40]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(rows) + "\n")
    out = tmp_path / "run"
    assert _train(out, "run.steps=3", f"data.train={data}", extra=["--stop-after", "1"]) == 0
    capsys.readouterr()
    data.write_text("\n".join(rows[:30]) + "\n")
    assert _train(out, "run.steps=3", f"data.train={data}", extra=["--resume", "latest"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"docuchat-rl: error: data.train {data} changed since checkpoint-1 was written (40 rows "
                          "then, 30 now)") and "\n" not in err
    data.write_text("\n".join([rows[1], rows[0], *rows[2:]]) + "\n")  # the same rows, two swapped
    assert _train(out, "run.steps=3", f"data.train={data}", extra=["--resume", "latest"]) == 2
    assert "(the same 40 rows, other content)" in capsys.readouterr().err
    data.write_text("\n".join(rows) + "\n")
    mixed = tmp_path / "mixed"
    assert _train(mixed, "run.steps=3", f"data.train={data}", "model.dtype=bf16-mixed", extra=["--stop-after", "1"]) == 0
    capsys.readouterr()
    assert _train(mixed, "run.steps=3", f"data.train={data}", extra=["--resume", "latest"]) == 2  # auto: float32
    err = capsys.readouterr().err
    assert "model.dtype='bf16-mixed' -> 'float32'" in err
    assert _train(out, "run.steps=3", f"data.train={data}", "model.dtype=float32", extra=["--resume", "latest"]) == 0


@pytest.mark.slow
def test_the_evaluation_before_training_is_written_at_once_and_survives_a_stop_and_resume(tmp_path):
    out = tmp_path / "run"
    sets = ["run.steps=2", "eval.before_and_after=true", "eval.limit=4", "eval.max_new_tokens=8"]
    assert _train(out, *sets, extra=["--stop-after", "1"]) == 0
    before = json.loads((out / "eval.json").read_text())
    assert set(before) == {"before"} and before["before"]["rows"] == 4
    assert _train(out, *sets, extra=["--resume", "latest"]) == 0
    report = json.loads((out / "eval.json").read_text())
    assert report["before"] == before["before"] and report["after"]["rows"] == 4


@pytest.mark.slow
def test_commands_write_only_files_they_create(tmp_path, capsys):
    """rescore --out onto the run's own traces (it used to overwrite them), or onto any existing file; audit
    --export/--html and eval --out onto an existing file: refused in one line, the file as it was."""
    run = tmp_path / "run"
    assert _train(run, "run.steps=1") == 0
    traces = (run / "traces.jsonl").read_bytes()
    capsys.readouterr()
    assert main(["rescore", str(run), "--out", str(run / "traces.jsonl")]) == 2
    assert "is a file of the training run" in capsys.readouterr().err
    assert (run / "traces.jsonl").read_bytes() == traces
    out = tmp_path / "rescored.jsonl"
    assert main(["rescore", str(run), "--out", str(out)]) == 0
    first = out.read_bytes()
    capsys.readouterr()
    for argv in (["rescore", str(run), "--out", str(out)], ["audit", str(run), "--export", str(out)],
                 ["audit", str(run), "--html", str(out)], ["eval", "--out", str(out)]):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.endswith("already exists: give a new file name (nothing is overwritten)") and "\n" not in err
        assert out.read_bytes() == first


@pytest.mark.slow
def test_a_keyboard_interrupt_raised_by_a_reward_is_said_to_be_no_signal(tmp_path, capsys):
    """It used to read "stopped at once by a second signal" (exit 130): no signal was sent."""
    from . import user_rewards

    user_rewards._CALLS["raises_keyboard_interrupt"] = 0
    out = tmp_path / "run"
    assert _train(out, "run.steps=3", "checkpoint.every=1", "rewards=[{name: correctness}, "
                  "{name: 'tests.user_rewards:raises_keyboard_interrupt', weight: 0}]") == 2  # (step 2 raises)
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("docuchat-rl: error: KeyboardInterrupt raised in ") and "user_rewards.py" in err
    assert "not by a signal" in err and "(checkpoint-1) is intact; resume with: docuchat-rl train" in err
    assert "\n" not in err


def test_without_a_terminal_progress_is_plain_lines_and_loading_prints_no_bar(tmp_path):
    """A log file gets one line per reported step, never a progress bar's carriage-return frames, and no
    "Loading weights" bar from transformers."""
    out = tmp_path / "run"
    args = ["train", "--set", f"run.output_dir={out}", "--set", "run.steps=3", "--set", "rollout.prompts_per_step=2",
            "--set", "rollout.num_generations=2", "--set", "rollout.max_new_tokens=8",
            "--set", "eval.before_and_after=false", "--set", "logging.progress=true"]
    done = subprocess.run([sys.executable, "-m", "docuchat_rl", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "\r" not in done.stderr and "Loading weights" not in done.stderr
    lines = [x for x in done.stderr.splitlines() if x.startswith("train step")]
    assert [x.split(":")[0] for x in lines] == ["train step 1/3", "train step 2/3", "train step 3/3"]
    assert all("reward " in x and "train_acc " in x and "tok/s " in x for x in lines)


@pytest.mark.parametrize("command", ["eval", "generate", "rescore"])
def test_what_a_plugin_prints_never_reaches_a_commands_machine_output(tmp_path, capsys, command):
    """A reward that prints while it scores: every command that writes JSON for a machine keeps its stdout
    pure (each line parses), the plugin's line goes to stderr."""
    reward = "--set", "rewards=[{name: correctness}, {name: 'tests.user_rewards:chatty', weight: 0.5}]"
    if command == "rescore":
        run = tmp_path / "run"
        assert main(["train", "--set", "run.steps=1", "--set", f"run.output_dir={run}", "--set", "rollout.prompts_per_step=2",
                     "--set", "rollout.num_generations=2", "--set", "rollout.max_new_tokens=8",
                     "--set", "eval.before_and_after=false", "--set", "logging.progress=false", *reward]) == 0
        capsys.readouterr()
        argv = ["rescore", str(run), "--json"]
    elif command == "eval":
        argv = ["eval", "--set", "eval.limit=4", "--set", "eval.max_new_tokens=8", *reward]
    else:
        argv = ["generate", "--held-out", "2", "--max-new-tokens", "8", "--score", "--json", *reward]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    if command == "eval":
        assert json.loads(out)["rows"] == 4
    else:
        assert all(json.loads(line) for line in out.splitlines())
    assert "scoring" not in out and "scoring" in err


def test_an_adapter_and_a_recipe_naming_different_models_is_one_line(tmp_path, capsys):
    """The model named by two sources (the adapter's own recipe, --config): never one picked silently."""
    run = tmp_path / "run"
    assert main(["train", "--set", "run.steps=1", "--set", f"run.output_dir={run}", "--set", "rollout.prompts_per_step=2",
                 "--set", "rollout.num_generations=2", "--set", "rollout.max_new_tokens=4",
                 "--set", "eval.before_and_after=false", "--set", "logging.progress=false"]) == 0
    capsys.readouterr()
    assert main(["eval", "--adapter", str(run), "--config", str(ROOT / "config/smollm2.yaml")]) == 2
    err = capsys.readouterr().err.strip()
    assert "was trained on model 'data/model', and the recipe here names" in err and "\n" not in err
    assert main(["eval", "--adapter", str(run), "--config", str(ROOT / "config/default.yaml"), "--set",
                 f"model.name_or_path={ROOT / 'data' / 'model'}", "--set", "eval.limit=2"]) == 0  # (the same folder)


def test_version_is_the_installed_packages(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"docuchat-rl {version('docuchat-rl')}"
    assert (ROOT / "LICENSE").read_text().lstrip().startswith("Apache License")


def test_every_command_that_scores_names_a_reward_that_failed_or_gave_no_value(tmp_path):
    """train (its steps and its evaluations), eval, rescore and generate --score: a component with no value (None
    on every completion) and one that fails are each named in one warning line with their counts."""
    import subprocess

    rewards = "rewards=[{name: correctness}, {name: 'tests.user_rewards:always_none'}, {name: 'tests.user_rewards:raises'}]"
    sets = ["--set", rewards, "--set", "eval.limit=4", "--set", "eval.max_new_tokens=8", "--set", "run.steps=1",
            "--set", "rollout.max_new_tokens=8", "--set", f"run.output_dir={tmp_path / 'r'}", "--set",
            "logging.progress=false"]

    def run(*args):
        done = subprocess.run([sys.executable, "-m", "docuchat_rl", *args], cwd=ROOT, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-1500:]
        return done.stderr

    said = run("train", *sets)
    assert "reward 'tests.user_rewards:always_none' gave no value (None) for 64 of 64 completions of step 1" in said
    assert "reward 'tests.user_rewards:raises' failed on 4 of 4 held-out completions (first error: RuntimeError: boom)" in said
    said = run("eval", *sets)
    assert "reward 'tests.user_rewards:always_none' gave no value (None) for 4 of 4 held-out completions" in said
    said = run("rescore", str(tmp_path / "r"), "--set", rewards)
    assert "gave no value (None) for 64 of 64 rescored completions" in said and "failed on 64 of 64" in said
    said = run("generate", "--held-out", "2", "--score", *sets)
    assert "reward 'tests.user_rewards:always_none' gave no value (None) for 2 of 2 completions" in said
