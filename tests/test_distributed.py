"""Data-parallel training on 2 CPU processes (torchrun, gloo) against 1 process: the same completions,
rewards and advantages (under dynamic sampling too), metrics equal to float tolerance, the same learning
rate at every step, the same held-out numbers from a sharded evaluation, and a 2-process stop-and-resume
equal to an uninterrupted 2-process run.

Tolerance: metrics within 1e-5 relative or 1e-6 absolute. Two processes sum gradients, token counts and
metric sums in another order and pad their micro-batches to other widths, so per-token log-probs differ
by ~1e-6 (measured: entropy and grad norm agree to ~1e-7 relative); quantities that are themselves float
noise (the GRPO loss at mu = 1, about 1e-8; the sampler mismatch, about 3e-7, up to 3e-6 under FSDP2, which
runs without the shared-prompt forward) are compared absolutely, at 1e-6 and 1e-5."""

import math
import shutil
import subprocess
import sys

import pytest

from docuchat_rl.outputs import read_jsonl
from docuchat_rl.trainer import MEASURED

from .conftest import ROOT, train_here

SHORT = ["rollout.prompts_per_step=4", "rollout.num_generations=4", "rollout.max_new_tokens=24",
         "logging.progress=false", "eval.before_and_after=false", "run.threads=1"]


FSDP2 = ROOT / "config" / "accelerate" / "fsdp2_cpu_2_processes.yaml"


def _train(out, procs, *sets, recipe="default", resume=False, check=True, fsdp=False, stop_after=None):
    # (a free port each, --standalone and --main_process_port 0: never port 29500 of another launch on the machine)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(procs)] \
        if procs > 1 else [sys.executable]
    if fsdp:  # the shipped accelerate config, through accelerate's own launcher
        assert procs == 2
        launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(FSDP2),
                    "--main_process_port", "0"]
    args = [*launcher, "-m", "docuchat_rl", "train", "--config", str(ROOT / "config" / f"{recipe}.yaml")]
    for s in [*SHORT, f"run.output_dir={out}", *sets]:
        args += ["--set", s]
    args += ["--resume", "latest"] if resume else []
    args += ["--stop-after", str(stop_after)] if stop_after else []
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """`launched(procs, *sets, **kw)` -> (folder, stderr) of a finished `_train` run with those arguments, made
    once per module and shared by the tests that read it (a launch costs ~12 s, mostly imports). Read-only:
    a test that goes on from it (resume) works on a `_copy`."""
    runs = {}

    def get(procs, *sets, **kw):
        kw = {"recipe": "default", "fsdp": False, "stop_after": None, **kw}  # (a default left out is the same run)
        key = (procs, sets, tuple(sorted(kw.items())))
        if key not in runs:
            out = tmp_path_factory.mktemp("launched") / "run"
            runs[key] = (out, _train(out, procs, *sets, **kw).stderr) if procs > 1 else (_train_here(out, *sets, **kw), "")
        return runs[key]

    return get


def _train_here(out, *sets, recipe="default", stop_after=None, fsdp=False):
    """What `_train(out, 1, ...)` runs, in this process."""
    assert not fsdp  # (FSDP2 needs its launcher)
    train_here(ROOT / "config" / f"{recipe}.yaml", [*SHORT, f"run.output_dir={out}", *sets], stop_after=stop_after)
    return out


def _copy(run, to):
    return shutil.copytree(run, to, symlinks=True)


def _schedule(sets, total):
    """The learning rate after each of `total` optimizer steps, straight from transformers' scheduler."""
    import torch
    from transformers import get_scheduler

    warmup = int(next(x.split("=")[1] for x in sets if x.startswith("optim.warmup_steps=")))
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=5e-4)
    sched = get_scheduler("cosine", opt, num_warmup_steps=warmup, num_training_steps=total)
    lrs = [sched.get_last_lr()[0]]
    for _ in range(total):
        opt.step()
        sched.step()
        lrs.append(sched.get_last_lr()[0])
    return lrs


def _untimed(path):
    return [{k: v for k, v in r.items() if not k.startswith(MEASURED) and k != "run_id"} for r in read_jsonl(path)]


