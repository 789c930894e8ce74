"""rollout.async_lag: step t trains on completions sampled by the adapter after step t-1-k, checked against
each step sampled again from that version's checkpoint; the ratio is taken against the sampler; a run
resumes exactly; what is not built is refused in one line."""

import contextlib

import pytest

from docuchat_rl.config import ConfigError
from docuchat_rl.data import render_prompt
from docuchat_rl.generation import generate
from docuchat_rl.inference import load_policy
from docuchat_rl.modeling import merged_adapter
from docuchat_rl.outputs import read_jsonl
from docuchat_rl.trainer import Trainer

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
            model, tok = load_policy(cfg, None)
            ctx = contextlib.nullcontext()
        else:
            model, tok = load_policy(cfg, tmp_path / f"checkpoint-{version}")
            ctx = merged_adapter(model)
        groups = [rows[i] for i in range(0, len(rows), r.num_generations)]
        prompts = [render_prompt(tok, g["prompt"], cfg.data.system_prompt) for g in groups]
        with ctx:
            gen = generate(model, tok, prompts, max_new_tokens=r.max_new_tokens, do_sample=True,
                           temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, num_return_sequences=r.num_generations,
                           engine="fast", row_seeds=[t["seed"] for t in rows], grouped_decode=True,
                           batch_size=r.generation_batch_size)
        assert gen.completion_ids == [t["completion_ids"] for t in rows], step
    assert history[0]["async/kl_sampler_learner"] < 1e-8  # step 1: the sampler is the learner
    assert min(m["async/kl_sampler_learner"] for m in history[2:]) > 1e-5  # behind: the gap the ratio sees

    tight = _run(tmp_path / "tight", "algorithm.epsilon_low=0.001", "algorithm.epsilon_high=0.001")
    clipped = [m["clip_low"] + m["clip_high"] for m in tight]  # the ratio is pi_learner / pi_sampler:
    assert clipped[0] == 0 and min(clipped[2:]) > 0  # 1 while they agree, clipped once the learner moved on


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


def test_what_a_fixed_lag_does_not_support_yet_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match="rollout.async_lag cannot be used with rollout.dynamic_sampling"):
        cfg_for(tmp_path, "rollout.async_lag=1", "rollout.dynamic_sampling=true")
    with pytest.raises(ConfigError, match="rollout.async_lag is not built for rollout.engine vllm"):
        cfg_for(tmp_path, "rollout.async_lag=1", "rollout.engine=vllm")
