"""Faults with the real mechanisms: SIGKILL soak, SIGTERM/SIGINT preemption, an injected non-finite
loss, an unwritable folder, a real file-size limit mid-checkpoint and mid-trace, damaged checkpoints,
and the one-run-per-folder lock."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from docuchat_rl.checkpoint import resolve_resume, verify_checkpoint
from docuchat_rl.errors import CheckpointError, CheckpointWarning
from docuchat_rl.outputs import read_jsonl
from docuchat_rl.trainer import Trainer, TrainingError

from .conftest import ROOT
from .test_trainer import FAST, cfg_for, untimed


def _cli(out, *sets, resume=False):
    args = [sys.executable, "-m", "docuchat_rl", "train", "--config", str(ROOT / "config" / "default.yaml")]
    for s in FAST + [f"run.output_dir={out}", *sets]:
        args += ["--set", s]
    return args + (["--resume", "latest"] if resume else [])


def _start_long_run(out, *sets):
    """A 200-step CLI run checkpointing every step, once its first checkpoint exists."""
    proc = subprocess.Popen(_cli(out, "run.steps=200", "checkpoint.every=1", *sets), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _wait_for(lambda: (out / "latest").exists(), proc)
    return proc


def _wait_for(predicate, proc, seconds=120):
    deadline = time.time() + seconds
    while time.time() < deadline and proc.poll() is None and not predicate():
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    assert predicate()


def _metric_lines(path):
    return len(read_jsonl(path)) if path.exists() else 0


@pytest.mark.slow
def test_fault_soak_short_version():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "fault_soak.py"), "--kills", "2", "--steps", "5",
                          "--json"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["ok"], res
    assert res["kills"] == 2 and res["records_lost"] == res["records_doubled"] == 0
    assert res["traces_identical"] and res["metrics_identical"] and res["adapter_identical"]


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT], ids=["SIGINT"])  # (SIGTERM: the test below; one handler serves both)
def test_preemption_stops_at_a_safe_point_checkpoints_and_resumes_exactly(tmp_path, sig):
    """A signal mid-run: the last finished step is checkpointed (checkpoint.every is far away), the exit
    message gives the resume command, and the resumed run equals an uninterrupted one."""
    full, cut = tmp_path / "full", tmp_path / "cut"
    opts = ["run.steps=6", "checkpoint.every=100"]
    t = Trainer(cfg_for(full, *opts))
    t.train()
    t.close()
    proc = subprocess.Popen(_cli(cut, *opts), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _wait_for(lambda: _metric_lines(cut / "metrics.jsonl") >= 2, proc)
    proc.send_signal(sig)
    proc.wait(timeout=120)
    err = proc.stderr.read().decode()
    assert proc.returncode == 128 + sig, err[-2000:]
    assert f"stopped by {sig.name} after step" in err and "resume with: docuchat-rl train" in err
    assert err.strip().splitlines()[-1].endswith("--resume latest")
    latest = resolve_resume("latest", cut)
    state = json.loads((latest / "trainer_state.json").read_text())
    assert state["step"] >= 2 and verify_checkpoint(latest) is None
    assert _metric_lines(cut / "metrics.jsonl") == state["step"]  # nothing beyond the checkpoint was written
    t = Trainer(cfg_for(cut, *opts), resume="latest")
    t.train()
    t.close()
    for name in ("traces.jsonl", "metrics.jsonl"):
        assert untimed(read_jsonl(cut / name)) == untimed(read_jsonl(full / name))


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM], ids=["SIGTERM"])  # (SIGINT: the test above)
def test_a_second_signal_stops_at_once_leaving_the_last_checkpoint_valid(tmp_path, sig):
    """The second signal lands while the first waits for its safe point (a reward that takes 2 s per step); the
    exit code is 128 + that signal's number (SIGTERM's used to be 130)."""
    out = tmp_path / "run"
    proc = _start_long_run(out, "rewards=[{name: correctness}, {name: 'tests.user_rewards:slow', weight: 0}]")
    proc.send_signal(sig)
    seen = b""
    while f"{sig.name} received".encode() not in seen:  # (two signals sent at once would arrive as one)
        seen += proc.stderr.readline()
    proc.send_signal(sig)
    proc.wait(timeout=60)
    err = proc.stderr.read().decode()
    assert proc.returncode == 128 + sig and "Traceback" not in err, err[-2000:]
    latest = resolve_resume("latest", out)
    assert err.strip().splitlines()[-1].startswith(f"docuchat-rl: stopped at once by a second signal ({sig.name}); "
                                                   f"the last checkpoint ({latest.name}) is intact; resume with: "
                                                   "docuchat-rl")
    assert verify_checkpoint(latest) is None
    state = json.loads((latest / "trainer_state.json").read_text())
    t = Trainer(cfg_for(out, f"run.steps={state['step'] + 1}", "rewards=[{name: correctness}, "
                        "{name: 'tests.user_rewards:slow', weight: 0}]"), resume="latest")
    t.train()
    t.close()
    keys = [(r["step"], r["group"], r["sample"]) for r in read_jsonl(out / "traces.jsonl")]
    assert len(keys) == len(set(keys)) == (state["step"] + 1) * 8


def test_non_finite_steps_are_skipped_counted_and_bounded(tmp_path):
    """A reward whose weighted total overflows float32 (inf) makes the advantages and the loss NaN: the
    optimizer step is skipped without touching weights or optimizer state; K in a row stop the run."""
    huge = "rewards=[{name: 'tests.user_rewards:huge', weight: 10.0}, {name: correctness}]"
    t = Trainer(cfg_for(tmp_path / "skip", huge, "run.steps=2", "optim.max_nonfinite_steps=10"))
    before = {n: p.detach().clone() for n, p in t.learner.model.named_parameters() if p.requires_grad}
    history = t.train()
    t.close()
    assert [m["nonfinite_skipped"] for m in history] == [1, 1]
    assert all(m["optimizer_steps"] == 0 and m["loss"] is None for m in history)
    after = dict(t.learner.model.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)  # no weight moved
    assert not t.learner.optimizer.state_dict()["state"]  # no optimizer state was created
    t = Trainer(cfg_for(tmp_path / "stop", huge, "run.steps=5", "optim.max_nonfinite_steps=2",
                        "checkpoint.every=1"))
    with pytest.raises(TrainingError, match=r"step 2: 2 optimizer steps in a row had a non-finite") as e:
        t.train()
    t.close()
    assert "\n" not in str(e.value)
    assert verify_checkpoint(resolve_resume("latest", tmp_path / "stop")) is None  # checkpoint-1 stays valid


@pytest.mark.parametrize("where", ["/proc/docuchat-rl-run", "file"])
def test_an_unusable_output_folder_fails_before_the_model_loads(tmp_path, where, monkeypatch):
    import docuchat_rl.run as run_mod

    def no_load(*a, **k):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(run_mod, "load_configured", no_load)
    if where == "file":  # a parent that is a file: cannot be created
        (tmp_path / "a-file").write_text("x")
        where = str(tmp_path / "a-file" / "run")
    with pytest.raises(TrainingError, match=r"run.output_dir .* is not writable") as e:
        Trainer(cfg_for(where))
    assert "\n" not in str(e.value)


_FSIZE = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG instead of killing
resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
from docuchat_rl.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_full_disk_mid_checkpoint_leaves_the_previous_checkpoint_and_one_line(tmp_path):
    out = tmp_path / "run"
    t = Trainer(cfg_for(out, "run.steps=2", "checkpoint.every=1"))
    t.train()
    t.close()
    first = out / "checkpoint-2"
    sizes = sorted(p.stat().st_size for p in first.iterdir() if p.is_file())
    limit = (sizes[-1] + sizes[-2]) // 2  # the largest checkpoint file no longer fits; traces still do
    args = _cli(out, "run.steps=4", "checkpoint.every=1", resume=True)[3:]  # drop "python -m docuchat_rl"
    proc = subprocess.run([sys.executable, "-c", _FSIZE.format(limit=limit), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    err = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert err[-1].startswith("docuchat-rl: error: could not write checkpoint-3") and "intact" in err[-1]
    assert (out / "latest").read_text().strip() == "checkpoint-2" and verify_checkpoint(first) is None
    t = Trainer(cfg_for(out, "run.steps=4", "checkpoint.every=1"), resume="latest")
    t.train()
    t.close()
    keys = [(r["step"], r["group"], r["sample"]) for r in read_jsonl(out / "traces.jsonl")]
    assert len(keys) == len(set(keys)) == 4 * 8


def test_a_failed_trace_write_leaves_no_partial_line(tmp_path):
    code = f"""
