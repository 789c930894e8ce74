"""rollout.async_lag: step t trains on completions sampled by the adapter after step t-1-k, checked against
each step sampled again from that version's checkpoint; the ratio is taken against the sampler; a run
resumes exactly; what is not built is refused in one line."""

import contextlib

import pytest
import torch

from docuchat_rl.config import ConfigError
from docuchat_rl.data import render_prompt
from docuchat_rl.modeling import merged_adapter
from docuchat_rl.outputs import read_jsonl
from docuchat_rl.sampling.generation import generate
from docuchat_rl.sampling.rollout import Timer
from docuchat_rl.tools.inference import load_policy
from docuchat_rl.trainer import Trainer

from .conftest import train_here
from .test_trainer import cfg_for, untimed

LAG = ["run.steps=5", "checkpoint.every=1", "checkpoint.keep_last=10", "rollout.async_lag=2"]


def _run(out, *extra):
    t = Trainer(cfg_for(out, *LAG, *extra))
    history = t.train()
    t.close()
    return history


@pytest.mark.slow
def test_each_step_is_sampled_by_the_adapter_of_step_t_minus_1_minus_lag(tmp_path):
    history = _run(tmp_path)
    assert [m["async/lag"] for m in history] == [0, 1, 2, 2, 2]
    traces = read_jsonl(tmp_path / "traces.jsonl")
    cfg = cfg_for(tmp_path, *LAG).for_device("cpu")
    r = cfg.rollout
    for step in range(1, 6):
        version = max(0, step - 3)
        rows = [t for t in traces if t["step"] == step]
        assert {t["policy_version"] for t in rows} == {version}
        if version == 0:  # the initial adapter (B = 0): the base model's distribution
            model, tok = load_policy(cfg.model, None)
            ctx = contextlib.nullcontext()
        else:
            model, tok = load_policy(cfg.model, tmp_path / f"checkpoint-{version}")
            ctx = merged_adapter(model)
        groups = [rows[i] for i in range(0, len(rows), r.num_generations)]
        prompts = [render_prompt(tok, g["prompt"], cfg.data.system_prompt) for g in groups]
        with ctx:
            gen = generate(model, tok, prompts, max_new_tokens=r.max_new_tokens, do_sample=True,
                           temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                           num_return_sequences=r.num_generations,
                           loop="fast", row_seeds=[t["seed"] for t in rows], grouped_decode=True,
                           batch_size=r.generation_batch_size)
        assert gen.completion_ids == [t["completion_ids"] for t in rows], step
        if step == 4:  # a tampered token's log-prob at the divergence is the sampling version's (1), not 3's
            from docuchat_rl.learning.batch import build_batch
            from docuchat_rl.learning.forward import policy_forward
            from docuchat_rl.tools.replay import replay

            line = next(t for t in rows if len(t["completion_ids"]) > 3)
            line["completion_ids"][2] = (line["completion_ids"][2] + 7) % 100
            (got,) = replay(tmp_path, [line], progress=False, say=lambda s: None)
            batch = build_batch([gen.prompt_ids[rows.index(line)]], [line["completion_ids"]], [0.0], [0],
                                tok.pad_token_id)
            with torch.no_grad():
                want = policy_forward(model, batch, temperature=r.temperature).logps[0, 2]
            assert got.diverges_at == 2 and got.traced_logp == pytest.approx(float(want), abs=1e-4)
    assert history[0]["async/kl_sampler_learner"] < 1e-8  # step 1: the sampler is the learner
    assert min(m["async/kl_sampler_learner"] for m in history[2:]) > 1e-5  # behind: the gap the ratio sees

    # decoupled PPO: the ratio is taken against the proximal policy (the learner at the step's start: with one
    # update per rollout the policy itself, ratio 1), so even a tight clip never bites; the lag enters through
    # the behaviour weight pi_prox / pi_sampler, 1 while they agree, away from 1 once the learner moved on
    tight = _run(tmp_path / "tight", "algorithm.epsilon_low=0.001", "algorithm.epsilon_high=0.001")
    assert all(m["clip_low"] + m["clip_high"] == 0 for m in tight)
    assert tight[0]["sampler/weight_mean"] == pytest.approx(1.0, abs=1e-6)
    assert min(abs(m["sampler/weight_mean"] - 1.0) + m["sampler/capped_share"] for m in tight[2:]) > 1e-5


