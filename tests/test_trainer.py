"""End-to-end runs of the real trainer on the committed tiny model: schema, exact resume, bad inputs."""

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import yaml

from docuchat_rl.checkpoint import resolve_resume
from docuchat_rl.config import load_config
from docuchat_rl.data import DataError, load_split
from docuchat_rl.outputs import read_jsonl
from docuchat_rl.trainer import MEASURED, Timer, Trainer, TrainingError

from .conftest import MODEL, ROOT, TASK

FAST = ["rollout.prompts_per_step=2", "rollout.num_generations=4", "rollout.max_new_tokens=24",
        "logging.progress=false", "eval.before_and_after=false", "run.threads=2"]
TRACE_KEYS = {"run_id", "step", "prompt_id", "group", "sample", "used", "prompt", "completion", "gold", "slot", "seed",
              "completion_ids", "policy_version", "adapter_sha256", "sampling", "versions",
              "completion_tokens", "truncated", "rewards", "total", "total_missing", "advantage", "turns",
              "observation"}


def cfg_for(tmp_path, *extra):
    """The default recipe shrunk by FAST; `algorithm.name=X` among `extra` starts X from its defaults
    (the default recipe's GRPO keys do not apply to another algorithm)."""
    recipe = ROOT / "config" / "default.yaml"
    algo = next((e.split("=", 1)[1] for e in extra if e.startswith("algorithm.name=")), None)
    if algo is not None:
        raw = yaml.safe_load(recipe.read_text())
        raw["algorithm"] = {"name": algo}
        recipe = Path(tempfile.mkdtemp()) / f"{algo}.yaml"
        recipe.write_text(yaml.safe_dump(raw))
    return load_config(recipe, FAST + [f"run.output_dir={tmp_path}", *extra])


def untimed(records):
    """Records without timings and without the run id (two separate runs compared)."""
    return [{k: v for k, v in r.items() if not k.startswith(MEASURED) and k != "run_id"} for r in records]


@pytest.mark.slow
def test_two_steps_write_adapter_metrics_and_traces(tmp_path):
    cfg = cfg_for(tmp_path, "run.steps=2", "checkpoint.every=1", "checkpoint.keep_last=1",
                  "algorithm.beta=0.05", "eval.every=2", "eval.limit=8", f"eval.also={{again: {TASK}/test.jsonl}}")
    t = Trainer(cfg)
    history = t.train()
    t.close()
    assert [m["step"] for m in history] == [1, 2]
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2"]  # keep_last 1
    assert (tmp_path / "latest").read_text().strip() == "checkpoint-2"
    traces = read_jsonl(tmp_path / "traces.jsonl")
    assert len(traces) == 2 * 2 * 4 and all(set(r) == TRACE_KEYS for r in traces)
    r = traces[0]
    assert set(r["rewards"]) == {"correctness", "format"}
    assert set(r["rewards"]["format"]) == {"raw", "weight", "weighted", "info", "error"}
    assert r["total"] == pytest.approx(sum(c["weighted"] or 0 for c in r["rewards"].values()))
    # per group: advantages are centred (GRPO), one group per prompt
    for step in (1, 2):
        for g in range(2):
            adv = [x["advantage"] for x in traces if x["step"] == step and x["group"] == g]
            assert len(adv) == 4 and sum(adv) == pytest.approx(0.0, abs=1e-5)
    metrics = read_jsonl(tmp_path / "metrics.jsonl")
    for key in ("reward/mean", "reward/std", "rewards/correctness/mean", "rewards/format/errors", "accuracy",
                "zero_std_frac", "completion_len/mean", "completion_len/max", "truncated_frac", "kl",
                "entropy", "clip_low", "clip_high", "grad_norm", "lr", "time/rollout", "time/score",
                "time/advantages", "time/update", "rollout_tokens_per_s"):
        assert key in metrics[0], key
    assert metrics[0]["kl"] is not None and metrics[0]["kl"] >= 0  # beta > 0: reference forward ran
    evals = read_jsonl(tmp_path / "eval.jsonl")  # eval.every=2: one periodic evaluation, in the metrics too
    assert [e["step"] for e in evals] == [2] and evals[0]["rows"] == 8
    assert "eval/accuracy" not in metrics[0] and metrics[1]["eval/accuracy"] == evals[0]["accuracy"]
    # eval.also: the same rows again under their own name give the same numbers (greedy)
    own = {k: v for k, v in evals[0].items() if k not in ("step", "minutes", "seconds") and not k.startswith("again/")}
    assert {f"again/{k}": v for k, v in own.items()} == \
        {k: v for k, v in evals[0].items() if k.startswith("again/") and k != "again/seconds"}
    assert evals[0]["again/rows"] == 8
    assert metrics[1]["eval/again/accuracy"] == evals[0]["accuracy"]

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(MODEL)
    adapted = PeftModel.from_pretrained(base, tmp_path / "checkpoint-2")
    lora = {k: v for k, v in adapted.state_dict().items() if "lora_B" in k}
    assert lora and any(v.abs().sum() > 0 for v in lora.values())  # the adapter was trained
    run_cfg = json.loads((tmp_path / "checkpoint-2" / "run_config.json").read_text())
    assert run_cfg["step"] == 2 and run_cfg["config"]["algorithm"]["beta"] == 0.05