def _assert_close(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            if k == "adapter_sha256":  # (weights equal up to float rounding have other digests; sharded: none)
                continue
            if isinstance(x[k], float) and isinstance(y[k], float):
                noise = 1e-5 if k.startswith("sampler/mismatch") else 1e-6  # (the mismatch is itself float noise)
                assert math.isclose(x[k], y[k], rel_tol=1e-5, abs_tol=noise), (x["step"], k, x[k], y[k])
            else:
                assert x[k] == y[k], (x["step"], k, x[k], y[k])


GRPO = ["algorithm.num_iterations=2", "optim.minibatch_size=8", "optim.micro_batch_size=4", "optim.schedule=cosine",
        "optim.warmup_steps=3", "algorithm.scale=batch"]
# held-out evaluation sharded 4 + 5 rows over the two processes
EVAL = ["eval.every=3", "eval.limit=9", "eval.pass_k=2", "eval.max_new_tokens=24"]
# seed 5, step 2: process 0's only group is dropped and three refill rounds of one prompt go to process 1,
# so process 0 trains on no rows (it still joins every collective) and the batch ends under-filled
DYNAMIC = ["algorithm.num_iterations=2", "rollout.prompts_per_step=2", "optim.minibatch_size=4",
           "optim.micro_batch_size=4", "optim.schedule=cosine", "optim.warmup_steps=3", "run.seed=5",
           "rollout.dynamic_sampling=true", "algorithm.loss_aggregation=dapo", "rollout.max_resample_rounds=3"]
PPO = ["rollout.num_generations=1", "rollout.prompts_per_step=8", "optim.minibatch_size=4",
       "optim.micro_batch_size=2", "optim.warmup_steps=2", "optim.schedule=cosine"]
A2C = ["rollout.num_generations=1", "rollout.prompts_per_step=8", "optim.micro_batch_size=2",
       "algorithm.critic_backbone=separate", "algorithm.n_steps=8", "optim.warmup_steps=2", "optim.schedule=cosine"]


ASYNC = ["rollout.async_lag=1", "rollout.async_worker_threads=1", "algorithm.num_iterations=2", "optim.minibatch_size=8",
         "optim.micro_batch_size=4", "optim.schedule=cosine", "optim.warmup_steps=3"]
SHARDED_GENERATION = ["rollout.sharded_generation=true"]  # (FSDP2 only) decoding in lockstep on sharded weights
UNMERGED = ["rollout.merge_adapter=false"]


@pytest.mark.slow
@pytest.mark.parametrize("recipe,sets,fsdp", [
    ("default", GRPO + EVAL, None),
    # (PPO, A2C and dynamic sampling run on two processes under FSDP2 below only: the gradient sum, the
    # critic's and the algorithms' collectives are the same code with and without sharding (distributed.py),
    # and their unsharded twins cost ~55 s of the suite)
    # FSDP2 (fsdp: the FSDP run's own extra settings): micro-batch counts padded with placeholders; generation
    # and evaluation on gathered weights (ppo) or in lockstep on sharded ones, a process with no prompt in a
    # refill round or fewer held-out rows joining the others' model calls (grpo), through generate (a2c)
    ("default", DYNAMIC + EVAL + UNMERGED, SHARDED_GENERATION),
    ("ppo", PPO, []),
    ("a2c", A2C + UNMERGED + ["rollout.engine=hf"], SHARDED_GENERATION),
    ("default", ASYNC, None),  # a fixed lag: each process's worker samples its share ahead
], ids=["grpo", "fsdp2-grpo-dynamic-sampling", "fsdp2-ppo",
        "fsdp2-a2c-separate-critic-hf-engine", "grpo-async-lag-workers"])
def test_two_processes_equal_one(launched, recipe, sets, fsdp):
    opts = ["run.steps=3", "checkpoint.every=3", *sets]
    one_dir, _ = launched(1, *opts, recipe=recipe)
    two_dir, stderr = launched(2, *opts, *(fsdp or []), recipe=recipe, fsdp=fsdp is not None)
    assert ("FSDP2 over 4 LlamaDecoderLayer modules on 2 processes" in stderr) == (fsdp is not None)
    one, two = _untimed(one_dir / "traces.jsonl"), _untimed(two_dir / "traces.jsonl")
    key = [(r["step"], r["prompt_id"], r["group"], r["sample"], r["completion"]) for r in one]
    assert key == [(r["step"], r["prompt_id"], r["group"], r["sample"], r["completion"]) for r in two]
    _assert_close(one, two)  # rewards identical; advantages (and PPO values) to float tolerance
    m1, m2 = _untimed(one_dir / "metrics.jsonl"), _untimed(two_dir / "metrics.jsonl")
    _assert_close(m1, m2)
    # the schedule moved exactly once per optimizer step on both (accelerate's would move once per process)
    per_step = m1[0]["optimizer_steps"]
    assert per_step == m2[0]["optimizer_steps"] == (1 if recipe == "a2c" else 4)
    expected = _schedule(sets, total=3 * per_step)
    # (a step's lr: the rate its last optimizer step used, as TRL logs it)
    assert [m["lr"] for m in m1] == [m["lr"] for m in m2] == pytest.approx(expected[per_step - 1:-1:per_step])
    if "rollout.dynamic_sampling=true" in sets:  # groups were dropped, refilled, and one step ran out of rounds
        assert [(m["prompts_sampled"], m["groups_used"]) for m in m1][1] == (5, 1)
    if "eval.every=3" in sets:  # the same held-out numbers from one process and from two halves
        drop = ("seconds", "minutes")
        e1, e2 = ([{k: v for k, v in r.items() if k not in drop} for r in read_jsonl(d / "eval.jsonl")]
                  for d in (one_dir, two_dir))
        assert e1 == e2 and e1[0]["rows"] == 9 and "pass@2" in e1[0]
    files = {p.name for p in (two_dir / "checkpoint-3").iterdir()}
    assert {"random_states_0.pkl", "random_states_1.pkl", "adapter_model.safetensors", "manifest.json"} <= files


# (the uninterrupted runs are test_two_processes_equal_one's "grpo" and "fsdp2-ppo")
STOPPED = {"ddp": ("default", GRPO + EVAL, False), "fsdp2": ("ppo", PPO, True)}


def _stopped(launched, name, procs=2):
    """A run of STOPPED[name]'s settings on `procs` processes, stopped after step 2 of 3 (--stop-after: its
    checkpoint written mid-schedule, with the cosine schedule still spanning 3 steps)."""
    recipe, sets, fsdp = STOPPED[name]
    return launched(procs, "run.steps=3", "checkpoint.every=3", *sets, recipe=recipe, fsdp=fsdp, stop_after=2)[0]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STOPPED))