@pytest.mark.slow
def test_a_lagged_run_stopped_and_resumed_equals_the_uninterrupted_one(tmp_path):
    full, cut = tmp_path / "full", tmp_path / "cut"
    _run(full, "algorithm.num_iterations=2", "optim.minibatch_size=4")
    t = Trainer(cfg_for(cut, *LAG, "algorithm.num_iterations=2", "optim.minibatch_size=4"))
    t.train(stop_after=3)
    t.close()
    assert sorted(p.name for p in (cut / "checkpoint-3" / "lagged").iterdir()) == ["adapter-v1.safetensors",
                                                                                  "adapter-v2.safetensors"]
    t = Trainer(cfg_for(cut, *LAG, "algorithm.num_iterations=2", "optim.minibatch_size=4"), resume="latest")
    t.train()
    t.close()
    for name in ("traces.jsonl", "metrics.jsonl"):
        assert untimed(read_jsonl(cut / name)) == untimed(read_jsonl(full / name)), name


def test_under_a_fixed_lag_the_ratio_is_clipped_against_the_proximal_policy_in_eval_mode(tmp_path):
    """Decoupled PPO: with several updates per rollout the old log-probs are the learner's at the step's start
    (a forward, in eval mode: LoRA dropout off, whichever process sampled), not the sampler's; the sampler's
    enter only through the behaviour weight. They used to be the sampler's, and the worker path ran this pass
    in train mode."""
    t = Trainer(cfg_for(tmp_path, *LAG, "algorithm.num_iterations=2", "lora.dropout=0.5", "run.steps=3"))
    t.train(stop_after=2)  # (the sampling policy now trails the learner by one update)
    rollout = t.collect(Timer())
    batch = t.prepare(rollout)
    t.learner.model.train()  # (as the previous update leaves it)
    t.learner.score_rollout(batch)
    first = batch.old_logps.clone()
    t.learner.score_rollout(batch)
    m = batch.completion_mask
    assert torch.equal(first, batch.old_logps)  # eval mode: the same numbers twice under LoRA dropout 0.5
    gap = ((first - batch.sampler_logps).abs() * m).sum() / m.sum()
    assert gap > 1e-4  # the learner's own log-probs, one update ahead of the sampler's
    t.close()


def test_what_a_fixed_lag_does_not_support_yet_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="rollout.async_lag cannot be used with rollout.dynamic_sampling"):
        cfg_for(tmp_path, "rollout.async_lag=1", "rollout.dynamic_sampling=true")
    with pytest.raises(ConfigError, match="rollout.async_worker_threads and rollout.async_timeout_s apply to "
                                          "rollout.async_lag >= 1"):
        cfg_for(tmp_path, "rollout.async_worker_threads=1")


WORKER = ["rollout.async_lag=1", "rollout.async_worker_threads=1", "run.steps=8", "checkpoint.every=1"]


def _cli(out, *sets, resume=False):
    import sys

    args = [sys.executable, "-m", "docuchat_rl", "train"]
    for s in [*FAST_CLI, f"run.output_dir={out}", *sets]:
        args += ["--set", s]
    return args + (["--resume", "latest"] if resume else [])


FAST_CLI = ["rollout.prompts_per_step=2", "rollout.num_generations=4", "rollout.max_new_tokens=24",
            "logging.progress=false", "eval.before_and_after=false", "run.threads=1"]


def _here(out, *sets, resume=False):
    """What `_cli(out, *sets, resume=resume)` runs, in this process."""
    train_here(None, [*FAST_CLI, f"run.output_dir={out}", *sets], resume="latest" if resume else None)


def _worker_pid(learner: int) -> int:
    """The sampler worker among the learner's children (spawn also starts a resource tracker)."""
    import time
    from pathlib import Path

    deadline = time.time() + 60
    while time.time() < deadline:
        for child in Path(f"/proc/{learner}/task/{learner}/children").read_text().split():
            cmd = Path(f"/proc/{child}/cmdline").read_bytes()
            if b"spawn_main" in cmd and b"resource_tracker" not in cmd:
                return int(child)
        time.sleep(0.1)
    raise AssertionError("no worker process")