class Crash(Exception):
    pass


@pytest.mark.slow
@pytest.mark.parametrize("extra,crash_at", [
    # mu = 2, two minibatches of two micro-batches: 8 loss calls a step; die in the 2nd iteration
    (["algorithm.num_iterations=2", "optim.minibatch_size=4", "optim.micro_batch_size=2"], 5),
    # dynamic sampling draws a varying number of prompts: the sampler position must resume too; with a
    # curriculum (levels 2, 3, 4 of the embedded task) raised at steps 1 and 2: checkpoint-2's data position
    # was taken before step 2's log raised the level
    (["rollout.dynamic_sampling=true", "algorithm.loss_aggregation=dapo", "data.curriculum.start=2",
      "data.curriculum.promote_at=0.01", "data.curriculum.window=1"], 1),
], ids=["mu2-minibatches", "dynamic-sampling-curriculum"])
def test_resume_inside_a_mu_cycle_matches_the_uninterrupted_run(tmp_path, extra, crash_at):
    opts = ["run.steps=4", "checkpoint.every=2", *extra]
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    t = Trainer(cfg_for(full_dir, *opts))
    t.train()
    t.close()

    t = Trainer(cfg_for(cut_dir, *opts))
    calls, real_loss = [0], t.learner.algo.loss

    def crashing_loss(*a, **k):  # die inside step 4 (t.step counts completed steps)
        if t.step == 3:
            calls[0] += 1
            if calls[0] == crash_at:
                raise Crash
        return real_loss(*a, **k)

    t.learner.algo.loss = crashing_loss
    with pytest.raises(Crash):
        t.train()
    t.close()
    # step 3 was logged but never checkpointed: its records are on disk past checkpoint-2's offsets
    assert max(r["step"] for r in read_jsonl(cut_dir / "traces.jsonl")) == 3
    assert (cut_dir / "latest").read_text().strip() == "checkpoint-2"

    t = Trainer(cfg_for(cut_dir, *opts), resume="latest")
    assert t.step == 2
    t.train()
    t.close()
    for name in ("traces.jsonl", "metrics.jsonl"):
        full, cut = read_jsonl(full_dir / name), read_jsonl(cut_dir / name)
        assert len(cut) == len(full)  # nothing lost, nothing written twice
        assert untimed(cut) == untimed(full)
    assert len({r["run_id"] for r in read_jsonl(cut_dir / "traces.jsonl")}) == 1  # the resume kept its id
    if any(e.startswith("data.curriculum") for e in extra):  # the levels rose, and each step drew up to its own
        metrics = read_jsonl(full_dir / "metrics.jsonl")
        assert [m["curriculum/level"] for m in metrics] == [2, 3, 4, 4]
        levels = [e.columns["answer"].count("<<") for e in load_split(t.cfg.data, "train")]
        for r in read_jsonl(full_dir / "traces.jsonl"):
            assert levels[r["prompt_id"]] <= metrics[r["step"] - 1]["curriculum/level"], r["step"]
        assert {levels[r["prompt_id"]] for r in read_jsonl(full_dir / "traces.jsonl") if r["step"] == 1} == {2}
    from safetensors.torch import load_file

    a = load_file(full_dir / "checkpoint-4" / "adapter_model.safetensors")
    b = load_file(cut_dir / "checkpoint-4" / "adapter_model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_kill_9_leaves_a_usable_checkpoint_and_traces(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "docuchat_rl", "train", "--config", str(ROOT / "config" / "default.yaml"),
           *[a for s in FAST + [f"run.output_dir={out}", "run.steps=50", "checkpoint.every=1"]
             for a in ("--set", s)]]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 120
    while time.time() < deadline and not (out / "checkpoint-2").exists():
        time.sleep(0.2)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (out / "checkpoint-2").exists(), proc.stderr.read().decode()[-2000:]
    newest = resolve_resume("latest", out)  # (the kill may fall between its rename and `latest`'s)
    state = json.loads((newest / "trainer_state.json").read_text())
    traces = read_jsonl(out / "traces.jsonl")
    assert {r["step"] for r in traces} >= set(range(1, state["step"] + 1))
    # resume finishes the run with every step's records exactly once
    cfg = cfg_for(out, f"run.steps={state['step'] + 1}")
    t = Trainer(cfg, resume="latest")
    t.train()
    t.close()
    keys = [(r["step"], r["group"], r["sample"]) for r in read_jsonl(out / "traces.jsonl")]
    assert len(keys) == len(set(keys)) == (state["step"] + 1) * 8


