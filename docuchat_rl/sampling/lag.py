"""Fixed-lag sampling (`rollout.async_lag: k`): step t trains on completions sampled by the policy after
step t - 1 - k (version v = the adapter after step v; 0 = the initial one), whatever the timing.

The schedule is fixed, not "whatever the sampler has by then", so a run is reproducible and resumes
exactly: a checkpoint of step t holds the adapter versions t - k .. t - 1 that the next steps still sample
with (`lagged/adapter-v<N>.safetensors`; the versions before are dropped as the run goes) and the data
position after step t's own prompts (a worker takes later steps' prompts ahead). The update is decoupled
PPO's (AReaL): the ratio is taken and clipped against the proximal policy, the learner at the step's start
(with one update per rollout the policy itself, so the clip never bites), and each token is weighted once by
pi_prox / pi_sampler, truncated to [rollout.correction_min, correction_max] (or as `rollout.correction`
says): the older the sample, the more the weight corrects, while the clip keeps its meaning. A2C, which has
no ratio, takes the same weight. The metrics give the lag (`async/lag`), the k3 estimate of KL(sampler ||
learner) per token (`async/kl_sampler_learner`), the `sampler/mismatch_*` of the proximal policy against
the sampler and the weights' mean and capped share. Every trace line names the version that sampled it
(`policy_version`, `adapter_sha256`). A signal to the whole process group (Ctrl-C, Slurm) reaches the
learner alone: the worker ignores SIGINT and SIGTERM and dies with its learner.

Where the sampling runs: with `rollout.async_worker_threads: 0` in the learner's process, the version
swapped into its model between updates (no overlap: the reference the worker is tested against); with N > 0
in a worker process of its own (`Ahead`, N torch threads) that holds the base model once, receives each new
adapter version (the LoRA tensors only, a few MB) after every optimizer step and samples step t + 1 + k as
soon as version t arrives, while the learner updates. Its results come back in step order; a worker that
dies, or a result that does not come within `rollout.async_timeout_s`, ends the run in one line naming the
step and version (the last checkpoint intact). The worker dies with the learner (PR_SET_PDEATHSIG).

Several data-parallel processes: each learner process has a worker of its own for its share of the prompts.

With `rollout.engine: vllm` the worker is a vLLM engine serving the versions as LoRA adapters (vllm_engine.py:
the base weights once, nothing merged on either side); with async_worker_threads 0 the learner's colocated
engine is synced with the lagged version (merged), the reference. Over vLLM's servers (`rollout.vllm.mode:
server`) no worker process is started: the servers are the worker, each version a LoRA adapter they load,
and step t + 1 + k's requests stay in flight while the learner updates step t (`Lookahead`).

Deliberately left out (not built yet): FSDP2 sharding (a worker holds the whole model) and dynamic sampling
(whose refill reads the same step's rewards); each is refused in one line.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import threading
import time
from pathlib import Path

import torch

from ..errors import TrainingError

FOLDER = "lagged"
LOAD_ALLOWANCE_S = 600.0  # the most a worker may take to load the model before its first answer


class LaggedPolicies:
    """The adapter versions a fixed-lag run still samples with, on the CPU (a few MB each)."""

    def __init__(self, lag: int):
        self.lag = lag
        self.versions: dict[int, dict[str, torch.Tensor]] = {}

    def version_for(self, step: int) -> int:
        """The policy version that samples `step`."""
        return max(0, step - 1 - self.lag)

    def record(self, version: int, model) -> None:
        """Keep the adapter after step `version`; forget the versions no later step samples with."""
        from peft import get_peft_model_state_dict

        self.versions[version] = {k: v.detach().to("cpu", copy=True)
                                  for k, v in get_peft_model_state_dict(model, adapter_name="default").items()}
        for old in [v for v in self.versions if v < version - self.lag]:
            del self.versions[old]

    def digest(self, version: int) -> str | None:
        """The adapter digest of a kept version (modeling.state_digest: the same as the model's with it in)."""
        from ..modeling import state_digest

        return state_digest(self.versions[version])

    @contextlib.contextmanager
    def active(self, model, version: int):
        """The block runs with adapter `version` in the model's LoRA weights (the current ones put back after,
        bit for bit)."""
        from peft import get_peft_model_state_dict, set_peft_model_state_dict

        if version not in self.versions:
            raise KeyError(f"adapter version {version} is not kept (kept: {sorted(self.versions)})")
        current = {k: v.detach().clone() for k, v in get_peft_model_state_dict(model, adapter_name="default").items()}
        with torch.no_grad():
            set_peft_model_state_dict(model, self.versions[version], adapter_name="default")
        try:
            yield
        finally:
            with torch.no_grad():
                set_peft_model_state_dict(model, current, adapter_name="default")

    def save(self, folder: Path, step: int) -> None:
        """Write the versions the steps after `step` still sample with (the current one is the checkpoint's)."""
        from safetensors.torch import save_file

        (Path(folder) / FOLDER).mkdir()
        for v in sorted(self.versions):
            if v < step:
                save_file(self.versions[v], str(Path(folder) / FOLDER / f"adapter-v{v}.safetensors"))

    def load(self, folder: Path, step: int, model) -> None:
        """The versions a checkpoint of `step` kept, and its own adapter (already in `model`) as version `step`."""
        from safetensors.torch import load_file

        self.versions = {}
        for path in sorted((Path(folder) / FOLDER).glob("adapter-v*.safetensors")):
            self.versions[int(path.stem.split("-v")[1])] = load_file(str(path))
        self.record(step, model)
        missing = [v for v in range(max(0, step - self.lag), step) if v not in self.versions]
        if missing:
            raise ValueError(f"{Path(folder).name} lacks the adapter versions {missing} that rollout.async_lag "
                             f"{self.lag} samples the next steps with")


class SamplingPolicy:
    """The policy that samples each step, as the loop sees it: the learner's current adapter (synchronous), or
    under rollout.async_lag the kept version after step t - 1 - k (`LaggedPolicies`), sampled by the learner's
    model with that version swapped in or by the worker (`Ahead`) with its own copy."""

    def __init__(self, model, lagged: LaggedPolicies | None = None, ahead: Ahead | None = None):
        self.model, self.lagged, self.ahead = model, lagged, ahead

    def of(self, step: int) -> tuple[int, str | None]:
        """(version, adapter digest) of the policy that samples `step`: the adapter after step `version`."""
        if self.lagged:
            version = self.lagged.version_for(step)
            return version, self.lagged.digest(version)
        from ..modeling import adapter_digest

        return step - 1, adapter_digest(self.model)

    def holding(self, step: int):
        """A context in which the learner's model holds the policy that samples `step` (its weights put back
        after)."""
        return self.lagged.active(self.model, self.lagged.version_for(step)) if self.lagged else contextlib.nullcontext()

    def updated(self, step: int) -> dict[str, float]:
        """After step `step`'s update: keep the new version, hand it to the worker (which then samples step
        step + 1 + k); -> the step's `async/lag` metric (how many steps its sampling policy was behind)."""
        if not self.lagged:
            return {}
        self.lagged.record(step, self.model)
        if self.ahead is not None:
            self.ahead.after_update(step)
        return {"async/lag": step - 1 - self.lagged.version_for(step)}


class Lookahead:
    """A fixed lag over an engine with weights of its own (a vLLM server, `engines.Engine.owns_versions`): the
    schedule of `Ahead`, the engine's requests for step u in flight from the moment the version that samples u
    exists (the server is the worker). Every process asks for its share of the prompts."""

    def __init__(self, engine, cfg, collector, lagged: LaggedPolicies, start: int):
        self.engine, self.cfg, self.collector, self.lagged = engine, cfg, collector, lagged
        self.pending: dict[int, tuple[list[int], list[int], int, object]] = {}  # step -> (rows, seeds, version, future)
        for v in sorted(lagged.versions):
            engine.add_version(v, lagged.versions[v], min(lagged.versions))
        for step in range(start + 1, start + 2 + lagged.lag):
            self._request(step)

    def _request(self, step: int) -> None:
        if step > self.cfg.run.steps:
            return
        idx, seeds = self.collector.take_prompts(step)
        version = self.lagged.version_for(step)
        future = self.engine.submit([self.collector.prompt_texts[i] for i in idx], seeds, version, step)
        self.pending[step] = (idx, seeds, version, future)

    def after_update(self, step: int) -> None:
        """Version `step` exists: load it (the versions no pending step needs unloaded) and ask for the step it
        samples."""
        self.engine.add_version(step, self.lagged.versions[step], self.lagged.version_for(step + 1))
        self._request(step + 1 + self.lagged.lag)

    def take(self, step: int):
        """(rows, seeds, Generation) of `step`, waiting for the engine (its errors are one line)."""
        idx, seeds, _, future = self.pending.pop(step)
        return idx, seeds, future.result()

    def close(self) -> None:
        """Drop the requests still in flight (the engine is closed by its run)."""
        for *_, future in self.pending.values():
            future.cancel()
        self.pending = {}


class Ahead:
    """The worker process of a fixed lag: asked for step u's prompts (taken from the data order when asked)
    and seeds with the version that samples u, it answers in step order (`take`). Messages go over one pipe
    each way; the learner's side sends through a thread of its own, so a message of a few MB never waits for
    a worker busy sampling (and, unlike a multiprocessing.Queue, no semaphore is left behind by a killed
    worker)."""

    def __init__(self, cfg, dtype: str, device: str, collector, lagged: LaggedPolicies, start: int, spec=None):
        ctx = torch.multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.cfg, self.collector, self.lagged = cfg, collector, lagged
        self.pending: dict[int, tuple[list[int], list[int], int]] = {}  # step -> (rows, seeds, version)
        self.ready = False  # the worker has loaded the model
        self.proc = ctx.Process(target=_work, name="docuchat-rl-sampler", daemon=True,
                                args=(cfg.to_dict(), dtype, device, cfg.rollout.async_worker_threads, child,
                                      os.getpid(), spec))
        with _signals_ignored():  # (the worker starts ignoring them: Python keeps an ignored SIGINT ignored)
            self.proc.start()
        child.close()
        self._outgoing: queue.SimpleQueue = queue.SimpleQueue()
        self._sender = threading.Thread(target=self._send_loop, name="docuchat-rl-sampler-send", daemon=True)
        self._sender.start()
        for v in sorted(lagged.versions):
            self._outgoing.put(("version", v, _bytes(lagged.versions[v]), min(lagged.versions)))
        for step in range(start + 1, start + 2 + lagged.lag):
            self._request(step)

    def _send_loop(self) -> None:
        while True:
            msg = self._outgoing.get()
            try:
                self.conn.send(msg)
            except (OSError, ValueError):  # (the worker is gone, or the pipe closed after it: `take` says so)
                return
            if msg is None:
                return

    def _request(self, step: int) -> None:
        if step > self.cfg.run.steps:
            return
        idx, seeds = self.collector.take_prompts(step)
        version = self.lagged.version_for(step)
        self.pending[step] = (idx, seeds, version)
        self._outgoing.put(("sample", step, version, [self.collector.prompt_texts[i] for i in idx], seeds))

    def after_update(self, step: int) -> None:
        """Version `step` exists: send it (the worker drops the versions no pending step needs) and ask for
        the step it samples."""
        self._outgoing.put(("version", step, _bytes(self.lagged.versions[step]), self.lagged.version_for(step + 1)))
        self._request(step + 1 + self.lagged.lag)

    def take(self, step: int):
        """(rows, seeds, Generation) of `step`, waiting for the worker; a dead or silent worker is a
        TrainingError in one line."""
        idx, seeds, version = self.pending.pop(step)
        limit = self.cfg.rollout.async_timeout_s
        # (until the worker has loaded the model, loading's own allowance: a cold start under load is slow)
        deadline = time.monotonic() + (limit if self.ready else max(limit, LOAD_ALLOWANCE_S))
        while True:
            ready = False
            try:
                ready = self.conn.poll(1.0)
                kind, done, payload = self.conn.recv() if ready else (None, None, None)
            except (EOFError, OSError):
                ready = False
                self.proc.join(timeout=5)
            if not ready:
                if not self.proc.is_alive():
                    code = self.proc.exitcode
                    how = f"signal {-code}" if code is not None and code < 0 else f"exit code {code}"
                    doing = (f"sampling step {step} with adapter version {version}" if self.ready else
                             "starting (before it had loaded the model)")
                    raise TrainingError(f"the sampler worker (pid {self.proc.pid}) died ({how}) while {doing}; the "
                                        "last checkpoint is intact") from None
                if time.monotonic() > deadline:
                    raise TrainingError(f"the sampler worker (pid {self.proc.pid}) did not deliver step {step} "
                                        f"(adapter version {version}) within rollout.async_timeout_s ({limit:g} s); "
                                        "the last checkpoint is intact") from None
                continue
            if kind == "ready":  # (loaded: the limit counts from here, not from the worker's start)
                self.ready, deadline = True, time.monotonic() + limit
                continue
            if kind == "start-error":
                raise TrainingError(f"the sampler worker (pid {self.proc.pid}) could not start: {payload}")
            if kind == "error":
                raise TrainingError(f"the sampler worker failed on step {done} (adapter version {version}): "
                                    f"{payload}")
            if done == step:
                return idx, seeds, payload

    def close(self) -> None:
        """Stop the worker: at once when it is still sampling ahead (not needed after the run), else let it
        leave its loop."""
        self._outgoing.put(None)  # (the sending thread delivers it after what it has, then leaves; a stuck worker
        # never reads it, so the wait is short and the kill follows)
        if self.proc.is_alive():
            self.proc.join(timeout=0.0 if self.pending else 5.0)
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=10)
        # (a send to the dead worker fails at once and ends the thread: the pipe closed under a send in flight
        # would raise outside the caught errors, a traceback after the run's one line)
        self._sender.join(timeout=10)
        self.conn.close()


