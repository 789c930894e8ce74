"""Run set-up: everything a training run holds before its first step, built in one call, `start_run`.

In order: the launch (accelerate's processes, FSDP2 from the launcher's config, refusals of what the
trainer cannot honour), the output folder (writable, locked, empty or overwritten; every process fails
if one does), the model with its LoRA adapter and the algorithm's critic, the optimizer and schedule,
the training rows and their length checks, the composite reward, the resumed state (adapter, critic,
optimizer, schedule, random states, data position, output offsets), the output writers and wandb.
The result is a typed `Run` that the loop (trainer.py) reads.

Deliberately left out: model preparation by accelerate (no DDP or accelerate-FSDP wrapping: gradients
are summed by hand and FSDP2 is applied by `distributed.shard_layers`; see distributed.py).
"""

from __future__ import annotations

import math
import sys
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from rewards import CompositeReward

from .checkpoint import (
    check_stage,
    TrainerState,
    load_start_adapter,
    resolve_adapter,
    check_resumable,
    saved_config,
    checkpoint_step,
    list_checkpoints,
    load_training_state,
    read_trainer_state,
    resolve_resume,
    verify_checkpoint,
)
from .config import Config, OptimConfig, steps_of
from .data import (Curriculum, DataError, Example, check_held_out_rows, fingerprint, levels_of, load_split, make_sampler,
                   prompt_text)
from .distributed import (
    Dist,
    Sharding,
    ShardingError,
    held_bytes,
    on_cpu,
    shard_layers,
    sharding_from_launcher,
    without_fsdp_env,
)
from .errors import CheckpointError, CheckpointWarning, TrainingError
from .learning.algorithms import Algorithm, get_algorithm_class
from .learning.fused_lora import fuse_lora
from .learning.learner import Handed, Learner
from .modeling import (
    REFERENCE_ADAPTER,
    add_critic_adapter,
    lora_config,
    build_lora,
    disable_dropout,
    eos_ids,
    load_configured,
    prepare_model,
)
from .outputs import JsonlWriter, RunLock, adopt_history, check_writable, claim_output_dir, undo_start
from .sampling.decoding import rollout_engine
from .sampling.engines import Engine, EngineContext, LocalEngine, get_engine_class
from .sampling.lag import Ahead, LaggedPolicies, Lookahead
from .sampling.multiturn import MultiTurn, ToolError, multiturn_from_config
from .sampling.rollout import Collector
from .sampling.scoring import build_reward

# Why refuse rather than scale: the LoRA weights and their Adam updates would live in float16 too (an update
# of lr x 1 is below float16's resolution next to a weight of 1e-2), so loss scaling alone does not train them
# correctly; it needs float32 master copies as well, and its skipped steps would be a second non-finite rule
# beside optim.max_nonfinite_steps. bfloat16 (every GPU since Ampere) or float32 trains without either.
FLOAT16_REFUSED = ("model.dtype float16 is not trained by docuchat-rl (no loss scaling: gradients underflow "
                   "silently): use model.dtype=bfloat16 on a GPU that has it, else float32")


def training_dtype(requested: str, device: torch.device, bf16_supported: bool) -> str:
    """The dtype a run trains in: `auto` is bfloat16 on a GPU that has it and float32 elsewhere (never the
    float16 that `auto` means for inference on older GPUs, V100 and T4)."""
    if requested == "float16":
        raise TrainingError(FLOAT16_REFUSED)
    if requested == "auto":  # (decided here once: the checkpoints record it, and a resume compares it)
        return "bfloat16" if device.type == "cuda" and bf16_supported else "float32"
    return requested


@dataclass
class Outputs:
    """The run's append-only files, open on the main process only (None elsewhere)."""

    traces: JsonlWriter | None
    metrics: JsonlWriter | None
    evals: JsonlWriter | None

    @classmethod
    def open(cls, out_dir: Path, main: bool, offsets: dict[str, int]) -> Outputs:
        """The writers, each file cut back to its checkpointed offset (a resume), on the main process."""
        if not main:
            return cls(None, None, None)
        return cls(*(JsonlWriter(out_dir / f"{name}.jsonl", offsets.get(key))
                     for name, key in (("traces", "traces"), ("metrics", "metrics"), ("eval", "evals"))))

    def offsets(self) -> dict[str, int]:
        """Each file's size now (what a checkpoint records), or {} off the main process."""
        if self.traces is None:
            return {}
        return {"traces": self.traces.offset, "metrics": self.metrics.offset, "evals": self.evals.offset}

    def close(self) -> None:
        for writer in (self.traces, self.metrics, self.evals):
            if writer is not None:
                writer.close()


