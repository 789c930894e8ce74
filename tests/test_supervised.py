"""The supervised stage (`docuchat-rl sft`) and its hand-off to `train`, on the embedded default and tiny real
architectures: the loss against a slow reference loop, zero gradient off the target, the prompt tokens RL
samples from, every target source, exact resume after kill -9, and the adapter `train` starts from."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from docuchat_rl.config import load_config
from docuchat_rl.data import DataError
from docuchat_rl.modeling import load_model_and_tokenizer
from docuchat_rl.supervised.targets import Target, check_held_out
from docuchat_rl.supervised.loss import nll_sum
from docuchat_rl.supervised.trainer import SupervisedTrainer, batch_order, build_targets

from .conftest import MODEL, ROOT, tiny_arch_folder, with_lora

FAST = ["eval.before_and_after=false", "logging.progress=false", "run.threads=1"]


def sft_cfg(tmp_path: Path, *sets: str, name: str = "run"):
    return load_config(None, [f"run.output_dir={tmp_path / name}", "sft.steps=4", "sft.batch_size=4", *FAST, *sets])


def run_sft(cfg, resume=None, stop_after=None):
    trainer = SupervisedTrainer(cfg, resume=resume)
    try:
        return trainer.train(stop_after=stop_after)
    finally:
        trainer.close()


def cli(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "docuchat_rl", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=timeout, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def adapter(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


def reference_nll(model, target: Target) -> float:
    """The slow reference: one unpadded sequence, the whole model's logits, each loss token's -log p summed."""
    ids = torch.tensor([target.prompt_ids + target.target_ids])
    with torch.no_grad():
        logps = model(input_ids=ids).logits.float().log_softmax(-1)[0, :-1]  # [L-1, V]: position j predicts j+1
    p = len(target.prompt_ids)
    return -sum(float(logps[p - 1 + j, t]) for j, (t, m) in enumerate(zip(target.target_ids, target.loss_mask)) if m)


# ------------------------------------------------------------------------------------------------ the loss

@pytest.mark.parametrize("arch", ["default", "qwen2", "gemma2", "mistral", "gpt2"])
def test_the_loss_is_the_target_tokens_nll_of_a_slow_reference_loop(tmp_path, arch):
    """nll_sum (whole examples right-padded, length-bucketed, logits chunked) equals a per-example loop over
    the unpadded sequences that sums -log p of the loss tokens only: prompt tokens and masked tokens are out."""
    folder = MODEL if arch == "default" else tiny_arch_folder(arch, tmp_path / arch)
    model, tok = load_model_and_tokenizer(str(folder), dtype="float32", device="cpu")
    pm = with_lora(model, ["c_attn"] if arch == "gpt2" else ["q_proj", "v_proj"]).eval()
    cfg = sft_cfg(tmp_path, f"model.name_or_path={folder}", "sft.answer_template=think_answer")
    targets = build_targets(cfg, tok, pm)[:5]
    masked = Target(targets[0].prompt_id, "masked", targets[0].prompt_ids, targets[0].target_ids,
                    [j % 3 != 1 for j in range(len(targets[0].target_ids))])  # (as tool tokens would be)
    rows = targets[1:] + [masked]
    for chunk, buckets in ((0, 1), (3, 3)):
        with torch.no_grad():
            total, n = nll_sum(pm, rows, tok.pad_token_id, chunk, buckets)
        assert n == sum(sum(t.loss_mask) for t in rows)
        expected = sum(reference_nll(pm, t) for t in rows)
        assert abs(float(total) - expected) <= 1e-4 * abs(expected), (chunk, buckets)


def test_masked_target_tokens_get_exactly_zero_gradient(tiny):
    """The hidden state that predicts a masked (tool-result) token gets no gradient at all from the loss."""
    from docuchat_rl.learning.forward import decoder_stack

    model, tok = tiny
    pm = with_lora(model, ["q_proj", "v_proj"])
    try:
        ids = tok("<think>\n1 + 1 = 2\n</think>\n<answer>2</answer>", add_special_tokens=False)["input_ids"]
        mask = [1, 1, 0, 0, 0, 1, 1] + [1] * (len(ids) - 7)
        target = Target(0, "t", tok("Q: 1 + 1?", add_special_tokens=False)["input_ids"], ids, mask)
        seen = {}
        final = decoder_stack(pm).norm  # (the last hidden states, before the output layer)
        hook = final.register_forward_hook(lambda m, args, out: seen.setdefault("h", out).retain_grad())
        try:
            total, _ = nll_sum(pm, [target], tok.pad_token_id, 0, 1)
            total.backward()
        finally:
            hook.remove()
        p = len(target.prompt_ids)
        grad = seen["h"].grad[0, p - 1:p - 1 + len(ids)]  # [T, H]: the hidden state predicting target token j
        zero = [j for j, m in enumerate(mask) if not m]
        assert torch.count_nonzero(grad[zero]) == 0
        assert all(grad[j].abs().sum() > 0 for j, m in enumerate(mask) if m)
    finally:
        pm.unload()


@pytest.mark.parametrize("arch", ["default", "qwen2"])
def test_a_few_sft_steps_lower_the_target_nll(tmp_path, arch):
    """On the answers as written (a form the model never saw: GSM8K's <<a op b=c>> notes), a few steps lower
    the mean NLL per target token of the examples they learned from."""
    folder = MODEL if arch == "default" else tiny_arch_folder(arch, tmp_path / arch)
    cfg = sft_cfg(tmp_path, f"model.name_or_path={folder}", "sft.steps=8", "sft.batch_size=8", "sft.lr=1e-2",
                  "sft.schedule=constant")
    trainer = SupervisedTrainer(cfg)
    try:
        seen = [trainer.targets[i] for s in range(1, 9) for i in batch_order(len(trainer.targets), 8, s, 0)]
        pad = trainer.tokenizer.pad_token_id

        def nll() -> float:
            with torch.no_grad():
                total, n = nll_sum(trainer.model.eval(), seen, pad, 0, 1)
            return float(total) / n

        before = nll()
        history = trainer.train()
        after = nll()
    finally:
        trainer.close()
    assert after < before - 0.1, (before, after)
    assert [m["step"] for m in history] == list(range(1, 9))


# ---------------------------------------------------------------------------------------------- the prompts

PROMPT_FORMS = {
    "chat template": [],
    "few-shot": ["data.few_shot=[{role: user, content: 'Tom has 2 pens. How many?'}, "
                 "{role: assistant, content: '#### 2'}]"],
    "no system prompt": ["data.system_prompt=null"],
    # (the embedded tokenizer spells a call in ~70 tokens: one-operation rows, whose one call fits its context)
    "tools": ["rollout.tools=[docuchat_rl.toolbox.calculate]", "rollout.max_turns=3", "rollout.max_tool_calls=2",
              "rollout.max_new_tokens=160", "data.train=data/task_1op/train.jsonl"],
}


@pytest.mark.parametrize("form", [*PROMPT_FORMS, "plain (no template)", "conversational"])
def test_the_sft_prompt_tokens_are_the_rl_prompt_tokens(tmp_path, form):
    """For every prompt form, each SFT example's prompt is, token for token, what the RL run samples after."""
    from docuchat_rl.trainer import Trainer

    sets = list(PROMPT_FORMS.get(form, []))
    if form == "plain (no template)":
        folder = tmp_path / "plain"
        model, tok = load_model_and_tokenizer(str(MODEL), dtype="float32", device="cpu")
        tok.chat_template = None
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        (folder / "chat_template.jinja").unlink(missing_ok=True)
        sets.append(f"model.name_or_path={folder}")
    if form == "conversational":
        rows = [{"question": [{"role": "user", "content": f"Ann has {i} cats and gets 1 more. How many?"}],
                 "answer": f"{i} + 1 = <<{i}+1={i + 1}>>{i + 1}\n#### {i + 1}"} for i in range(12)]
        data = tmp_path / "conv.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        sets += [f"data.train={data}", "rollout.prompts_per_step=4"]
    sets.append("sft.source=tool_transcripts" if form == "tools" else "sft.answer_template=steps")
    cfg = sft_cfg(tmp_path, "run.steps=1", *sets)
    trainer = Trainer(sft_cfg(tmp_path, "run.steps=1", *sets, "sft=null"))  # (RL from a zero adapter)
    try:
        sampled = trainer.run.tokenizer(trainer.collector.prompt_texts, add_special_tokens=False)["input_ids"]
        targets = build_targets(cfg, trainer.run.tokenizer, trainer.learner.model)
    finally:
        trainer.close()
    assert len(targets) == len(sampled)
    for t in targets:
        assert t.prompt_ids == sampled[t.prompt_id]
    if form == "plain (no template)":
        assert trainer.run.tokenizer.decode(targets[0].prompt_ids).rstrip().endswith("Answer:")


# ---------------------------------------------------------------------------------------------- the sources

def test_answers_as_written_and_through_each_template(tmp_path, tiny):
    model, tok = tiny
    first = json.loads((ROOT / "data/task/train.jsonl").read_text().splitlines()[0])["answer"]
    texts = {}
    for template in ("as_written", "steps", "think_answer"):
        cfg = sft_cfg(tmp_path, f"sft.answer_template={template}")
        t = build_targets(cfg, tok, model)[0]
        assert t.target_ids[-1] == tok.eos_token_id and all(t.loss_mask)
        texts[template] = tok.decode(t.target_ids[:-1])
    assert texts["as_written"] == first
    assert "<<" not in texts["steps"] and texts["steps"].endswith("#### 5")
    assert texts["think_answer"].startswith("<think>") and texts["think_answer"].endswith("<answer>5</answer>")


@pytest.mark.parametrize("stops,expected", [([0, 3], 3), ([3, 0], 3), ([0], 0)],
                         ids=["end-of-text first", "end-of-turn first", "the template's token not a stop"])
def test_targets_end_with_the_token_the_template_ends_an_assistant_turn_with(tmp_path, stops, expected):
    """Llama-3.x-Instruct and Gemma-3-IT list end-of-text before the template's end-of-turn: a target ends with
    the stop the template writes after an answer (here <|im_end|>, id 3), whatever the list's order; where the
    template writes none of the stops, the first stop. The tool transcripts' turns and a JSONL row end alike."""
    model, tok = load_model_and_tokenizer(str(MODEL), dtype="float32", device="cpu")
    model.generation_config.eos_token_id = stops
    tok.eos_token = "<|endoftext|>" if stops[0] == 0 else tok.eos_token  # (a tokenizer whose EOS is end-of-text)
    targets = build_targets(sft_cfg(tmp_path, "sft.answer_template=steps"), tok, model)
    assert {t.target_ids[-1] for t in targets} == {expected}
    f = tmp_path / "sft.jsonl"
    f.write_text(json.dumps({"prompt": "Bo has 3 figs. How many?", "completion": "#### 3"}) + "\n")
    (row,) = build_targets(sft_cfg(tmp_path, "sft.source=jsonl", f"sft.path={f}"), tok, model)
    assert row.target_ids[-1] == expected


def test_answers_can_come_from_other_rows_than_rls_own(tmp_path, tiny):
    """sft.path names the rows source answers learns (worked solutions), while data.train stays RL's rows
    (final answers only); their prompts are rendered as RL renders any row."""
    model, tok = tiny
    rows = [json.loads(x) for x in (ROOT / "data/task/train.jsonl").read_text().splitlines()[:6]]
    worked = tmp_path / "worked.jsonl"
    worked.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = sft_cfg(tmp_path, f"sft.path={worked}", "sft.answer_template=steps",
                  "data.train=data/task_answers_varied/train.jsonl")
    targets = build_targets(cfg, tok, model)
    assert [t.question for t in targets] == [r["question"] for r in rows]
    assert tok.decode(targets[0].target_ids[:-1]) == "4 + 3 = 7\n7 - 2 = 5\n#### 5"
    with pytest.raises(Exception, match="sft.path applies|no such file|not found"):
        build_targets(sft_cfg(tmp_path, f"sft.path={tmp_path / 'nope.jsonl'}"), tok, model)


def test_sft_prompts_hold_an_environments_observation_as_rl_samples_them(tmp_path, tiny):
    """An environment whose reset returns an observation: each SFT prompt is, token for token, the prompt the RL
    collector samples the row's group from (observation appended and cut as the tool loop does); a JSONL row,
    whose prompt cannot hold it, is refused in one line, as is a reset that raises."""
    from docuchat_rl.trainer import Trainer

    model, tok = tiny
    sets = ["rollout.tools=[docuchat_rl.toolbox.calculate]", "rollout.environment_factory=tests.tool_envs.Briefing",
            "rollout.max_turns=3", "rollout.max_tool_calls=2", "rollout.max_new_tokens=160",
            "data.train=data/task_1op/train.jsonl", "rollout.prompts_per_step=4",
            "rewards=[{name: correctness}, {name: environment, weight: 0.1}]"]
    cfg = sft_cfg(tmp_path, "run.steps=1", *sets, "sft.answer_template=steps")
    targets = build_targets(cfg, tok, model)
    trainer = Trainer(sft_cfg(tmp_path, "run.steps=1", *sets, "sft=null"))
    try:
        idx = [0, 5, 9, 17]
        g = cfg.rollout.num_generations
        gen, _ = trainer.collector.sample(trainer.learner.model, idx, list(range(len(idx) * g)), 0, 1)
    finally:
        trainer.close()
    for p, i in enumerate(idx):
        assert "Hint: the answer has" in tok.decode(targets[i].prompt_ids)
        assert all(gen.prompt_ids[p * g + s] == targets[i].prompt_ids for s in range(g))
    f = tmp_path / "sft.jsonl"
    f.write_text(json.dumps({"prompt": "Bo has 3 figs. How many?", "completion": "#### 3"}) + "\n")
    with pytest.raises(DataError, match="line 1: rollout.environment_factory's its reset returns an observation"):
        build_targets(sft_cfg(tmp_path, *sets, "sft.source=jsonl", f"sft.path={f}"), tok, model)
    with pytest.raises(DataError, match="reset raised for training row 0 .RuntimeError: the board"):
        build_targets(sft_cfg(tmp_path, *sets, "rollout.environment_factory=tests.tool_envs.NeverResets"), tok, model)


def test_tool_transcripts_are_the_rl_tool_loops_own_conversations(tmp_path, tiny):
    """One calculator call per <<a op b=c>> step, the tool's real result framed by the protocol (mask 0), then
    the final answer; the limits that would cut an RL conversation refuse a transcript, naming the key."""
    from docuchat_rl.sampling.multiturn import Protocol, ToolSource

    model, tok = tiny
    rows = [json.loads(line) for line in (ROOT / "data/task/train.jsonl").read_text().splitlines()[:40]]
    rows = [r for r in rows if r["answer"].count("<<") == 2][:8]  # two steps each: two calls (row 0: 4 + 3, 7 - 2)
    data = tmp_path / "two_steps.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = ["rollout.tools=[docuchat_rl.toolbox.calculate]", "rollout.max_turns=3", "rollout.max_tool_calls=2",
            "rollout.max_new_tokens=240", f"data.train={data}", "sft.source=tool_transcripts"]
    t = build_targets(sft_cfg(tmp_path, *sets), tok, model)[0]
    protocol = Protocol(tok, ToolSource.load(["docuchat_rl.toolbox.calculate"], None).schemas, "text")
    pieces, ids, mask = [], t.target_ids, t.loss_mask
    start = 0
    for j in range(1, len(ids) + 1):  # runs of model tokens and tool tokens
        if j == len(ids) or mask[j] != mask[start]:
            pieces.append((mask[start], tok.decode(ids[start:j], skip_special_tokens=False)))
            start = j
    model_turns = [text for m, text in pieces if m]
    tool_turns = [text for m, text in pieces if not m]
    assert [c for turn in model_turns for c in [c.arguments for c in protocol.parse(turn)]] == [
        {"expression": "4 + 3"}, {"expression": "7 - 2"}]
    assert ["<tool_response>\n7\n</tool_response>" in x for x in tool_turns] == [True, False]
    assert "<tool_response>\n5\n</tool_response>" in tool_turns[1]
    assert model_turns[-1] == "#### 5<|im_end|>"
    assert tool_turns[0] == tok.decode(protocol.result_ids([("calculate", "7")]), skip_special_tokens=False)
    with pytest.raises(DataError, match="rollout.max_tool_calls"):
        build_targets(sft_cfg(tmp_path, *sets, "rollout.max_tool_calls=1"), tok, model)
    with pytest.raises(DataError, match="rollout.max_new_tokens"):
        build_targets(sft_cfg(tmp_path, *sets, "rollout.max_new_tokens=200"), tok, model)


