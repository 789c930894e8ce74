"""Seconds per GRPO step, ours against `trl.GRPOTrainer`, at the same settings on the same machine.

    python scripts/benchmark.py                      # 8 x 8 completions, 48 new tokens, natural EOS and fixed length
    python scripts/benchmark.py --repeats 5 --lengths natural
    python scripts/benchmark.py --only ours --set optim.share_prompt=false
    python scripts/benchmark.py --sweep              # group size {4, 8, 16} x max new tokens {32, 64, 128}
    python scripts/benchmark.py --json
    python scripts/benchmark.py --config config/smollm2.yaml --steps 30 --repeats 1 --lengths natural --curve
    python scripts/benchmark.py --config config/smollm2.yaml --switches --steps 5 --warmup 1 --repeats 2
    python scripts/benchmark.py --config config/smollm2.yaml --steps 100 --repeats 1 --lengths natural --curve \
        --keep runs/paired --ours runs/lc/smollm2     # learning: TRL 100 steps beside our run, both evaluated
    python scripts/benchmark.py --shape qwen2.5-0.5b --lengths fixed --prompts 16 --max-new 256   # on a GPU
    python scripts/benchmark.py --sft --steps 8 --warmup 2 --repeats 2   # `docuchat-rl sft` against TRL's SFTTrainer
    python scripts/benchmark.py --config config/smollm2_tools.yaml --switches --flip rollout.turn_cache=false
    python scripts/benchmark.py --config config/smollm2_tools.yaml --tools --steps 5 --warmup 1 --repeats 2

Robust to a noisy machine (the same TRL run has taken 2.65 and 3.58 s/step here): each side runs
`--repeats` times, interleaved (ours, TRL, TRL, ours, ...: drift hits both alike), each run in its own
process; a run's time per step is the median over its steps after `--warmup`; printed per side are the
median over the repeats and the spread (min-max), and the ratio of the medians with the spread of the
paired ratios. `--lengths` runs natural EOS, fixed length (every completion max-new tokens), or both.

Each side runs in its own process (so each peak RSS is its own): (a) our trainer,
(b) TRL's GRPOTrainer with `use_cpu=True, bf16=False` (on a CPU), gradient checkpointing off, `report_to="none"`.
Both get the embedded default model, LoRA r16/alpha 32 on all linear layers, the same prompts in the same
order (TRL's shuffling off, fed our sampler's order), the same group size, max new tokens, temperature,
learning rate (constant), beta 0, mu 1, the "grpo" loss aggregation, and the correctness reward only
(ours from `rewards/`, TRL's the same function in TRL's reward signature). Printed per side: seconds per
step, our seconds per phase, rollout tokens/s, peak RSS, mean reward over the last 10 steps; then ours/TRL.
TRL's rollout time is measured around its `generate` call. `--tensor-memory` also counts each side's tensors
alive per phase (`docuchat_rl.memory.TensorBytes`: what CUDA's allocated memory counts, measurable on a CPU,
where RSS also holds allocator caches; "loaded": the weights, adapters and everything else alive once the
trainer is built; TRL's "update" is all outside its `generate`).

`--config RECIPE` runs a recipe instead (the real model: config/smollm2.yaml): both sides get its model,
system prompt, every reward component with its weight and params (TRL: `reward_funcs` + `reward_weights`),
sampling settings, learning rate and schedule, GRPO settings (TRL's `loss_type`, `scale_rewards`, epsilon,
beta, num_iterations) and micro-batch (TRL: `per_device_train_batch_size` = optim.micro_batch_size with
gradient accumulation up to the step's completions, so one generation batch and one optimizer step per
step, as ours); prompts per step, group size, max new tokens, temperature and lr default to the recipe's.
Ours runs in the recipe's `model.dtype`; TRL on a CPU in float32 (`use_cpu=True, bf16=False`) unless
`--trl-dtype bfloat16`, which loads its model in bfloat16 and trains it with `bf16=True` (autocast), as on a
GPU (TRL 1.16 accepts bf16 on a CPU; earlier versions refused it). `--curve` prints the
mean training reward of both sides per window of 5 steps (the same prompts in the same order).

`--keep DIR` keeps what each side learned: its final adapter and a line per step (reward, its standard
deviation, seconds) under DIR/ours and DIR/trl, written as the run goes (a run cut off keeps its steps and a
checkpoint every quarter of the run), then evaluates both final adapters with `docuchat-rl eval` on the
recipe's held-out set and its `eval.also` sets into DIR/eval_ours.json and DIR/eval_trl.json (ours evaluates
TRL's adapter too: the same rows, prompt, greedy decoding and reward code for both), and prints the
accuracies and the training reward's paired difference with its standard error. With `--only`, one side at a
time (run the two into the same DIR one after the other; the comparison is printed once both are there).
`--ours RUN` takes our side from a finished run of the recipe instead of running it again (its metrics and its
checkpoint at `--steps`): a recipe's learning run (scripts/learning_curve.py) draws exactly the completions
of our side here, the same seed, prompts and settings (the first 30 steps' rewards of config/smollm2.yaml's
agree to the last digit), and evaluating between steps changes nothing in training.

`--switches` runs our side only: the recipe as it is (every `auto` switch decided for the CPU), then with
one speed switch at a time set to its plain path (SWITCHES), the variants interleaved in each repeat; a
table of each variant's s/step, rollout and update seconds, peak RSS and rollout tokens/s against the
defaults (on a GPU, where the defaults are the plain paths: GPU_SWITCHES, each switch on; `--flip` names
other variants). That table decides the `auto` switches per device (config.Config.for_device).

`--sft` times the supervised stage instead: `docuchat-rl sft`'s step (config/smollm2_task_sft.yaml, or `--config`)
against TRL's SFTTrainer on the same examples in the same batches (ours writes each step's prompt ids, target
ids and loss mask; TRL gets them as pre-tokenized `input_ids` + `completion_mask` rows, sequential sampling,
`completion_only_loss`), LoRA as the recipe's, per `--dtypes` (ours in that model.dtype; TRL's weights float32,
`bf16=True` for a bf16 one): seconds a step, peak RSS, and both sides' loss at step 1 (the same batch from the
same weights: LoRA's B starts at zero).

`--tools` compares a tool-using recipe's step (its `rollout.tools`, max_turns, max_new_tokens as the whole
completion's budget, tool results included, on both sides): TRL's GRPOTrainer with `tools=` parses calls only for
chat templates it knows by their text (`trl.chat_template_utils.add_response_schema`), so both sides run the
recipe's model under TRL's copy of Qwen2.5's template (TOOL_TEMPLATE; a ChatML template, which SmolLM2's
tokens already are) from a folder made once under runs/bench/, ours with `rollout.tool_protocol: template`;
the recipe's few-shot call is written as that template writes calls. TRL gets the tools as Python functions,
`max_tool_calling_iterations` = max_turns - 1, and the prompt as chat messages. Printed beside the times, per
completion: turns on each side (TRL's: the rows its `generate` calls sampled, over the completions) and tool
calls (ours `tool_calls/mean`, every call parsed; TRL's `tools/call_frequency`, the calls it ran); and the
prompt tokens our rollout prefilled per step. TRL's rollout time is the sum of its `generate` calls in the step.

On a GPU (docs/performance.md, "GPU"): both sides run there in bfloat16 (TRL: `bf16=True`, its model loaded
in bfloat16), peak memory is torch's peak GPU allocation, and `--shape` gives both a random-weight model of
a published shape (SHAPES) with the embedded default's tokenizer: for timing only, at fixed length.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


TOY = {"prompts": 8, "generations": 8, "max_new": 48, "lr": 5e-4, "temperature": 1.0}  # the embedded default's


def settings_args(a) -> list[str]:
    return ["--prompts", str(a.prompts), "--generations", str(a.generations), "--max-new", str(a.max_new),
            "--steps", str(a.steps), "--warmup", str(a.warmup), "--lr", str(a.lr), "--temperature", str(a.temperature),
            "--threads", str(a.threads), *(["--fixed-length"] if a.fixed_length else []),
            *(["--config", str(a.config)] if a.config else []), "--trl-dtype", a.trl_dtype,
            *(["--keep", str(a.keep)] if a.keep else []), *(["--ours", str(a.ours)] if a.ours else []),
            *(["--tools"] if a.tools else []), *(["--tensor-memory"] if a.tensor_memory else []),
            *(["--trl-quantization", a.trl_quantization] if a.trl_quantization != "none" else []),
            *[x for s in a.overrides for x in ("--set", s)]]


def fill_settings(a) -> None:
    """Settings left unset: the recipe's (--config), else the embedded default benchmark's (TOY); TRL's dtype
    by the device."""
    if a.trl_dtype is None:
        import torch

        a.trl_dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    defaults = TOY
    if a.config:
        from docuchat_rl.config import load_config

        cfg = load_config(a.config, a.overrides)
        r = cfg.rollout
        defaults = {"prompts": r.prompts_per_step, "generations": r.num_generations, "max_new": r.max_new_tokens,
                    "lr": cfg.optim.lr, "temperature": r.temperature}
    for key, value in defaults.items():
        if getattr(a, key) is None:
            setattr(a, key, value)


def bench_config(a, out: str):
    """Our config for a run: the recipe's (or the embedded default's, reduced to the correctness reward with
    beta 0, mu 1 and the grpo aggregation) at the benchmark's sizes."""
    from docuchat_rl.config import load_config

    sizes = [f"run.output_dir={out}", f"run.steps={a.steps}", f"run.threads={a.threads}", "run.seed=0",
             f"rollout.prompts_per_step={a.prompts}", f"rollout.num_generations={a.generations}",
             f"rollout.max_new_tokens={a.max_new}", f"rollout.temperature={a.temperature}", f"optim.lr={a.lr}",
             f"rollout.min_new_tokens={a.max_new if a.fixed_length else 0}", "logging.progress=false",
             "eval.before_and_after=false", "eval.every=null",
             # (kept: a checkpoint every quarter of the run, as TRL's side saves, so a run cut short leaves adapters)
             *([f"checkpoint.every={max(1, a.steps // 4)}", "checkpoint.keep_last=4"] if a.keep
               else [f"checkpoint.every={a.steps + 1}"])]
    if a.config:
        return load_config(a.config, [*sizes, *tool_overrides(a), *a.overrides])
    toy = ["algorithm.beta=0", "algorithm.num_iterations=1", "algorithm.loss_aggregation=grpo",
           "optim.schedule=constant", "optim.warmup_steps=0", "rewards.components=[{name: correctness, weight: 1.0}]"]
    return load_config(ROOT / "config/default.yaml", [*sizes, *toy, *a.overrides])