@dataclass
class Placement:
    """Where the model runs: the processes, and under FSDP2 the sharded layers and how generation sees them."""

    accelerator: object  # accelerate.Accelerator (optimizer/scheduler/RNG state saving, backward, clipping)
    dist: Dist
    dtype: str  # the model's dtype for training (training_dtype)
    sharding: Sharding | None  # the launcher's FSDP2 request (None: plain data-parallel)
    sharded_layers: list[torch.nn.Module]  # the decoder layers fully_shard split across processes
    gather_for_generation: list[torch.nn.Module]  # layers gathered whole for rollout and evaluation
    lockstep: object  # sharded generation: Dist.any, so every process decodes as long as any does; else None


@dataclass
class Run:
    """A started run: what the loop reads and what it must release (`close`)."""

    cfg: Config
    out_dir: Path
    place: Placement
    tokenizer: object
    learner: Learner
    collector: Collector
    reward: CompositeReward
    examples: list[Example]
    state: TrainerState  # the step to continue from (0 for a fresh run), run id, data position, offsets
    outputs: Outputs
    wandb: object  # a wandb run, or None
    lock: RunLock | None  # the output folder's lock (main process)
    lagged: LaggedPolicies | None = None  # rollout.async_lag's adapter versions (lag.py)
    curriculum: Curriculum | None = None  # data.curriculum: the level reached and the accuracies deciding the next

    def close(self) -> None:
        """Close the files, wandb and a vLLM engine, release the folder."""
        self.outputs.close()
        if self.collector.ahead is not None:
            self.collector.ahead.close()
        if self.collector.engine is not None:
            self.collector.engine.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.lock is not None:
            self.lock.release()


def start_run(cfg: Config, resume: str | None = None, examples: list[Example] | None = None,
              quiet: bool = False, model=None, held_out: dict[str, list[Example]] | None = None) -> Run:
    """Set up a run (see the module docstring); on any failure nothing stays held (the folder's lock) and the
    folder is left as it was found (`undo_start`). The run's `cfg` is `cfg` with its `auto` switches decided for
    the device (what the loop and checkpoints read); `quiet` leaves the settings a resume applied unsaid (a
    replay's own); `model`: (model, tokenizer) already loaded (the Python API's), in place of loading
    model.name_or_path; `held_out`: the sets the run evaluates, by key, each refused if it asks a training row's
    question (data.check_held_out_rows)."""
    out_dir = Path(cfg.run.output_dir)
    resume_dir = resolve_resume(resume, out_dir) if resume else None  # every folder check before any load
    place = launch(cfg)
    sized = cfg.rollout.generation_batch_size == "auto"  # (its cap decided here, its rows once the model is loaded)
    # every `auto` decided for this device, once: the switches, and the dtype (a resume compares what they are)
    cfg = cfg.for_device(place.dist.device.type)
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"dtype": place.dtype})})
    if resume_dir is not None and cfg.sft is not None:
        cfg = _recorded_sft_folder(cfg, resume_dir)
    if resume_dir is not None:
        check_stage(resume_dir, "train")
    applied = check_resumable(resume_dir, cfg.to_dict()) if resume_dir else []
    lock, undo = None, undo_start(out_dir) if place.dist.is_main else (lambda: None)
    try:
        lock = agree_on_main(place.dist, lock_output_dir, out_dir, cfg.run.overwrite, resume_dir, place.dist.is_main)
        if applied and place.dist.is_main and not quiet:
            print(f"docuchat-rl: resuming {resume_dir.name} with changed settings (applied): {'; '.join(applied)}",
                  file=sys.stderr, flush=True)
        return _build(cfg, out_dir, place, resume_dir, examples, lock, model, held_out or {}, sized)
    except BaseException:
        if lock is not None:
            lock.release()
        undo()  # (a refused start leaves the folder as it found it)
        raise