def test_jsonl_rows_in_trls_formats(tmp_path, tiny):
    model, tok = tiny
    f = tmp_path / "sft.jsonl"
    f.write_text(json.dumps({"prompt": "Bo has 3 figs and eats 1. How many?", "completion": "#### 2"}) + "\n"
                 + json.dumps({"messages": [{"role": "user", "content": "Bo has 9 figs. How many?"},
                                            {"role": "assistant", "content": "#### 9"}]}) + "\n")
    cfg = sft_cfg(tmp_path, "sft.source=jsonl", f"sft.path={f}")
    a, b = build_targets(cfg, tok, model)
    assert tok.decode(a.target_ids) == "#### 2<|im_end|>" and tok.decode(b.target_ids) == "#### 9<|im_end|>"
    assert "Bo has 9 figs" in tok.decode(b.prompt_ids) and "Solve the problem" in tok.decode(b.prompt_ids)
    f.write_text(json.dumps({"question": "x"}) + "\n")
    with pytest.raises(DataError, match="line 1 has neither 'messages' nor 'prompt' and 'completion'"):
        build_targets(cfg, tok, model)


def test_no_held_out_question_reaches_the_sft_set(tmp_path, tiny):
    """The answers set of the embedded task holds no held-out question; a JSONL file with one is refused."""
    model, tok = tiny
    cfg = sft_cfg(tmp_path)
    check_held_out(build_targets(cfg, tok, model), cfg)  # (the committed splits are disjoint)
    test_q = json.loads((ROOT / "data/task/test.jsonl").read_text().splitlines()[3])["question"]
    f = tmp_path / "leak.jsonl"
    f.write_text(json.dumps({"prompt": "Bo has 3 figs. How many?", "completion": "#### 3"}) + "\n"
                 + json.dumps({"prompt": test_q, "completion": "#### 1"}) + "\n")
    with pytest.raises(DataError, match="1 question of the held-out set data.test .first: line 2"):
        build_targets(sft_cfg(tmp_path, "sft.source=jsonl", f"sft.path={f}"), tok, model)
    for changed in (test_q.lower(), "  " + test_q.replace(" ", "   "), test_q.upper().replace(".", " ."),
                    test_q.replace("?", "")):  # (another case, spacing or punctuation is the same question)
        f.write_text(json.dumps({"prompt": changed, "completion": "#### 1"}) + "\n")
        with pytest.raises(DataError, match="held-out set data.test"):
            build_targets(sft_cfg(tmp_path, "sft.source=jsonl", f"sft.path={f}"), tok, model)