def test_two_process_stop_and_resume_equals_an_uninterrupted_two_process_run(tmp_path, launched, name):
    recipe, sets, fsdp = STOPPED[name]
    opts = ["run.steps=3", "checkpoint.every=3", *sets]
    full, _ = launched(2, *opts, recipe=recipe, fsdp=fsdp)
    cut = _copy(_stopped(launched, name), tmp_path / "cut")
    assert [r["step"] for r in read_jsonl(cut / "metrics.jsonl")] == [1, 2] and (cut / "checkpoint-2").is_dir()
    _train(cut, 2, *opts, recipe=recipe, fsdp=fsdp, resume=True)
    for file in ("traces.jsonl", "metrics.jsonl"):
        assert _untimed(cut / file) == _untimed(full / file)


@pytest.mark.slow
@pytest.mark.parametrize("wrote,resumes", [(2, 1), (1, 2)])
def test_a_checkpoint_resumes_on_another_number_of_processes_with_one_warning(tmp_path, launched, wrote, resumes):
    """(1 -> 2: the new process finds no random state of its own in the checkpoint and keeps its seeded one.)"""
    run = _copy(_stopped(launched, "ddp", procs=wrote), tmp_path / "run")
    proc = _train(run, resumes, "run.steps=3", "checkpoint.every=3", *GRPO, *EVAL, resume=True)
    said = f"was written by {wrote} process{'es' if wrote > 1 else ''} and resumes on {resumes}"
    assert proc.stderr.count(said) == 1 and "not bit-exactly" in proc.stderr
    steps = [r["step"] for r in read_jsonl(run / "metrics.jsonl")]
    assert steps == [1, 2, 3]
    assert len([r for r in read_jsonl(run / "traces.jsonl")]) == 3 * 16