def test_bad_inputs_fail_early_with_clear_errors(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(DataError, match="empty.jsonl"):
        Trainer(cfg_for(tmp_path, f"data.train={empty}"))
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"question": "one two " * 400, "answer": "#### 1"}) + "\n")
    with pytest.raises(TrainingError, match="row 0 has a prompt of .* tokens"):
        Trainer(cfg_for(tmp_path, f"data.train={long}", "rollout.prompts_per_step=1"))
    with pytest.raises(TrainingError, match="leaves no room for a prompt"):
        Trainer(cfg_for(tmp_path, "rollout.max_new_tokens=600"))


@pytest.mark.slow
@pytest.mark.parametrize("algo,extra", [
    ("ppo", ["algorithm.num_iterations=2", "optim.minibatch_size=4", "algorithm.ent_coef=0.01",
             "algorithm.beta=0.05", "algorithm.kl_in_reward=true"]),
    ("a2c", ["optim.name=rmsprop", "optim.eps=1e-5", "algorithm.n_steps=8", "algorithm.ent_coef=0.01"]),
    ("ppo", ["algorithm.critic_backbone=separate", "optim.minibatch_size=4"]),
], ids=["ppo", "a2c", "ppo-separate-critic"])
def test_actor_critic_runs_traces_values_and_resumes_bit_identically(tmp_path, algo, extra):
    opts = [f"algorithm.name={algo}", "rollout.num_generations=1", "rollout.prompts_per_step=8",
            "run.steps=3", "checkpoint.every=2", *extra]
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    t = Trainer(cfg_for(full_dir, *opts))
    history = t.train()
    t.close()
    for key in ("value/mean", "value/explained_variance", "value_loss", "entropy", "grad_norm"):
        assert key in history[0], key
    traces = read_jsonl(full_dir / "traces.jsonl")
    assert len(traces) == 3 * 8 and all(r["value"] is not None and r["advantage"] is not None for r in traces)
    t = Trainer(cfg_for(cut_dir, *opts))
    t.train(stop_after=2)
    t.close()
    t = Trainer(cfg_for(cut_dir, *opts), resume="latest")
    t.train()
    t.close()
    for name in ("traces.jsonl", "metrics.jsonl"):
        assert untimed(read_jsonl(cut_dir / name)) == untimed(read_jsonl(full_dir / name))
    from safetensors.torch import load_file

    files = ["critic.safetensors", "adapter_model.safetensors"]
    if "algorithm.critic_backbone=separate" in extra:
        files.append("critic/adapter_model.safetensors")  # the critic's own LoRA adapter
    for f in files:
        a, b = load_file(full_dir / "checkpoint-3" / f), load_file(cut_dir / "checkpoint-3" / f)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), f