def test_traces_select_exactly_what_the_audit_query_selects(tmp_path, tiny):
    """source traces learns the traced completions the audit filter selects, as sampled (token ids), at most
    per_prompt distinct ones a prompt, the newest first."""
    from docuchat_rl.tools.audit import TraceStore

    from .conftest import train_here

    model, tok = tiny
    run = tmp_path / "rl"
    train_here(None, [f"run.output_dir={run}", "run.steps=3", *FAST, "eval.before_and_after=false"])
    where = "correctness.raw == 1 and step >= 2"
    with TraceStore([run]) as store:
        chosen = store.select(where, columns="step, prompt_id, completion_ids")
    assert chosen
    for per_prompt in (1, 100):
        cfg = sft_cfg(tmp_path, "sft.source=traces", f"sft.path={run}", f"sft.where={where}",
                      f"sft.per_prompt={per_prompt}")
        targets = build_targets(cfg, tok, model)
        expected: dict[int, list] = {}
        for r in sorted(chosen, key=lambda r: -r["step"]):
            ids = list(r["completion_ids"])
            if ids not in expected.setdefault(r["prompt_id"], []) and len(expected[r["prompt_id"]]) < per_prompt:
                expected[r["prompt_id"]].append(ids)
        got: dict[int, list] = {}
        for t in targets:
            got.setdefault(t.prompt_id, []).append(t.target_ids)
        assert {k: sorted(v) for k, v in got.items()} == {k: sorted(v) for k, v in expected.items()}
    with pytest.raises(DataError, match="selects no traced completion"):
        build_targets(sft_cfg(tmp_path, "sft.source=traces", f"sft.path={run}", "sft.where=step > 99"), tok, model)