@pytest.mark.slow
def test_prompts_per_step_must_divide_by_the_processes(tmp_path):
    proc = _train(tmp_path / "odd", 2, "rollout.prompts_per_step=3", "run.steps=1", check=False)
    assert proc.returncode != 0
    assert "rollout.prompts_per_step (3) must divide by the number of processes (2)" in proc.stderr


FSDP_ENV = {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2", "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP"}


@pytest.mark.parametrize("extra,key", [
    ({"FSDP_VERSION": "1"}, "fsdp_version"),
    ({"FSDP_OFFLOAD_PARAMS": "true"}, "fsdp_offload_params"),
    ({"FSDP_ACTIVATION_CHECKPOINTING": "true"}, "fsdp_activation_checkpointing"),
    ({"FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP", "FSDP_MIN_NUM_PARAMS": "1000"}, "fsdp_auto_wrap_policy"),
    ({"FSDP_CPU_RAM_EFFICIENT_LOADING": "true"}, "fsdp_cpu_ram_efficient_loading"),
], ids=["fsdp1", "offload", "activation-checkpointing", "size-based-wrap", "ram-efficient-loading"])
def test_an_fsdp_setting_the_trainer_cannot_honour_is_refused_by_name(monkeypatch, extra, key):
    from docuchat_rl.distributed import ShardingError, sharding_from_launcher

    for k, v in {**FSDP_ENV, **extra}.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(ShardingError, match=f"accelerate config key {key}:"):
        sharding_from_launcher()


def test_the_launchers_fsdp_settings_are_read_and_deepspeed_is_refused(monkeypatch):
    from docuchat_rl.distributed import Sharding, ShardingError, sharding_from_launcher

    assert sharding_from_launcher() is None  # no accelerate config: plain data-parallel
    for k, v in {**FSDP_ENV, "FSDP_RESHARD_AFTER_FORWARD": "false",
                 "FSDP_TRANSFORMER_CLS_TO_WRAP": "LlamaDecoderLayer"}.items():
        monkeypatch.setenv(k, v)
    assert sharding_from_launcher() == Sharding(reshard_after_forward=False, layer_classes=("LlamaDecoderLayer",))
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ShardingError, match="DeepSpeed.*fsdp2.yaml"):
        sharding_from_launcher()


def test_sharding_a_model_without_the_named_layer_class_names_it(tiny):
    from docuchat_rl.distributed import Sharding, ShardingError, shard_layers

    with pytest.raises(ShardingError, match="no module of class NoSuchLayer in LlamaForCausalLM"):
        shard_layers(tiny[0], Sharding(reshard_after_forward=True, layer_classes=("NoSuchLayer",)))


def test_sharded_generation_without_an_fsdp_launch_is_refused(tmp_path):
    from docuchat_rl.config import load_config
    from docuchat_rl.errors import TrainingError
    from docuchat_rl.trainer import Trainer

    cfg = load_config(ROOT / "config" / "default.yaml", [f"run.output_dir={tmp_path}", *SHARDED_GENERATION, *UNMERGED])
    with pytest.raises(TrainingError, match="rollout.sharded_generation applies only to runs sharded by an FSDP"):
        Trainer(cfg)


