"""Use what was trained: sample from a checkpoint (or the base model, or both), chat with it, export it.

- `load_policy`: the base model with a checkpoint's LoRA adapter on top (peft), or the base alone.
- `sample_records`: completions for a list of questions, through the same chat template, system prompt,
  sampler and reward inputs as training, as records shaped like the audit's (prompt, completion, gold,
  tokens, truncated, and each reward component's raw/weight/weighted/error/info when scored).
- `chat`: a multi-turn loop over a line-based console (the model's chat template; /reset, /exit).
- `export_merged`: the adapter merged into the base weights (peft's merge, in the base dtype) and saved as
  a standalone Hugging Face model folder that plain `AutoModelForCausalLM` (and so vLLM or any server)
  loads, with the tokenizer, chat template, a generation config holding only the sampling settings the
  run trained with, and a model card.

Deliberately left out: serving (an exported folder is what servers take) and quantised export.
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Callable

from ..checkpoint import saved_config
from ..config import Config, ModelConfig
from ..data import Example, prompt_text
from ..errors import ModelError
from ..modeling import eos_ids, load_configured
from ..outputs import read_jsonl
from ..sampling.decoding import Decoding
from ..sampling.generation import completion_texts, generate


def config_of_checkpoint(adapter: str | Path) -> dict | None:
    """The resolved config a checkpoint was trained with (`run_config.json`), if it has one."""
    return saved_config(Path(adapter))


def check_adapter_files(adapter: str | Path) -> None:
    """An adapter folder peft can load: its config, and weights whose safetensors header reads (a cut or
    damaged file is one line naming it, not a traceback from inside peft)."""
    from safetensors import safe_open

    folder = Path(adapter)
    if not (folder / "adapter_config.json").exists():
        raise FileNotFoundError(f"--adapter {adapter}: no adapter_config.json there (give a checkpoint folder)")
    weights = folder / "adapter_model.safetensors"
    if weights.exists():
        try:
            with safe_open(str(weights), framework="pt") as f:
                f.keys()
        except Exception as e:  # (safetensors' own error type: a header cut short or not JSON)
            raise ModelError(f"--adapter {adapter}: {weights.name} cannot be read (damaged or cut short?): "
                             f"{str(e).splitlines()[0][:120]}") from None


def load_policy(m: ModelConfig, adapter: str | Path | None, device: str | None = None):
    """(model, tokenizer): the configured base model (on `device`, else model.device), with the
    checkpoint's adapter when given."""
    model, tok = load_configured(m, device=device)
    if adapter is not None:
        from peft import PeftModel

        check_adapter_files(adapter)
        try:
            model = PeftModel.from_pretrained(model, str(adapter))
        except (ValueError, RuntimeError) as e:  # peft: no module it targets, or weights of other shapes
            base = json.loads((Path(adapter) / "adapter_config.json").read_text()).get("base_model_name_or_path")
            why = ("its weight shapes do not fit that model" if isinstance(e, RuntimeError)
                   else "that model has none of the modules it adapts")
            raise ModelError(f"--adapter {adapter} was trained on base model {base!r}, not on the configured "
                             f"model.name_or_path {m.name_or_path!r}: {why}; set model.name_or_path={base}") from None
    return model.eval(), tok


