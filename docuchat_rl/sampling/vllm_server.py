"""vLLM's own servers as the rollout engine (`rollout.engine: vllm`, `rollout.vllm.mode: server`), on GPUs or
machines of their own, as TRL's `vllm_mode: server` and its async GRPO.

The server is vLLM's OpenAI-compatible one, started by the user (`docuchat-rl serve` prints and runs the
command): nothing of ours runs inside it. This engine speaks HTTP to it:
- Versions. After each update the adapter (the LoRA tensors and peft's adapter_config.json) is written once
  to `rollout.vllm.adapter_dir` (default: the run folder's `vllm-adapters/`, which the servers must be able
  to read) and loaded into every server as `policy-v{N}-{run}` (`POST /v1/load_lora_adapter`, vLLM's runtime LoRA
  loading); versions no pending step needs are unloaded and their folders deleted. Every request names the
  version it samples with, and the trace records it (`policy_version`, `adapter_sha256`). No weights are
  merged and no NCCL group is needed.
- Requests. One completion per request (`n` 1), with that completion's own seed (`generation.row_seed`),
  the prompt as token ids, exactly the configured temperature/top-k/top-p, the stop ids, and the sampled
  token's log-prob (`logprobs` 0; the server must run with `--logprobs-mode processed_logprobs` for that to
  be the sampler's own). One request per completion, not `n = G` per prompt (vLLM seeds child k of an `n`
  request with `seed + k`; our row seeds are hashes, `generation.row_seed`): a completion then depends on
  its own seed alone (not on the group size, the batching, or which server answered), which is what makes a
  run resume and replay with the same completions and sample what the colocated engine samples; the G rows of a prompt go to
  the same server, whose prefix cache shares the prompt's computation. Prompts are spread over the servers
  (`server_base_url` a list: data-parallel servers) round-robin, requests sent concurrently.
- Checks at start (`GET /v1/models`, then loading the first version): the server answers, serves the
  configured base model, and takes LoRA adapters at run time of this rank; each refusal is one line naming
  the server flag or variable to change.
- Faults: a server that does not answer, answers with an error or takes longer than `rollout.vllm.timeout_s`
  ends the run in one line naming the URL, the step and the version (the last checkpoint intact); `--resume`
  sends the same requests again (same seeds, the versions reloaded from the checkpoint).

Several training processes share the servers: each sends its own share of the prompts; the main process
writes and loads each version, the others wait for it (a barrier) before they ask for it.

Deliberately left out: NCCL weight broadcast of merged weights (TRL's `trl vllm-serve`: it needs the
trainer and the servers in one process group and merges the adapter); streaming; a server's own scheduling
priorities.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
import shutil
import sys
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import torch

from ..errors import TrainingError
from .engines import Engine, EngineContext, register_engine
from .generation import Generation, eos_ids



class ServerError(TrainingError):
    """A vLLM server that cannot serve the run: the message names the URL and what to change."""


class NotListening(ServerError):
    """Nothing listens at the URL yet (connection refused): a server still loading, worth waiting for."""


def one_line(text: str, most: int = 200) -> str:
    """A server's answer that is not JSON as one short line: an HTML page by its title (else its text without
    tags), any text with its whitespace collapsed.

    >>> one_line("<html>\\n<head><title>404 Not Found</title></head>\\n<body>\\n<h1>Not Found</h1>\\n</body></html>")
    'an HTML page: 404 Not Found'
    >>> one_line("Bad Gateway\\n\\nupstream   gone")
    'Bad Gateway upstream gone'
    """
    title = re.search(r"<title[^>]*>(.*?)</title>", text, re.I | re.S)
    if title or re.match(r"\s*<(!doctype|html)", text, re.I):
        body = title.group(1) if title else re.sub(r"<[^>]+>", " ", text)
        return "an HTML page: " + " ".join(body.split())[:most]
    return " ".join(text.split())[:most]


def _call(url: str, path: str, body: dict | None, timeout: float) -> dict | str:
    """One HTTP call to a vLLM server (GET without a body) -> its JSON (or text) answer; raises ServerError
    with the server's own message, or with what went wrong on the way."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read().decode()
    except urllib.error.HTTPError as e:
        raw = e.read().decode(errors="replace")
        try:
            message = json.loads(raw)["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = one_line(raw) or e.reason
        raise ServerError(f"HTTP {e.code}: {message}") from None
    except (urllib.error.URLError, ConnectionError) as e:
        reason = getattr(e, "reason", e)
        kind = NotListening if isinstance(reason, ConnectionRefusedError) else ServerError
        raise kind(f"no answer ({reason})") from None
    except TimeoutError:
        raise ServerError(f"no answer within rollout.vllm.timeout_s ({timeout:g} s)") from None
    try:
        return json.loads(text)
    except ValueError:
        return text


@register_engine("vllm-server")
class VLLMServer(Engine):
    """The rollout engine on vLLM servers (see the module docstring)."""

    owns_versions = True

    @classmethod
    def check(cls, ctx: EngineContext) -> None:
        if ctx.sharded:  # (each version would be gathered from the shards)
            raise TrainingError("rollout.vllm.mode server with FSDP2 sharding is not built: use accelerate's "
                                "data-parallel launch (each process holds the whole adapter)")

    def __init__(self, ctx: EngineContext):
        super().__init__(ctx)
        v, r = ctx.cfg.rollout.vllm, ctx.cfg.rollout
        urls = v.server_base_url if isinstance(v.server_base_url, list) else [v.server_base_url]
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout, self.startup_timeout = v.timeout_s, v.startup_timeout_s
        self.folder = Path(v.adapter_dir) if v.adapter_dir else Path(ctx.out_dir) / "vllm-adapters"
        # (the run's own names: two runs sharing a server or an adapter_dir never sample each other's versions)
        self.tag = hashlib.sha256(str(Path(ctx.out_dir or ".").resolve()).encode()).hexdigest()[:8]
        self.loaded: set[int] = set()
        self.stop = eos_ids(ctx.model, ctx.tokenizer)
        fields = ctx.model.peft_config["default"].to_dict()
        self.adapter_config = json.dumps({k: sorted(x) if isinstance(x, set) else x for k, x in fields.items()},
                                         default=str)
        self.rank = int(fields["r"])
        self._rows = ThreadPoolExecutor(max_workers=max(4, min(64, r.batch_rows)), thread_name_prefix="vllm-request")
        self._steps = ThreadPoolExecutor(max_workers=r.async_lag + 2, thread_name_prefix="vllm-step")
        for url in self.urls:
            self._check(url)

    def _check(self, url: str) -> None:
        """The server answers (waiting up to rollout.vllm.startup_timeout_s for one still loading) and serves the
        configured base model."""
        want = self.ctx.cfg.model.name_or_path
        deadline, waited = time.monotonic() + self.startup_timeout, False
        while True:
            try:
                models = _call(url, "/v1/models", None, min(self.timeout, 60.0))
                break
            except ServerError as e:
                if not isinstance(e, NotListening) or time.monotonic() >= deadline:  # (an error, a hang: at once)
                    more = (f" after waiting rollout.vllm.startup_timeout_s ({self.startup_timeout:g} s)"
                            if waited else "")
                    raise ServerError(f"rollout.vllm.server_base_url {url}: {e}{more}; start the server first "
                                      "(docuchat-rl serve prints its command)") from None
                if not waited:
                    print(f"docuchat-rl: waiting for the vLLM server at {url} (up to rollout.vllm.startup_timeout_s, "
                          f"{self.startup_timeout:g} s): {e}", file=sys.stderr, flush=True)
                waited = True
                time.sleep(min(2.0, max(0.0, deadline - time.monotonic())))
        if not isinstance(models, dict):  # (a web server that is not vLLM's answers with a page)
            raise ServerError(f"rollout.vllm.server_base_url {url}: /v1/models answered {one_line(str(models))!r}, "
                              "not vLLM's JSON: is the URL a vLLM server?")
        served = [m for m in models.get("data", []) if not m.get("parent")]
        names = {m.get("id") for m in served} | {m.get("root") for m in served}
        if not any(n == want or (n and Path(n).resolve() == Path(want).resolve()) for n in names):
            raise ServerError(f"the vLLM server {url} serves {sorted(n for n in names if n)}, not model.name_or_path "
                              f"{want!r}: start it with --model {want}")

    # ------------------------------------------------------------------------------------------ versions
    def name(self, version: int) -> str:
        """Version `version`'s LoRA name on the servers and its folder's name: `policy-v{N}-{the run's tag}`."""
        return f"policy-v{version}-{self.tag}"

    def begin_step(self, model, version: int) -> None:
        """Synchronous loop: the learner's adapter now is `version`: loaded unless it is already."""
        if version not in self.loaded:
            from peft import get_peft_model_state_dict

            state = {k: t.detach().to("cpu") for k, t in get_peft_model_state_dict(model, adapter_name="default").items()}
            self.add_version(version, state, keep_from=version)

    def add_version(self, version: int, state: dict[str, torch.Tensor], keep_from: int) -> None:
        """Write version `version` once and load it into every server (main process); unload the versions
        before `keep_from`; every process waits until it is loaded."""
        dist = self.ctx.dist
        if dist.is_main:
            from safetensors.torch import save_file

            folder = self.folder / self.name(version)
            folder.mkdir(parents=True, exist_ok=True)
            save_file(state, str(folder / "adapter_model.safetensors"))
            (folder / "adapter_config.json").write_text(self.adapter_config)
            for url in self.urls:
                self._load(url, version, folder)
            for old in sorted(v for v in self.loaded if v < keep_from):
                for url in self.urls:
                    try:
                        _call(url, "/v1/unload_lora_adapter", {"lora_name": self.name(old)}, self.timeout)
                    except ServerError:  # (already gone with a restarted server: nothing to free)
                        pass
                shutil.rmtree(self.folder / self.name(old), ignore_errors=True)
        self.loaded = {v for v in self.loaded if v >= keep_from} | {version}
        dist.barrier()

    def _load(self, url: str, version: int, folder: Path) -> None:
        # (load_inplace: a name the server holds already, from before a resume, takes these tensors)
        body = {"lora_name": self.name(version), "lora_path": str(folder.resolve()), "load_inplace": True}
        try:
            _call(url, "/v1/load_lora_adapter", body, self.timeout)
        except ServerError as e:
            text = str(e)
            if text.startswith("no answer"):  # (a server that died or hangs: the step's own words)
                raise ServerError(f"the vLLM server {url} failed while loading adapter version {version} (the policy "
                                  f"after step {version}): {text}; the last checkpoint is intact") from None
            if "HTTP 404" in text and "Not Found" in text:
                how = ("start it with VLLM_ALLOW_RUNTIME_LORA_UPDATING=True in its environment and --enable-lora "
                       "(runtime LoRA loading is off)")
            elif "max_lora_rank" in text:
                how = f"start it with --max-lora-rank {max(8, 1 << (self.rank - 1).bit_length())} or more (lora.r is {self.rank})"
            elif "lora" in text.lower() and "enable" in text.lower():
                how = "start it with --enable-lora"
            elif "No adapter found" in text or "not exist" in text:
                how = (f"the server must read {folder.parent} (rollout.vllm.adapter_dir: a folder both machines "
                       "see)")
            else:
                how = "see the server's log"
            raise ServerError(f"the vLLM server {url} did not load adapter version {version}: {text}; {how}") from None

    # ----------------------------------------------------------------------------------------- sampling
    def generate(self, prompts: list[str], seeds: list[int], version: int, step: int | None = None) -> Generation:
        r, tok = self.ctx.cfg.rollout, self.ctx.tokenizer
        ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
        return self._sample(ids, r.num_generations, seeds, version, step, r.max_new_tokens, r.min_new_tokens)

    def continue_rows(self, ids: list[list[int]], seeds: list[int], version: int, step: int | None,
                      max_new_tokens: int) -> Generation:
        return self._sample([list(i) for i in ids], 1, seeds, version, step, max_new_tokens, 0)

    def _sample(self, ids: list[list[int]], g: int, seeds: list[int], version: int, step: int | None,
                max_new_tokens: int, min_new_tokens: int) -> Generation:
        """`g` completions of each prompt's token ids, row r from seeds[r], one request per row."""
        r = self.ctx.cfg.rollout
        if len(seeds) != len(ids) * g:
            raise ValueError(f"{len(seeds)} row seeds for {len(ids) * g} rows")
        t0 = time.perf_counter()
        futures = []
        for i, p in enumerate(ids):
            url = self.urls[i % len(self.urls)]  # (a prompt's rows on one server: its prefix cache)
            for s in range(g):
                body = {"model": self.name(version), "prompt": p, "n": 1, "seed": seeds[i * g + s],
                        "max_tokens": max_new_tokens, "min_tokens": min_new_tokens, "temperature": r.temperature,
                        "top_p": r.top_p, "top_k": r.top_k if r.top_k > 0 else -1, "logprobs": 0,
                        "stop_token_ids": self.stop, "ignore_eos": False, "skip_special_tokens": True,
                        "return_token_ids": True, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                        "frequency_penalty": 0.0, "min_p": 0.0}
                futures.append((url, self._rows.submit(_call, url, "/v1/completions", body, self.timeout)))
        gen = Generation([], [], [], [])
        for row, (url, future) in enumerate(futures):
            try:
                answer = future.result()
                choice = answer["choices"][0]
                tokens = [int(t) for t in choice["token_ids"]]
                logps = [float(x) for x in choice["logprobs"]["token_logprobs"]]
            except ServerError as e:
                where = f"step {step}" if step is not None else "a step"
                raise ServerError(f"the vLLM server {url} failed while sampling {where} with adapter version "
                                  f"{version}: {e}; the last checkpoint is intact") from None
            except (KeyError, IndexError, TypeError, ValueError) as e:
                raise ServerError(f"the vLLM server {url} answered without token ids and log-probs ({e}): is it "
                                  "vLLM's OpenAI-compatible server?") from None
            gen.prompt_ids.append(ids[row // g])
            gen.completion_ids.append(tokens)
            gen.truncated.append(choice.get("finish_reason") == "length" and not (tokens and tokens[-1] in self.stop))
            gen.logps.append(logps)
        gen.seconds = time.perf_counter() - t0
        return gen

    def submit(self, prompts: list[str], seeds: list[int], version: int, step: int) -> Future:
        """The step's requests sent now; the learner takes the Generation when it needs it (a fixed lag: while
        it updates the step before)."""
        return self._steps.submit(self.generate, prompts, seeds, version, step)

    def close(self) -> None:
        """Stop waiting for answers; unload the versions this run loaded (main process) and delete their folders
        (and adapter_dir itself when that leaves it empty)."""
        self._rows.shutdown(wait=False, cancel_futures=True)
        self._steps.shutdown(wait=False, cancel_futures=True)
        if self.ctx.dist.is_main:
            for v in sorted(self.loaded):
                for url in self.urls:
                    try:
                        _call(url, "/v1/unload_lora_adapter", {"lora_name": self.name(v)}, 10.0)
                    except ServerError:
                        pass
                shutil.rmtree(self.folder / self.name(v), ignore_errors=True)
            with contextlib.suppress(OSError):  # (not empty: another run's versions, or the user's files)
                self.folder.rmdir()
        self.loaded = set()


def serve_command(cfg, port: int, python: str, extra: list[str], cpu: bool = False) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) of the vLLM server a recipe's server mode needs (`docuchat-rl serve`): vLLM's own
    OpenAI-compatible server on the recipe's base model, runtime LoRA loading on, room for the versions a fixed
    lag keeps in use (lag + 2, at least 4: a recipe served for lag 0 still takes --set rollout.async_lag=2),
    LoRA rank rounded up to vLLM's sizes, the sampler's processed log-probs; on a machine without CUDA
    (`cpu`), a token budget in which no prompt's prefill is split (vLLM's CPU build cannot rewind a seeded
    request's generator after a chunked prefill: "CPU Generator does not use offset" kills its engine);
    `extra` (vLLM's own flags) last."""
    r, rank = cfg.rollout, cfg.lora.r
    dtype = {"bf16-mixed": "bfloat16", "bf16-autocast": "bfloat16", "bfloat16": "bfloat16",
             "float32": "float32"}.get(cfg.model.dtype)
    rows = max(r.batch_rows, 8)
    argv = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", cfg.model.name_or_path,
            "--port", str(port), "--enable-lora", "--max-loras", str(max(4, r.async_lag + 2)),
            "--max-lora-rank", str(max(8, 1 << (rank - 1).bit_length())), "--logprobs-mode", "processed_logprobs",
            "--seed", str(cfg.run.seed), *(["--dtype", dtype] if dtype else []),  # (auto: vLLM's own choice)
            "--max-num-seqs", str(rows)]
    if cpu and "--max-num-batched-tokens" not in extra:  # (as the colocated engine sets it, vllm_engine.py)
        longest = cfg.rollout.vllm.max_model_len or cfg.data.max_prompt_tokens + r.max_new_tokens
        argv += ["--max-num-batched-tokens", str(max(8192, longest * rows))]
    argv += extra
    if cfg.model.trust_remote_code:
        argv.insert(argv.index("--port"), "--trust-remote-code")
    return argv, {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