def test_traces_cut_at_max_new_tokens_are_not_learned_unless_asked_and_are_counted(tmp_path, tiny, capsys):
    """A completion cut at max_new_tokens never ends: source traces leaves it out and says how many; with
    sft.keep_truncated it is learned as sampled."""
    from docuchat_rl.tools.audit import TraceStore

    from .conftest import train_here

    model, tok = tiny
    run = tmp_path / "rl"
    train_here(None, [f"run.output_dir={run}", "run.steps=2", "rollout.max_new_tokens=24", *FAST])
    with TraceStore([run]) as store:
        rows = store.select("step >= 1", columns="prompt_id, completion_ids, truncated")
    cut = {tuple(r["completion_ids"]) for r in rows if r["truncated"]}
    whole = {tuple(r["completion_ids"]) for r in rows if not r["truncated"]}
    assert cut and whole  # (24 tokens: some end, some are cut)
    sets = ["sft.source=traces", f"sft.path={run}", "sft.where=step >= 1", "sft.per_prompt=100"]
    targets = build_targets(sft_cfg(tmp_path, *sets), tok, model)
    assert {tuple(t.target_ids) for t in targets} == whole
    assert all(t.target_ids[-1] == tok.eos_token_id for t in targets)
    said = capsys.readouterr().err
    n_cut = sum(bool(r["truncated"]) for r in rows)
    assert f"{n_cut} selected completions were cut at max_new_tokens and not learned" in said
    kept = build_targets(sft_cfg(tmp_path, *sets, "sft.keep_truncated=true"), tok, model)
    assert {tuple(t.target_ids) for t in kept} == whole | cut
    with pytest.raises(Exception, match="sft.keep_truncated applies to source traces"):
        sft_cfg(tmp_path, "sft.keep_truncated=true")