@pytest.mark.slow
def test_model_stop_tokens_end_rollout_completions_and_leave_their_text(tmp_path):
    """model.stop_tokens reaches the rollout: a completion ends at the first stop token, which the rewards'
    text (the trace's completion) does not hold, and the sampling coordinate replay reads lists it."""
    from transformers import AutoTokenizer

    (newline,) = AutoTokenizer.from_pretrained(str(MODEL)).encode("\n", add_special_tokens=False)
    t = Trainer(cfg_for(tmp_path, "run.steps=1", 'model.stop_tokens=["\\n"]'))
    t.train()
    t.close()
    traces = read_jsonl(tmp_path / "traces.jsonl")
    assert newline in traces[0]["sampling"]["stop_ids"]
    ended = [r for r in traces if r["completion_ids"][-1] == newline]
    assert ended and all(not r["truncated"] and not r["completion"].endswith("\n") for r in ended)
    assert all(newline not in r["completion_ids"][:-1] for r in traces)


def test_data_set_columns_reach_the_rewards(tmp_path):
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"question": f"Ava has {i} apples. How many apples does Ava have now?",
                                        "answer": f"#### {i}", "level": i}) + "\n" for i in range(1, 5)))
    cfg = cfg_for(tmp_path, f"data.train={data}", "run.steps=1",
                  "rewards=[{name: correctness}, {name: 'tests.user_rewards:uses_level', weight: 0.0}]")
    t = Trainer(cfg)
    t.train()
    t.close()
    traces = read_jsonl(tmp_path / "traces.jsonl")
    for r in traces:  # the reward saw each row's own level column
        assert r["rewards"]["tests.user_rewards:uses_level"]["raw"] == float(r["prompt_id"] + 1)


def test_critic_lr_moves_the_value_head_at_its_own_rate(tmp_path):
    """algorithm.critic_lr puts the value head in its own optimizer group: Adam's first step moves each
    parameter by about its group's rate (sign of the gradient), so the head's bias moves by critic_lr and no
    LoRA weight by much more than optim.lr."""
    t = Trainer(cfg_for(tmp_path, "algorithm.name=ppo", "rollout.num_generations=1", "rollout.prompts_per_step=4",
                        "run.steps=1", "optim.lr=1e-4", "algorithm.critic_lr=0.05", "optim.max_grad_norm=null"))
    head = {n: p.detach().clone() for n, p in t.learner.algo.critic.named_parameters()}
    lora = {n: p.detach().clone() for n, p in t.learner.model.named_parameters() if p.requires_grad}
    t.train()
    head_moved = {n: (p.detach() - head[n]).abs().max().item() for n, p in t.learner.algo.critic.named_parameters()}
    lora_moved = max((p.detach() - lora[n]).abs().max().item() for n, p in t.learner.model.named_parameters()
                     if p.requires_grad)
    lrs = [g["lr"] for g in t.learner.optimizer.param_groups]
    t.close()
    assert lrs == [1e-4, 0.05]
    assert head_moved["v.bias"] == pytest.approx(0.05, rel=1e-3)
    assert 0 < lora_moved < 2e-4


def test_separate_critic_adapter_keeps_value_gradients_off_the_policy_adapter(tmp_path):
    """With critic_backbone=separate the value loss trains the critic's adapter and value head only, and
    the policy loss trains the policy adapter only; shared, the value loss reaches the policy adapter."""
    from docuchat_rl.learning.losses import Normalisers

    for backbone in ("separate", "shared"):
        t = Trainer(cfg_for(tmp_path / backbone, "algorithm.name=ppo", "rollout.num_generations=1",
                            "rollout.prompts_per_step=4", f"algorithm.critic_backbone={backbone}"))
        batch = t.prepare(t.collect(Timer()))
        t.advantages(batch, Timer())
        norm = Normalisers(rows=batch.rows, tokens=float(batch.completion_mask.sum()), max_new_tokens=24)
        grads = {}
        for part in ("value", "policy"):
            t.learner.optimizer.zero_grad(set_to_none=True)
            out = t.learner.forward(batch, with_entropy=True)
            if part == "value":
                loss = t.learner.algo.critic_terms(out, batch, norm, None)[0]
            else:
                loss = t.learner.algo.policy_loss(out, batch, norm)[0]
            loss.backward()
            grads[part] = {n for n, p in t.learner.model.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0}
        t.close()
        assert grads["policy"] and all(".default." in n for n in grads["policy"])
        if backbone == "separate":
            assert grads["value"] and all(".critic." in n for n in grads["value"])
        else:  # the value loss trains the policy's own adapter
            assert grads["value"] & grads["policy"]