def _recorded_sft_folder(cfg: Config, resume_dir: Path) -> Config:
    """On a resume, sft.output_dir is the checkpoint's own: it names the SFT stage the run started from, which
    a resume never reads (the checkpoint holds the adapter and the KL reference). Resuming into a new
    run.output_dir derives another default, which is put back; a value given that is neither is one line."""
    recorded = ((saved_config(resume_dir) or {}).get("sft") or {}).get("output_dir")
    if recorded is None or recorded == cfg.sft.output_dir:
        return cfg
    if cfg.sft.output_dir != cfg.run.output_dir.rstrip("/") + "-sft":
        raise CheckpointError(f"sft.output_dir {cfg.sft.output_dir}: {resume_dir.name} started from the SFT stage "
                              f"in {recorded}, and a resume does not read it: leave sft.output_dir out (the "
                              "checkpoint's own is kept)")
    return cfg.model_copy(update={"sft": cfg.sft.model_copy(update={"output_dir": recorded})})


def launch(cfg: Config) -> Placement:
    """The processes the launcher started (one without a launcher) and the FSDP2 request, refused by name
    where the trainer cannot honour it."""
    from accelerate import Accelerator

    try:
        sharding = sharding_from_launcher()
    except ShardingError as e:
        raise TrainingError(str(e)) from None
    with without_fsdp_env():
        accelerator = Accelerator(cpu=on_cpu(cfg.model.device), step_scheduler_with_optimizer=False)
    if accelerator.mixed_precision != "no":  # (it would be ignored: the model is not prepared)
        raise TrainingError(f"the accelerate config's mixed_precision ({accelerator.mixed_precision}) is not "
                            "used by docuchat-rl, whose model runs in model.dtype: set model.dtype (bfloat16) "
                            "instead and mixed_precision: 'no'")
    if sharding and cfg.model.quantization != "none":
        raise TrainingError(f"model.quantization {cfg.model.quantization} with FSDP2 sharding: bitsandbytes' packed "
                            "weights are not sharded here; use data-parallel processes (accelerate's multi_gpu "
                            "config), each with the whole quantized model")
    if cfg.rollout.async_lag and sharding:
        raise TrainingError("rollout.async_lag is not built for FSDP2 sharding yet (a worker holds the whole model): "
                            "use data-parallel processes, or set rollout.async_lag=0")
    if cfg.rollout.sharded_generation and not sharding:
        raise TrainingError("rollout.sharded_generation applies only to runs sharded by an FSDP accelerate "
                            "config (accelerate launch --config_file config/accelerate/fsdp2.yaml)")
    dist = Dist.from_accelerator(accelerator)
    bf16 = dist.device.type == "cuda" and torch.cuda.is_bf16_supported()
    return Placement(accelerator, dist, training_dtype(cfg.model.dtype, dist.device, bf16), sharding, [], [], None)


def agree_on_main(dist: Dist, fn, *args):
    """`fn(*args)` (which may fail on one process only, e.g. the main one's folder checks), failing on every
    process if it failed on any, so that none is left waiting in a collective."""
    error, result = None, None
    try:
        result = fn(*args)
    except (RuntimeError, ValueError) as e:
        error = str(e)
    if int(dist.max(torch.tensor([float(error is not None)]))):
        if result is not None:
            result.release()
        raise TrainingError(error or "the main process could not start the run (see its error)")
    return result


def lock_output_dir(out_dir: Path, overwrite: bool, resume_dir: Path | None, main: bool,
                    key: str = "run.output_dir") -> RunLock | None:
    """The output folder is writable, locked by this run, and (a new run) empty or overwritable; a resume
    writes only into its own run's folder from its newest checkpoint on, or into a new folder that starts
    with the history up to the checkpoint (never cutting another run's files)."""
    check_writable(out_dir, key)
    if not main:
        return None
    lock = RunLock(out_dir)
    try:
        if resume_dir is None:
            claim_output_dir(out_dir, overwrite)
        elif resume_dir.parent.resolve() != out_dir.resolve():  # another run's checkpoint: a new folder
            claim_output_dir(out_dir, overwrite, resuming=resume_dir)
            adopt_history(out_dir, resume_dir.parent, read_trainer_state(resume_dir).offsets)
        else:
            _check_newest(out_dir, resume_dir, key)
    except BaseException:
        lock.release()
        raise
    return lock