@pytest.mark.slow
def test_the_worker_samples_what_the_learner_s_process_samples_and_a_killed_side_resumes_exactly(tmp_path):
    """The worker process (overlapping the update) gives the completions of the in-process reference and the
    same losses to float noise; kill -9 of the worker is one line, kill -9 of the learner takes the worker
    with it, SIGTERM to the process group stops the learner at a checkpoint; after all three, --resume gives
    the uninterrupted run's traces and metrics."""
    import math
    import os
    import signal
    import subprocess
    import time

    from .conftest import ROOT

    ref, full = tmp_path / "inline", tmp_path / "worker"
    _here(ref, *WORKER, "rollout.async_worker_threads=0")  # (the cuts below need the CLI's own processes)
    _here(full, *WORKER)
    a, b = read_jsonl(ref / "traces.jsonl"), read_jsonl(full / "traces.jsonl")
    assert [t["completion_ids"] for t in a] == [t["completion_ids"] for t in b]
    for x, y in zip(read_jsonl(ref / "metrics.jsonl"), read_jsonl(full / "metrics.jsonl")):
        assert x["async/lag"] == y["async/lag"] and math.isclose(x["loss"], y["loss"], rel_tol=1e-4, abs_tol=1e-7)
    worked = read_jsonl(full / "metrics.jsonl")
    assert max(m["time/rollout"] for m in worked[2:]) < 0.5  # sampled while updating
    # tokens/s over the worker's own sampling seconds (not over the learner's wait, which is ~0): those seconds
    # outlast the wait once sampling overlaps the update (no fixed floor: 2 x 4 rows of 24 tokens took 0.07-0.17 s
    # here after the leaner decode step of 2026-11-29, under 0.05 s on a fast moment)
    inline = read_jsonl(ref / "metrics.jsonl")
    assert all(m["rollout_sampler_s"] > 0 for m in worked) and "rollout_sampler_s" not in inline[0]
    assert all(m["rollout_sampler_s"] > m["time/rollout"] for m in worked[2:])
    assert max(m["rollout_tokens_per_s"] for m in worked) < 20 * max(m["rollout_tokens_per_s"] for m in inline)
    from docuchat_rl.tools.replay import replay  # a worker run replays with its worker (same threads, same numbers)

    lines = [t for t in b if t["step"] in (2, 4)][::5]
    assert all(r.same for r in replay(full, lines, progress=False, say=lambda s: None))

    # The three cuts in one run, each resume cut again further on (two CLI processes fewer than a run per cut):
    # SIGTERM to the whole process group (as Slurm sends it), then kill -9 of the worker, then of the learner,
    # each once the process has written a checkpoint of its own; then a last resume to the end (8 steps: room
    # for each cut to land a step or two late).
    cut = tmp_path / "cut"
    for side, after in (("group", 1), ("worker", 2), ("learner", 1)):
        done = max((int(c.name.split("-")[1]) for c in cut.glob("checkpoint-*") if c.name.split("-")[1].isdigit()),
                   default=0)  # (the newest whole checkpoint: a killed write leaves checkpoint-N.tmp)
        proc = subprocess.Popen(_cli(cut, *WORKER, resume=done > 0), cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, start_new_session=True)
        worker = _worker_pid(proc.pid)
        if side == "group":  # (first to the worker alone: it ignores both, as a group's signal reaches it too)
            for sig in (signal.SIGTERM, signal.SIGINT):
                os.kill(worker, sig)
        while not (cut / f"checkpoint-{done + after}").exists() and proc.poll() is None:
            time.sleep(0.05)
        assert proc.poll() is None, f"the run ended before the {side} was cut"
        if side == "group":
            assert open(f"/proc/{worker}/stat", "rb").read().split()[2] not in (b"Z", b"X"), "the worker died"
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            os.kill(worker if side == "worker" else proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
        err = proc.stderr.read().decode()
        if side == "group":  # the worker ignores it: the learner stops at its safe point with a checkpoint
            line = err.strip().splitlines()[-1]
            assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err[-1500:]
            assert line.startswith("docuchat-rl: stopped by SIGTERM after step ") and "holds it; resume with" in line
        elif side == "worker":
            line = err.strip().splitlines()[-1]
            assert proc.returncode == 2 and line.startswith("docuchat-rl: error: the sampler worker (pid ") \
                and "died (signal 9) while sampling step" in line and "Traceback" not in err, err[-1500:]
        else:
            for _ in range(100):  # (PR_SET_PDEATHSIG: the worker goes with its learner)
                try:
                    if open(f"/proc/{worker}/stat", "rb").read().split()[2] == b"Z":  # (a zombie: dead)
                        break
                except FileNotFoundError:  # (gone)
                    break
                time.sleep(0.1)
            else:
                raise AssertionError("the worker outlived its learner")
    _here(cut, *WORKER, resume=True)
    for name in ("traces.jsonl", "metrics.jsonl"):
        assert untimed(read_jsonl(cut / name)) == untimed(read_jsonl(full / name)), name


@pytest.mark.slow
def test_a_stuck_worker_ends_the_run_in_one_line_naming_the_step_and_version(tmp_path):
    import os
    import signal
    import subprocess
    import time

    from .conftest import ROOT

    out = tmp_path / "run"
    proc = subprocess.Popen(_cli(out, *WORKER, "rollout.async_timeout_s=3"), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    worker = _worker_pid(proc.pid)
    while not (out / "checkpoint-1").exists() and proc.poll() is None:
        time.sleep(0.05)
    os.kill(worker, signal.SIGSTOP)  # alive, and silent
    try:
        proc.wait(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):  # (the learner kills it as it leaves)
            os.kill(worker, signal.SIGKILL)
    err = proc.stderr.read().decode()
    line = err.strip().splitlines()[-1]
    assert proc.returncode == 2 and "did not deliver step" in line and "(adapter version" in line \
        and "within rollout.async_timeout_s (3 s)" in line and "Traceback" not in err, err[-1500:]