def test_an_accelerate_mixed_precision_setting_is_refused_not_ignored(tmp_path):
    """accelerate's mixed_precision only acts on a model it prepares; the trainer's model runs in model.dtype.
    (A fresh process: accelerate keeps its state for the life of one.)"""
    import os

    env = {**os.environ, "ACCELERATE_MIXED_PRECISION": "bf16"}  # what accelerate launch sets from its config file
    proc = subprocess.run([sys.executable, "-m", "docuchat_rl", "train", "--config", str(ROOT / "config" / "default.yaml"),
                           "--set", f"run.output_dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode != 0
    assert "mixed_precision (bf16) is not used by docuchat-rl" in proc.stderr and "set model.dtype" in proc.stderr


@pytest.mark.slow
def test_the_eval_command_on_two_processes_reports_once_the_numbers_of_one(capsys):
    import json

    import torch

    from docuchat_rl.cli import main

    argv = ["eval", "--config", str(ROOT / "config" / "default.yaml"),
            *[x for s in ["eval.limit=9", "eval.max_new_tokens=24", "eval.pass_k=2"] for x in ("--set", s)]]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # (as each launched process: OMP_NUM_THREADS=1)
    try:
        assert main(argv) == 0  # one process: this one
    finally:
        torch.set_num_threads(threads)
    one = capsys.readouterr().out
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "-m", "docuchat_rl",
                           *argv], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.count('"rows": 9') == one.count('"rows": 9') == 1  # printed by the main process only
    one, two = ({k: v for k, v in json.loads(out).items() if k != "seconds"} for out in (one, proc.stdout))
    assert one == two and "pass@2" in one


def test_the_trainable_weights_start_as_the_main_processs_on_every_process(tmp_path):
    """A rank-dependent initialisation (each process drew its own numbers) is overwritten by the main
    process's weights, whatever their dtype."""
    script = tmp_path / "broadcast.py"
    script.write_text(
        "import json, torch, torch.distributed as d\n"
        "from docuchat_rl.distributed import Dist\n"
        "d.init_process_group('gloo'); rank = d.get_rank()\n"
        "ps = [torch.nn.Parameter(torch.randn(3, generator=torch.Generator().manual_seed(rank))),\n"
        "      torch.nn.Parameter(torch.full((2, 2), rank + 0.5, dtype=torch.bfloat16))]\n"
        "before = ps[0].tolist()\n"
        "Dist(2, rank).broadcast_(ps)\n"
        f"open(f'{tmp_path}/{{rank}}.json', 'w').write(json.dumps([before, ps[0].tolist(), ps[1].float().tolist()]))\n"
        "from docuchat_rl.distributed import end_processes; end_processes()\n")
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", str(script)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    import json

    rows = {rank: json.loads((tmp_path / f"{rank}.json").read_text()) for rank in (0, 1)}  # (one file a process)
    assert rows[0][0] != rows[1][0]  # the two processes drew different numbers
    assert rows[0][1] == rows[1][1] == rows[0][0]  # now both hold the main process's
    assert rows[1][2] == [[0.5, 0.5], [0.5, 0.5]]


@pytest.mark.parametrize("version", ["2.6.0+cu124", "2.4.1"])
def test_fsdp2_on_a_torch_older_than_2_7_is_refused_in_one_line(monkeypatch, version):
    from docuchat_rl.distributed import ShardingError, check_fsdp_torch, sharding_from_launcher

    with pytest.raises(ShardingError, match=f"torch >= 2.7 .* this is torch {version.replace('+', '.')}"):
        check_fsdp_torch(version)
    check_fsdp_torch("2.7.0")
    check_fsdp_torch("2.13.0+cpu")
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setattr("torch.__version__", version)
    with pytest.raises(ShardingError, match="upgrade torch"):
        sharding_from_launcher()  # before accelerate's plugin reads the rest


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node(out, rank: int, port: int, *sets, timeout: float = 600):
    """One node of a two-node launch on this machine: torchrun --nnodes 2 --node_rank RANK, one process, the
    static rendezvous over TCP at 127.0.0.1:PORT (what docs/scaling.md's "Several machines" runs per machine)."""
    import os

    args = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1",
            "--node_rank", str(rank), "--master_addr", "127.0.0.1", "--master_port", str(port),
            "-m", "docuchat_rl", "train", "--config", str(ROOT / "config" / "default.yaml")]
    for s in [*SHORT, f"run.output_dir={out}", *sets]:
        args += ["--set", s]
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"}, start_new_session=True)  # (a node: a group)