def test_an_under_filled_batch_still_takes_the_configured_optimizer_steps(tmp_path):
    """Dynamic sampling out of rounds can leave fewer groups than prompts_per_step: the rollout must still
    take (batch_rows / minibatch_size) * num_iterations optimizer steps, so the schedule stays on time."""
    t = Trainer(cfg_for(tmp_path, "optim.minibatch_size=4", "optim.micro_batch_size=2",
                        "algorithm.num_iterations=2", "optim.schedule=linear"))
    batch = t.prepare(t.collect(Timer()))
    half = batch.select(torch.arange(4))  # one group of 4 instead of two
    t.advantages(half, Timer())
    m = t.update(half, Timer())
    t.close()
    assert m["optimizer_steps"] == 4 == t.learner.updates_per_step
    assert t.learner.scheduler.scheduler.last_epoch == 4  # the schedule moved exactly one step per optimizer step


@pytest.mark.slow
def test_a_run_samples_the_same_completions_whatever_the_generation_batch_size(tmp_path):
    """Each (step, prompt slot, sample) draws from its own stream: generation_batch_size changes nothing."""
    traces = {}
    for gbs in (64, 4):
        t = Trainer(cfg_for(tmp_path / str(gbs), "run.steps=2", f"rollout.generation_batch_size={gbs}"))
        t.train()
        t.close()
        traces[gbs] = [(r["step"], r["prompt_id"], r["sample"], r["completion"])
                       for r in read_jsonl(tmp_path / str(gbs) / "traces.jsonl")]
    assert traces[64] == traces[4] and len(traces[4]) == 16


@pytest.mark.slow
def test_reward_functions_written_as_trl_documents_them_score_in_a_real_run(tmp_path):
    """TRL's quick-start `reward_len(completions, **kwargs)`, `accuracy_reward(completions, solution, **kwargs)`
    on a data set column, an async function, `completion_ids`, and a function without **kwargs: each trace
    value equals a direct call on that completion (before, every call failed and the run trained nothing)."""
    import asyncio
    import importlib

    user = importlib.import_module("tests.user_rewards")
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"question": f"What is {i} + {i}?", "solution": str(2 * i)}) + "\n"
                            for i in range(1, 9)))
    names = ["reward_len", "accuracy_reward", "async_len", "token_count", "only_named"]
    rewards = "rewards=[" + ", ".join(f"{{name: 'tests.user_rewards:{n}'}}" for n in names) + "]"
    t = Trainer(cfg_for(tmp_path / "run", "run.steps=1", f"data.train={data}", "data.answer_column=solution",
                        "data.test=null", rewards, "rewards.accuracy_component=null"))
    t.train()
    t.close()
    traces = read_jsonl(tmp_path / "run" / "traces.jsonl")
    assert len(traces) == 8 and not any(r["total_missing"] for r in traces)
    for r in traces:
        c, p, s = [r["completion"]], [r["prompt"]], [r["gold"]]
        got = {n: r["rewards"][f"tests.user_rewards:{n}"] for n in names}
        assert all(g["error"] is None for g in got.values()), got
        assert got["reward_len"]["raw"] == user.reward_len(completions=c)[0]
        assert got["accuracy_reward"]["raw"] == user.accuracy_reward(completions=c, solution=s)[0]
        assert got["async_len"]["raw"] == asyncio.run(user.async_len(prompts=p, completions=c))[0]
        assert got["token_count"]["raw"] == r["completion_tokens"]
        assert got["only_named"]["raw"] == user.only_named(c, s)[0]
    assert len({r["advantage"] for r in traces}) > 1  # the rewards varied, so the step trained on them