def _check_newest(out_dir: Path, resume_dir: Path, key: str = "run.output_dir") -> None:
    """Resuming inside a run folder starts from its newest intact checkpoint: from an older one, the later
    steps' traces and metrics would be cut and their checkpoints pruned as newer than the resumed run's."""
    step = checkpoint_step(resume_dir)
    newer = [c.name for c in list_checkpoints(out_dir)
             if checkpoint_step(c) > step and verify_checkpoint(c) is None]
    if newer:
        raise ValueError(f"{resume_dir.name} is older than {', '.join(newer)} in {out_dir}: resuming it there would "
                         f"cut the later steps' traces and checkpoints; resume it into a new folder (--set "
                         f"{key}=...), which starts with the history up to step {step}")


def _build(cfg: Config, out_dir: Path, place: Placement, resume_dir: Path | None, examples: list[Example] | None,
           lock: RunLock | None, loaded=None, held_out: dict[str, list[Example]] | None = None,
           sized: bool = False) -> Run:
    """Everything after the launch and the folder claim (see the module docstring)."""
    from transformers import set_seed

    dist = place.dist
    if cfg.logging.wandb:
        try:
            import wandb  # noqa: F401  (fail before loading anything)
        except ImportError:
            raise TrainingError("logging.wandb is on but wandb is not installed: pip install "
                                "'docuchat-rl[wandb]'") from None
    if cfg.run.threads:
        torch.set_num_threads(cfg.run.threads)
    set_seed(cfg.run.seed)
    if cfg.rollout.prompts_per_step % dist.world:
        raise TrainingError(f"rollout.prompts_per_step ({cfg.rollout.prompts_per_step}) must divide by the "
                            f"number of processes ({dist.world}): each process samples whole groups")
    source = cfg.data.train if examples is None else "train_dataset"  # (what errors name: the rows given in memory)
    examples = examples if examples is not None else load_split(cfg.data, "train")
    if len(examples) < cfg.rollout.prompts_per_step:  # (an epoch's permutation must fill a step)
        raise DataError(f"{source}: {len(examples)} training row{'s' * (len(examples) != 1)}, fewer than "
                        f"rollout.prompts_per_step ({cfg.rollout.prompts_per_step}): a step would sample a prompt "
                        "twice; lower rollout.prompts_per_step or add rows")
    check_held_out_rows(examples, held_out or {})
    rows = fingerprint(examples)
    c = cfg.data.curriculum
    levels = levels_of(examples, c, cfg.data.answer_column) if c is not None else None  # (before the model loads)
    if resume_dir:  # (before the model loads)
        _check_same_rows(source, resume_dir, rows)
    start, reference = start_adapters(cfg, resume_dir)
    model, tokenizer, algo, params = _model(cfg, place, start, reference, loaded)
    if start is not None and dist.is_main:  # (once it loaded: an adapter that does not fit is one line alone)
        print(f"docuchat-rl: the adapter starts from {describe_start(start)}", file=sys.stderr, flush=True)
    head = list(algo.critic.parameters()) if algo.critic is not None else []
    opt, sched = build_optimizer(params, cfg.optim, cfg.run.steps * cfg.algorithm.num_iterations
                            * (cfg.rollout.batch_rows // cfg.minibatch_rows),
                            head, getattr(cfg.algorithm, "critic_lr", None))
    # the model is not wrapped (no DDP): gradients are summed across processes per minibatch (distributed.py)
    optimizer, scheduler = place.accelerator.prepare(opt, sched)
    # accelerate saves optimizer, scheduler and RNG states; the adapter is saved by peft instead
    place.accelerator.register_save_state_pre_hook(lambda models, weights, d: weights.clear())
    place.accelerator.register_load_state_pre_hook(lambda models, d: models.clear())

    try:
        multiturn = multiturn_from_config(cfg, tokenizer, stop_ids=eos_ids(model, tokenizer),
                                          context_len=getattr(model.config, "max_position_embeddings", None))
    except ToolError as e:
        raise TrainingError(str(e)) from None
    prompt_texts = [multiturn.prompt_text(e) if multiturn else
                    prompt_text(tokenizer, cfg.data, e)
                    for e in examples]
    longest = _check_lengths(cfg, tokenizer, examples, prompt_texts,
                             getattr(model.config, "max_position_embeddings", None), source)
    if sized:  # rollout.generation_batch_size auto: the rows that fit the memory free now, at most the device's cap
        cfg = _sized_rollout(cfg, model, longest + cfg.rollout.max_new_tokens, dist)
    reward = build_reward(cfg.rewards)
    ctx = EngineContext(cfg, tokenizer, model, dist, out_dir, place.lockstep, place.sharding is not None)
    kind = get_engine_class(rollout_engine(cfg.rollout))
    kind.check(ctx)  # (what it cannot serve, in one line, before anything starts)
    if cfg.rollout.async_lag and cfg.rollout.async_worker_threads:  # a fixed lag's worker process samples: its
        spec = kind.worker_spec(ctx)  # engine is built there (from `spec`: vLLM's), this process's never asked
        engine = LocalEngine(ctx)
    else:  # (built before a resume restores the RNG states: vLLM seeds the global ones)
        spec, engine = None, kind(ctx)  # (servers: checked that they answer and serve this model)
    try:
        return _assemble(cfg, out_dir, place, resume_dir, examples, lock, model, tokenizer, algo, params, optimizer,
                         scheduler, prompt_texts, reward, rows, engine, spec, multiturn, levels)
    except BaseException:  # (a failure after the engine started: it is closed, not left holding its memory)
        engine.close()
        raise


def _assemble(cfg: Config, out_dir: Path, place: Placement, resume_dir: Path | None, examples: list[Example],
              lock: RunLock | None, model, tokenizer, algo: Algorithm, params, optimizer, scheduler,
              prompt_texts: list[str], reward: CompositeReward, rows: dict, engine: Engine, spec,
              multiturn: MultiTurn | None = None, levels: list[int] | None = None) -> Run:
    """The run's state (resumed or fresh), its learner, collector, files and wandb; a fixed lag's worker is
    started last, when nothing after it can fail and leave it running."""
    dist = place.dist
    state = TrainerState(step=0, run_id=dist.gather([uuid.uuid4().hex[:12]])[0])  # the main process's id
    if resume_dir:
        state = load_training_state(resume_dir, model=model, critic=algo.critic, accelerator=place.accelerator,
                                    separate_critic=algo.critic is not None
                                    and cfg.algorithm.critic_backbone == "separate")
        if state.world_size != dist.world and dist.is_main:
            warnings.warn(f"{resume_dir.name} was written by {state.world_size} "
                          f"process{'es' * (state.world_size != 1)} and resumes on {dist.world}: the run goes on, "
                          "but not bit-exactly (sums run in another order)", CheckpointWarning, stacklevel=3)
    state.data = rows
    dist.broadcast_(params)  # every process trains the main process's initial (or resumed) weights
    lagged = None
    if cfg.rollout.async_lag:  # the adapter versions the next steps sample with (lag.py)
        lagged = LaggedPolicies(cfg.rollout.async_lag)
        if resume_dir:
            try:
                lagged.load(resume_dir, state.step, model)
            except ValueError as e:
                raise CheckpointError(f"cannot resume with rollout.async_lag: {e}") from None
        else:
            lagged.record(0, model)
    curriculum = Curriculum.start(cfg.data.curriculum, levels, state.curriculum) if levels is not None else None
    sampler = make_sampler(len(examples), cfg.run.seed, state.sampler, curriculum, cfg.data.difficulty)
    vocab = model.get_output_embeddings().weight.shape[0]
    chunk = cfg.optim.logit_chunk if cfg.optim.logit_chunk is not None else (1024 if vocab > 32768 else 0)
    r = cfg.rollout
    handed = Handed(num_iterations=cfg.algorithm.num_iterations, n_minibatches=r.batch_rows // cfg.minibatch_rows,
                    temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                    correction=r.correction_in_effect, correction_min=r.correction_min,
                    correction_max=r.correction_max, decoupled=bool(r.async_lag),
                    gradient_checkpointing=cfg.model.gradient_checkpointing,
                    separate_critic=getattr(cfg.algorithm, "critic_backbone", "") == "separate",
                    pad_id=tokenizer.pad_token_id, logit_chunk=chunk, sharded=bool(place.sharded_layers))
    learner = Learner(cfg.optim, handed, model, algo, params, optimizer, scheduler, place.accelerator, dist,
                      state.nonfinite_streak)
    collector = Collector(cfg.rollout, tokenizer, examples, prompt_texts, reward, sampler, cfg.run.seed, dist,
                          place.lockstep, max_steps=cfg.run.steps, engine=engine, stop=eos_ids(model, tokenizer),
                          accuracy=cfg.rewards.accuracy_component)
    collector.multiturn = multiturn
    outputs = Outputs.open(out_dir, dist.is_main, state.offsets)
    wandb_run = None
    try:
        if cfg.logging.wandb and dist.is_main:
            import wandb

            wandb_run = wandb.init(project=cfg.logging.wandb_project, mode=cfg.logging.wandb_mode,
                                   dir=str(out_dir), config=cfg.to_dict(), id=state.run_id, resume="allow")
        if lagged is not None and cfg.rollout.async_worker_threads:  # the worker samples ahead (lag.Ahead)
            collector.ahead = Ahead(cfg, place.dtype, str(dist.device), collector, lagged, state.step, spec)
        elif lagged is not None and engine.owns_versions:  # a server samples ahead (its requests in flight)
            collector.ahead = Lookahead(engine, cfg, collector, lagged, state.step)
    except BaseException:
        outputs.close()
        if wandb_run is not None:
            wandb_run.finish()
        raise
    return Run(cfg, out_dir, place, tokenizer, learner, collector, reward, examples, state, outputs, wandb_run,
               lock, lagged, curriculum)


def _check_same_rows(train: str, resume_dir: Path, rows: dict) -> None:
    """A resume draws from the rows the checkpoint's run drew from (same count and content): a data file
    changed under the same name would go on with other prompts at the saved data position, silently."""
    saved = read_trainer_state(resume_dir).data
    if saved and saved != rows:  # (checkpoints written before the fingerprint have none)
        what = (f"{saved['rows']} rows then, {rows['rows']} now" if saved.get("rows") != rows["rows"]
                else f"the same {rows['rows']} rows, other content")
        which = "train_dataset's rows" if train == "train_dataset" else f"data.train {train}"
        raise CheckpointError(f"{which} changed since {resume_dir.name} was written ({what}): "
                              "resuming exactly needs the rows it trained on; restore them, or start a new run")


def _model(cfg: Config, place: Placement, start: Path | None = None, reference: Path | None = None, loaded=None
           ) -> tuple[torch.nn.Module, object, Algorithm, list[torch.nn.Parameter]]:
    """(the peft model, tokenizer, algorithm, trainable parameters): the policy (`policy_model`), the
    algorithm's critic (and its own adapter when separate); under FSDP2 the decoder layers sharded and `place`
    told how generation sees them."""
    dist = place.dist
    model, tokenizer = policy_model(cfg, place, start, reference, loaded)
    algo = get_algorithm_class(cfg.algorithm.name)(cfg.algorithm, model.config.hidden_size, dist.sum,
                                                   cfg.rewards.weights)
    params = [p for p in model.parameters() if p.requires_grad]
    if algo.critic is not None:
        algo.critic.to(dist.device)
        if cfg.algorithm.critic_backbone == "separate":
            add_critic_adapter(model, cfg.lora)
            params = [p for p in model.parameters() if p.requires_grad]
        params += list(algo.critic.parameters())
    if cfg.lora.fused and not place.sharding:  # (under FSDP2 the layers' weights are gathered per forward: peft's path)
        fuse_lora(model)
    if place.sharding:  # the decoder layers' frozen weights split across processes; trainable ones stay whole
        place.sharded_layers = shard_layers(model, place.sharding)
        if cfg.rollout.sharded_generation:  # decode on the sharded weights, every process in lockstep
            place.lockstep = dist.any
        else:
            place.gather_for_generation = place.sharded_layers
        if dist.is_main:
            mine, whole = held_bytes(model)
            layer = type(place.sharded_layers[0]).__name__.removeprefix("FSDP")  # (fully_shard renames the class)
            print(f"docuchat-rl: FSDP2 over {len(place.sharded_layers)} {layer} modules on {dist.world} "
                  f"processes: each holds {mine / 2**20:.1f} MB of the model's {whole / 2**20:.1f} MB of parameters",
                  file=sys.stderr, flush=True)
    return model, tokenizer, algo, params


def policy_model(cfg: Config, place: Placement, start: Path | None = None, reference: Path | None = None,
                 loaded=None):
    """(the peft model, tokenizer): the base model with dropout off and the policy's LoRA adapter, zero or
    `start`'s (an adapter folder, checked against the recipe); with `reference`, a frozen second adapter
    (REFERENCE_ADAPTER) holding that folder's adapter, the KL reference of a run that started from one.
    `loaded`: (model, tokenizer) a caller loaded, made ready as a loaded one is (modeling.prepare_model)."""
    if loaded is not None:
        model, tokenizer = prepare_model(*loaded, place.dtype, str(place.dist.device), cfg.model.stop_tokens,
                                         cfg.model.chat_template, cfg.model.chat_template_kwargs)
    else:
        model, tokenizer = load_configured(cfg.model, place.dtype, str(place.dist.device))
    if cfg.model.disable_dropout:
        disable_dropout(model)
    model = build_lora(model, cfg.lora)
    if start is not None:
        load_start_adapter(model, start, cfg.lora, cfg.model.name_or_path, _start_key(cfg))
    if reference is not None:
        model.add_adapter(REFERENCE_ADAPTER, lora_config(cfg.lora))
        load_start_adapter(model, reference, cfg.lora, cfg.model.name_or_path, _start_key(cfg), REFERENCE_ADAPTER)
        for name, p in model.named_parameters():
            if f".{REFERENCE_ADAPTER}." in name:
                p.requires_grad_(False)
    if cfg.model.gradient_checkpointing:  # active in train mode only: the update, not sampling or no-grad passes
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()  # (peft's hook: the embeddings' output carries grad into each block)
    return model, tokenizer


def _start_key(cfg: Config) -> str:
    return "sft.output_dir (the recipe's SFT stage)" if cfg.sft is not None and cfg.rl_start == cfg.sft_dir \
        else "lora.init_from"


def describe_start(folder: Path) -> str:
    """What a start adapter is, in words: the folder, and for one of our checkpoints its step of its stage's steps,
    saying when the stage did not finish (an `sft --stop-after`, or a stage still running)."""
    try:
        state = read_trainer_state(folder)
        recorded = saved_config(folder) or {}
    except CheckpointError:
        return str(folder)
    step, sft, run = state.step, recorded.get("sft") or {}, recorded.get("run") or {}
    stage = "SFT" if sft and folder.parent.resolve() == Path(str(sft.get("output_dir", ""))).resolve() else "RL"
    total = run.get("steps")
    if stage == "SFT":  # (sft.steps, or its epochs' worth of the examples it learned)
        rows = (state.data or {}).get("rows")
        total = sft.get("steps") or (rows and math.ceil((sft.get("epochs") or 1.0) * rows / sft.get("batch_size", 16)))
    if not total:
        return f"{folder} (step {step} of its {stage} stage)"
    unfinished = "" if step >= total else f": that stage stopped before its last step ({total - step} left)"
    return f"{folder} (step {step} of its {stage} stage's {total}{unfinished})"


def start_adapters(cfg: Config, resume_dir: Path | None) -> tuple[Path | None, Path | None]:
    """(the adapter `train` starts from, the KL reference's adapter) as folders. The start is cfg.rl_start's
    newest intact checkpoint (none on a resume: the checkpoint holds the adapter). The reference, with
    algorithm.beta > 0 and a start, is the starting policy (TRL's reference when it is given an SFT model): the
    start folder, or on a resume the copy the checkpoint keeps (so a resume does not need the start any more)."""
    if not cfg.rl_start:
        return None, None
    needs_reference = getattr(cfg.algorithm, "beta", 0) > 0
    if resume_dir is not None:
        return None, (resume_dir / REFERENCE_ADAPTER if needs_reference else None)
    try:
        start = resolve_adapter(cfg.rl_start, _start_key(cfg))
    except FileNotFoundError as e:
        if cfg.sft is not None and cfg.rl_start == cfg.sft_dir:
            raise CheckpointError(f"the recipe has an sft section, whose stage writes {cfg.sft_dir}, and there is no "
                                  "checkpoint there: run docuchat-rl sft with this recipe first (or set sft: null "
                                  "to train from a zero adapter)") from None
        raise CheckpointError(str(e)) from None
    return start, (start if needs_reference else None)


def build_optimizer(params, o: OptimConfig, total_updates: int, head: list | None = None, head_lr: float | None = None):
    """The configured optimizer over `params` and transformers' schedule over `total_updates` steps; the
    parameters in `head` (the value head) in their own group at `head_lr` when one is given, the schedule
    scaling both groups alike."""
    from transformers import get_scheduler

    if head and head_lr is not None:
        mine = {id(p) for p in head}
        params = [{"params": [p for p in params if id(p) not in mine]}, {"params": head, "lr": head_lr}]
    if o.name == "adamw":
        opt = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    else:
        opt = torch.optim.RMSprop(params, lr=o.lr, alpha=o.alpha, eps=o.eps, weight_decay=o.weight_decay)
    name = "constant_with_warmup" if o.schedule == "constant" else o.schedule  # (ours warms up over warmup_steps)
    sched = get_scheduler(name, opt, num_warmup_steps=steps_of(o.warmup_steps, total_updates),
                          num_training_steps=total_updates, scheduler_specific_kwargs=dict(o.schedule_kwargs))
    return opt, sched


def _sized_rollout(cfg: Config, model, positions: int, dist: Dist) -> Config:
    """cfg with rollout.generation_batch_size decided from memory (memory.size_rollout), the same on every process
    (the least any has room for: lockstep decoding makes the same calls everywhere); one line when not one group
    fits."""
    from .memory import size_rollout

    r = cfg.rollout
    said, rows = None, 0
    try:
        rows = size_rollout(model, r.generation_batch_size, r.num_generations, positions, dist.device,
                            "rollout.generation_batch_size auto")
    except MemoryError as e:
        said = str(e)
    rows = -int(dist.max(torch.tensor([-float(rows)])))  # (every process takes part, whatever it found)
    if rows == 0:
        raise TrainingError(said or "rollout.generation_batch_size auto: another process has no room for one group")
    return cfg.model_copy(update={"rollout": r.model_copy(update={"generation_batch_size": rows})})


def _check_lengths(cfg: Config, tokenizer, examples: list[Example], prompt_texts: list[str],
                   context_len: int | None, source: str | None = None) -> int:
    """Every prompt fits data.max_prompt_tokens and, with rollout.max_new_tokens, the model's context; errors name
    `source` (the training rows' file, or train_dataset). -> the longest prompt's tokens."""
    source = source or cfg.data.train
    limit = cfg.data.max_prompt_tokens
    budget = None if context_len is None else context_len - cfg.rollout.max_new_tokens
    if budget is not None and budget < 1:
        raise TrainingError(f"rollout.max_new_tokens ({cfg.rollout.max_new_tokens}) leaves no room "
                            f"for a prompt in the model's context of {context_len} tokens")
    lengths = [len(x) for x in tokenizer(prompt_texts, add_special_tokens=False)["input_ids"]]
    for i, n in enumerate(lengths):
        if budget is not None and limit >= n > budget:  # (the context binds: data.max_prompt_tokens would not help)
            raise TrainingError(
                f"{source}: row {examples[i].prompt_id} has a prompt of {n} tokens, and the model's context "
                f"of {context_len} leaves {budget} after rollout.max_new_tokens ({cfg.rollout.max_new_tokens}): lower "
                "rollout.max_new_tokens, shorten the prompt (data.system_prompt, data.few_shot) or filter the data")
        if n > limit:
            raise TrainingError(
                f"{source}: row {examples[i].prompt_id} has a prompt of {n} tokens, over data.max_prompt_tokens "
                f"({limit}); raise data.max_prompt_tokens"
                + (f" (the model's context leaves {budget} after rollout.max_new_tokens)" if budget is not None else "")
                + ", shorten the prompt or filter the data")
    return max(lengths, default=0)