import resource, signal
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (5000, 5000))
from docuchat_rl.outputs import JsonlWriter
w = JsonlWriter({str(tmp_path / 't.jsonl')!r})
n = 0
try:
    while True:
        w.write([{{"step": n, "text": "x" * 300}}, {{"step": n, "text": "y" * 300}}])
        n += 1
except OSError as e:
    print(n, e.errno)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    steps, errno = map(int, out.stdout.split())
    data = (tmp_path / "t.jsonl").read_bytes()
    assert errno == 27 and steps > 0 and len(data) < 5000  # EFBIG, after some complete writes
    assert data.endswith(b"\n") and len(data.splitlines()) == 2 * steps  # whole steps only
    assert all(json.loads(line) for line in data.splitlines())


def test_resume_skips_a_damaged_newest_checkpoint_with_a_warning(tmp_path):
    out = tmp_path / "run"
    t = Trainer(cfg_for(out, "run.steps=3", "checkpoint.every=1", "checkpoint.keep_last=3"))
    t.train()
    t.close()
    with open(out / "checkpoint-3" / "adapter_model.safetensors", "r+b") as f:
        f.truncate(100)
    with pytest.warns(CheckpointWarning, match=r"resuming from checkpoint-2.*checkpoint-3/adapter_model"
                                               r".safetensors has 100 bytes"):
        assert resolve_resume("latest", out) == out / "checkpoint-2"
    (out / "checkpoint-2" / "optimizer.bin").unlink()
    (out / "checkpoint-1" / "trainer_state.json").write_text("{}")
    with pytest.raises(CheckpointError, match="no intact checkpoint to resume") as e:
        resolve_resume("latest", out)
    assert "checkpoint-2/optimizer.bin is missing" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(CheckpointError, match="cannot resume from .*checkpoint-1: .*trainer_state.json has 2 bytes"):
        resolve_resume(str(out / "checkpoint-1"), out)