# ------------------------------------------------------------------------------------ the run and its hand-off

def test_the_batch_order_is_a_seeded_function_of_the_step():
    steps = [batch_order(10, 4, s, seed=3) for s in range(1, 6)]  # 20 positions: two epochs
    assert sorted(steps[0] + steps[1] + steps[2][:2]) == list(range(10))
    assert sorted(steps[2][2:] + steps[3] + steps[4]) == list(range(10))
    assert batch_order(10, 4, 4, seed=3) == steps[3] and batch_order(10, 4, 4, seed=4) != steps[3]


def test_kill_9_during_sft_then_resume_equals_the_uninterrupted_run(tmp_path):
    sets = ["--set", f"run.output_dir={tmp_path / 'a'}", "--set", "sft.steps=8", "--set", "sft.batch_size=8",
            "--set", "checkpoint.every=2", *[x for s in FAST for x in ("--set", s)]]
    whole = cli("sft", *sets[:1], f"run.output_dir={tmp_path / 'whole'}", *sets[2:])
    assert whole.returncode == 0, whole.stderr[-2000:]
    out = tmp_path / "a-sft"
    proc = subprocess.Popen([sys.executable, "-m", "docuchat_rl", "sft", *sets], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.time() + 240
    while not (out / "checkpoint-4").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (out / "checkpoint-4").exists() and not (out / "checkpoint-8").exists()
    resumed = cli("sft", *sets, "--resume", "latest")
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    a, b = adapter(out / "checkpoint-8"), adapter(tmp_path / "whole-sft" / "checkpoint-8")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == list(range(1, 9))  # (the killed run's later lines cut back)


def test_train_starts_from_the_sft_adapter_and_its_kl_reference_is_that_policy(tmp_path):
    """With an sft section, `train` starts its adapter from sft.output_dir: its first forward equals the SFT
    adapter's, and with beta > 0 the KL reference is the starting policy (step 1's KL is 0)."""
    from peft import PeftModel

    from docuchat_rl.checkpoint import resolve_adapter
    from docuchat_rl.trainer import Trainer

    cfg = sft_cfg(tmp_path, "sft.answer_template=think_answer", "sft.lr=2e-3", "run.steps=2",
                  "algorithm.beta=0.1")
    run_sft(cfg)
    base, tok = load_model_and_tokenizer(str(MODEL), dtype="float32", device="cpu")
    sft_model = PeftModel.from_pretrained(base, str(resolve_adapter(cfg.sft_dir))).eval()
    targets = build_targets(cfg, tok, sft_model)[:6]
    trainer = Trainer(cfg)
    try:
        with torch.no_grad():
            started, _ = nll_sum(trainer.learner.model.eval(), targets, tok.pad_token_id, 0, 1)
            sft, _ = nll_sum(sft_model, targets, tok.pad_token_id, 0, 1)
            with trainer.learner.reference():
                reference, _ = nll_sum(trainer.learner.model, targets, tok.pad_token_id, 0, 1)
            with trainer.learner.model.disable_adapter():
                zero, _ = nll_sum(trainer.learner.model, targets, tok.pad_token_id, 0, 1)
        assert torch.allclose(started, sft, rtol=1e-6) and torch.allclose(reference, sft, rtol=1e-6)
        assert not torch.allclose(zero, sft, rtol=1e-3)  # (the SFT adapter changed the policy)
        history = trainer.train()
    finally:
        trainer.close()
    assert history[0]["kl"] == pytest.approx(0.0, abs=1e-6)
    resumed_ref = adapter(Path(cfg.run.output_dir) / "checkpoint-2" / "reference")
    start = adapter(resolve_adapter(cfg.sft_dir))
    assert all(torch.equal(resumed_ref[k], start[k]) for k in start)  # (a resume needs no SFT folder)


def test_a_mismatched_start_adapter_is_one_line(tmp_path):
    """Another rank, another base model, no SFT checkpoint yet: each one line naming the key, exit 2."""
    sets = ["--set", f"run.output_dir={tmp_path / 'r'}", "--set", "sft.steps=2", "--set", "sft.batch_size=4",
            *[x for s in FAST for x in ("--set", s)]]
    missing = cli("train", *sets)
    assert missing.returncode == 2 and "run docuchat-rl sft with this recipe first" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1
    assert cli("sft", *sets).returncode == 0
    rank = cli("train", *sets, "--set", "lora.r=8", "--set", "run.output_dir=" + str(tmp_path / "r2"),
               "--set", f"sft.output_dir={tmp_path / 'r-sft'}")
    assert rank.returncode == 2 and "does not fit the recipe's lora (rank 8" in rank.stderr, rank.stderr[-800:]
    assert len(rank.stderr.strip().splitlines()) == 1
    other = tiny_arch_folder("llama", tmp_path / "llama")
    base = cli("train", *sets, "--set", f"model.name_or_path={other}", "--set",
               "run.output_dir=" + str(tmp_path / "r3"), "--set", f"sft.output_dir={tmp_path / 'r-sft'}")
    assert base.returncode == 2 and "was trained on model 'data/model'" in base.stderr, base.stderr[-800:]
    assert len(base.stderr.strip().splitlines()) == 1


def test_the_sft_checkpoint_serves_eval_generate_and_export_and_a_run_from_it_replays(tmp_path):
    sets = ["--set", f"run.output_dir={tmp_path / 'r'}", "--set", "sft.steps=2", "--set", "sft.batch_size=4",
            *[x for s in FAST for x in ("--set", s)]]
    assert cli("sft", *sets).returncode == 0
    assert cli("train", *sets, "--set", "run.steps=2").returncode == 0
    line = [json.loads(x) for x in (tmp_path / "r" / "traces.jsonl").read_text().splitlines()][-1]
    again = cli("replay", str(tmp_path / "r"), "--step", "2", "--prompt-id", str(line["prompt_id"]), "--sample",
                str(line["sample"]), "--json")  # (step 1's policy: rebuilt from the SFT adapter it started from)
    assert again.returncode == 0 and json.loads(again.stdout.splitlines()[-1])["same"] is True, again.stderr[-800:]
    folder = str(tmp_path / "r-sft")
    ev = cli("eval", "--adapter", folder, "--set", "eval.limit=4")
    assert ev.returncode == 0 and json.loads(ev.stdout)["rows"] == 4, ev.stderr[-800:]
    gen = cli("generate", "--adapter", folder, "--held-out", "1")
    assert gen.returncode == 0 and gen.stdout.strip(), gen.stderr[-800:]
    ex = cli("export", "--adapter", folder, "--out", str(tmp_path / "merged"))
    assert ex.returncode == 0 and (tmp_path / "merged" / "config.json").exists(), ex.stderr[-800:]


def test_evaluate_reads_the_held_out_rows_once_and_scores_eval_also(tmp_path):
    """SupervisedTrainer.evaluate: the held-out set and each eval.also set, read at the first evaluation (a
    second gives the same numbers after the files are gone: nothing is read again)."""
    import shutil

    data = tmp_path / "data"
    shutil.copytree(ROOT / "data" / "task", data)
    cfg = sft_cfg(tmp_path, f"data.test={data / 'test.jsonl'}", "eval.limit=4", "eval.max_new_tokens=8",
                  f"eval.also={{other: {data / 'test.jsonl'}}}")
    trainer = SupervisedTrainer(cfg)
    try:
        first = trainer.evaluate()
        shutil.rmtree(data)
        second = trainer.evaluate()
    finally:
        trainer.close()
    assert first["rows"] == 4 and first["other/rows"] == 4
    drop = ("seconds", "other/seconds")
    assert {k: v for k, v in first.items() if k not in drop} == {k: v for k, v in second.items() if k not in drop}


@pytest.mark.parametrize("key", ["run.output_dir", "sft.output_dir"])
def test_every_key_naming_a_folder_refuses_empty_a_file_a_dangling_link_and_the_working_folder(tmp_path, key):
    """One rule for the folders a command writes: empty, a file, a link to nothing are refused at load naming
    the key; the working folder itself (by any name) where the folder is claimed, before anything is written."""
    from docuchat_rl.config import ConfigError

    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    link = tmp_path / "gone"
    link.symlink_to(tmp_path / "nowhere")
    for value, said in (("''", "must name a folder"), ("'  '", "must name a folder"), (str(a_file), "is a file"),
                        (str(link), "is a link to nothing")):
        with pytest.raises(ConfigError, match=f"'{key}'.*{said}"):
            load_config(None, [f"{key}={value}", *([] if key == "run.output_dir" else ["sft.source=answers"])])
    before = sorted(p.name for p in tmp_path.iterdir())
    command = "sft" if key == "sft.output_dir" else "train"
    for here in (".", str(tmp_path), f"{tmp_path}/../{tmp_path.name}"):
        done = subprocess.run([sys.executable, "-m", "docuchat_rl", command, "--set", f"{key}={here}", "--set",
                               "run.output_dir=" + (str(tmp_path / "rl") if key == "sft.output_dir" else here)],
                              capture_output=True, text=True, cwd=tmp_path, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        assert done.returncode == 2 and f"{key} {here} is the working folder itself" in done.stderr, done.stderr[-600:]
        assert len(done.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # (nothing written beside the user's files)


def test_resuming_an_sft_recipes_run_into_a_new_folder_and_starting_from_an_unfinished_sft_stage(tmp_path):
    """A recipe with an sft section resumes into a new run.output_dir (the derived sft.output_dir is the
    checkpoint's own, which a resume never reads); `train` after an SFT stage stopped early says which checkpoint
    it starts from and that the stage did not finish."""
    sets = ["--set", f"run.output_dir={tmp_path / 'r'}", "--set", "sft.steps=4", "--set", "sft.batch_size=4",
            "--set", "run.steps=2", *[x for s in FAST for x in ("--set", s)]]
    assert cli("sft", *sets, "--stop-after", "2").returncode == 0
    first = cli("train", *sets, "--stop-after", "1")
    assert first.returncode == 0, first.stderr[-800:]
    assert "checkpoint-2 (step 2 of its SFT stage's 4: that stage stopped before its last step (2 left))" in first.stderr
    moved = cli("train", *sets, "--resume", str(tmp_path / "r" / "checkpoint-1"), "--set",
                f"run.output_dir={tmp_path / 'moved'}")
    assert moved.returncode == 0, moved.stderr[-800:]
    recorded = json.loads((tmp_path / "moved" / "checkpoint-2" / "run_config.json").read_text())["config"]
    assert recorded["sft"]["output_dir"] == str(tmp_path / "r-sft")  # (the stage the run started from)
    other = cli("train", *sets, "--resume", str(tmp_path / "r" / "checkpoint-1"), "--set",
                f"run.output_dir={tmp_path / 'moved2'}", "--set", f"sft.output_dir={tmp_path / 'elsewhere'}")
    assert other.returncode == 2 and "leave sft.output_dir out" in other.stderr


JSON_VALUES = [None, 3, 2.5, True, "", "text", [], ["x"], [{"role": "user"}], [{"content": "hi"}],
               [{"role": "user", "content": 7}], [{"role": "assistant", "content": "#### 1"}],
               [{"role": "user", "content": "Q?"}, {"role": "assistant", "content": "#### 2"}], {"a": 1}]


@pytest.mark.parametrize("seed", range(3))
def test_every_sft_jsonl_row_is_learned_or_refused_in_one_line_naming_its_line(tmp_path, tiny, seed):
    """Generated rows of TRL's fields holding every JSON type, bytes that are not UTF-8, a folder: each either
    becomes a target or is one DataError naming the file and the line (never a traceback, never a replacement
    character learned)."""
    import random

    model, tok = tiny
    rng = random.Random(seed)
    f = tmp_path / "rows.jsonl"
    for case in range(40):
        keys = rng.choice([("prompt", "completion"), ("messages",), ("prompt",), ("question", "answer")])
        row = {k: rng.choice(JSON_VALUES) for k in keys}
        good = json.dumps({"prompt": "Bo has 3 figs. How many?", "completion": "#### 3"}).encode() + b"\n"
        line = json.dumps(row).encode() + b"\n"
        if case % 7 == 3:
            line = b'{"prompt": "Bo has 3 figs\xff\xfe", "completion": "#### 3"}\n'  # (not UTF-8)
        f.write_bytes(good + line)
        cfg = sft_cfg(tmp_path, "sft.source=jsonl", f"sft.path={f}")
        try:
            targets = build_targets(cfg, tok, model)
        except DataError as e:
            text = str(e)
            assert "\n" not in text and str(f) in text and "line 2" in text, text
            continue
        assert len(targets) == 2, row
        assert all("\ufffd" not in tok.decode(t.prompt_ids + t.target_ids) for t in targets)
    with pytest.raises(DataError, match="is a folder"):
        build_targets(sft_cfg(tmp_path, "sft.source=jsonl", f"sft.path={tmp_path}"), tok, model)


def test_a_template_that_ends_with_the_final_number_refuses_an_answer_without_one(tmp_path, tiny):
    model, tok = tiny
    f = tmp_path / "rows.jsonl"
    f.write_text(json.dumps({"question": "Bo has 3 figs. How many?", "answer": "3 figs, I think"}) + "\n")
    with pytest.raises(DataError, match="sft.answer_template steps: training row 0's answer has no final number"):
        build_targets(sft_cfg(tmp_path, f"sft.path={f}", "sft.answer_template=steps"), tok, model)
    build_targets(sft_cfg(tmp_path, f"sft.path={f}"), tok, model)  # (as written: the text is the target)


@pytest.mark.parametrize("template", ["steps", "think_answer"])
def test_a_steps_template_on_rows_without_worked_steps_is_refused_not_learned_as_the_bare_answer(tmp_path, tiny,
                                                                                                   template):
    """Answer-only rows ("#### N") through a template of the worked steps would teach the bare answer: refused in
    one line naming the row and the key."""
    from docuchat_rl.data import DataError

    model, tok = tiny
    cfg = sft_cfg(tmp_path, f"sft.answer_template={template}", "data.train=data/task_answers_varied/train.jsonl")
    with pytest.raises(DataError, match=f"sft.answer_template {template}: training row 0's answer has no worked steps"):
        build_targets(cfg, tok, model)
