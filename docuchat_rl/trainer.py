"""The training loop: rollout -> score -> advantages -> update -> log -> checkpoint, one step at a time.

One step samples `prompts_per_step` prompts, `num_generations` completions each, scores them with the
composite reward, lets the algorithm turn rewards into per-token advantages, runs `num_iterations`
passes of minibatch updates over the LoRA adapter (and critic), writes one trace record per
completion and one metrics record, and checkpoints every `checkpoint.every` steps.

Exact resume: a checkpoint holds everything the next step reads (adapter, critic, optimizer,
scheduler, RNG states, data order and position, output file offsets). Checkpoints are taken between
steps, so a run stopped anywhere inside a step (inside a mu-cycle included) resumes by replaying that
step from the same state, and output files are truncated back to the checkpoint's offsets first.

Deliberately left out: multi-process data sharding (accelerate launches work, but each process
samples the full batch; traces are written by the main process only), and serving engines (vLLM,
SGLang) for the rollout.
"""

from __future__ import annotations

import contextlib
import random
import time
import uuid
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

from rewards import CompositeReward

from .algorithms import get_algorithm_class
from .batch import Batch, build_batch, policy_forward
from .checkpoint import resolve_resume, save_checkpoint, write_json
from .config import Config
from .data import DataError, Example, load_examples, render_prompt
from .generation import generate
from .losses import Norm
from .modeling import load_model_and_tokenizer, merged_adapter
from .outputs import JsonlWriter, claim_output_dir


class TrainingError(RuntimeError):
    """A run that cannot start or go on; the message says what to change."""