@pytest.mark.slow
def test_two_nodes_equal_one_process(launched, tmp_path):
    """Two nodes (two torchrun launches, one process each, rendezvous over TCP) give the one-process run's
    completions and rewards, its metrics and weights to float tolerance (as two processes on one node do)."""
    from safetensors.torch import load_file

    opts = ["run.steps=3", "checkpoint.every=3", *GRPO]
    one_dir, _ = launched(1, *opts)
    port = _free_port()
    nodes = [_node(tmp_path / "two", rank, port, *opts) for rank in (0, 1)]
    outs = [p.communicate(timeout=600) for p in nodes]
    assert [p.returncode for p in nodes] == [0, 0], [err[-2000:] for _, err in outs]
    one, two = _untimed(one_dir / "traces.jsonl"), _untimed(tmp_path / "two" / "traces.jsonl")
    assert [(r["step"], r["prompt_id"], r["sample"], r["completion"], r["total"]) for r in one] == \
        [(r["step"], r["prompt_id"], r["sample"], r["completion"], r["total"]) for r in two]
    _assert_close(one, two)
    _assert_close(_untimed(one_dir / "metrics.jsonl"), _untimed(tmp_path / "two" / "metrics.jsonl"))
    a, b = (load_file(str(d / "checkpoint-3" / "adapter_model.safetensors")) for d in (one_dir, tmp_path / "two"))
    assert a.keys() == b.keys() and all((a[k] - b[k]).abs().max() <= 1e-5 for k in a)


def test_a_node_that_never_comes_fails_the_rendezvous_in_its_stated_time(tmp_path):
    """Node 0 alone: the static rendezvous gives up after the timeout it was started with (--rdzv-conf timeout=20;
    torchrun's default is 900 s), saying how many nodes joined; nothing is written in the run folder."""
    import os
    import time

    port = _free_port()
    args = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1", "--node_rank",
            "0", "--master_addr", "127.0.0.1", "--master_port", str(port), "--rdzv-conf", "timeout=20",
            "-m", "docuchat_rl", "train", "--set", f"run.output_dir={tmp_path / 'r'}", "--set", "run.steps=1"]
    start = time.perf_counter()
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    took = time.perf_counter() - start
    assert done.returncode != 0 and 20 <= took < 60, (done.returncode, took, done.stderr[-1500:])
    assert "Timed out after" in done.stderr and "1/2 clients joined" in done.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_a_node_that_dies_stops_the_other_in_one_line_and_the_run_resumes(tmp_path):
    """Node 1 killed (SIGKILL) after a checkpoint: node 0's next collective fails at once (gloo: the connection
    closed), it says so in one line naming the intact checkpoint, and the run resumes from it in one process."""
    import os
    import signal
    import time

    out, port = tmp_path / "two", _free_port()
    opts = ["run.steps=40", "checkpoint.every=1", "eval.before_and_after=false"]
    nodes = [_node(out, rank, port, *opts) for rank in (0, 1)]
    deadline = time.time() + 300
    while not (out / "checkpoint-2" / "manifest.json").exists() and time.time() < deadline:
        time.sleep(0.1)
    subprocess.run(["pkill", "-KILL", "-P", str(nodes[1].pid)])  # (the machine goes: its worker, which torchrun
    os.kill(nodes[1].pid, signal.SIGKILL)  # starts in a session of its own, and the launcher)
    killed = time.perf_counter()
    _, err = nodes[0].communicate(timeout=120)
    took = time.perf_counter() - killed
    nodes[1].communicate()
    lines = [x for x in err.splitlines() if x.startswith("docuchat-rl: error:")]
    assert nodes[0].returncode != 0 and took < 60, (took, err[-1500:])
    assert len(lines) == 1 and "another process of the run stopped" in lines[0] and "is intact" in lines[0], err[-1500:]
    step = int((out / "latest").read_text().strip().split("-")[1])
    assert step >= 2
    resumed = _train(out, 1, *opts, f"run.steps={step + 1}", resume=True)
    assert resumed.returncode == 0 and (out / "latest").read_text().strip() == f"checkpoint-{step + 1}"