# --tools: the chat template both sides run under (TRL parses tool calls only for templates it knows by their text)
TOOL_TEMPLATE = "qwen2_5_chat_template"


def tool_model(cfg) -> Path:
    """The recipe's model folder with TOOL_TEMPLATE as its chat template, made once under runs/bench/ (the
    weights linked, not copied)."""
    import trl.chat_template_utils as templates

    source = (ROOT / cfg.model.name_or_path).resolve()
    folder = ROOT / "runs" / "bench" / f"{source.name}-{TOOL_TEMPLATE.removesuffix('_chat_template')}"
    if not (folder / "chat_template.jinja").exists():
        folder.mkdir(parents=True, exist_ok=True)
        for f in source.iterdir():
            if f.name == "tokenizer_config.json":  # (a template held there would win over the file's)
                config = {k: v for k, v in json.loads(f.read_text()).items() if k != "chat_template"}
                (folder / f.name).write_text(json.dumps(config, indent=2))
            elif f.name != "chat_template.jinja" and not (folder / f.name).exists():
                (folder / f.name).symlink_to(f)
        (folder / "chat_template.jinja").write_text(getattr(templates, TOOL_TEMPLATE))
    return folder


def tool_overrides(a) -> list[str]:
    """With --tools: the recipe's model under TOOL_TEMPLATE, tools through the template, and each few-shot
    call written as that template writes calls (its block on lines of its own)."""
    if not a.tools:
        return []
    import re

    from docuchat_rl.config import load_config

    cfg = load_config(a.config, a.overrides)
    shots = [{"role": t.role, "content": re.sub(r"<tool_call>\s*(.*?)\s*</tool_call>", "<tool_call>\n\\1\n</tool_call>",
                                                 t.content, flags=re.S)}
             for t in cfg.data.few_shot]
    return [f"model.name_or_path={tool_model(cfg)}", "rollout.tool_protocol=template",
            f"data.few_shot={json.dumps(shots)}"]


def after_warmup(values: list, a) -> list:
    """The per-step values after the first `warmup` steps (all of them when the run is that short)."""
    return values[a.warmup:] or values