@contextlib.contextmanager
def _signals_ignored():
    """SIGINT and SIGTERM ignored while the block starts a worker, which inherits that: a signal to the whole
    process group (Ctrl-C in a terminal, Slurm's preemption) then reaches the learner alone, which stops at
    its safe point with a checkpoint; the worker answers until then and dies with it (PR_SET_PDEATHSIG)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _bytes(state: dict[str, torch.Tensor]) -> bytes:
    """An adapter version as safetensors bytes: plain data through the pipe (torch's tensor pickling would
    share file descriptors through a server thread, which a stopped or killed worker leaves hanging)."""
    import safetensors.torch

    return safetensors.torch.save(state)


def _work(cfg_dict: dict, dtype: str, device: str, threads: int, conn, parent: int, spec=None) -> None:
    """The worker process: the base model with the run's LoRA layout, sampling each asked step with the
    adapter version it names, through the same function as the learner's process (engines.sample_rows); with
    `spec` (a vllm_engine.EngineSpec, rollout.engine vllm) a vLLM engine that serves the versions as LoRA
    adapters instead."""
    import ctypes
    import warnings

    import safetensors.torch

    from ..config import config_from_dict

    for s in (signal.SIGINT, signal.SIGTERM):  # (the learner's to handle: it stops this worker when it stops)
        signal.signal(s, signal.SIG_IGN)
    try:  # die with the learner, even a kill -9 of it
        ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() != parent:
        return
    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)  # (cli.main)
    from tqdm import tqdm
    from transformers.utils import logging as hf_logging

    tqdm.set_lock(threading.RLock())  # (tqdm's default lock is a multiprocessing one, left behind by a kill)
    hf_logging.disable_progress_bar()  # (the learner shows the loading)
    torch.set_num_threads(threads)
    try:
        from transformers import AutoTokenizer

        from ..distributed import Dist
        from .engines import EngineContext, LocalEngine, VLLMColocated

        # (the learner's decided dtype and its device: the worker samples what the learner's process would)
        cfg = config_from_dict(cfg_dict, [f"model.dtype={dtype}", f"model.device={device}"])
        if spec is not None:  # vLLM's LoRA mode: the base weights once, each version a LoRA adapter
            m = cfg.model
            tok = AutoTokenizer.from_pretrained(m.name_or_path, trust_remote_code=m.trust_remote_code,
                                                revision=m.revision)
            serve = VLLMColocated(EngineContext(cfg, tok, None, Dist()), spec)
        else:  # its own copy of the model (and tokenizer), each version put into its LoRA weights
            serve = LocalEngine(EngineContext(cfg, None, None, Dist()))
    except Exception as e:  # (said by the learner in one line, as a start that failed)
        conn.send(("start-error", None, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"))
        return
    conn.send(("ready", None, None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        if msg[0] == "version":
            _, v, state, keep_from = msg
            serve.add_version(v, safetensors.torch.load(state), keep_from)
            continue
        _, step, version, prompts, seeds = msg
        try:
            t0 = time.perf_counter()
            with torch.no_grad():
                gen = serve.generate(prompts, seeds, version, step)
            gen.seconds = time.perf_counter() - t0
            reply = ("done", step, gen)
        except Exception as e:  # (said by the learner in one line)
            reply = ("error", step, f"{type(e).__name__}: {e}")
        try:
            conn.send(reply)
        except (EOFError, OSError):
            return