@pytest.mark.slow
def test_one_live_run_per_folder_and_no_stale_lock_after_kill_9(tmp_path):
    out = tmp_path / "run"
    proc = _start_long_run(out)
    with pytest.raises(TrainingError, match=rf"is in use by a live run \(pid {proc.pid}\)") as e:
        Trainer(cfg_for(out), resume="latest")
    assert "\n" not in str(e.value)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    t = Trainer(cfg_for(out, "run.steps=200"), resume="latest")  # the killed run's lock is gone
    t.close()


@pytest.mark.slow
def test_a_signal_before_the_first_step_finished_says_nothing_was_trained_and_the_same_command_starts_again(
        tmp_path, monkeypatch):
    """SIGINT while step 1 is scored: no checkpoint exists, so no `--resume latest` is offered (it would fail);
    the same command then starts the run."""
    out, mark = tmp_path / "run", tmp_path / "scoring"
    args = _cli(out, "run.steps=2", "rewards=[{name: correctness}, {name: 'tests.user_rewards:slow_marked', weight: 0}]")
    proc = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            env={**os.environ, "DOCUCHAT_TEST_MARK": str(mark)})
    _wait_for(mark.exists, proc)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    err = proc.stderr.read().decode()
    assert proc.returncode == 130, err[-2000:]
    assert err.strip().splitlines()[-1] == ("docuchat-rl: stopped by SIGINT after step 0; no step had finished; "
                                            "nothing was trained: run the same command to start again")
    monkeypatch.setenv("DOCUCHAT_TEST_MARK", str(mark))
    from docuchat_rl.cli import main

    threads = torch.get_num_threads()
    try:  # the same command, in this process (a new interpreter spends ~8 s importing)
        assert main(args[3:]) == 0
    finally:
        torch.set_num_threads(threads)
    assert (out / "latest").read_text().strip() == "checkpoint-2"