def peak_mb() -> float:
    """This process's peak memory: on a GPU the most torch ever held allocated there, else the peak RSS."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# Published shapes for `--shape` (random weights, data/model's tokenizer; no hub here): hidden, MLP, layers,
# heads, KV heads, vocabulary. qwen2-tiny is the same path at a CPU's size, to check the script before a GPU run.
SHAPES = {"qwen2.5-0.5b": (896, 4864, 24, 14, 2, 151_936), "qwen2.5-1.5b": (1536, 8960, 28, 12, 2, 151_936),
          "qwen2.5-3b": (2048, 11008, 36, 16, 2, 151_936), "qwen2.5-7b": (3584, 18944, 28, 28, 4, 152_064),
          "qwen2-tiny": (64, 128, 2, 4, 2, 151_936)}  # (hidden, mlp, layers, heads, key/value heads, vocabulary)


def build_shape(name: str, folder: Path, layers: int | None = None) -> Path:
    """A random-weight Qwen2 model of a published shape (tied embeddings, bfloat16 on disk) with the embedded
    default's tokenizer, saved to `folder`; `layers`: that many decoder layers instead of the shape's (the memory
    table measures a few and extrapolates). Its completions are noise (every token id above the tokenizer's 544
    decodes to nothing): for timing only, at fixed length."""
    import shutil

    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    hidden, mlp, full, heads, kv, vocab = SHAPES[name]
    layers = layers or full
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, tie_word_embeddings=True,
                         max_position_embeddings=32_768, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                         rms_norm_eps=1e-6, eos_token_id=3, pad_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)  # (tied: Qwen2.5-7B's head is its own, 0.5 GB more)
    model.generation_config = GenerationConfig(eos_token_id=3, pad_token_id=1)
    model.save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(ROOT / "data/model" / f, folder / f)
    return folder


def prompt_order(n_rows: int, a) -> list[int]:
    """The row order our trainer samples in (seed 0), so TRL can be fed the same prompts step by step."""
    from docuchat_rl.data import PromptSampler

    sampler = PromptSampler(n_rows, seed=0)
    return [i for _ in range(a.steps) for i in sampler.take(a.prompts)]


def kept(a, side: str) -> Path | None:
    """`--keep`'s folder for a side (None without --keep)."""
    return a.keep / side if a.keep else None


def run_ours(a) -> dict:
    import contextlib

    from docuchat_rl.memory import TensorBytes
    from docuchat_rl.trainer import Trainer

    keep = kept(a, "ours")
    held = TensorBytes() if a.tensor_memory else None
    with (contextlib.nullcontext(str(keep)) if keep else tempfile.TemporaryDirectory()) as out, \
            held or contextlib.nullcontext():
        # (kept: the run folder itself, whose metrics.jsonl is written step by step and whose final checkpoint
        # is the adapter evaluated; the trainer always checkpoints at its last step)
        trainer = Trainer(bench_config(a, out), on_phase=held.phase if held else None)
        if held:
            held.phase("loaded")  # (weights read from a file are counted here: no operation made them)
        history = trainer.train()
        trainer.close()
    rest = after_warmup(history, a)
    phases = sorted({k for m in rest for k in m if k.startswith("time/")})
    return {
        "seconds_per_step": statistics.median(sum(m[p] for p in phases) for m in rest),
        "phases": {p.removeprefix("time/"): statistics.median(m[p] for m in rest) for p in phases},
        "rollout_tokens_per_s": statistics.median(m["rollout_tokens_per_s"] for m in rest),
        "peak_mb": peak_mb(),
        "mean_reward_last_10": statistics.mean(m["reward/mean"] for m in history[-10:]),
        "reward_per_step": [m["reward/mean"] for m in history],
        "reward_std_per_step": [m["reward/std"] for m in history],
        "mismatch_mean": statistics.mean(m["sampler/mismatch_mean"] for m in history),
        # multi-turn recipes: prompt tokens the model ran over per step, every turn's (turn_cache.py)
        "prefill_tokens": statistics.median(m["rollout/prefill_tokens"] for m in rest)
        if rest[0].get("rollout/prefill_tokens") is not None else None,
        "tool_calls": statistics.mean(m["tool_calls/mean"] for m in rest) if "tool_calls/mean" in rest[0] else None,
        "turns": statistics.mean(m["turns/mean"] for m in rest) if "turns/mean" in rest[0] else None,
        **tensor_peaks(held),
    }


def step_clock(on_log=None):
    """A TRL trainer callback timing each optimizer step (`.seconds`), calling `on_log(state, logs, seconds)` at
    each log (TRL has no per-step timings of its own)."""
    from transformers import TrainerCallback

    class StepClock(TrainerCallback):
        def __init__(self):
            self.begin, self.seconds = 0.0, []
            self.generating: list[float] = []  # seconds of each generate call in the step (`timed` appends)
            self.rows = 0  # rows the step's generate calls sampled, every turn's (with tools: turns = rows / completions)
            self.rows_per_step: list[int] = []
            self.rollout: list[float] = []  # per step, their sum

        def on_step_begin(self, args, state, control, **kw):
            self.begin = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.seconds.append(time.perf_counter() - self.begin)
            self.rollout.append(sum(self.generating))  # (the step's generate calls: several with tools)
            self.generating.clear()
            self.rows_per_step.append(self.rows)
            self.rows = 0

        def on_log(self, args, state, control, logs=None, **kw):
            if on_log is not None:
                on_log(state, logs, self.seconds)

    return StepClock()


def run_trl(a) -> dict:
    import contextlib

    import torch

    from docuchat_rl.memory import TensorBytes

    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as scratch:
        cfg = bench_config(a, scratch)  # (the same recipe our side runs)
    held = TensorBytes() if a.tensor_memory else None
    with held or contextlib.nullcontext():  # (phases as on our side: start, loaded, then rollout / update)
        return _run_trl(a, cfg, held)


