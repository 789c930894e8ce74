"""Multi-turn rollouts (sampling/multiturn.py): the protocol's parsing and tool-result tokens, tool faults and
limits, and whole conversations sampled by a real model that calls tools (the embedded default taught to call
one, tests/multiturn_model.py): the trained tokens are the sampled ones, tool tokens are out of the loss and
its gradient, the sampler's log-probs equal a teacher-forced forward, TRL's environment class trains through
the CLI, and a resumed run equals the uninterrupted one."""

import subprocess
import sys
import time

import pytest
import torch

from docuchat_rl.config import ConfigError
from docuchat_rl.outputs import read_jsonl
from docuchat_rl.sampling.multiturn import (
    Protocol,
    ToolCall,
    ToolSource,
    TurnLimits,
    call_tools,
    run_turns,
    turn_seed,
)
from docuchat_rl.trainer import Trainer, TrainingError

from .conftest import MODEL, ROOT
from .multiturn_model import CALL
from .test_trainer import cfg_for, untimed

# Qwen2.5's tool-calling template, cut to what it renders for tools, assistant calls and tool results
HERMES_TEMPLATE = (
    "{%- if tools %}{{ '<|im_start|>system\\n# Tools\\n<tools>' }}{% for t in tools %}{{ '\\n' + (t | tojson) }}"
    "{% endfor %}{{ '\\n</tools><|im_end|>\\n' }}{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}"
    "{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{ '<|im_start|>user' }}{% endif %}"
    "{{ '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{%- elif m.role == 'assistant' and m.tool_calls %}{{ '<|im_start|>assistant\\n' + m.content }}"
    "{%- for c in m.tool_calls %}{{ '\\n<tool_call>\\n{\"name\": \"' + c.function.name + '\", \"arguments\": ' + "
    "(c.function.arguments | tojson) + '}\\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\\n' }}"
    "{%- else %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL)


def _source():
    return ToolSource.load(["tests.tool_envs.add", "tests.tool_envs.slow_double"], None)


def test_calls_are_parsed_in_the_hermes_and_llama3_formats_and_malformed_ones_are_the_models(tok):
    p = Protocol(tok, _source().schemas, "text")
    calls = p.parse('sum: <tool_call>{"name": "add", "arguments": {"a": 2, "b": "3"}}</tool_call> and '
                    '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 1}"}</tool_call>')
    assert [(c.name, c.arguments, c.error) for c in calls] == [("add", {"a": 2, "b": "3"}, None),
                                                               ("add", {"a": 1, "b": 1}, None)]
    assert [c.error.split(":")[0] for c in p.parse("<tool_call>{'name': 1}</tool_call> <tool_call>{\"name\": \"a\"")] \
        == ["malformed", "malformed"]
    assert p.parse("no call, just <answer>5</answer>") == []
    p.format = "llama3"
    assert [(c.name, c.arguments) for c in p.parse('<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}')] \
        == [("add", {"a": 1, "b": 2})]


@pytest.mark.parametrize("mode", ["text", "template"])
def test_tool_results_become_the_tokens_the_template_renders_after_an_assistant_turn(tok, mode):
    """The appended ids are exactly what the chat template renders for the whole conversation after the
    assistant's end-of-turn token: no re-tokenising of the history, no drift at the boundary."""
    if mode == "template":
        tok = type(tok).from_pretrained(MODEL)
        tok.chat_template = HERMES_TEMPLATE
    p = Protocol(tok, _source().schemas, "auto")
    assert p.template == (mode == "template")
    prompt = [{"role": "user", "content": "What is 2 + 3?"}]
    messages, kw = p.prompt_messages(prompt)
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    assert "add(a: integer, b: integer)" in text if mode == "text" else '"name": "add"' in text
    turn = tok(CALL, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    ids = tok(text, add_special_tokens=False)["input_ids"] + turn + p.result_ids([("add", "5"), ("add", "7")])
    if mode == "template":  # the template's own rendering of the same conversation, tokenised whole
        call = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
        whole = tok.apply_chat_template(messages + [{"role": "assistant", "content": "", "tool_calls": [call]},
                                                    {"role": "tool", "name": "add", "content": "5"},
                                                    {"role": "tool", "name": "add", "content": "7"}],
                                        tokenize=False, add_generation_prompt=True, **kw)
        tail = whole[whole.rindex("</tool_call>") + len("</tool_call>"):]  # (after the call's text)
    else:
        tail = "<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\n7\n" \
               "</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert tok.decode(ids).endswith(tail)


def test_a_turn_ends_at_the_models_stop_token_when_the_templates_end_of_turn_is_not_the_tokenizers_eos():
    """A base model's tokenizer with an instruct template (Qwen2.5's base: EOS <|endoftext|>, turns ending
    in <|im_end|>), <|im_end|> made a stop (model.stop_tokens): the turn's text leaves it out, and the tool
    results follow it exactly as the template renders them (the newline after it included)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(MODEL)
    tok.eos_token = "<|endoftext|>"
    end = tok.convert_tokens_to_ids("<|im_end|>")
    p = Protocol(tok, _source().schemas, "text", stop_ids=[end])
    messages, kw = p.prompt_messages([{"role": "user", "content": "What is 2 + 3?"}])
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    turn = tok(CALL, add_special_tokens=False)["input_ids"] + [end]
    assert p.turn_text(turn) == CALL
    ids = tok(text, add_special_tokens=False)["input_ids"] + turn + p.result_ids([("add", "5")])
    assert tok.decode(ids).endswith("</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response>"
                                    "<|im_end|>\n<|im_start|>assistant\n")
    eos_only = Protocol(tok, _source().schemas, "text")  # (the tokenizer's EOS alone: the newline is lost)
    assert eos_only.result_ids([("add", "5")]) != p.result_ids([("add", "5")])


def test_tool_faults_are_told_to_the_model_and_async_tools_run_concurrently():
    from tests import tool_envs as t

    named = {f.__name__: f for f in (t.add, t.slow_double, t.hang, t.leave, t.nothing)}
    calls = [ToolCall("add", {"a": 2, "b": 3}, ""), ToolCall("add", {"a": 2}, ""), ToolCall("hang", {"x": 1}, ""),
             ToolCall("leave", {"x": 1}, ""), ToolCall("nothing", {"x": 1}, ""), ToolCall("nope", {}, ""),
             ToolCall("slow_double", {"x": 4}, ""), ToolCall("slow_double", {"x": 5}, "")]
    t0 = time.perf_counter()
    call_tools([calls[:4], calls[4:]], [named, named], timeout_s=1.0)
    elapsed = time.perf_counter() - t0
    assert [c.result for c in calls[:1] + calls[6:]] == ["5", "8", "10"]
    errors = [c.error for c in calls]
    assert errors[0] is None and errors[1].startswith("TypeError") and errors[2] == "timeout"
    assert errors[3] == "sys.exit(3)" and errors[4] == "returned NoneType" and errors[5] == "unknown tool"
    assert all(c.result.startswith("Error: ") for c in calls[1:6])
    assert elapsed < 1.9, elapsed  # the hang's 1 s limit and the two 0.5 s async calls overlap


class _Sampler:
    """Sampling with the taught model through our engine, as the collector does."""

    def __init__(self, model_dir, max_new_tokens):
        from docuchat_rl.config import load_config
        from docuchat_rl.modeling import load_model_and_tokenizer

        self.model, self.tok = load_model_and_tokenizer(str(model_dir), dtype="float32", device="cpu")
        self.cfg = load_config(None, ["rollout.num_generations=4", f"rollout.max_new_tokens={max_new_tokens}"])
        self.cfg = self.cfg.for_device("cpu")
        self.seen = []  # every `more` call's (ids, sampled rows)

    def first(self, prompts, seeds):
        from docuchat_rl.sampling.decoding import Decoding
        from docuchat_rl.sampling.rollout import sample_rows

        return sample_rows(self.model, self.tok, Decoding.of(self.cfg.rollout, self.model), prompts, seeds)

    def more(self, ids, seeds, n):
        from docuchat_rl.sampling.decoding import Decoding
        from docuchat_rl.sampling.rollout import sample_rows

        gen = sample_rows(self.model, self.tok, Decoding.of(self.cfg.rollout, self.model), ids, seeds, turn_tokens=n)
        self.seen.append((ids, gen))
        return gen


def _conversations(taught, limits: TurnLimits, rows=8, add=None):
    """`rows` conversations of the taught model with the `add` tool (or `add`, run under that name)."""
    s = _Sampler(taught, limits.max_new_tokens)
    source = ToolSource.load(["tests.tool_envs.add"], None)
    p = Protocol(s.tok, source.schemas, "text")
    from docuchat_rl.data import load_split, prompt_turns

    e = load_split(s.cfg.data, "train")[:rows // 4]
    texts = [s.tok.apply_chat_template(m, tokenize=False, add_generation_prompt=True, **kw) for m, kw in
             (p.prompt_messages(prompt_turns(x.question, s.cfg.data.system_prompt)) for x in e)]
    seeds = list(range(100, 100 + rows))
    tools = [{"add": add or source.functions[0]} for _ in seeds]
    return s, p, run_turns(s.first(texts, seeds), s.more, seeds, tools, p, limits)


def test_a_conversation_is_the_sampled_tokens_and_the_tool_tokens_turn_by_turn(taught):
    s, p, gen = _conversations(taught, TurnLimits(192, 3, 8, 5.0, 64))
    assert any(len(t) > 1 for t in gen.turns), "the taught model made no call that ran"
    for r, (ids, mask, turns) in enumerate(zip(gen.completion_ids, gen.model_mask, gen.turns)):
        at = 0
        for k, turn in enumerate(turns):
            model = ids[at:at + turn.model_tokens]
            assert all(mask[at:at + turn.model_tokens])
            if k:  # this turn is what the engine sampled for this row from its whole history, with its turn seed
                calls = [(h, g) for h, g in s.seen if gen.prompt_ids[r] + ids[:at] in h]
                h, g = calls[k - 1]
                assert g.completion_ids[h.index(gen.prompt_ids[r] + ids[:at])][:turn.model_tokens] == model
            at += turn.model_tokens
            tool = ids[at:at + turn.env_tokens]
            assert not any(mask[at:at + turn.env_tokens])
            if turn.env_tokens:
                results = [(c.name or "tool", gen.conversations[r][2 * k + 1 + j]["content"])
                           for j, c in enumerate(turn.calls)]
                assert tool == p.result_ids(results)
                assert turn.calls[0].result == "5" or turn.calls[0].error
            at += turn.env_tokens
        assert at == len(ids) and len(ids) <= 192
    assert turn_seed(7, 1) != turn_seed(7, 2) != 7


def test_model_token_log_probs_equal_a_teacher_forced_forward_and_tool_tokens_get_no_gradient(taught):
    from docuchat_rl.learning.batch import build_batch
    from docuchat_rl.learning.losses import token_logprobs

    s, _, gen = _conversations(taught, TurnLimits(192, 3, 8, 5.0, 64))
    batch = build_batch(gen.prompt_ids, gen.completion_ids, [float(i % 2) for i in range(8)], [0] * 4 + [1] * 4,
                        s.tok.pad_token_id, sampler_logps=gen.logps, model_masks=gen.model_mask)
    tools = [len(m) - sum(m) for m in gen.model_mask]
    assert sum(tools) > 0 and batch.info.tool_tokens == tuple(tools)
    assert batch.info.loss_lens == tuple(len(m) - k for m, k in zip(gen.model_mask, tools))
    logits = s.model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits.float()
    lp = batch.prompt_width
    logps = token_logprobs(logits[:, lp - 1:-1], batch.completion_ids)  # [R, T] teacher-forced
    m = batch.completion_mask.bool()
    assert torch.allclose(logps[m], batch.sampler_logps[m], atol=2e-3), (logps[m] - batch.sampler_logps[m]).abs().max()
    leaf = logps.detach().requires_grad_(True)
    from docuchat_rl.config import load_config
    from docuchat_rl.learning.algorithms import get_algorithm_class
    from docuchat_rl.learning.forward import PolicyOutput
    from docuchat_rl.learning.losses import Normalisers

    cfg = load_config(None, ["rollout.num_generations=4", "rollout.prompts_per_step=2", "rollout.max_new_tokens=192"])
    algo = get_algorithm_class(cfg.algorithm.name)(cfg.algorithm)
    algo.advantages(batch)
    batch.old_logps = batch.sampler_logps
    loss, _ = algo.loss(PolicyOutput(leaf, None, None), batch,
                        Normalisers(rows=8, tokens=float(sum(batch.info.loss_lens)), max_new_tokens=192))
    (grad,) = torch.autograd.grad(loss, leaf)
    tool_positions = (~m) & (torch.arange(grad.shape[1]) < torch.tensor([len(c) for c in gen.completion_ids])[:, None])
    assert tool_positions.any() and grad[tool_positions].abs().max() == 0
    assert grad[m].abs().max() > 0


def test_turn_and_call_limits_hold(taught):
    _, _, gen = _conversations(taught, TurnLimits(192, 1, 8, 5.0, 64))  # one turn: calls parsed, never run
    assert all(len(t) == 1 for t in gen.turns)
    stopped = [t[0] for t in gen.turns if t[0].ended == "max_turns"]
    assert stopped and all(c.error in ("max_turns",) or c.error.startswith("malformed")
                           for t in stopped for c in t.calls)
    _, _, none = _conversations(taught, TurnLimits(192, 3, 0, 5.0, 64))  # 0 calls means none, not unlimited
    assert all(len(t) == 1 for t in none.turns)
    called = [c for t in none.turns for c in t[0].calls]
    assert called and all(c.error == "max_tool_calls" for c in called if c.name)
    # results cut to 2 tokens, said so (the taught model's call adds 2 and 3: a result that says so in words)
    s, _, cut = _conversations(taught, TurnLimits(192, 3, 8, 5.0, 2), add=lambda a, b: f"{a} plus {b} is {a + b}")
    shown = [c for t in cut.turns for turn in t if turn.ended == "tools" for c in turn.calls]
    assert shown and any(c.truncated for c in shown)
    for c in shown:  # the call keeps the text as inserted, and counts its tokens, the note included
        assert c.result_tokens == len(s.tok(c.result, add_special_tokens=False)["input_ids"])
        kept = c.result.split("\n[truncated: ")[0]
        assert len(s.tok(kept, add_special_tokens=False)["input_ids"]) <= 2 or not c.truncated
    inserted = [m["content"] for conv in cut.conversations for m in conv if m["role"] == "tool"]
    assert any("[truncated:" in m for m in inserted)
    assert sorted(inserted) == sorted(c.result for c in shown)


def _tool_run(tmp_path, taught, *extra):
    return cfg_for(tmp_path, f"model.name_or_path={taught}", "rollout.tools=[tests.tool_envs.add]",
                   "rollout.max_new_tokens=192", "rollout.tool_protocol=text", "run.steps=2", "checkpoint.every=1",
                   *extra)


@pytest.mark.slow
def test_an_environment_trains_through_the_cli_its_reward_traced(tmp_path, taught):
    """TRL's example environment shape (reset, a tool method, get_reward) named in the recipe, as a TRL user
    brings it; the environment component is in every trace line."""
    out = tmp_path / "run"
    args = [sys.executable, "-m", "docuchat_rl", "train", "--config", str(ROOT / "config" / "default.yaml")]
    for s in ["rollout.prompts_per_step=2", "rollout.num_generations=4", "logging.progress=false",
              "eval.before_and_after=false", f"model.name_or_path={taught}", "rollout.max_new_tokens=192",
              "rollout.environment_factory=tests.tool_envs.Counter", "rollout.tool_protocol=text", "run.steps=2",
              f"run.output_dir={out}",
              "rewards=[{name: correctness}, {name: environment, weight: 0.5}]"]:
        args += ["--set", s]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = read_jsonl(out / "traces.jsonl")
    assert len(lines) == 16 and all("environment" in r["rewards"] for r in lines)
    metrics = read_jsonl(out / "metrics.jsonl")
    assert all(m["tool_call_rate"] is not None and m["turns/mean"] >= 1 for m in metrics)
    assert all(r["rewards"]["environment"]["raw"] in (0.0, 1.0) for r in lines)
    assert all(r["turns"] and r["turns"][0]["model_tokens"] > 0 for r in lines)


@pytest.mark.slow
def test_a_resumed_multi_turn_run_equals_the_uninterrupted_one(tmp_path, taught):
    full = Trainer(_tool_run(tmp_path / "full", taught))
    full.train()
    full.close()
    cut = Trainer(_tool_run(tmp_path / "cut", taught))
    cut.train(stop_after=1)
    cut.close()
    cut = Trainer(_tool_run(tmp_path / "cut", taught), resume="latest")
    cut.train()
    cut.close()
    a, b = (read_jsonl(tmp_path / d / "traces.jsonl") for d in ("full", "cut"))
    assert any(len(r["turns"]) > 1 for r in a)
    strip = [{k: v for k, v in r.items() if k != "turns"} for r in untimed(a)], \
        [{k: v for k, v in r.items() if k != "turns"} for r in untimed(b)]
    assert strip[0] == strip[1]
    no_seconds = [[[{k: v for k, v in c.items() if k != "seconds"} for c in t["calls"]] for t in r["turns"]]
                  for r in a], [[[{k: v for k, v in c.items() if k != "seconds"} for c in t["calls"]]
                                 for t in r["turns"]] for r in b]
    assert no_seconds[0] == no_seconds[1]
    # rescoring reads the traced conversations (the rewards score the last assistant turn, as in training)
    from docuchat_rl.tools.replay import replay, rescore

    result = rescore(tmp_path / "full")
    assert len(result.lines) == len(a) and result.changed == []
    assert [r["total"] for r in result.lines] == [r["total"] for r in a]
    line = next(r for r in a if len(r["turns"]) > 1 and r["step"] == 2)
    turn1 = line["turns"][0]["model_tokens"] + line["turns"][0]["env_tokens"]  # the second turn's first token
    bent = {**line, "completion_ids": [*line["completion_ids"][:turn1], line["completion_ids"][turn1] ^ 1,
                                       *line["completion_ids"][turn1 + 1:]]}  # (one step sampled again for both)
    same, moved = replay(tmp_path / "full", [line, bent], progress=False, say=lambda _: None)
    assert same.same and same.ids == line["completion_ids"], same.as_dict()
    assert moved.diverges_at == turn1 and moved.as_dict()["diverges_in"] == "turn 1 model"


def test_a_fixed_lag_samples_conversations_with_the_lagged_policy(tmp_path, taught):
    t = Trainer(_tool_run(tmp_path, taught, "rollout.async_lag=1", "run.steps=3", "checkpoint.every=3"))
    t.train()
    t.close()
    lines = read_jsonl(tmp_path / "traces.jsonl")
    assert {r["step"]: r["policy_version"] for r in lines} == {1: 0, 2: 0, 3: 1}
    assert any(len(r["turns"]) > 1 for r in lines)


def test_an_environment_whose_reset_fails_drops_its_group(tmp_path, taught):
    t = Trainer(_tool_run(tmp_path, taught, "rollout.tools=[]", "rollout.environment_factory=tests.tool_envs.BrokenReset",
                          "run.steps=1", "rewards=[{name: correctness}, {name: environment}]",
                          "rollout.prompts_per_step=4"))
    with pytest.warns(UserWarning, match="environment reset failed for prompt row .*no room for this row"):
        t.train()
    t.close()
    lines = read_jsonl(tmp_path / "traces.jsonl")
    broken = {r["prompt_id"] for r in lines if "7" in r["prompt"]}
    assert broken, "no prompt with a 7 among the step's"
    assert all(not r["used"] for r in lines if r["prompt_id"] in broken)
    assert any(r["used"] for r in lines)


def test_evaluation_runs_the_tool_loop_and_reports_tool_use(taught):
    from docuchat_rl.config import load_config
    from docuchat_rl.modeling import load_model_and_tokenizer
    from docuchat_rl.evaluation import evaluate

    model, tok = load_model_and_tokenizer(str(taught), dtype="float32", device="cpu")
    cfg = load_config(None, ["rollout.tools=[tests.tool_envs.add]", "rollout.max_new_tokens=192", "eval.limit=8",
                             "eval.pass_k=2"])
    out = evaluate(model, tok, cfg)
    assert out["rows"] == 8 and out["tool_call_rate"] > 0 and 0 <= out["tool_call_ok_frac"] <= 1
    assert out["tool_calls/mean"] >= out["tool_call_rate"]
    assert 0 <= out["pass@1"] <= out["pass@2"] <= 1
    again = evaluate(model, tok, cfg)  # pass@k's conversations come from their own seeds: the same numbers
    assert {k: v for k, v in again.items() if k != "seconds"} == {k: v for k, v in out.items() if k != "seconds"}


def test_tool_settings_without_tools_and_bad_tools_fail_early_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match="rollout.max_turns applies to multi-turn rollouts"):
        cfg_for(tmp_path, "rollout.max_turns=3")
    with pytest.raises(ConfigError, match="with rollout.async_lag sample in the learner's process"):
        cfg_for(tmp_path, "rollout.tools=[tests.tool_envs.add]", "rollout.async_lag=1", "rollout.async_worker_threads=1")
    with pytest.raises(TrainingError, match=r"rollout.tools.0: cannot import 'tests.tool_envs.nope'"):
        Trainer(cfg_for(tmp_path, "rollout.tools=[tests.tool_envs.nope]"))
    with pytest.raises(TrainingError, match="has get_reward\\(\\): add it to the rewards"):
        Trainer(cfg_for(tmp_path / "b", "rollout.environment_factory=tests.tool_envs.Counter"))


def test_turns_are_in_the_trace_schema():
    from docuchat_rl.traces import columns

    assert columns()["turns"] == "JSON"


@pytest.mark.parametrize("algo", ["ppo", "a2c"])
def test_actor_critic_advantages_skip_tool_tokens(algo):
    """PPO's GAE and A2C's n-step returns over a multi-turn row equal those over the same row with its tool
    tokens cut out (the environment's tokens are not steps of the policy); the tool positions get none."""
    from docuchat_rl.config import load_config
    from docuchat_rl.learning.algorithms import get_algorithm_class
    from docuchat_rl.learning.batch import build_batch

    extra = ["algorithm.lam=0.9", "algorithm.gamma=0.95"] if algo == "ppo" else ["algorithm.n_steps=2",
                                                                                   "algorithm.gamma=0.9"]
    cfg = load_config(None, [f"algorithm.name={algo}", "rollout.num_generations=1", "rollout.prompts_per_step=2",
                             "algorithm.whiten_advantages=false", *extra])
    a = get_algorithm_class(algo)(cfg.algorithm, hidden_size=8)
    ids, mask = [5, 6, 7, 8, 9, 10, 11], [1, 1, 0, 0, 0, 1, 1]
    values = torch.tensor([[0.1, 0.2, 0.9, 0.9, 0.9, 0.3, 0.4], [0.5, 0.6, 0, 0, 0, 0, 0]])
    multi = build_batch([[1], [1]], [ids, [5, 6]], [1.0, 0.0], [0, 1], 0, model_masks=[mask, [1, 1]])
    multi.values = values.clone()
    a.advantages(multi)
    cut = build_batch([[1], [1]], [[5, 6, 10, 11], [5, 6]], [1.0, 0.0], [0, 1], 0)
    cut.values = torch.tensor([[0.1, 0.2, 0.3, 0.4], [0.5, 0.6, 0, 0]])
    a.advantages(cut)
    keep = torch.tensor([0, 1, 5, 6])
    assert torch.allclose(multi.advantages[0, keep], cut.advantages[0]), (multi.advantages, cut.advantages)
    assert torch.allclose(multi.returns[0, keep], cut.returns[0])
    assert torch.equal(multi.advantages[0, 2:5], torch.zeros(3))
    assert torch.allclose(multi.advantages[1, :2], cut.advantages[1, :2])


# ----------------------------------------------------------------- round 4: right numbers with tools (issue 55)


def _cli_train(out, taught, *sets):
    args = [sys.executable, "-m", "docuchat_rl", "train", "--config", str(ROOT / "config" / "default.yaml")]
    for s in ["rollout.prompts_per_step=2", "rollout.num_generations=4", "logging.progress=false",
              "eval.before_and_after=false", f"model.name_or_path={taught}", "rollout.tool_protocol=text",
              f"run.output_dir={out}", *sets]:
        args += ["--set", s]
    done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.mark.slow
def test_a_completion_cut_before_its_tool_results_are_shown_is_scored_as_cut_never_on_the_tools_text(tmp_path, taught):
    """The tool hands the model the gold answer; the completion's room (105 tokens: the 61-token call, the
    43 tokens of empty results' framing and one more) runs the call but cannot show its result. Scored on
    the tool's text, every such completion would be right (the reward hack); scored as cut, none is, and
    rescoring the traces agrees with training."""
    out = tmp_path / "run"
    _cli_train(out, taught, "rollout.max_new_tokens=105", "rollout.environment_factory=tests.tool_envs.Oracle",
               "run.steps=1", "rewards=[{name: correctness}, {name: environment, weight: 0.1}]")
    lines = read_jsonl(out / "traces.jsonl")
    cut = [r for r in lines if r["turns"][-1]["ended"] == "max_new_tokens"]
    assert cut, [r["turns"][-1]["ended"] for r in lines]
    for r in cut:
        last = r["turns"][-1]
        assert r["truncated"] and last["env_tokens"] == 0 and last["calls"]
        assert r["rewards"]["correctness"]["raw"] == 0.0, r["rewards"]["correctness"]
        assert r["completion_tokens"] == sum(t["model_tokens"] + t["env_tokens"] for t in r["turns"])
    ran = [c for r in cut for c in r["turns"][-1]["calls"] if c["error"] is None]
    assert ran and all(c["result"].startswith("<answer>") for c in ran)  # (they ran: the result was never shown)
    from docuchat_rl.tools.replay import rescore

    again = rescore(out)
    assert again.changed == [] and again.kept == ["environment"]
    assert [r["rewards"]["environment"] for r in again.lines] == [r["rewards"]["environment"] for r in lines]


def test_the_shared_prompt_scores_each_rows_own_observation(tmp_path, taught):
    """An environment whose first observation differs per row (a random start): with the shared prompt on,
    the second epoch's old log-probs (the no-grad pass) equal the sampler's, as with it off."""
    from .conftest import train_here

    mismatch = {}
    for share in (True, False):
        out = tmp_path / str(share)
        train_here(ROOT / "config" / "default.yaml", [
            "rollout.prompts_per_step=2", "rollout.num_generations=4", "logging.progress=false",
            "eval.before_and_after=false", f"model.name_or_path={taught}", "rollout.tool_protocol=text",
            "rollout.max_new_tokens=192", "rollout.environment_factory=tests.tool_envs.RandomStart",
            "rewards=[{name: correctness}, {name: environment}]", "algorithm.num_iterations=2", "run.steps=1",
            f"optim.share_prompt={str(share).lower()}", f"run.output_dir={out}"])
        (m,) = read_jsonl(out / "metrics.jsonl")
        mismatch[share] = m["sampler/mismatch_max"]
        prompts = {r["observation"] for r in read_jsonl(out / "traces.jsonl")}
        assert len(prompts) == 8, prompts  # (each row its own start)
    assert mismatch[True] < 1e-3 and mismatch[False] < 1e-3, mismatch


def test_what_tools_and_environments_return_is_cut_before_it_is_tokenised_and_traced_as_cut(taught):
    """30 KB from reset and 12 MB from a tool: the prompt is cut to data.max_prompt_tokens, the result to
    rollout.max_tool_result_tokens, each saying so; the call keeps the text as inserted (a bounded trace)."""
    from docuchat_rl.sampling.multiturn import MultiTurn, _observed

    s = _Sampler(taught, 192)
    source = ToolSource.load([], "tests.tool_envs.Flood")
    p = Protocol(s.tok, source.schemas, "text")
    from docuchat_rl.data import load_split

    examples = load_split(s.cfg.data, "train")[:2]
    mt = MultiTurn(source, p, TurnLimits(192, 3, 8, 5.0, 16), group_size=4, max_prompt_tokens=300)
    t0 = time.perf_counter()
    gen = mt.sample([0, 1], examples, list(range(8)), None, s.more)
    assert time.perf_counter() - t0 < 60
    assert all(len(ids) <= 300 for ids in gen.prompt_ids)
    assert all("[observation truncated: " in o and o.endswith("tokens kept of 36000 characters]")
               for o in gen.observations)
    assert gen.prompt_ids[0] == s.tok(mt.render(_observed(mt.turns(examples[0]), gen.observations[0])),
                                      add_special_tokens=False)["input_ids"]
    assert all(r.get("answer", "").count("####") == 1 for r in [mt.reset_row(e) for e in examples])  # (as written)
    from docuchat_rl.sampling.multiturn import _truncate

    call = ToolCall("add", {"a": 2, "b": 3}, "")
    call_tools([[call]], [{"add": lambda a, b: "9" * 12_000_000}], 5.0)
    t0 = time.perf_counter()
    inserted = _truncate(s.tok, call, 16)
    assert time.perf_counter() - t0 < 1.0  # (12 MB through the tokenizer takes many seconds)
    assert inserted == call.result and call.truncated and inserted.endswith("of 12000000 characters]")
    assert len(inserted) < 16 * 64 and call.result_tokens == len(s.tok(inserted, add_special_tokens=False)["input_ids"])


def test_calls_a_limit_kept_from_running_are_not_counted_as_failed():
    from docuchat_rl.traces import TraceRecord, step_metrics

    def record(calls):
        return TraceRecord(run_id="r", step=1, prompt_id=0, group=0, sample=0, used=True, prompt="Q", completion="A",
                           gold="1", completion_tokens=3, truncated=False, rewards={}, total=0.0, total_missing=False,
                           turns=[{"calls": calls, "env_tokens": 0}])

    ok, failed = {"error": None}, {"error": "TypeError: x"}
    limited = [{"error": e} for e in ("max_turns", "max_tool_calls", "max_new_tokens")]
    m = step_metrics([record([ok, failed] + limited)], [], None)
    assert m["tool_call_ok_frac"] == 0.5 and m["tool_calls/mean"] == 5
    assert ToolCall("add", {}, "", error="max_turns").ran is False and ToolCall("add", {}, "").ran


def test_an_environment_reward_of_nan_is_said_and_counted(tmp_path, taught):
    from .conftest import train_here

    train_here(ROOT / "config" / "default.yaml", [
        "rollout.prompts_per_step=2", "rollout.num_generations=4", "logging.progress=false",
        "eval.before_and_after=false", f"model.name_or_path={taught}", "rollout.tool_protocol=text",
        "rollout.max_new_tokens=192", "rollout.environment_factory=tests.tool_envs.NanReward",
        "rewards=[{name: correctness}, {name: environment}]", "run.steps=1", f"run.output_dir={tmp_path}"])
    (m,) = read_jsonl(tmp_path / "metrics.jsonl")
    lines = read_jsonl(tmp_path / "traces.jsonl")
    assert m["rewards/environment/nan"] == 8
    assert all(r["rewards"]["environment"]["raw"] is None and r["rewards"]["environment"]["info"] == {"nan": True}
               for r in lines)


def test_evaluation_leaves_out_the_rows_whose_reset_failed_and_counts_them(taught):
    from docuchat_rl.config import load_config
    from docuchat_rl.modeling import load_model_and_tokenizer
    from docuchat_rl.evaluation import evaluate

    model, tok = load_model_and_tokenizer(str(taught), dtype="float32", device="cpu")
    sets = ["rollout.environment_factory=tests.tool_envs.BrokenReset", "rollout.max_new_tokens=64", "eval.limit=12",
            "rewards=[{name: correctness}, {name: environment}]"]
    cfg = load_config(None, sets)
    from docuchat_rl.data import load_split

    broken = sum("7" in e.question for e in load_split(cfg.data, "test", 12))
    assert 0 < broken < 12
    with pytest.warns(UserWarning, match="environment reset failed"):
        out = evaluate(model, tok, cfg)
    assert out["reset_failed"] == broken and out["rows"] == 12 - broken
    from docuchat_rl.errors import ToolError

    with pytest.raises(ToolError, match="every one of the 12 held-out rows failed its environment's reset"):
        with pytest.warns(UserWarning):
            evaluate(model, tok, load_config(None, sets[1:] + ["rollout.environment_factory=tests.tool_envs.NeverResets"]))


def test_a_step_whose_every_reset_failed_names_the_resets_not_dynamic_sampling(tmp_path, taught):
    t = Trainer(_tool_run(tmp_path, taught, "rollout.tools=[]", "rollout.environment_factory=tests.tool_envs.NeverResets",
                          "run.steps=1", "rewards=[{name: correctness}, {name: environment}]"))
    with pytest.warns(UserWarning, match="out of pieces"), \
            pytest.raises(TrainingError, match="rollout.environment_factory's reset raised for every prompt"):
        t.train()
    t.close()


def test_generate_says_it_calls_no_tool(capsys):
    """generate with the recipe's tools set answers in one turn and says so (chat shares the same check)."""
    from docuchat_rl.cli import main

    assert main(["generate", "--set", "rollout.tools=[tests.tool_envs.add]", "--prompt", "1 + 1?",
                 "--max-new-tokens", "4"]) == 0
    err = capsys.readouterr().err
    assert "warning: generate answers in one turn and calls no tool" in err


def test_an_interrupt_while_a_tool_hangs_stops_at_once_and_is_not_the_tools_error():
    """Ctrl-C (or the second SIGTERM, which raises the same) during the wait for a hung tool is the run's
    interrupt: it propagates within a moment instead of becoming the call's error at the tool's time limit."""
    import os
    import signal
    import threading

    from tests import tool_envs as t

    call = ToolCall("hang", {"x": 1}, "")
    # (Python's own Ctrl-C handler, whatever this process inherited: a shell starts a background job with
    # SIGINT ignored, and then no KeyboardInterrupt would come)
    inherited = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Timer(0.3, lambda: os.kill(os.getpid(), signal.SIGINT)).start()
        t0 = time.perf_counter()
        with pytest.raises(KeyboardInterrupt):
            call_tools([[call]], [{"hang": t.hang}], timeout_s=30.0)
    finally:
        signal.signal(signal.SIGINT, inherited)
    assert time.perf_counter() - t0 < 5 and call.error is None


@pytest.mark.parametrize("unit", ["tokens", "chars"])
def test_the_length_reward_measures_what_the_model_wrote_in_either_unit(unit):
    """A multi-turn completion: the length reward counts the model's own turns, never the tool's result, in
    tokens (model_tokens, from the model mask) as in characters (the assistant messages): a longer tool result
    changes neither."""
    from docuchat_rl.data import Example
    from docuchat_rl.sampling.generation import Generation
    from docuchat_rl.sampling.scoring import build_reward, score
    from docuchat_rl.config import RewardsConfig

    reward = build_reward(RewardsConfig.model_validate(
        {"components": [{"name": "length", "params": {"shape": "overlong", "max_len": 1000, "cache": 1000,
                                                      "unit": unit}}]}))
    lengths = []
    for result in ("7", "7" * 300):
        call, answer = "<tool_call>{\"name\": \"calculate\"}</tool_call>", "#### 7"
        model, tool = [5] * 12, [9] * (4 + len(result))  # (12 model tokens, the result's tokens between)
        gen = Generation([[1]], [model[:8] + tool + model[8:]], [False], [[0.0] * (len(model) + len(tool))])
        gen.model_mask = [[1] * 8 + [0] * len(tool) + [1] * 4]
        gen.conversations = [[{"role": "assistant", "content": call}, {"role": "tool", "content": result},
                              {"role": "assistant", "content": answer}]]
        rec = score(reward, [Example(0, "Q", "7")], [answer], gen).records[0]
        lengths.append(rec.components["length"].info["length"])
    assert lengths[0] == lengths[1] == (12 if unit == "tokens" else len(call) + len(answer))


def test_tool_and_environment_settings_that_cannot_take_effect_are_one_line(tmp_path):
    """A tool name two sources give (a function and an environment's method), a template protocol the model's
    chat template cannot show, and a reset that returns other than text or None: each one line naming it."""
    from docuchat_rl.modeling import load_model_and_tokenizer
    from docuchat_rl.sampling.multiturn import multiturn_from_config, reset_environments

    from docuchat_rl.errors import ToolError

    _, tok = load_model_and_tokenizer(str(MODEL), dtype="float32", device="cpu")
    both = cfg_for(tmp_path, "rollout.tools=[docuchat_rl.toolbox.calculate]",
                   "rollout.environment_factory=tests.tool_envs.CalculatorToo",
                   "rewards=[{name: correctness}, {name: environment}]")
    with pytest.raises(ToolError, match="both give a tool named 'calculate'"):
        multiturn_from_config(both, tok)
    template = cfg_for(tmp_path, "rollout.tools=[docuchat_rl.toolbox.calculate]", "rollout.tool_protocol=template")
    with pytest.raises(ToolError, match="rollout.tool_protocol template: this model's chat template does not use"):
        multiturn_from_config(template, tok)  # (the embedded model's template renders no tools)
    from .tool_envs import DictStart

    with pytest.warns(UserWarning, match="returned dict, not text or None: its group is dropped"):
        _, observations, failed = reset_environments(DictStart, [{"question": "Q", "prompt_id": 4}] * 2, 2)
    assert observations == [None, None] and failed == {0: "reset returned dict, not text or None"}