class PromptSampler:
    """Epoch-wise permutations of the data set from (seed, epoch): its whole state is two integers."""

    def __init__(self, n: int, seed: int, epoch: int = 0, position: int = 0):
        self.n, self.seed, self.epoch, self.position = n, seed, epoch, position
        self._order = self._perm()

    def _perm(self) -> list[int]:
        order = list(range(self.n))
        random.Random(f"{self.seed}-{self.epoch}").shuffle(order)
        return order

    def take(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.position == self.n:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._perm()
            out.append(self._order[self.position])
            self.position += 1
        return out

    def state(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Timer:
    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        t0 = time.perf_counter()
        yield
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0


CRITIC_ADAPTER = "critic"  # the separate critic's LoRA adapter (algorithm.critic_backbone: separate)


def lora_config(cfg: Config):
    from peft import LoraConfig

    lc = cfg.lora
    return LoraConfig(r=lc.r, lora_alpha=lc.alpha, lora_dropout=lc.dropout, target_modules=lc.target_modules,
                      task_type="CAUSAL_LM")


def build_lora(model, cfg: Config):
    from peft import get_peft_model

    return get_peft_model(model, lora_config(cfg))


@contextlib.contextmanager
def active_adapter(model, name: str, trainable: list[torch.nn.Parameter]):
    """Run the block with adapter `name` active, then the policy's ("default") again. peft's set_adapter
    also freezes the inactive adapters; every trainable parameter is made trainable again each time."""
    model.set_adapter(name)
    for p in trainable:
        p.requires_grad_(True)
    try:
        yield
    finally:
        model.set_adapter("default")
        for p in trainable:
            p.requires_grad_(True)


def build_optimizer(params, cfg: Config, total_updates: int):
    from transformers import get_scheduler

    o = cfg.optim
    if o.name == "adamw":
        opt = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    else:
        opt = torch.optim.RMSprop(params, lr=o.lr, alpha=o.alpha, eps=o.eps, weight_decay=o.weight_decay)
    name = {"constant": "constant_with_warmup", "linear": "linear", "cosine": "cosine"}[o.schedule]
    sched = get_scheduler(name, opt, num_warmup_steps=o.warmup_steps, num_training_steps=total_updates)
    return opt, sched


class Trainer:
    def __init__(self, cfg: Config, resume: str | None = None, examples: list[Example] | None = None):
        from accelerate import Accelerator

        self.cfg = cfg
        self.out_dir = Path(cfg.run.output_dir)
        resume_dir = resolve_resume(resume, self.out_dir) if resume else None  # fail before loading anything
        if not resume:
            try:
                claim_output_dir(self.out_dir, cfg.run.overwrite)
            except ValueError as e:
                raise TrainingError(str(e)) from None
        if cfg.logging.wandb:
            try:
                import wandb  # noqa: F401  (fail before loading anything)
            except ImportError:
                raise TrainingError("logging.wandb is on but wandb is not installed: pip install "
                                    "'docuchat-rl[wandb]'") from None
        if cfg.run.threads:
            torch.set_num_threads(cfg.run.threads)
        seed_everything(cfg.run.seed)
        self.accelerator = Accelerator(cpu=cfg.model.device == "cpu")
        model, self.tokenizer = load_model_and_tokenizer(
            cfg.model.name_or_path, cfg.model.dtype, str(self.accelerator.device),
            cfg.model.trust_remote_code, cfg.model.revision)
        self.context_len = getattr(model.config, "max_position_embeddings", None)
        self.model = build_lora(model, cfg)
        self.algo = get_algorithm_class(cfg.algorithm.name)(cfg, model.config.hidden_size)
        self.separate_critic = self.algo.critic is not None and cfg.algorithm.critic_backbone == "separate"
        if self.algo.critic is not None:
            self.algo.critic.to(self.accelerator.device)
        if self.separate_critic:
            self.model.add_adapter(CRITIC_ADAPTER, lora_config(cfg))
            for name, p in self.model.named_parameters():
                if f".{CRITIC_ADAPTER}." in name:
                    p.requires_grad_(True)
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.algo.critic is not None:
            params += list(self.algo.critic.parameters())
        self.params = params
        self.updates_per_step = cfg.algorithm.num_iterations * (cfg.rollout.batch_rows // cfg.minibatch_rows)
        opt, sched = build_optimizer(params, cfg, cfg.run.steps * self.updates_per_step)
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(self.model, opt, sched)
        # accelerate saves optimizer, scheduler and RNG states; the adapter is saved by peft instead
        self.accelerator.register_save_state_pre_hook(lambda models, weights, d: weights.clear())
        self.accelerator.register_load_state_pre_hook(lambda models, d: models.clear())

        self.examples = examples if examples is not None else load_examples(
            cfg.data.train, cfg.data.train_split, cfg.data.prompt_column, cfg.data.answer_column,
            revision=cfg.data.revision, subset=cfg.data.subset)
        if not self.examples:
            raise DataError(f"{cfg.data.train}: no training rows")
        self.prompt_texts = [render_prompt(self.tokenizer, e.question, cfg.data.system_prompt)
                             for e in self.examples]
        self._check_lengths()
        self.reward = CompositeReward([c.model_dump() for c in cfg.rewards.components],
                                      strict=cfg.rewards.strict, timeout_s=cfg.rewards.timeout_s)
        self.sampler = PromptSampler(len(self.examples), cfg.run.seed)
        self.step, self.run_id = 0, uuid.uuid4().hex[:12]
        offsets = self._load(resume_dir) if resume_dir else {}
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.traces = JsonlWriter(self.out_dir / "traces.jsonl", offsets.get("traces"))
        self.metrics = JsonlWriter(self.out_dir / "metrics.jsonl", offsets.get("metrics"))
        self.evals = JsonlWriter(self.out_dir / "eval.jsonl", offsets.get("evals"))
        self._eval_examples: list[Example] | None = None
        self.last_eval: dict | None = None  # the latest periodic evaluation (eval.every)
        self.wandb = self._init_wandb()

    # ---------------------------------------------------------------- set-up checks
    def _check_lengths(self) -> None:
        limit = self.cfg.data.max_prompt_tokens
        budget = None if self.context_len is None else self.context_len - self.cfg.rollout.max_new_tokens
        if budget is not None and budget < 1:
            raise TrainingError(f"rollout.max_new_tokens ({self.cfg.rollout.max_new_tokens}) leaves no room "
                                f"for a prompt in the model's context of {self.context_len} tokens")
        lengths = [len(x) for x in self.tokenizer(self.prompt_texts, add_special_tokens=False)["input_ids"]]
        for i, n in enumerate(lengths):
            if n > limit or (budget is not None and n > budget):
                raise TrainingError(
                    f"{self.cfg.data.train}: row {self.examples[i].prompt_id} has a prompt of {n} tokens; "
                    f"data.max_prompt_tokens is {limit} and the model's context leaves {budget} after "
                    f"rollout.max_new_tokens; shorten it, filter the data, or raise the limit")

    def _init_wandb(self):
        if not self.cfg.logging.wandb or not self.accelerator.is_main_process:
            return None
        import wandb

        return wandb.init(project=self.cfg.logging.wandb_project, mode=self.cfg.logging.wandb_mode,
                          dir=str(self.out_dir), config=self.cfg.to_dict(), id=self.run_id, resume="allow")

    # ---------------------------------------------------------------- phases
    def rollout(self, n_prompts: int, timer: Timer):
        idx = self.sampler.take(n_prompts)
        examples = [self.examples[i] for i in idx]
        r = self.cfg.rollout
        unwrapped = self.accelerator.unwrap_model(self.model)
        unwrapped.eval()
        merged = merged_adapter(unwrapped) if r.merge_adapter else contextlib.nullcontext()
        with timer("rollout"), merged:
            gen = generate(unwrapped, self.tokenizer, [self.prompt_texts[i] for i in idx],
                           max_new_tokens=r.max_new_tokens, do_sample=True, temperature=r.temperature,
                           top_p=r.top_p, top_k=r.top_k, batch_size=r.generation_batch_size,
                           num_return_sequences=r.num_generations, engine=r.engine,
                           min_new_tokens=r.min_new_tokens)
        texts = self.tokenizer.batch_decode(gen.completion_ids, skip_special_tokens=True)
        return examples, gen, texts

    def score(self, examples: list[Example], gen, texts: list[str], timer: Timer):
        g = self.cfg.rollout.num_generations
        rows = [e for e in examples for _ in range(g)]
        columns = {k: [e.columns.get(k) for e in rows] for k in {k for e in examples for k in e.columns}}
        # the data set's other columns, then ours (which win a name clash)
        columns.update(answer=[e.answer for e in rows], completion_tokens=[len(c) for c in gen.completion_ids],
                       truncated=gen.truncated, prompt_id=[e.prompt_id for e in rows])
        with timer("score"):
            return self.reward([e.question for e in rows], texts, **columns)

    def collect(self, timer: Timer):
        """Rollout and score until the step's groups are ready (refilling when dynamic sampling drops some)."""
        r, g = self.cfg.rollout, self.cfg.rollout.num_generations
        parts, kept, rounds = [], 0, 0
        while True:
            need = r.prompts_per_step - kept if r.dynamic_sampling else r.prompts_per_step
            examples, gen, texts = self.rollout(need, timer)
            result = self.score(examples, gen, texts, timer)
            totals = torch.tensor(result.totals).view(-1, g)  # [prompts, G]
            varied = (totals.std(dim=1) > 1e-8).tolist() if g > 1 else [True] * len(examples)
            use = [v or not r.dynamic_sampling for v in varied]
            use = [u and (kept + sum(use[:i + 1]) <= r.prompts_per_step) for i, u in enumerate(use)]
            kept += sum(use)
            parts.append((examples, gen, texts, result, use))
            rounds += 1
            if kept >= r.prompts_per_step or not r.dynamic_sampling or rounds > r.max_resample_rounds:
                return parts, rounds

    def prepare(self, parts, timer: Timer) -> tuple[Batch, list[dict]]:
        """The batch of used groups (tensors) and the per-completion trace rows of every group."""
        g = self.cfg.rollout.num_generations
        prompt_ids, comp_ids, rewards, group, rows = [], [], [], [], []
        n_group = 0
        for examples, gen, texts, result, use in parts:
            for p, ex in enumerate(examples):
                for s in range(g):
                    i = p * g + s
                    row = {"example": ex, "text": texts[i], "ids": gen.completion_ids[i],
                           "truncated": gen.truncated[i], "reward": result.records[i], "used": use[p],
                           "group": n_group if use[p] else None, "sample": s}
                    rows.append(row)
                    if use[p]:
                        prompt_ids.append(gen.prompt_ids[i])
                        comp_ids.append(gen.completion_ids[i])
                        rewards.append(result.records[i].total)
                        group.append(n_group)
                if use[p]:
                    n_group += 1
        batch = build_batch(prompt_ids, comp_ids, rewards, group, self.tokenizer.pad_token_id)
        return batch.to(self.accelerator.device), rows

    def forward(self, model, mb: Batch, **kw):
        """policy_forward, plus the hidden states the critic reads: the same forward's (shared backbone)
        or a second forward through the critic's own adapter (separate backbone)."""
        critic = self.algo.critic is not None
        kw.update(temperature=self.cfg.rollout.temperature, share_prompt=self.cfg.optim.share_prompt)
        out = policy_forward(model, mb, with_hidden=critic and not self.separate_critic, **kw)
        if critic and self.separate_critic:
            with active_adapter(self.accelerator.unwrap_model(model), CRITIC_ADAPTER, self.params):
                out.hidden = policy_forward(model, mb, with_hidden=True, **kw).hidden  # [r, T, H]
        return out

    def _rollout_pass(self, batch: Batch, logps_into: str | None, values: bool,
                      disable_adapter: bool = False) -> None:
        """One no-grad pass over the batch, micro-batch by micro-batch, filling batch.<logps_into> [R, T]
        with log-probs and, with a critic, batch.values [R, T] from the same forward's hidden states."""
        model = self.accelerator.unwrap_model(self.model)
        logps = torch.zeros_like(batch.completion_mask)  # [R, T]
        vals = torch.zeros_like(batch.completion_mask)  # [R, T]
        ctx = model.disable_adapter() if disable_adapter else contextlib.nullcontext()
        with torch.no_grad(), ctx:
            for rows in torch.arange(batch.rows).split(self.cfg.optim.micro_batch_size):
                mb = batch.select(rows)
                out = self.forward(model, mb) if values else policy_forward(
                    model, mb, self.cfg.rollout.temperature, share_prompt=self.cfg.optim.share_prompt)
                logps[rows, :out.logps.shape[1]] = out.logps
                if values:
                    vals[rows, :out.logps.shape[1]] = self.algo.critic(out.hidden)
        if logps_into:
            setattr(batch, logps_into, logps)
        if values:
            batch.values = vals * batch.completion_mask

    def advantages(self, batch: Batch, timer: Timer) -> dict[str, float]:
        with timer("advantages"):
            n_minibatches = -(-batch.rows // self.cfg.minibatch_rows)
            need_old = (self.cfg.algorithm.num_iterations > 1 or n_minibatches > 1
                        or self.algo.needs_rollout_logps)
            critic = self.algo.critic is not None
            if need_old or critic:  # old log-probs and values share one forward
                self._rollout_pass(batch, "old_logps" if need_old else None, values=critic)
            if self.cfg.algorithm.beta > 0:
                self._rollout_pass(batch, "ref_logps", values=False, disable_adapter=True)
            return self.algo.advantages(batch)

    def update(self, batch: Batch, timer: Timer) -> dict[str, float]:
        cfg = self.cfg
        sums: dict[str, float] = defaultdict(float)
        weight = 0.0
        grad_norms, losses = [], []
        self.model.train()
        with timer("update"):
            for _ in range(cfg.algorithm.num_iterations):
                for mb_rows in torch.arange(batch.rows).split(cfg.minibatch_rows):
                    mask = batch.completion_mask[mb_rows]
                    norm = Norm(rows=len(mb_rows), tokens=float(mask.sum()),
                                max_new_tokens=cfg.rollout.max_new_tokens)
                    total = 0.0
                    for rows in mb_rows.split(cfg.optim.micro_batch_size):
                        mb = batch.select(rows)
                        out = self.forward(self.model, mb, with_entropy=True,
                                           entropy_grad=self.algo.entropy_grad)
                        loss, m = self.algo.loss(out, mb, norm)
                        self.accelerator.backward(loss)
                        total += float(loss.detach())
                        w = float(mb.completion_mask.sum())  # every metric is token-weighted
                        for k, v in m.items():
                            sums[k] += v * w
                        weight += w
                    max_norm = cfg.optim.max_grad_norm or float("inf")
                    grad_norms.append(float(self.accelerator.clip_grad_norm_(self.params, max_norm)))
                    self.optimizer.step()
                    self.scheduler.step()
                    self.optimizer.zero_grad(set_to_none=True)
                    losses.append(total)
        out = {k: v / max(weight, 1.0) for k, v in sums.items()}
        out.update(loss=float(np.mean(losses)), grad_norm=float(np.mean(grad_norms)),
                   lr=float(self.scheduler.get_last_lr()[0]), optimizer_steps=len(losses))
        return out

    # ---------------------------------------------------------------- log and checkpoint
    def log(self, step: int, rows: list[dict], batch: Batch, metrics: dict, timer: Timer, parts) -> dict:
        extra = self.algo.trace_fields(batch)
        used_i = 0
        records = []
        acc_name = self.cfg.rewards.accuracy_component
        for row in rows:
            ex, rec = row["example"], row["reward"]
            record = {"run_id": self.run_id, "step": step, "prompt_id": ex.prompt_id, "group": row["group"],
                      "sample": row["sample"], "used": row["used"], "prompt": ex.question,
                      "completion": row["text"], "gold": ex.answer, "completion_tokens": len(row["ids"]),
                      "truncated": row["truncated"],
                      "rewards": {k: c.as_dict() for k, c in rec.components.items()},
                      "total": rec.total, "total_missing": rec.total_missing}
            for k, values in extra.items():
                record[k] = values[used_i] if row["used"] else None
            used_i += row["used"]
            records.append(record)
        with timer("log"):  # the trace records' writing (the metrics record carries these timings)
            self.traces.write(records)

        totals = np.array([r["reward"].total for r in rows])
        lengths = np.array([len(r["ids"]) for r in rows])
        m = {"step": step, "reward/mean": float(totals.mean()), "reward/std": float(totals.std())}
        for name in self.reward.names:
            raws = [r["reward"].components[name].raw for r in rows]
            vals = [v for v in raws if v is not None]
            m[f"rewards/{name}/mean"] = float(np.mean(vals)) if vals else None
            m[f"rewards/{name}/errors"] = sum(r["reward"].components[name].error is not None for r in rows)
        if acc_name in self.reward.names:
            m["accuracy"] = m[f"rewards/{acc_name}/mean"]
        m.update({"completion_len/mean": float(lengths.mean()), "completion_len/max": int(lengths.max()),
                  "truncated_frac": float(np.mean([r["truncated"] for r in rows])),
                  "prompts_sampled": sum(len(p[0]) for p in parts), "groups_used": int(batch.group.max()) + 1
                  if batch.rows else 0, "kl": None})
        m.update(metrics)
        rollout_s = timer.seconds.get("rollout", 0.0)
        m["rollout_tokens_per_s"] = float(lengths.sum() / rollout_s) if rollout_s else None
        for phase, s in timer.seconds.items():
            m[f"time/{phase}"] = s
        self.metrics.write([m])
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in m.items() if v is not None}, step=step)
        return m

    def checkpoint(self, step: int) -> Path:
        unwrapped = self.accelerator.unwrap_model(self.model)

        def write_into(folder: Path) -> None:
            unwrapped.save_pretrained(folder, safe_serialization=True)
            self.tokenizer.save_pretrained(folder)
            if self.algo.critic is not None:
                from safetensors.torch import save_file

                save_file(self.algo.critic.state_dict(), folder / "critic.safetensors")
            self.accelerator.save_state(str(folder), safe_serialization=True)
            write_json(folder / "run_config.json", {"step": step, "config": self.cfg.to_dict()})
            write_json(folder / "trainer_state.json", {
                "step": step, "run_id": self.run_id, "sampler": self.sampler.state(),
                "offsets": {"traces": self.traces.offset, "metrics": self.metrics.offset,
                            "evals": self.evals.offset}})

        return save_checkpoint(self.out_dir, step, write_into, self.cfg.checkpoint.keep_last)

    def _load(self, folder: Path) -> dict:
        import json

        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        state = json.loads((folder / "trainer_state.json").read_text())
        adapter = load_file(str(folder / "adapter_model.safetensors"))
        set_peft_model_state_dict(self.accelerator.unwrap_model(self.model), adapter)
        if self.separate_critic:  # peft saves a second adapter in a folder named after it
            critic = load_file(str(folder / CRITIC_ADAPTER / "adapter_model.safetensors"))
            set_peft_model_state_dict(self.accelerator.unwrap_model(self.model), critic,
                                      adapter_name=CRITIC_ADAPTER)
        if self.algo.critic is not None:
            self.algo.critic.load_state_dict(load_file(str(folder / "critic.safetensors")))
        self.accelerator.load_state(str(folder))
        self.step, self.run_id = state["step"], state["run_id"]
        self.sampler = PromptSampler(len(self.examples), self.cfg.run.seed, **state["sampler"])
        return state["offsets"]

    def held_out(self) -> list[Example]:
        """The held-out rows (eval.limit of them), read once per run."""
        if self._eval_examples is None:
            d = self.cfg.data
            self._eval_examples = load_examples(d.test, d.test_split, d.prompt_column, d.answer_column,
                                                limit=self.cfg.eval.limit, revision=d.revision, subset=d.subset)
        return self._eval_examples

    def evaluate(self) -> dict:
        """Held-out evaluation (greedy: it draws no random numbers, so the run is unchanged by it)."""
        from .evaluate import evaluate

        return evaluate(self.accelerator.unwrap_model(self.model), self.tokenizer, self.cfg, self.held_out())

    # ---------------------------------------------------------------- the loop
    def train(self, stop_after: int | None = None) -> list[dict]:
        """Run to `run.steps` (or stop after step `stop_after`, for tests). Returns the metric records."""
        cfg, history = self.cfg, []
        bar = None
        if cfg.logging.progress and self.accelerator.is_main_process:
            from tqdm.auto import tqdm

            bar = tqdm(total=cfg.run.steps, initial=self.step, desc="train", dynamic_ncols=True)
        started = time.perf_counter()
        for step in range(self.step + 1, cfg.run.steps + 1):
            timer = Timer()
            parts, _ = self.collect(timer)
            with timer("prepare"):
                batch, rows = self.prepare(parts, timer)
            if batch.rows == 0:
                raise TrainingError("dynamic sampling found no group with varied rewards in "
                                    f"{cfg.rollout.max_resample_rounds + 1} rounds")
            adv_metrics = self.advantages(batch, timer)
            upd_metrics = self.update(batch, timer)
            extra = {**adv_metrics, **upd_metrics}
            if cfg.eval.every and cfg.data.test and step % cfg.eval.every == 0:
                self.last_eval = {"step": step, "minutes": round((time.perf_counter() - started) / 60, 3),
                                  **self.evaluate()}
                self.evals.write([self.last_eval])
                extra["eval/accuracy"] = self.last_eval.get("accuracy")
            m = self.log(step, rows, batch, extra, timer, parts)
            history.append(m)
            self.step = step
            if step % cfg.checkpoint.every == 0 or step == cfg.run.steps:
                self.checkpoint(step)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(reward=f"{m['reward/mean']:.3f}", acc=f"{m.get('accuracy') or 0:.3f}",
                                tok_s=f"{m['rollout_tokens_per_s'] or 0:.0f}")
            if stop_after is not None and step >= stop_after:
                break
        if bar is not None:
            bar.close()
        return history

    def close(self) -> None:
        for writer in (self.traces, self.metrics, self.evals):
            writer.close()
        if self.wandb is not None:
            self.wandb.finish()
