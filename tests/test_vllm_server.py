"""vLLM servers as the rollout engine (`rollout.vllm.mode: server`, sampling/vllm_server.py).

The tests that need a server start vLLM's own OpenAI-compatible server on the committed model, with the
command `docuchat-rl serve --print-only` prints (plus the CPU build's flags), as a subprocess; they run in
the vLLM environment (`scripts/vllm_tests.sh`). The config, the `serve` command and the faults that need no
server (nothing listening, a server that never answers: a real socket) run in the main suite too.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from .conftest import MODEL, ROOT
from .test_vllm_engine import KV, needs_vllm, one_and_two_processes_agree, untimed

CPU_FLAGS = ["--enforce-eager", "--max-model-len", "512", "--kv-cache-memory-bytes", "268435456",
             "--dtype", "float32"]  # (the CPU build needs a KV size; float32 as the trainer's CPU default)
SHORT = ["data.test=null", "rollout.prompts_per_step=4", "rollout.num_generations=4", "rollout.max_new_tokens=32"]


def cfg_for(out, url, *extra):
    from docuchat_rl.config import load_config

    return load_config(ROOT / "config" / "default.yaml", [
        f"run.output_dir={out}", "rollout.engine=vllm", "rollout.vllm.mode=server",
        f"rollout.vllm.server_base_url={url}", *SHORT, *extra])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_line(*args: str) -> str:
    """What `docuchat-rl serve --print-only` prints for the default recipe."""
    proc = subprocess.run([sys.executable, "-m", "docuchat_rl", "serve", "--config", str(ROOT / "config" / "default.yaml"),
                           "--print-only", *args], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


class Server:
    """vLLM's server on the committed model, started from the printed command (`lora` False: as a plain
    `vllm serve MODEL`, without runtime LoRA loading)."""

    def __init__(self, log_dir, lora: bool = True, model=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        other = ["--set", f"model.name_or_path={model}"] if model else []
        words = shlex.split(serve_line(*other, "--port", str(self.port), "--", *CPU_FLAGS))
        env = dict(w.split("=", 1) for w in words if "=" in w and w.split("=")[0].isupper() and not w.startswith("-"))
        argv = words[len(env):]
        if not lora:
            env = {}
            for flag in ("--max-loras", "--max-lora-rank"):
                i = argv.index(flag)
                del argv[i:i + 2]
            argv.remove("--enable-lora")
        self.log = open(log_dir / f"vllm-{self.port}.log", "w")
        self.proc = subprocess.Popen(argv, cwd=ROOT, env={**os.environ, **env}, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        deadline = time.time() + 400
        while time.time() < deadline:
            assert self.proc.poll() is None, (log_dir / f"vllm-{self.port}.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(self.url + "/v1/models", timeout=5):
                    return
            except OSError:
                time.sleep(1)
        self.kill()
        raise AssertionError("the vLLM server did not start within 400 s")

    def adapters(self) -> list[str]:
        """The LoRA adapters the server holds now (GET /v1/models)."""
        with urllib.request.urlopen(self.url + "/v1/models", timeout=30) as r:
            return sorted(m["id"] for m in json.loads(r.read())["data"] if m.get("parent"))

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


# --------------------------------------------------------------------------------- without a server


def test_server_mode_keys_are_checked_at_load(tmp_path):
    from docuchat_rl.config import ConfigError, load_config

    base = ["rollout.engine=vllm", "rollout.vllm.mode=server"]
    cases = [
        ([*base], r"rollout.vllm.mode server needs rollout.vllm.server_base_url"),
        ([*base, "rollout.vllm.server_base_url=localhost:8000"], r"'localhost:8000' is not an http\(s\) URL"),
        ([*base, "rollout.vllm.server_base_url=[]"], r"an empty list"),
        ([*base, "rollout.vllm.server_base_url=http://a:1", "rollout.vllm.gpu_memory_utilization=0.5"],
         r"rollout.vllm.gpu_memory_utilization does not apply to rollout.vllm.mode server: the server's own flags"),
        (["rollout.engine=vllm", "rollout.vllm.timeout_s=5"],
         r"rollout.vllm.timeout_s does not apply to rollout.vllm.mode colocate: set rollout.vllm.mode=server"),
        ([*base, "rollout.vllm.server_base_url=http://a:1", "rollout.async_lag=1", "rollout.async_worker_threads=1"],
         r"rollout.async_worker_threads does not apply to rollout.vllm.mode server"),
    ]
    for sets, message in cases:
        with pytest.raises(ConfigError, match=message) as e:
            load_config(ROOT / "config" / "default.yaml", sets)
        assert "\n" not in str(e.value)
    cfg = load_config(ROOT / "config" / "default.yaml", [
        *base, 'rollout.vllm.server_base_url=["http://a:8000", "https://b:8000/"]'])
    assert cfg.rollout.vllm.server_base_url == ["http://a:8000", "https://b:8000/"]


def test_serve_prints_vllms_own_command_for_the_recipe():
    """The printed line is vLLM's server on the recipe's model with runtime LoRA loading, room for the versions
    a fixed lag keeps (lag + 2, at least 4), the rank rounded up to vLLM's sizes, processed log-probs, the run's seed;
    flags after -- go last, as given."""
    from docuchat_rl.config import load_config

    words = shlex.split(serve_line("--port", "8123", "--set", "rollout.async_lag=3", "--set", "lora.r=12",
                                   "--", "--gpu-memory-utilization", "0.3"))
    assert words[0] == "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True"
    argv = words[1:]
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    cfg = load_config(ROOT / "config" / "default.yaml")
    assert argv[argv.index("--model") + 1] == cfg.model.name_or_path and argv[argv.index("--port") + 1] == "8123"
    assert "--enable-lora" in argv and argv[argv.index("--max-loras") + 1] == "5"
    assert argv[argv.index("--max-lora-rank") + 1] == "16"
    assert argv[argv.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert argv[argv.index("--seed") + 1] == str(cfg.run.seed)
    assert argv[-2:] == ["--gpu-memory-utilization", "0.3"]
    # without CUDA, room for every row's whole prompt in one batch: vLLM's CPU build cannot rewind a seeded
    # request after a chunked prefill (its engine dies with "CPU Generator does not use offset")
    longest = cfg.data.max_prompt_tokens + cfg.rollout.max_new_tokens
    assert int(argv[argv.index("--max-num-batched-tokens") + 1]) >= longest * cfg.rollout.batch_rows


def test_no_server_at_the_url_is_one_line_before_the_model_trains(tmp_path, capsys):
    """Nothing listens at the URL: the start waits rollout.vllm.startup_timeout_s for a server still loading
    (saying so once), then stops in one line naming the URL and the setting."""
    from docuchat_rl.errors import TrainingError
    from docuchat_rl.trainer import Trainer

    url = f"http://127.0.0.1:{free_port()}"  # (nothing listens there)
    t0 = time.time()
    with pytest.raises(TrainingError, match=rf"rollout.vllm.server_base_url {url}: no answer .*after waiting "
                                            r"rollout.vllm.startup_timeout_s \(3 s\); start the server "
                                            r"first \(docuchat-rl serve prints its command\)") as e:
        Trainer(cfg_for(tmp_path, url, "rollout.vllm.startup_timeout_s=3"))
    assert "\n" not in str(e.value) and 3 <= time.time() - t0 < 60
    assert capsys.readouterr().err.count(f"waiting for the vLLM server at {url}") == 1


def test_a_server_that_starts_listening_later_is_waited_for(tmp_path):
    """vLLM loads for minutes before it listens: a server that starts 3 s after the trainer is reached (here a
    web server that then answers /v1/models with another model: the run stops on that, not on the wait)."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from docuchat_rl.errors import TrainingError
    from docuchat_rl.trainer import Trainer

    port = free_port()

    class Models(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps({"data": [{"id": "some/other-model", "root": "some/other-model"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    servers = []

    def start_later():
        time.sleep(3)
        servers.append(ThreadingHTTPServer(("127.0.0.1", port), Models))
        servers[0].serve_forever()

    threading.Thread(target=start_later, daemon=True).start()
    try:
        with pytest.raises(TrainingError, match=r"serves \['some/other-model'\], not model.name_or_path"):
            Trainer(cfg_for(tmp_path, f"http://127.0.0.1:{port}", "rollout.vllm.startup_timeout_s=120"))
    finally:
        if servers:
            servers[0].shutdown()


def test_a_server_that_never_answers_ends_the_run_in_one_line_after_timeout_s(tmp_path):
    """A listener that accepts and never answers (a hung server): the start's check waits timeout_s, then
    one line names the URL and the setting."""
    from docuchat_rl.errors import TrainingError
    from docuchat_rl.trainer import Trainer

    hung = socket.socket()
    hung.bind(("127.0.0.1", 0))
    hung.listen(8)
    url = f"http://127.0.0.1:{hung.getsockname()[1]}"
    t0 = time.time()
    try:
        with pytest.raises(TrainingError, match=rf"{url}: no answer within rollout.vllm.timeout_s \(2 s\)"):
            Trainer(cfg_for(tmp_path, url, "rollout.vllm.timeout_s=2"))
    finally:
        hung.close()
    assert time.time() - t0 < 60


@pytest.mark.parametrize("status", [404, 200])
def test_a_web_server_that_answers_with_a_page_is_one_short_line(tmp_path, status):
    """Not a vLLM server: an HTML page (an error page, or a site's 200) is named by its title, on one line."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from docuchat_rl.errors import TrainingError
    from docuchat_rl.trainer import Trainer

    class Page(BaseHTTPRequestHandler):
        def do_GET(self):
            body = ("<!DOCTYPE html>\n<html>\n<head>\n<title>Welcome to nginx!</title>\n</head>\n<body>\n"
                    + "<p>line</p>\n" * 9 + "</body>\n</html>\n").encode()
            self.send_response(status)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    web = ThreadingHTTPServer(("127.0.0.1", 0), Page)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{web.server_address[1]}"
    try:
        with pytest.raises(TrainingError, match=r"an HTML page: Welcome to nginx!") as e:
            Trainer(cfg_for(tmp_path, url))
    finally:
        web.shutdown()
    assert "\n" not in str(e.value) and len(str(e.value)) < 300


# ------------------------------------------------------------------------------------- with servers


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    s = Server(tmp_path_factory.mktemp("server"))
    yield s
    s.kill()


def traces(folder):
    from docuchat_rl.outputs import read_jsonl

    return read_jsonl(folder / "traces.jsonl")


@needs_vllm
@pytest.mark.slow
def test_server_mode_samples_what_the_colocated_engine_samples(tmp_path, server):
    """3 steps with the same seeds: the server (each version a LoRA adapter) and the colocated engine (the
    merged weights) sample the same completions; the sampler/trainer log-prob gap stays below 1e-4; every
    trace names the version that sampled it; the run's versions are unloaded and their folder removed at
    the end."""
    from docuchat_rl.outputs import read_jsonl
    from docuchat_rl.trainer import Trainer

    opts = ["run.steps=3", "checkpoint.every=3", "optim.lr=5e-3"]
    for name, cfg in (("server", cfg_for(tmp_path / "server", server.url, *opts)),
                      ("colocated", cfg_for(tmp_path / "colocated", server.url, *opts,
                                            "rollout.vllm.mode=colocate", "rollout.vllm.server_base_url=null", KV))):
        t = Trainer(cfg)
        history = t.train()
        t.close()
        assert all(m["sampler/mismatch_max"] < 1e-4 for m in history), (name, [m["sampler/mismatch_max"] for m in history])
    served, colocated = traces(tmp_path / "server"), traces(tmp_path / "colocated")
    assert [r["completion_ids"] for r in served] == [r["completion_ids"] for r in colocated]
    assert {r["step"]: r["policy_version"] for r in served} == {1: 0, 2: 1, 3: 2}
    assert len({r["adapter_sha256"] for r in served}) == 3
    for a, b in zip(read_jsonl(tmp_path / "server" / "metrics.jsonl"), read_jsonl(tmp_path / "colocated" / "metrics.jsonl")):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-3, abs=1e-5)
    assert server.adapters() == [] and not (tmp_path / "server" / "vllm-adapters").exists()


@needs_vllm
def test_versions_are_loaded_once_and_unloaded_when_no_step_needs_them(tmp_path, server):
    """add_version writes the peft folder once and loads it as policy-v{N}-{run}; the versions before keep_from
    leave the server (seen in /v1/models) and the disk; a version's completions differ from another's; a
    second run on the same server and adapter_dir has names of its own (its version 1 leaves the first run's
    alone), and a version loaded again (a resume) takes the new tensors."""
    import torch
    from peft import get_peft_model_state_dict
    from safetensors.torch import load_file

    from docuchat_rl.distributed import Dist
    from docuchat_rl.modeling import load_model_and_tokenizer
    from docuchat_rl.sampling.engines import EngineContext, build_engine

    from .conftest import with_lora

    model, tok = load_model_and_tokenizer(str(MODEL), dtype="float32", device="cpu")
    model = with_lora(model, ["q_proj", "v_proj"])
    shared = tmp_path / "adapters"
    cfg = cfg_for(tmp_path, server.url, "rollout.async_lag=1", "lora.target_modules=[q_proj, v_proj]",
                  f"rollout.vllm.adapter_dir={shared}")
    engine = build_engine(EngineContext(cfg, tok, model, Dist(), tmp_path / "run-a"))
    other = build_engine(EngineContext(cfg, tok, model, Dist(), tmp_path / "run-b"))
    assert engine.name(1).startswith("policy-v1-") and engine.name(1) != other.name(1)
    state = {k: t.detach().clone() for k, t in get_peft_model_state_dict(model).items()}
    engine.add_version(0, state, keep_from=0)
    engine.add_version(1, {k: t * 3 for k, t in state.items()}, keep_from=0)
    assert server.adapters() == [engine.name(0), engine.name(1)]
    engine.add_version(2, {k: t * -2 for k, t in state.items()}, keep_from=1)
    assert server.adapters() == sorted([engine.name(1), engine.name(2)])
    assert sorted(p.name for p in shared.iterdir()) == sorted([engine.name(1), engine.name(2)])
    written = load_file(str(shared / engine.name(2) / "adapter_model.safetensors"))
    assert written.keys() == state.keys() and all(torch.equal(written[k], t * -2) for k, t in state.items())
    prompt = [tok.apply_chat_template([{"role": "user", "content": "What is 7 + 5?"}], tokenize=False,
                                      add_generation_prompt=True)]
    one, two = (engine.submit(prompt, [11] * 4, v, 3).result() for v in (1, 2))
    assert one.completion_ids != two.completion_ids and len(one.completion_ids) == 4
    assert one.completion_ids[0] == one.completion_ids[1]  # (the same seed, the same completion)
    other.add_version(1, {k: t * -2 for k, t in state.items()}, keep_from=1)  # (run b's version 1 = a's 2)
    assert engine.submit(prompt, [11] * 4, 1, 3).result().completion_ids == one.completion_ids
    assert other.submit(prompt, [11] * 4, 1, 3).result().completion_ids == two.completion_ids
    other.close()
    engine.add_version(1, {k: t * -2 for k, t in state.items()}, keep_from=1)  # (loaded again: in place)
    assert engine.submit(prompt, [11] * 4, 1, 3).result().completion_ids == two.completion_ids
    engine.close()
    assert server.adapters() == [] and not shared.exists()


@needs_vllm
def test_a_server_that_cannot_serve_the_run_is_one_line_naming_the_flag(tmp_path, server):
    """Another base model: one line naming --model; a LoRA rank over the server's --max-lora-rank: one
    line naming the flag and the rank it needs."""
    from docuchat_rl.errors import TrainingError
    from docuchat_rl.trainer import Trainer

    other = shutil.copytree(MODEL, tmp_path / "other-model")
    with pytest.raises(TrainingError, match=rf"the vLLM server {server.url} serves \[.*\], not model.name_or_path "
                                            rf"'{other}': start it with --model {other}"):
        Trainer(cfg_for(tmp_path / "a", server.url, f"model.name_or_path={other}"))
    t = Trainer(cfg_for(tmp_path / "b", server.url, "lora.r=32", "lora.alpha=64"))
    with pytest.raises(TrainingError, match=r"did not load adapter version 0: HTTP \d+: .*rank 32.*start it with "
                                            r"--max-lora-rank 32 or more \(lora.r is 32\)") as e:
        t.train()
    t.close()
    assert "\n" not in str(e.value)


@needs_vllm
@pytest.mark.slow
def test_lag_over_a_server_killed_mid_run_resumes_to_the_uninterrupted_run(tmp_path, server):
    """rollout.async_lag 1 over a server: step t+2's requests are in flight while the learner updates step t.
    The server is killed mid-run: the run ends in one line naming the URL, step and version, the last
    checkpoint intact; `--resume` (against another server) re-requests the in-flight steps with the same
    seeds and writes the uninterrupted run's traces and metrics."""
    from docuchat_rl.outputs import read_jsonl

    opts = ["run.steps=6", "checkpoint.every=1", "rollout.async_lag=1", "optim.lr=5e-3"]

    # (the reference through the CLI too, as the run it is compared with: in this process vLLM's CPU build,
    # loaded by earlier tests, made torch.set_num_threads a no-op)
    done = subprocess.run(_cli(tmp_path / "full", server.url, opts), cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    full = traces(tmp_path / "full")
    assert {r["step"]: r["policy_version"] for r in full} == {1: 0, 2: 0, 3: 1, 4: 2, 5: 3, 6: 4}
    for m in read_jsonl(tmp_path / "full" / "metrics.jsonl"):  # (tokens/s over the server's seconds, not the wait)
        assert m["rollout_sampler_s"] > 0 and m["rollout_tokens_per_s"] < 1e5, m

    doomed = Server(tmp_path)
    try:
        _kill_mid_run(tmp_path / "cut", doomed, opts)
    finally:
        doomed.kill()
    cut = tmp_path / "cut"
    args = _cli(cut, doomed.url, opts)
    resumed = subprocess.run([*args, "--set", f"rollout.vllm.server_base_url={server.url}", "--resume", "latest"],
                             cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # The same completions, rewards, advantages and versions, line for line. Not bit-equal weights: the
    # server's log-probs (the behaviour weights' denominators) vary in their last bits with how its requests
    # were batched, between any two runs (seen at step 1, before any kill: sampler/mismatch_mean 3.633e-07
    # against 3.624e-07), so the adapters' digests differ and the metrics agree to rounding.
    digestless = [[{k: v for k, v in r.items() if k != "adapter_sha256"} for r in untimed(d / "traces.jsonl")]
                  for d in (cut, tmp_path / "full")]
    assert digestless[0] == digestless[1]
    for a, b in zip(untimed(cut / "metrics.jsonl"), untimed(tmp_path / "full" / "metrics.jsonl"), strict=True):
        assert a.keys() == b.keys()
        for k in a:
            # (None where a metric has no value, as kl at beta 0: pytest 9.2's approx refuses None with rel)
            assert a[k] == (b[k] if b[k] is None else pytest.approx(b[k], rel=1e-3, abs=1e-5)), (a["step"], k)


def _cli(out, url, opts) -> list[str]:
    args = [sys.executable, "-m", "docuchat_rl", "train", "--config", str(ROOT / "config" / "default.yaml")]
    for s in [f"run.output_dir={out}", "rollout.engine=vllm", "rollout.vllm.mode=server",
              f"rollout.vllm.server_base_url={url}", "rollout.vllm.timeout_s=300", *SHORT, *opts]:
        args += ["--set", s]
    return args


def _kill_mid_run(cut, doomed, opts) -> None:
    """A CLI run over `doomed`, the server killed once two steps are done: one line, a checkpoint left."""
    proc = subprocess.Popen(_cli(cut, doomed.url, opts), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(proc.stderr))
    reader.start()
    metrics = cut / "metrics.jsonl"
    deadline = time.time() + 300
    try:
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert proc.poll() is None and time.time() < deadline, "".join(err)[-3000:]
            time.sleep(0.05)
        doomed.kill()
        assert proc.wait(timeout=120) == 2
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join()
    last = err[-1].strip()
    # (killed while it sampled a step, or while it loaded the version after a step)
    assert re.match(rf"docuchat-rl: error: the vLLM server {re.escape(doomed.url)} failed while (sampling step \d+ with "
                    r"adapter version \d+|loading adapter version \d+ \(the policy after step \d+\)): .*; the last "
                    r"checkpoint is intact$", last), "".join(err)
    done = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert 2 <= len(done) < 6 and (cut / f"checkpoint-{done[-1]}").is_dir()


@needs_vllm
@pytest.mark.slow
def test_two_training_processes_sharing_a_server_equal_one(tmp_path, server):
    """Data-parallel trainers share the server: each asks for its share of the prompts, the main process
    writes and loads each version; completions, rewards and metrics equal a one-process run's."""
    one_and_two_processes_agree(tmp_path, "rollout.engine=vllm", "rollout.vllm.mode=server",
                                f"rollout.vllm.server_base_url={server.url}")
    assert server.adapters() == []


@needs_vllm
@pytest.mark.slow
def test_a_server_without_runtime_lora_is_refused_in_one_line(tmp_path):
    """`vllm serve MODEL` as most users first start it (no --enable-lora, no runtime LoRA loading): the
    first version's load is refused in one line naming the variable and the flag."""
    from docuchat_rl.errors import TrainingError
    from docuchat_rl.trainer import Trainer

    plain = Server(tmp_path, lora=False)
    try:
        t = Trainer(cfg_for(tmp_path / "run", plain.url))
        with pytest.raises(TrainingError, match=rf"the vLLM server {plain.url} did not load adapter version 0: .*"
                                                r"VLLM_ALLOW_RUNTIME_LORA_UPDATING=True .*--enable-lora") as e:
            t.train()
        t.close()
        assert "\n" not in str(e.value)
    finally:
        plain.kill()


def test_fsdp2_sharding_with_servers_is_refused_in_one_line(tmp_path):
    """Each version is the whole adapter; under FSDP2 a process holds a shard of it: refused before any
    server is asked (none runs here)."""
    from .test_distributed import _train

    proc = _train(tmp_path, 2, "rollout.engine=vllm", "rollout.vllm.mode=server",
                  f"rollout.vllm.server_base_url=http://127.0.0.1:{free_port()}", check=False, fsdp=True)
    assert proc.returncode != 0  # (the launcher's own code for a process that failed)
    assert ("docuchat-rl: error: rollout.vllm.mode server with FSDP2 sharding is not built: use accelerate's "
            "data-parallel launch") in proc.stderr


@needs_vllm
@pytest.mark.slow
def test_multi_turn_rollouts_through_a_server_and_the_colocated_engine_agree(tmp_path):
    """Tools over vLLM: the next turns are sampled from the conversation's token ids (Engine.continue_rows)
    by the server and by the colocated engine; with the same seeds both give the same conversations, the
    sampler/trainer gap on the model's tokens stays below 1e-4, and tool calls ran."""
    from docuchat_rl.trainer import Trainer

    from .multiturn_model import teach_tool_calls

    taught = teach_tool_calls(tmp_path / "taught")
    server = Server(tmp_path, model=taught)
    try:
        opts = [f"model.name_or_path={taught}", "rollout.tools=[tests.tool_envs.add]", "rollout.tool_protocol=text",
                "rollout.max_new_tokens=192", "run.steps=2", "checkpoint.every=2"]
        for name, cfg in (("server", cfg_for(tmp_path / "server", server.url, *opts)),
                          ("colocated", cfg_for(tmp_path / "colocated", server.url, *opts, "rollout.vllm.mode=colocate",
                                                "rollout.vllm.server_base_url=null", KV))):
            t = Trainer(cfg)
            history = t.train()
            t.close()
            assert all(m["sampler/mismatch_max"] < 1e-4 for m in history), (name, history)
            assert any(m["tool_calls/mean"] > 0 for m in history), name
    finally:
        server.kill()
    served, colocated = traces(tmp_path / "server"), traces(tmp_path / "colocated")
    assert any(len(r["turns"]) > 1 for r in served)
    assert [r["completion_ids"] for r in served] == [r["completion_ids"] for r in colocated]
    def calls(lines):
        return [[(c["name"], c["arguments"], c["result"], c["error"]) for t in r["turns"] for c in t["calls"]]
                for r in lines]

    assert calls(served) == calls(colocated)