def _run_trl(a, cfg, held) -> dict:
    import contextlib

    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    from docuchat_rl.data import load_examples, render_prompt
    from docuchat_rl.modeling import load_model_and_tokenizer
    from docuchat_rl.sampling.multiturn import load_object
    from rewards import build_reward

    gpu = torch.cuda.is_available()
    quantized = None
    if a.trl_quantization != "none":  # (TRL's QLoRA: the model loaded with a BitsAndBytesConfig, peft's k-bit path)
        from docuchat_rl.modeling import Quantization

        quantized = Quantization(a.trl_quantization, a.trl_dtype, False)
    model, tok = load_model_and_tokenizer(str(ROOT / cfg.model.name_or_path), a.trl_dtype, "cuda" if gpu else "cpu",
                                          quantization=quantized)
    rows = load_examples(str(ROOT / cfg.data.train), "train", cfg.data.prompt_column, cfg.data.answer_column)
    order = prompt_order(len(rows), a)
    tools = [load_object(spec, "rollout.tools") for spec in cfg.rollout.tools] if a.tools else None

    def prompt(question: str):  # with tools, chat messages (TRL renders them with the tools' schemas)
        if tools:
            return [{"role": "system", "content": cfg.data.system_prompt}, *cfg.data.few_shot_turns,
                    {"role": "user", "content": question}]
        return render_prompt(tok, question, cfg.data.system_prompt, few_shot=cfg.data.few_shot_turns)

    data = Dataset.from_list([{"prompt": prompt(rows[i].question), "answer": rows[i].answer} for i in order])
    # our reward components are TRL-style callables already (named after their registry names)
    funcs = [build_reward(c.name, c.params) for c in cfg.rewards.components]
    weights = [c.weight for c in cfg.rewards.components]
    rows_per_step = a.prompts * a.generations
    micro = min(cfg.optim.micro_batch_size, rows_per_step)
    alg = cfg.algorithm

    def log_step(state, logs, seconds):
        if keep and logs and "reward" in logs:  # a line per step as it ends: a run cut off keeps its steps
            with open(keep / "steps.jsonl", "a") as f:
                f.write(json.dumps({"step": state.global_step, "seconds": seconds[-1], **logs}) + "\n")

    clock = step_clock(log_step)
    keep = kept(a, "trl")
    if keep:
        keep.mkdir(parents=True)
    with (contextlib.nullcontext(str(keep / "run")) if keep else tempfile.TemporaryDirectory()) as out:
        args = GRPOConfig(  # (kept: TRL's checkpoints every quarter of the run, a run cut short leaves adapters)
            output_dir=out, use_cpu=not gpu, bf16=a.trl_dtype == "bfloat16", report_to="none",
            save_strategy="steps" if keep else "no", save_steps=max(1, a.steps // 4), save_only_model=True,
            logging_steps=1,
            max_steps=a.steps, per_device_train_batch_size=micro, gradient_accumulation_steps=rows_per_step // micro,
            num_generations=a.generations, max_completion_length=a.max_new, temperature=a.temperature,
            top_p=cfg.rollout.top_p, top_k=cfg.rollout.top_k, learning_rate=a.lr,
            lr_scheduler_type={"constant": "constant_with_warmup"}.get(cfg.optim.schedule, cfg.optim.schedule),
            warmup_steps=cfg.optim.warmup_steps, max_grad_norm=cfg.optim.max_grad_norm, beta=alg.beta,
            epsilon=alg.epsilon_low, epsilon_high=alg.epsilon_high, num_iterations=alg.num_iterations,
            loss_type=alg.loss_aggregation, scale_rewards=alg.scale, reward_weights=weights,
            shuffle_dataset=False, seed=0, activation_checkpointing=cfg.model.gradient_checkpointing,
            disable_dropout=cfg.model.disable_dropout, disable_tqdm=True,
            generation_kwargs={"min_new_tokens": a.max_new} if a.fixed_length else None,
            **({"max_tool_calling_iterations": cfg.rollout.max_turns - 1} if tools else {}))
        trainer = GRPOTrainer(model=model, processing_class=tok, reward_funcs=funcs, args=args,
                              train_dataset=data, callbacks=[clock], tools=tools,
                              peft_config=LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha,
                                                     lora_dropout=cfg.lora.dropout,
                                                     target_modules=cfg.lora.target_modules, task_type="CAUSAL_LM"))
        if held:
            held.phase("loaded")  # (as on our side)
        policy = trainer.model
        plain_generate = policy.generate

        def timed_generate(*args, **kwargs):  # measurement only: TRL has no per-phase timings in its logs
            t0 = time.perf_counter()
            ids = kwargs.get("input_ids", args[0] if args else None)
            clock.rows += 0 if ids is None else len(ids)
            if held:
                held.phase("rollout")
            try:
                return plain_generate(*args, **kwargs)
            finally:
                clock.generating.append(time.perf_counter() - t0)
                if held:
                    held.phase("update")  # (TRL's scoring, log-probs, loss, backward and optimizer step)

        policy.generate = timed_generate
        trainer.train()
        if keep:  # the LoRA adapter as peft saves it, which `docuchat-rl eval --adapter` loads
            trainer.save_model(str(keep / "adapter"))
    logs = [r for r in trainer.state.log_history if "reward" in r]
    tok_s = [r["completions/mean_length"] * rows_per_step / s for r, s in zip(logs, clock.rollout)]
    return {
        "seconds_per_step": statistics.median(after_warmup(clock.seconds, a)),
        "phases": {"rollout": statistics.median(after_warmup(clock.rollout, a))},
        # (TRL's call_frequency counts the calls it ran; ours every call parsed: turns are the comparable count)
        "tool_calls": statistics.mean(r["tools/call_frequency"] for r in after_warmup(logs, a)) if tools else None,
        "turns": statistics.mean(after_warmup(clock.rows_per_step, a)) / rows_per_step if tools else None,
        "rollout_tokens_per_s": statistics.median(after_warmup(tok_s, a)),
        "peak_mb": peak_mb(),
        "mean_reward_last_10": statistics.mean(r["reward"] for r in logs[-10:]),
        "reward_per_step": [r["reward"] for r in logs],
        "reward_std_per_step": [r["reward_std"] for r in logs],
        **tensor_peaks(held),
    }


def tensor_peaks(held) -> dict:
    """`--tensor-memory`: the peak MiB of tensors alive in each phase (memory.TensorBytes; "start": what loading
    made by operations, "loaded": all alive once the trainer is built)."""
    return {"tensor_peaks_mb": {k: v / 2**20 for k, v in held.peaks.items()}} if held else {}