def sample_records(model, tok, cfg: Config, examples: list[Example], *, n: int = 1, do_sample: bool = False,
                   temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0, max_new_tokens: int | None = None,
                   reward=None, base: bool = False) -> list[dict]:
    """`n` completions per example (greedy when not `do_sample`); scored by `reward` (a CompositeReward)
    when given. `base` runs a peft model with its adapter disabled."""
    from ..sampling.scoring import score
    from ..traces import completion_fields

    cfg = cfg.for_device(next(model.parameters()).device.type)
    prompts = [prompt_text(tok, cfg.data, e)
               for e in examples]
    ctx = model.disable_adapter() if base and hasattr(model, "disable_adapter") else contextlib.nullcontext()
    with ctx:
        gen = generate(model, tok, prompts, _decoding(cfg, model, max_new_tokens or cfg.rollout.max_new_tokens,
                                                      do_sample, temperature, top_p, top_k, cfg.eval.batch_size, n))
    texts = completion_texts(tok, gen.completion_ids, eos_ids(model, tok))
    rows = [e for e in examples for _ in range(n)]
    result = score(reward, rows, texts, gen) if reward is not None else None
    return [completion_fields(e, i % n, text, len(gen.completion_ids[i]), gen.truncated[i],
                              result.records[i] if result is not None else None)
            for i, (e, text) in enumerate(zip(rows, texts))]


def _decoding(cfg: Config, model, max_new_tokens: int, do_sample: bool, temperature: float, top_p: float,
              top_k: int, batch_size: int = 64, n: int = 1) -> Decoding:
    """The recipe's decode loop and switches (its merged adapter too, as evaluation samples) with the command's
    own sampling settings, `n` completions a prompt."""
    return Decoding.of(cfg.rollout, model, max_new_tokens=max_new_tokens, do_sample=do_sample,
                       temperature=temperature, top_p=top_p, top_k=top_k, batch_size=batch_size,
                       num_return_sequences=n, min_new_tokens=0)


def is_text(text: str) -> bool:
    """Whether `text` is valid Unicode (command-line arguments and input in a C/POSIX locale carry bytes that
    are not UTF-8 as lone surrogates, which a tokenizer cannot encode)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def chat(model, tok, cfg: Config, read: Callable[[str], str], write: Callable[[str], None], *,
         max_new_tokens: int, do_sample: bool, temperature: float, top_p: float, top_k: int) -> int:
    """A multi-turn conversation: `read(prompt)` gives the user's next line (EOFError ends), `write`
    shows the reply. /reset forgets the conversation, /exit ends it. Returns the number of replies."""
    cfg = cfg.for_device(next(model.parameters()).device.type)
    system = [{"role": "system", "content": cfg.data.system_prompt}] if cfg.data.system_prompt else []
    messages, replies = [*system, *cfg.data.few_shot_turns], 0
    write("chat with the model: /reset forgets the conversation, /exit quits\n")
    while True:
        try:
            line = read("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            write("\n")
            return replies
        except UnicodeDecodeError:  # (bytes that are not UTF-8 on standard input)
            write("(that line is not UTF-8 text: nothing was sent; type it again)\n")
            continue
        if not is_text(line):  # (undecodable bytes kept as surrogates by a C/POSIX locale)
            write("(that line is not UTF-8 text: nothing was sent; type it again)\n")
            continue
        if line in ("/exit", "/quit"):
            return replies
        if line == "/reset":
            messages = list(system)
            write("(conversation reset)\n")
            continue
        if not line:
            continue
        messages.append({"role": "user", "content": line})
        prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        gen = generate(model, tok, [prompt], _decoding(cfg, model, max_new_tokens, do_sample, temperature, top_p,
                                                       top_k))
        reply = completion_texts(tok, gen.completion_ids, eos_ids(model, tok))[0].strip()
        messages.append({"role": "assistant", "content": reply})
        write(f"model> {reply}\n")
        replies += 1


def export_merged(cfg: Config, adapter: str | Path, out: str | Path, dtype: str = "base") -> Path:
    """Merge the checkpoint's adapter into the base weights and save a standalone model folder."""
    import torch
    from peft import PeftModel
    from transformers import GenerationConfig

    out, adapter = Path(out), Path(adapter)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"export folder {out} is a file; give a new folder")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"export folder {out} is not empty; give a new folder")
    check_adapter_files(adapter)
    m = cfg.model
    base, tok = load_configured(m, dtype, "cpu", quantized=False)  # (a quantized run's adapter merges into the
    # base as it is stored: `export` says so, and what it writes is a plain model, not a quantized one)
    if m.quantization != "none":
        print(f"docuchat-rl: the adapter was trained over the base quantized ({m.quantization}); it is merged into "
              f"the base as stored ({m.name_or_path}), dequantized", file=sys.stderr, flush=True)
    lm_head, embedding = base.get_output_embeddings(), base.get_input_embeddings()
    if getattr(base.config, "tie_word_embeddings", False) and lm_head is not None and \
            lm_head.weight is embedding.weight:
        adapted = json.loads((adapter / "adapter_config.json").read_text()).get("target_modules") or []
        sides = {name.rsplit(".", 1)[-1] for name, m in base.named_modules() if m is lm_head or m is embedding}
        if sides & set(adapted):  # merging into a tied weight would change the other side too: in training
            # only the adapted side carried the delta (modeling.build_lora)
            lm_head.weight = torch.nn.Parameter(lm_head.weight.detach().clone())
            base.config.tie_word_embeddings = False
    merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    r = cfg.rollout
    # only the sampling settings the run trained with: nothing the trainer never scored (no repetition
    # penalty, no default top-k of 50)
    merged.generation_config = GenerationConfig(
        bos_token_id=base.generation_config.bos_token_id, eos_token_id=base.generation_config.eos_token_id,
        pad_token_id=tok.pad_token_id, do_sample=True, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
        repetition_penalty=1.0)
    out.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / "README.md").write_text(_model_card(cfg, adapter))
    return out