def test_a_conversational_data_set_gives_trls_message_shapes_to_reward_functions(tmp_path):
    """A TRL conversational data set (the prompt column holds messages, no answer column): user functions
    get prompts as message lists and completions as `[{"role": "assistant", "content": ...}]`, as TRL
    passes them; our own rewards read the same shapes; the trace shows the last user turn."""
    import importlib

    user = importlib.import_module("tests.user_rewards")
    data = tmp_path / "train.jsonl"
    rows = [{"prompt": [{"role": "system", "content": "Answer briefly."},
                        {"role": "user", "content": f"What is {i} + {i}?"}]} for i in range(1, 5)]
    rows[0]["prompt"] = rows[0]["prompt"][1:]  # one prompt without its own system message
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    names = ["conversational_len", "system_turns"]
    rewards = "rewards=[" + ", ".join(f"{{name: 'tests.user_rewards:{n}'}}" for n in names) + ", {name: format}]"
    t = Trainer(cfg_for(tmp_path / "run", "run.steps=1", f"data.train={data}", "data.prompt_column=prompt",
                        "data.answer_column=null", "data.test=null", "rollout.prompts_per_step=4", rewards,
                        "rewards.accuracy_component=null", "rollout.max_new_tokens=24"))
    t.train()
    t.close()
    traces = read_jsonl(tmp_path / "run" / "traces.jsonl")
    assert len(traces) == 16 and not any(r["total_missing"] for r in traces)
    for r in traces:
        got = {n: r["rewards"][f"tests.user_rewards:{n}"] for n in names}
        assert all(g["error"] is None for g in got.values()), got
        messages = rows[r["prompt_id"]]["prompt"]
        assert r["prompt"] == messages[-1]["content"]
        assert got["conversational_len"]["raw"] == user.conversational_len(
            completions=[[{"role": "assistant", "content": r["completion"]}]])[0]
        assert got["system_turns"]["raw"] == user.system_turns(prompts=[messages], completions=[None])[0]
        assert r["rewards"]["format"]["error"] is None


def test_trls_trainer_state_log_extra_and_log_metric_reach_reward_functions(tmp_path):
    """`trainer_state` (steps completed, max steps), `log_extra` (into the completion's trace) and
    `log_metric` (into the step's metrics record, never over one of ours), as TRL passes them."""
    t = Trainer(cfg_for(tmp_path, "run.steps=2", "rewards=[{name: 'tests.user_rewards:uses_trl_hooks'}, "
                        "{name: correctness}]", "rollout.max_new_tokens=16"))
    t.train()
    t.close()
    traces, metrics = read_jsonl(tmp_path / "traces.jsonl"), read_jsonl(tmp_path / "metrics.jsonl")
    for r in traces:
        got = r["rewards"]["tests.user_rewards:uses_trl_hooks"]
        assert got["raw"] == r["step"] - 1 + 0.02 and got["info"] == {"chars": len(r["completion"])}
    for m in metrics:
        chars = [len(r["completion"]) for r in traces if r["step"] == m["step"]]
        assert m["mean_chars"] == pytest.approx(sum(chars) / len(chars))
        assert m["user/loss"] == -1.0 and m["loss"] != -1.0


def test_a_reward_failing_everywhere_is_said_at_once_and_stops_the_run(tmp_path, capsys, monkeypatch):
    """A component failing on every completion prints one line naming it and its error, on a line of its own
    with the progress bar drawn (not after the bar's text, where the next redraw hides it); when no
    component gives any completion a value for rewards.max_failed_steps steps, the run stops in one line
    naming the component."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # (the bar is drawn on a terminal only)
    t = Trainer(cfg_for(tmp_path, "run.steps=5", "rewards=[{name: 'tests.user_rewards:raises'}]",
                        "rewards.accuracy_component=null", "rewards.max_failed_steps=2", "logging.progress=true"))
    with pytest.raises(TrainingError, match=r"2 steps in a row .*reward 'tests.user_rewards:raises': "
                                            r"RuntimeError: boom") as e:
        t.train()
    t.close()
    assert "\n" not in str(e.value)
    err = capsys.readouterr().err
    assert "train:" in err  # the bar was drawn
    warned = [x for x in err.replace("\r", "\n").splitlines() if "failed on 8 of 8 completions of step" in x]
    assert len(warned) == 2 and all(x.startswith("docuchat-rl: warning: reward 'tests.user_rewards:raises' failed")
                                    for x in warned) and "boom" in warned[0]
    assert [m["reward_missing"] for m in read_jsonl(tmp_path / "metrics.jsonl")] == [8, 8]  # both steps logged


def test_the_steps_without_a_reward_value_count_on_across_a_resume(tmp_path):
    """The stop counts steps in a row without any reward value across a resume (checkpointed), so a run
    resumed after step 2 of a failing reward stops at step 3, not 5."""
    opts = ["run.steps=6", "checkpoint.every=2", "rewards=[{name: 'tests.user_rewards:raises'}]",
            "rewards.accuracy_component=null", "rewards.max_failed_steps=3"]
    t = Trainer(cfg_for(tmp_path, *opts))
    t.train(stop_after=2)
    t.close()
    t = Trainer(cfg_for(tmp_path, *opts), resume="latest")
    with pytest.raises(TrainingError, match=r"3 steps in a row"):
        t.train()
    t.close()
    assert [m["step"] for m in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_training_minutes_count_on_across_a_resume(tmp_path):
    """A resumed run's checkpoints and evaluations count the training time from where the checkpoint left
    off (eval.jsonl's minutes would otherwise restart at 0 and a learning curve go back in time)."""
    opts = ["run.steps=2", "checkpoint.every=1", "eval.every=1", "eval.limit=4"]
    t = Trainer(cfg_for(tmp_path, *opts))
    t.train(stop_after=1)
    t.close()
    first = json.loads((tmp_path / "checkpoint-1" / "trainer_state.json").read_text())["seconds"]
    t = Trainer(cfg_for(tmp_path, *opts), resume="latest")
    t.train()
    t.close()
    second = json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())["seconds"]
    evals = read_jsonl(tmp_path / "eval.jsonl")
    assert [e["step"] for e in evals] == [1, 2] and 0 < first < second
    # step 1's evaluation came before its checkpoint; step 2's after the resumed-from checkpoint's time
    assert evals[0]["minutes"] <= first / 60 + 1e-3 and evals[1]["minutes"] >= first / 60