def spawn(side: str, a, **changes) -> dict:
    """One side in a fresh process (its own peak RSS), returning its JSON line."""
    b = argparse.Namespace(**{**vars(a), **changes})
    cmd = [sys.executable, __file__, "--worker", side, *settings_args(b)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if done.returncode != 0:
        raise SystemExit(f"{side} run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    extra = [o for o in b.overrides if not o.startswith("model.name_or_path=")]
    print(f"# {side}{' fixed' if b.fixed_length else ''} {' '.join(extra)}: {result['seconds_per_step']:.3f} s/step, "
          f"rollout {result['phases'].get('rollout', 0):.3f} s, peak {result['peak_mb']:.0f} MB", file=sys.stderr,
          flush=True)  # (each run as it ends: a run cut off by a time limit keeps what it measured)
    return result


def median_run(rs: list[dict]) -> dict:
    """Of repeated runs of one variant: the run closest to the median time per step (its phases, tokens/s
    and RSS), with the median itself, the spread and every run's time."""
    times = [r["seconds_per_step"] for r in rs]
    mid = statistics.median(times)
    return {**min(rs, key=lambda r: abs(r["seconds_per_step"] - mid)), "seconds_per_step": mid,
            "spread": [min(times), max(times)], "runs": times}


def compare(a, **changes) -> dict:
    """Each side `a.repeats` times, interleaved; per side the run closest to the median of its time per
    step (its phases, tokens/s and RSS), the median and spread of the times, and the ratios."""
    sides = ["ours", "trl"] if a.only is None else [a.only]
    runs: dict[str, list[dict]] = {side: [] for side in sides}
    for i in range(a.repeats):
        for side in (sides if i % 2 == 0 else sides[::-1]):  # alternate who goes first
            runs[side].append(spawn(side, a, **changes))
    result: dict = {side: median_run(rs) for side, rs in runs.items()}
    if len(result) == 2:
        o, t = result["ours"], result["trl"]
        paired = [x / y for x, y in zip(o["runs"], t["runs"])]
        result["ratio"] = {"seconds_per_step": o["seconds_per_step"] / t["seconds_per_step"],
                           "paired_spread": [min(paired), max(paired)],
                           "peak": o["peak_mb"] / t["peak_mb"],
                           "rollout_tokens_per_s": o["rollout_tokens_per_s"] / t["rollout_tokens_per_s"]}
    return result


# each speed switch's plain path (the defaults have every switch on), and the CPU's other dtype (bf16-mixed,
# with and without merged sampling) against its default float32; several overrides in one variant: " + "
SWITCHES = ["rollout.engine=hf", "rollout.grouped_decode=false", "rollout.merge_adapter=false",
            "optim.share_prompt=false", "optim.length_buckets=1", "lora.fused=false", "model.dtype=bf16-mixed",
            "model.dtype=bf16-mixed + rollout.merge_adapter=false"]


# on a GPU every `auto` switch is off (the plain paths): each switch on alone, then the CPU's defaults together,
# and the memory switches (chunked log-probs off, activation checkpointing on)
GPU_SWITCHES = [" + ".join(["rollout.engine=fast", "rollout.grouped_decode=true", "rollout.merge_adapter=true",
                           "optim.share_prompt=true"]),
                "rollout.engine=fast", "rollout.engine=fast + rollout.grouped_decode=true",
                "rollout.engine=fast + rollout.merge_adapter=true", "rollout.merge_adapter=true",
                "optim.share_prompt=true", "optim.logit_chunk=0", "model.gradient_checkpointing=true"]


def switches(a) -> dict:
    """Our side with the defaults and with each switch flipped (SWITCHES on a CPU, GPU_SWITCHES on a GPU),
    interleaved (the order reversed every other repeat); per variant the median run's numbers and the spread
    of its seconds per step."""
    import torch

    flips = a.flips or (GPU_SWITCHES if torch.cuda.is_available() else SWITCHES)
    variants = [("defaults", [])] + [(s, s.split(" + ")) for s in flips]
    runs: dict[str, list[dict]] = {name: [] for name, _ in variants}
    for i in range(a.repeats):
        for name, extra in (variants if i % 2 == 0 else variants[::-1]):
            runs[name].append(spawn("ours", a, overrides=[*a.overrides, *extra]))
    return {name: median_run(rs) for name, rs in runs.items()}


def print_switches(title: str, result: dict, fixed_length: bool = False) -> None:
    base = result["defaults"]
    width = max(map(len, result)) + 2
    print(title)
    print(f"  {'variant':<{width}}{'s/step':>8}{'spread':>13}{'vs defaults':>12}{'rollout s':>11}{'update s':>10}"
          f"{'tok/s':>7}{'peak MB':>13}{'mismatch':>10}{'prefill tok':>12}")
    for name, r in result.items():
        ph = r["phases"]
        print(f"  {name:<{width}}{r['seconds_per_step']:>8.2f}{r['spread'][0]:>6.2f}-{r['spread'][1]:<6.2f}"
              f"{r['seconds_per_step'] / base['seconds_per_step']:>11.2f}x{ph.get('rollout', 0):>11.2f}"
              f"{ph.get('update', 0):>10.2f}{r['rollout_tokens_per_s']:>7.0f}{r['peak_mb']:>13.0f}"
              f"{r['mismatch_mean']:>10.1e}{r.get('prefill_tokens') or '':>12}")
    if fixed_length:  # (the large mismatch a fixed-length run prints is this, not a sampler/learner bug)
        print("  mismatch at fixed length: the sampler bans EOS before max new tokens (min_new_tokens), so its "
              "log-probs are under another distribution than the learner's; compare it between variants only")


def print_table(title: str, result: dict) -> None:
    print(title)
    print(f"  {'':<8}{'s/step':>8}{'spread':>14}{'rollout s':>11}{'update s':>10}{'tok/s':>8}{'peak MB':>13}"
          f"{'reward':>8}")
    for side in ("ours", "trl"):
        if side in result:
            r = result[side]
            ph = r["phases"]
            upd = ph.get("update", float("nan"))
            spread = f"{r['spread'][0]:.2f}-{r['spread'][1]:.2f}"
            print(f"  {side:<8}{r['seconds_per_step']:>8.3f}{spread:>14}{ph['rollout']:>11.3f}{upd:>10.3f}"
                  f"{r['rollout_tokens_per_s']:>8.0f}{r['peak_mb']:>13.0f}{r['mean_reward_last_10']:>8.3f}")
    if "ratio" in result:
        q = result["ratio"]
        print(f"  ours/TRL: seconds per step {q['seconds_per_step']:.2f} (paired runs {q['paired_spread'][0]:.2f}-"
              f"{q['paired_spread'][1]:.2f}), peak memory {q['peak']:.2f}, rollout tokens/s "
              f"{q['rollout_tokens_per_s']:.2f}")
    if "ours" in result:
        print("  our phases (s): " + ", ".join(f"{k} {v:.3f}" for k, v in result["ours"]["phases"].items()))
    for side in ("ours", "trl"):  # (--tensor-memory)
        if "tensor_peaks_mb" in result.get(side, {}):
            print(f"  {side} tensor memory peak (MiB) by phase: " + ", ".join(
                f"{k} {v:.0f}" for k, v in result[side]["tensor_peaks_mb"].items()))
    calls = {side: r for side, r in result.items() if side != "ratio" and r.get("tool_calls") is not None}
    if calls:  # (--tools: how much tool use each side's time covers; ours counts calls parsed, TRL's calls run)
        print("  per completion, turns and tool calls: " + ", ".join(
              f"{side} {r['turns']:.2f} and {r['tool_calls']:.2f}" for side, r in calls.items())
              + (f"; our rollout prefilled {result['ours']['prefill_tokens']:.0f} prompt tokens a step"
                 if result.get("ours", {}).get("prefill_tokens") is not None else ""))


def evaluate_kept(a) -> dict:
    """`docuchat-rl eval` of each kept side's final adapter, in its own process: {side: its eval JSON}."""
    found = {}
    ours = a.ours / f"checkpoint-{a.steps}" if a.ours else a.keep / "ours"
    for side, adapter in (("ours", ours), ("trl", a.keep / "trl" / "adapter")):
        if not adapter.exists():
            continue
        out = a.keep / f"eval_{side}.json"  # (beside the runs: `eval` writes nothing into a run's folder)
        if not out.exists():
            recipe = a.config or ROOT / "config/default.yaml"
            cmd = [sys.executable, "-m", "docuchat_rl", "eval", "--config", str(recipe), "--adapter", str(adapter),
                   "--out", str(out), *[x for s in a.overrides for x in ("--set", s)]]
            subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
        found[side] = json.loads(out.read_text())
    return found


def print_learning(a, evals: dict) -> None:
    """Held-out accuracy of each side's final adapter, then both sides' training reward and its paired
    difference (ours minus TRL's, the same prompts each step) per window of steps, over the whole run and over
    its second half, each with its standard error over the steps."""
    print(f"  held-out, final adapters (`docuchat-rl eval`, greedy, {a.keep}/eval_<side>.json):")
    for side, r in evals.items():
        also = [k.removesuffix("/accuracy") for k in r if k.endswith("/accuracy") and not k.startswith("eval/")]
        extra = "".join(f", {name} {r[name + '/accuracy']:.1%}" for name in also)
        print(f"    {side:<5} accuracy {r['accuracy']:.1%}, format {r.get('format_rate', float('nan')):.1%}{extra}")
    curves = {}
    ours, trl = (a.ours or a.keep / "ours") / "metrics.jsonl", a.keep / "trl" / "steps.jsonl"
    if ours.exists():
        curves["ours"] = [json.loads(x)["reward/mean"] for x in ours.read_text().splitlines() if x.strip()][:a.steps]
    if trl.exists():
        curves["trl"] = [json.loads(x)["reward"] for x in trl.read_text().splitlines() if x.strip()]
    if len(curves) < 2:
        return
    n = min(len(c) for c in curves.values())
    diff = [x - y for x, y in zip(curves["ours"][:n], curves["trl"][:n])]

    def cell(xs: list[float]) -> str:  # a window's mean +- its standard error over the steps
        return f"{statistics.mean(xs):+.3f}" if len(xs) < 2 else \
            f"{statistics.mean(xs):.3f} +- {statistics.stdev(xs) / len(xs) ** 0.5:.3f}"

    window = 10 if n >= 40 else 5
    print(f"  training reward per {window} steps, mean +- standard error over the steps (the same prompts each "
          "step): ours | TRL | ours - TRL")
    for lo in range(0, n, window):
        hi = min(lo + window, n)
        cells = [cell(c[lo:hi]) for c in (curves["ours"], curves["trl"], diff)]
        print(f"    steps {lo + 1:>3}-{hi:<3} " + " | ".join(cells))
    for lo in (0, n // 2):
        d = diff[lo:n]
        if len(d) < 2:
            continue
        spread = statistics.stdev(d) / len(d) ** 0.5
        print(f"    steps {lo + 1}-{n}: ours {statistics.mean(curves['ours'][lo:n]):.3f}, TRL "
              f"{statistics.mean(curves['trl'][lo:n]):.3f}, ours - TRL {cell(d)} "
              + (f"({statistics.mean(d) / spread:+.1f} standard errors)" if spread else "(no spread: equal every step)"))


def print_curve(result: dict, window: int = 5) -> None:
    """Each side's mean training reward per window of steps (the median run's), side by side, with the
    standard error of each window's mean over its steps."""
    sides = [side for side in ("ours", "trl") if side in result]
    curves = {side: result[side]["reward_per_step"] for side in sides}
    n = min(len(c) for c in curves.values())
    print(f"  training reward per {window} steps (mean +- standard error over the steps): " + " | ".join(sides))
    for lo in range(0, n, window):
        hi = min(lo + window, n)
        cells = [f"{statistics.mean(curves[side][lo:hi]):.3f} +- "
                 f"{statistics.stdev(curves[side][lo:hi]) / (hi - lo) ** 0.5 if hi - lo > 1 else 0:.3f}"
                 for side in sides]
        print(f"    steps {lo + 1:>3}-{hi:<3} " + " | ".join(cells))


# ------------------------------------------------------------------------------------------- sft

SFT_RECIPE = ROOT / "config" / "smollm2_task_sft.yaml"


def sft_config(a, out: str):
    """Our SFT stage's config for a run: the recipe's `sft` section at the benchmark's steps, dtype and threads."""
    from docuchat_rl.config import load_config

    return load_config(a.config or SFT_RECIPE, [f"run.output_dir={out}", f"sft.steps={a.steps}", f"model.dtype={a.dtype}",
                                                f"run.threads={a.threads}", "run.seed=0", "logging.progress=false",
                                                f"checkpoint.every={a.steps + 1}", *a.overrides])


def run_sft_ours(a) -> dict:
    """`docuchat-rl sft`'s steps (SupervisedTrainer); writes every step's examples (prompt ids, target ids, loss
    mask) to `a.rows_file` for TRL's side."""
    from docuchat_rl.supervised.trainer import SupervisedTrainer, batch_order

    with tempfile.TemporaryDirectory() as out:
        cfg = sft_config(a, out + "/run")
        trainer = SupervisedTrainer(cfg)
        steps = [[[t.prompt_ids, t.target_ids, t.loss_mask] for t in
                  (trainer.targets[i] for i in batch_order(len(trainer.targets), cfg.sft.batch_size, k, cfg.run.seed))]
                 for k in range(1, a.steps + 1)]
        Path(a.rows_file).write_text(json.dumps({"micro": trainer.micro, "steps": steps}))
        history = trainer.train()
        trainer.close()
    return {"seconds_per_step": statistics.median(after_warmup([m["time/step"] for m in history], a)),
            "peak_mb": peak_mb(), "losses": [m["loss"] for m in history]}


def run_sft_trl(a) -> dict:
    """TRL's SFTTrainer on the examples our side wrote, in the same order and batches (pre-tokenized rows:
    `input_ids` and `completion_mask`, so both sides score the same tokens), LoRA as the recipe's."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from trl import SFTConfig, SFTTrainer

    from docuchat_rl.modeling import load_model_and_tokenizer

    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as scratch:
        cfg = sft_config(a, scratch)
    saved = json.loads(Path(a.rows_file).read_text())
    data = Dataset.from_list([{"input_ids": p + t, "completion_mask": [0] * len(p) + m}
                              for step in saved["steps"] for p, t, m in step])
    model, tok = load_model_and_tokenizer(str(ROOT / cfg.model.name_or_path), "float32", "cpu")
    s, micro = cfg.sft, saved["micro"]

    clock = step_clock()
    with tempfile.TemporaryDirectory() as out:
        args = SFTConfig(output_dir=out, use_cpu=True, bf16=a.dtype != "float32", report_to="none", save_strategy="no",
                         logging_steps=1, max_steps=a.steps, per_device_train_batch_size=micro,
                         gradient_accumulation_steps=s.batch_size // micro, learning_rate=s.lr,
                         warmup_steps=s.warmup_steps, lr_scheduler_type="linear",
                         max_grad_norm=cfg.optim.max_grad_norm, train_sampling_strategy="sequential",
                         completion_only_loss=True, max_length=None, seed=0, disable_tqdm=True)
        trainer = SFTTrainer(model=model, processing_class=tok, args=args, train_dataset=data, callbacks=[clock],
                             peft_config=LoraConfig(r=cfg.lora.r, lora_alpha=cfg.lora.alpha,
                                                    lora_dropout=cfg.lora.dropout,
                                                    target_modules=cfg.lora.target_modules, task_type="CAUSAL_LM"))
        trainer.train()
    return {"seconds_per_step": statistics.median(after_warmup(clock.seconds, a)), "peak_mb": peak_mb(),
            "losses": [r["loss"] for r in trainer.state.log_history if "loss" in r]}


def sft_compare(a) -> dict:
    """Per dtype: both sides `--repeats` times, interleaved (ours, TRL, TRL, ours, ...), each in its own process;
    the median seconds per step, peak RSS, and step 1's loss on both (the same batch from the same weights)."""
    report = {}
    with tempfile.TemporaryDirectory() as scratch:
        rows = str(Path(scratch) / "rows.json")
        for dtype in a.dtypes.split(","):
            runs: dict[str, list[dict]] = {"ours": [], "trl": []}
            for i in range(a.repeats):
                for side in (["ours", "trl"] if i % 2 == 0 else ["trl", "ours"]):
                    cmd = [sys.executable, __file__, "--sft", "--worker", side, "--dtype", dtype, "--rows-file", rows,
                           "--steps", str(a.steps), "--warmup", str(a.warmup), "--threads", str(a.threads),
                           *(["--config", str(a.config)] if a.config else []),
                           *[x for o in a.overrides for x in ("--set", o)]]
                    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
                    if done.returncode != 0:
                        raise SystemExit(f"sft {side} ({dtype}) failed:\n{done.stderr[-3000:]}")
                    runs[side].append(json.loads(done.stdout.strip().splitlines()[-1]))
                    print(f"# sft {side} {dtype}: {runs[side][-1]['seconds_per_step']:.2f} s/step, "
                          f"peak {runs[side][-1]['peak_mb']:.0f} MB", file=sys.stderr, flush=True)
            med = {side: statistics.median(r["seconds_per_step"] for r in rs) for side, rs in runs.items()}
            report[dtype] = {
                "ours_s": med["ours"], "trl_s": med["trl"], "ratio": med["ours"] / med["trl"],
                "paired": [o["seconds_per_step"] / t["seconds_per_step"] for o, t in zip(runs["ours"], runs["trl"])],
                "ours_peak_mb": statistics.median(r["peak_mb"] for r in runs["ours"]),
                "trl_peak_mb": statistics.median(r["peak_mb"] for r in runs["trl"]),
                "loss_step1": [runs["ours"][0]["losses"][0], runs["trl"][0]["losses"][0]]}
    return report


def print_sft(a, report: dict) -> None:
    print(f"{time.strftime('%Y-%m-%d')}: sft, {a.config or SFT_RECIPE.relative_to(ROOT)}, {a.steps} steps "
          f"({a.warmup} warm-up), {a.repeats} runs a side, {a.threads} threads")
    print(f"  {'dtype':<16}{'ours s':>8}{'TRL s':>8}{'ratio':>7}{'paired':>15}{'ours MB':>9}{'TRL MB':>9}"
          f"{'memory':>8}{'step-1 loss ours / TRL':>34}")
    for dtype, r in report.items():
        lo, hi = min(r["paired"]), max(r["paired"])
        print(f"  {dtype:<16}{r['ours_s']:>8.2f}{r['trl_s']:>8.2f}{r['ratio']:>7.2f}{f'{lo:.2f}-{hi:.2f}':>15}"
              f"{r['ours_peak_mb']:>9.0f}{r['trl_peak_mb']:>9.0f}{r['ours_peak_mb'] / r['trl_peak_mb']:>7.2f}x"
              f"{r['loss_step1'][0]:>17.6f} / {r['loss_step1'][1]:.6f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=None,
                    help="a recipe to run on both sides (default: the embedded default, correctness reward only)")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per step (8; with --config, the recipe's)")
    ap.add_argument("--generations", type=int, default=None, help="completions per prompt (8, or the recipe's)")
    ap.add_argument("--max-new", type=int, default=None, help="max new tokens per completion (48, or the recipe's)")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=4, help="steps left out of each run's median")
    ap.add_argument("--repeats", type=int, default=3, help="runs of each side, interleaved")
    ap.add_argument("--lengths", choices=["natural", "fixed", "both"], default=None,
                    help="natural EOS, fixed length (no EOS before max-new), or both (the default; natural with --tools)")
    ap.add_argument("--lr", type=float, default=None, help="5e-4, or the recipe's")
    ap.add_argument("--temperature", type=float, default=None, help="1.0, or the recipe's")
    ap.add_argument("--trl-dtype", choices=["float32", "bfloat16"], default=None,
                    help="the dtype TRL's model is loaded in (default: float32 on a CPU, bfloat16 on a GPU); "
                         "bfloat16 also trains with bf16=True (autocast), as ours does under bf16-autocast")
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None,
                    help="both sides train a random-weight model of this published shape (built once, for timing; "
                         "use with --lengths fixed)")
    ap.add_argument("--curve", action="store_true", help="print both sides' training reward per 5 steps")
    ap.add_argument("--switches", action="store_true", help="our side only: each speed switch off against the defaults")
    ap.add_argument("--flip", dest="flips", action="append", default=[],
                    help="with --switches: a variant to run instead of the device's list (overrides joined by ' + ')")
    ap.add_argument("--threads", type=int, default=2, help="torch threads for each side")
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    help="extra override for our side, e.g. rollout.engine=hf (repeatable)")
    ap.add_argument("--only", choices=["ours", "trl"], help="run one side")
    ap.add_argument("--engine", choices=["fast", "hf", "vllm"], default=None,
                    help="our rollout engine (vllm: run this script with the python of scripts/vllm_tests.sh's "
                         "environment, .venv-vllm/bin/python; on a CPU it gets a 256 MiB KV cache)")
    ap.add_argument("--sweep", action="store_true", help="group size {4,8,16} x max new tokens {32,64,128}")
    ap.add_argument("--sweep-steps", type=int, default=12, help="steps per sweep point")
    ap.add_argument("--fixed-length", action="store_true", help=argparse.SUPPRESS)  # (a worker's --lengths)
    ap.add_argument("--json", action="store_true", help="print JSON instead of tables")
    ap.add_argument("--keep", type=Path, default=None, metavar="DIR",
                    help="keep each side's final adapter and steps under DIR/<side>, then evaluate both held out "
                         "(with --repeats 1 --lengths natural)")
    ap.add_argument("--ours", type=Path, default=None, metavar="RUN",
                    help="with --keep: our side from this finished run of the recipe (its checkpoint at --steps), "
                         "not run again")
    ap.add_argument("--tools", action="store_true",
                    help="a tool-using recipe (--config) on both sides under TRL's Qwen2.5 template, TRL with tools=")
    ap.add_argument("--sft", action="store_true",
                    help="the supervised stage instead: `docuchat-rl sft`'s step against TRL's SFTTrainer on the same "
                         "examples (--config: an SFT recipe, default config/smollm2_task_sft.yaml)")
    ap.add_argument("--dtypes", default="float32,bf16-autocast", help="with --sft: our model.dtype per comparison "
                    "(TRL: float32 weights, bf16=True for a bf16 one)")
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)  # (an sft worker's)
    ap.add_argument("--rows-file", default=None, help=argparse.SUPPRESS)  # (an sft worker's examples)
    ap.add_argument("--trl-quantization", choices=["none", "nf4", "int8"], default="none",
                    help="TRL's side loads its model quantized by bitsandbytes (its QLoRA; ours: --set model.quantization)")
    ap.add_argument("--tensor-memory", action="store_true",
                    help="also count each side's tensors alive per phase (memory.TensorBytes: what CUDA's allocated "
                         "memory counts, on any device; slows both sides alike)")
    ap.add_argument("--worker", choices=["ours", "trl"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.lengths is None:
        a.lengths = "natural" if a.tools else "both"
    if a.sft:
        if a.worker:
            print(json.dumps(run_sft_ours(a) if a.worker == "ours" else run_sft_trl(a)))
            return
        report = sft_compare(a)
        if a.json:
            print(json.dumps(report))
        else:
            print_sft(a, report)
        return
    fill_settings(a)
    if a.tools and a.lengths != "natural" and not a.worker:
        # at fixed length EOS is banned before max-new tokens, so none of our turns ends in a call: no tool step
        ap.error("--tools compares tool-using steps at natural lengths: at fixed length no turn ends, so our "
                 "side runs no tool call")
    if a.config and a.lengths != "fixed" and a.only != "ours" and not a.worker:
        from docuchat_rl.config import load_config

        stops = load_config(a.config, a.overrides).model.stop_tokens
        if stops:  # TRL's completion mask ends at its tokenizer's EOS only
            ap.error(f"model.stop_tokens {stops} cannot reach TRL's side: compare this recipe with --lengths fixed, "
                     "where neither side stops early (or --only ours)")
    if a.ours and not a.keep:
        ap.error("--ours needs --keep (the folder its evaluation and TRL's side go to)")
    if a.keep and not a.worker:
        if a.repeats != 1 or a.lengths != "natural" or a.sweep or a.switches:
            ap.error("--keep keeps one run a side: give it with --repeats 1 --lengths natural (no --sweep, --switches)")
        if a.ours:
            if not (a.ours / f"checkpoint-{a.steps}" / "adapter_config.json").exists():
                ap.error(f"--ours {a.ours}: no checkpoint-{a.steps} there (the run's checkpoint at --steps)")
            a.only = "trl"
        taken = [str(a.keep / side) for side in ([a.only] if a.only else ["ours", "trl"]) if (a.keep / side).exists()]
        if taken:
            ap.error(f"--keep: {', '.join(taken)} exists already (another run's): remove it or keep elsewhere")
    if a.engine is not None:  # (sugar for --set rollout.engine=...; passed on to the workers as overrides)
        a.overrides = [f"rollout.engine={a.engine}", *a.overrides]
        if a.engine == "vllm" and not any(o.startswith("rollout.vllm.") for o in a.overrides):
            a.overrides.append(f"rollout.vllm.kv_cache_memory_bytes={256 << 20}")
        a.engine = None

    if a.worker:
        print(json.dumps(run_ours(a) if a.worker == "ours" else run_trl(a)))
        return
    if a.tools:
        from docuchat_rl.config import load_config

        recipe = load_config(a.config, a.overrides) if a.config else None
        if not (recipe and recipe.rollout.tools):
            ap.error("--tools compares a tool-using recipe: give --config with rollout.tools (config/smollm2_tools.yaml)")
        print(f"# both sides under {TOOL_TEMPLATE}: {tool_model(recipe)}", file=sys.stderr)  # (made before the workers)
    if a.shape:  # built once here, read by every run (the folder lives as long as this process)
        shape_dir = tempfile.TemporaryDirectory(prefix=f"{a.shape}-")
        a.overrides = [f"model.name_or_path={build_shape(a.shape, Path(shape_dir.name))}", *a.overrides]
    started = time.strftime("%Y-%m-%d")
    if a.switches:
        for fixed in {"natural": [False], "fixed": [True], "both": [False, True]}[a.lengths]:
            b = argparse.Namespace(**{**vars(a), "fixed_length": fixed})
            result = switches(b)
            if a.json:
                print(json.dumps({"date": started, "fixed_length": fixed, "switches": result}))
            else:
                print_switches(f"{started}: {a.config or a.shape or 'embedded default'}, switches one at a time, "
                               f"{a.prompts} prompts x {a.generations} completions, {a.max_new} new tokens "
                               f"({'fixed length' if fixed else 'natural EOS'}), {a.steps} steps ({a.warmup} "
                               f"warm-up), {a.repeats} runs each", result, fixed_length=fixed)
        return
    if not a.sweep:
        report = {}
        for fixed in {"natural": [False], "fixed": [True], "both": [False, True]}[a.lengths]:
            result = compare(a, fixed_length=fixed)
            report["fixed_length" if fixed else "natural_eos"] = result
            if not a.json:
                print_table(f"{started}: {a.config or a.shape or 'embedded default'}, {a.prompts} prompts x "
                            f"{a.generations} "
                            f"completions, {a.max_new} new tokens ({'fixed length' if fixed else 'natural EOS'}), "
                            f"{a.steps} steps ({a.warmup} warm-up), {a.repeats} runs a side, {a.threads} threads",
                            result)
                if a.curve:
                    print_curve(result)
        if a.keep:
            evals = evaluate_kept(a)
            if not a.json:
                print_learning(a, evals)
            report["held_out"] = evals
        if a.json:
            print(json.dumps({"date": started, "settings": {k: str(v) for k, v in vars(a).items()}, **report}))
        return
    points = []
    for g in (4, 8, 16):
        for n in (32, 64, 128):
            r = compare(a, generations=g, max_new=n, steps=a.sweep_steps, fixed_length=a.lengths == "fixed")
            points.append({"generations": g, "max_new": n, **r})
            if not a.json:
                print_table(f"G={g} max_new={n} ({a.prompts} prompts, {a.sweep_steps} steps)", r)
    if a.json:
        print(json.dumps({"date": started, "settings": vars(a), "sweep": points}))
        return
    print("\nsweep, seconds per step (ours | TRL | ratio):")
    print("  G \\ max_new" + "".join(f"{n:>24}" for n in (32, 64, 128)))
    for g in (4, 8, 16):
        cells = []
        for p in (q for q in points if q["generations"] == g):
            o = p.get("ours", {}).get("seconds_per_step", float("nan"))
            t = p.get("trl", {}).get("seconds_per_step", float("nan"))
            cells.append(f"{o:.2f} | {t:.2f} | {o / t:.2f}")
        print(f"  {g:<12}" + "".join(f"{c:>24}" for c in cells))


if __name__ == "__main__":
    main()
