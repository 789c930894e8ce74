"""A real model that calls tools: the embedded default, fine-tuned in a few seconds to answer the text
protocol's prompt with a tool call (`docuchat_rl/sampling/multiturn.py`), so that the tests sample real
multi-turn conversations (the committed model never saw a tool)."""

from __future__ import annotations

import json
from pathlib import Path

from .conftest import MODEL

CALL = '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>'


def teach_tool_calls(out: Path, steps: int = 600) -> Path:
    """The embedded model, taught for `steps` full fine-tuning steps that after a prompt listing tools it
    writes CALL and, after a tool result, a short answer; saved with its tokenizer in `out`.

    The tests sample it at temperature 1.0, so the 61-token call must be near certain on prompts it never saw
    (a question of the test split, an environment's first observation after it): taught on 64 questions, half
    with an observation, at lr 1e-3 after 20 warm-up steps, a held-out prompt's call costs 0.01-0.02 nats in
    all (98-99 % of sampled rows write it whole). Taught on 16 plain questions at 2e-3 for 150 steps, it cost 4.8
    nats on a held-out question and 73 after an observation: a garbled call in most sampled rows ("<tol__call>"),
    and tests failing on one CPU and passing on another."""
    import torch

    from docuchat_rl.config import load_config
    from docuchat_rl.data import load_split
    from docuchat_rl.modeling import load_model_and_tokenizer
    from docuchat_rl.sampling.multiturn import Protocol, ToolSource

    if (out / "model.safetensors").exists():
        return out
    torch.manual_seed(0)
    model, tok = load_model_and_tokenizer(str(MODEL), dtype="float32", device="cpu")
    cfg = load_config(None)
    examples = load_split(cfg.data, "train", 64)
    source = ToolSource.load(["tests.tool_envs.add"], "tests.tool_envs.Counter")
    protocol = Protocol(tok, source.schemas, "text")
    texts = []
    for i, e in enumerate(examples):  # half of them with an environment's first observation
        texts.append((_prompt(tok, protocol, cfg, e.question, f" You start at {i * 37 % 101}." if i % 2 else ""),
                      CALL + tok.eos_token))
    suffix = protocol.result_ids([("add", "5")])
    answer = tok("<think>\n2 + 3 = 5\n</think>\n<answer>5</answer>", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    warmup = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    model.train()
    for step in range(steps):
        prompt, call = texts[step % len(texts)]
        p = tok(prompt, add_special_tokens=False)["input_ids"]
        c = tok(call, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([p + c + suffix + answer])
        labels = torch.tensor([[-100] * len(p) + c + [-100] * len(suffix) + answer])
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        # clipped: unclipped, a few large early steps leave the model writing garbage on some CPUs (AVX2)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        warmup.step()
        opt.zero_grad()
    model.eval()
    cost = _call_cost(model, tok, protocol, cfg)
    # checked here, once, so that a machine where teaching falls short fails with this line, not as tool tests
    # that find no call that ran (at 0.1 nats, 90 % of sampled rows write the call whole)
    assert max(cost.values()) < 0.1, f"the taught model's call costs {cost} nats on held-out prompts"
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "taught.json").write_text(json.dumps({"steps": steps, "final_loss": float(loss.detach()), "call_nats": cost}) + "\n")
    return out


def _call_cost(model, tok, protocol, cfg) -> dict[str, float]:
    """The mean negative log-likelihood (nats) of the whole CALL after 4 test-split prompts, plain and with an
    observation appended (prompts the teaching never saw)."""
    import torch

    from docuchat_rl.data import load_split

    call = tok(CALL + tok.eos_token, add_special_tokens=False)["input_ids"]
    cost = {}
    for kind, obs in (("plain", ""), ("observed", " You start at 58.")):
        nats = []
        for e in load_split(cfg.data, "test", 4):
            p = tok(_prompt(tok, protocol, cfg, e.question, obs), add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([p + call])).logits[0, len(p) - 1:-1]  # [len(call), V]
            nats.append(-logits.log_softmax(-1).gather(-1, torch.tensor(call)[:, None]).sum().item())
        cost[kind] = round(sum(nats) / len(nats), 4)
    return cost


def _prompt(tok, protocol, cfg, question: str, observation: str) -> str:
    """A question's prompt text as the collector renders it, an environment's first observation (or "")
    appended by the collector's own rule."""
    from docuchat_rl.data import prompt_turns
    from docuchat_rl.sampling.multiturn import _observed

    messages, kw = protocol.prompt_messages(_observed(prompt_turns(question, cfg.data.system_prompt), observation))
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