def test_steps_without_a_learning_signal_are_said_while_they_happen(tmp_path, capsys):
    """Every group's rewards agreeing (a reward no completion can earn) and completions all cut at
    max_new_tokens each print a warning line at the step (TRL says nothing in either case)."""
    t = Trainer(cfg_for(tmp_path, "run.steps=2", "rollout.max_new_tokens=4",
                        "rewards=[{name: 'tests.user_rewards:length_over', params: {limit: 1000}}]",
                        "rewards.accuracy_component=null"))
    history = t.train()
    t.close()
    err = capsys.readouterr().err
    assert [m["zero_std_frac"] for m in history] == [1.0, 1.0] and [m["truncated_frac"] for m in history] == [1.0, 1.0]
    for step in (1, 2):
        assert f"step {step}: the rewards agreed within every group" in err
        assert f"step {step}: 100% of the completions were cut at rollout.max_new_tokens" in err


@pytest.mark.parametrize("extra,metric", [
    (["algorithm.surrogate=cispo", "algorithm.mask_truncated_completions=true",
      "algorithm.multi_objective_aggregation=normalize_then_sum", "algorithm.ent_coef=0.01"], "cispo_capped"),
    (["algorithm.surrogate=vespo", "algorithm.top_entropy_quantile=0.2",
      "algorithm.off_policy_mask_threshold=0.5"], "off_policy_masked"),
], ids=["cispo-gdpo-masked", "vespo-entropy-mask"])
def test_trl_loss_knobs_run_through_the_trainer(tmp_path, extra, metric):
    t = Trainer(cfg_for(tmp_path, "run.steps=2", "rollout.max_new_tokens=24", *extra))
    history = t.train()
    t.close()
    assert all(math.isfinite(h["loss"]) for h in history)
    assert metric in history[-1]
    traces = read_jsonl(tmp_path / "traces.jsonl")
    cut = [r for r in traces if r["truncated"] and r["used"]]
    if "algorithm.mask_truncated_completions=true" in extra:
        assert cut  # (24 new tokens cut some) and their rows are traced, with their group's advantage
        assert all(r["advantage"] == 0.0 for r in cut)  # no token of theirs is trained on


@pytest.mark.parametrize("engine", ["fast", "hf"])
def test_under_top_k_and_top_p_the_run_sees_no_sampler_trainer_gap_and_an_unclipped_ratio(tmp_path, engine):
    """The learner scores the sampler's truncated distribution: sampler/mismatch_max is float noise (it was
    log(kept mass), ~0.1-1 nats here), the correction's weights are 1 and no token's ratio is clipped."""
    t = Trainer(cfg_for(tmp_path, "run.steps=1", f"rollout.engine={engine}", "rollout.temperature=0.9",
                        "rollout.top_k=6", "rollout.top_p=0.9", "rollout.correction=token_truncate",
                        "algorithm.num_iterations=2"))
    t.train()
    t.close()
    (m,) = read_jsonl(tmp_path / "metrics.jsonl")
    assert m["sampler/mismatch_max"] < 1e-4 and abs(m["sampler/weight_mean"] - 1) < 1e-4, m
    assert m["sampler/capped_share"] == 0