def _json_object(path: Path) -> dict:
    """A JSON object file's content; {} when it is missing, damaged or not an object."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _model_card(cfg: Config, adapter: Path) -> str:
    state = _json_object(adapter / "trainer_state.json")
    run = adapter.parent
    evals = _json_object(run / "eval.json")  # (the card shows what it can read; a damaged file is left out)
    if not evals and (run / "eval.jsonl").exists():
        lines = read_jsonl(run / "eval.jsonl")
        evals = {"after": lines[-1]} if lines else {}
    rewards = ", ".join(f"{c.name} x {c.weight:g}" for c in cfg.rewards.components)
    lines = [
        "---", f"base_model: {cfg.model.name_or_path}", "library_name: transformers", "tags: [docuchat-rl, rl, lora-merged]",
        "---", "", f"# {cfg.model.name_or_path} + docuchat-rl {cfg.algorithm.name}", "",
        f"LoRA adapter trained with docuchat-rl ({cfg.algorithm.name}), merged into the base weights.", "",
        f"- base model: `{cfg.model.name_or_path}`", f"- checkpoint: `{adapter}` (step {state.get('step', '?')})",
        f"- algorithm: {cfg.algorithm.name}; rewards: {rewards}",
        f"- rollout: {cfg.rollout.prompts_per_step} prompts x {cfg.rollout.num_generations} completions, "
        f"temperature {cfg.rollout.temperature}, top_p {cfg.rollout.top_p}, top_k {cfg.rollout.top_k}, "
        f"max {cfg.rollout.max_new_tokens} new tokens",
        f"- LoRA: r {cfg.lora.r}, alpha {cfg.lora.alpha}, targets {cfg.lora.target_modules}",
        f"- data: `{cfg.data.train}`; system prompt: {cfg.data.system_prompt!r}", ""]
    if evals:
        lines += ["## Held-out evaluation (greedy)", "", "| | accuracy | format rate | mean length |", "|---|---|---|---|"]
        for when in ("before", "after"):
            e = evals.get(when)
            if e:
                lines.append(f"| {when} | {e.get('accuracy')} | {e.get('format_rate')} | {e.get('completion_len/mean')} |")
        lines.append("")
    else:
        lines += ["No held-out evaluation was found next to the checkpoint.", ""]
    lines += ["The run's full resolved config:", "", "```json", json.dumps(cfg.to_dict(), indent=1), "```", ""]
    return "\n".join(lines)
