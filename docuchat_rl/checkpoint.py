"""Checkpoints: `checkpoint-{step}/` with the peft adapter, tokenizer, resolved config and full state.

Layout of one checkpoint:
    adapter_model.safetensors, adapter_config.json   the LoRA adapter (PeftModel.from_pretrained loads it)
    critic.safetensors                               the value head, when the algorithm has one
    critic/adapter_model.safetensors                 the separate critic's LoRA adapter, when it has one
    tokenizer files
    run_config.json                                  {"step": k, "config": {...resolved config...}}
    trainer_state.json                               data order/position, output offsets, run id
    optimizer.bin, scheduler.bin, random_states_0.pkl   accelerate's save_state (model weights skipped)

    manifest.json                                    every other file with its size and sha256, written last

Writes go to `checkpoint-{step}.tmp/`; every file and the folder are fsync'ed, the folder is renamed into
place, then `latest` (a file holding the folder name) is replaced atomically, last, and the parent folder
is fsync'ed after each rename. A crash at any point, of the process or of the machine, leaves the
previous checkpoint and `latest` intact. Only the newest `keep_last` checkpoints are kept.

`resolve_resume("latest")` takes the newest sealed checkpoint (newer than `latest` names when a crash fell
between the rename and the pointer) and verifies it against the manifest (every file present, with its
size and hash); a damaged newest checkpoint (a file deleted or truncated) is skipped for the newest intact
one, with a warning naming what was wrong.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from .config import flat_keys
from .errors import CheckpointError, CheckpointWarning
from .modeling import CRITIC_ADAPTER

LATEST = "latest"
TRAINER_STATE = "trainer_state.json"
MANIFEST = "manifest.json"


def _fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(path.parent)  # the rename itself reaches the disk


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _seal(folder: Path) -> None:
    """Write the manifest of every file in `folder`, then fsync every file and folder in it."""
    files = sorted(p for p in folder.rglob("*") if p.is_file())
    manifest = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": _sha256(p)} for p in files}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    for p in [*files, folder / MANIFEST]:
        _fsync_path(p)
    for d in sorted({p.parent for p in files} | {folder}, key=lambda d: -len(d.parts)):
        _fsync_path(d)


def save_checkpoint(out_dir: Path, step: int, write_into, keep_last: int | None, dist=None) -> Path:
    """`write_into(folder)` fills a temporary folder; sealed and synced, it then becomes checkpoint-{step}.
    With `dist` (several processes) every process calls this: the main one prepares and completes the
    folder, all of them write into it in between."""
    main = dist is None or dist.is_main
    final = out_dir / f"checkpoint-{step}"
    tmp = out_dir / f"checkpoint-{step}.tmp"
    try:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        if dist is not None:
            dist.barrier()
        write_into(tmp)
        if dist is not None:
            dist.barrier()
        if main:
            _seal(tmp)
    except Exception as e:  # noqa: BLE001 (a full disk: the OS's OSError, torch's serializer's RuntimeError,
        # safetensors' SafetensorError, a writer's own; whatever writes a file, a failed write is one line)
        if main:
            shutil.rmtree(tmp, ignore_errors=True)  # (a half-written folder is no checkpoint: nothing left to mislead)
        first = _why_not_written(e, out_dir)
        left = ("the previous checkpoint and `latest` are intact" if (out_dir / LATEST).exists() else
                "no earlier checkpoint exists")
        raise CheckpointError(f"could not write {final.name} in {out_dir}: {first}; {left}") from e
    if main:
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_path(out_dir)
        _atomic_write(out_dir / LATEST, final.name + "\n")
        prune(out_dir, keep_last)
    if dist is not None:
        dist.barrier()
    return final


def _why_not_written(error: BaseException, out_dir: Path) -> str:
    """A failed write's cause in words: the OS's reason, or for torch's serializer (which reports a full disk
    as "[enforce fail at inline_container.cc] unexpected pos") the disk's free space when it is nearly full."""
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    try:
        free = shutil.disk_usage(out_dir).free
    except OSError:
        free = None
    if free is not None and free < 64 * 2**20:
        return f"the disk is full ({free // 1024} KB free)"
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def verify_checkpoint(folder: Path) -> str | None:
    """What is wrong with a checkpoint folder (one line), or None when every file of its manifest is
    there with its size and hash."""
    folder = Path(folder)
    if not folder.is_dir():
        return f"{folder.name} does not exist"
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except FileNotFoundError:
        return f"{folder.name}/{MANIFEST} is missing"
    except (OSError, ValueError) as e:
        return f"{folder.name}/{MANIFEST} is unreadable ({e})"
    for name, want in manifest.items():
        path = folder / name
        if not path.is_file():
            return f"{folder.name}/{name} is missing"
        size = path.stat().st_size
        if size != want["bytes"]:
            return f"{folder.name}/{name} has {size} bytes, expected {want['bytes']}"
        if _sha256(path) != want["sha256"]:
            return f"{folder.name}/{name} is damaged (its hash differs from the manifest's)"
    return None


def latest_step(out_dir: Path) -> int | None:
    """The step of the checkpoint `latest` names, or None when there is none."""
    pointer = Path(out_dir) / LATEST
    if not pointer.exists():
        return None
    return int(pointer.read_text().strip().split("-", 1)[1])


def checkpoint_step(folder: Path) -> int:
    """The step of a checkpoint folder: N of `checkpoint-N`, else its trainer state's (a renamed copy)."""
    tail = Path(folder).name.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else read_trainer_state(folder).step


def list_checkpoints(out_dir: Path) -> list[Path]:
    """The `checkpoint-N` folders in `out_dir`, oldest first."""
    found = []
    for p in Path(out_dir).glob("checkpoint-*"):
        if p.is_dir() and p.name.split("-", 1)[1].isdigit():
            found.append(p)
    return sorted(found, key=checkpoint_step)


def prune(out_dir: Path, keep_last: int | None) -> None:
    """Delete all but the newest `keep_last` checkpoints (None: keep all), and any half-written `.tmp` folder."""
    for old in list_checkpoints(out_dir)[:-keep_last] if keep_last else []:
        shutil.rmtree(old, ignore_errors=True)
    for stale in Path(out_dir).glob("checkpoint-*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)


def resolve_resume(path: str, out_dir: Path) -> Path:
    """`latest` (the pointer in out_dir) or a run folder: its newest intact checkpoint (a damaged newer
    one is skipped with a warning); a checkpoint folder: that one, which must be intact."""
    p = Path(out_dir) if path == "latest" else Path(path)
    if not (p / LATEST).exists() and not list_checkpoints(p):
        if not (p / TRAINER_STATE).exists():
            raise FileNotFoundError(f"no checkpoint to resume at {p} (expected trainer_state.json; "
                                    f"checkpoints: {[c.name for c in list_checkpoints(Path(out_dir))]})")
        problem = verify_checkpoint(p)
        if problem:
            raise CheckpointError(f"cannot resume from {p}: {problem}")
        return p
    # Newest first, whatever `latest` names: a crash between a checkpoint's rename and the pointer's
    # replacement leaves a newer sealed checkpoint than `latest` says, and it is the one to resume.
    candidates = list_checkpoints(p)[::-1]
    problems = []
    for c in candidates:
        problem = verify_checkpoint(c)
        if problem is None:
            if problems:
                warnings.warn(f"resuming from {c.name}, the newest intact checkpoint: " + "; ".join(problems),
                              CheckpointWarning, stacklevel=2)
            return c
        problems.append(problem)
    raise CheckpointError(f"no intact checkpoint to resume in {p}: " + ("; ".join(problems) or "none there"))


def resolve_adapter(path: str | Path, key: str = "--adapter") -> Path:
    """What `--adapter` (or `key`) names: a checkpoint folder; a run folder or its `latest` pointer (what `train`
    prints) is its newest intact checkpoint."""
    p = Path(path)
    if (p / "adapter_config.json").exists():
        unsealed = not (p / MANIFEST).exists() and ((p / TRAINER_STATE).exists() or p.name.endswith(".tmp"))
        if unsealed:  # (one of ours whose write never finished: a plain peft folder has neither)
            raise CheckpointError(f"{key} {path}: a checkpoint that was never sealed (no {MANIFEST}: its write did "
                                  "not finish); use a sealed one (a run folder gives its newest intact one)")
        problem = verify_checkpoint(p) if (p / MANIFEST).exists() else None  # (a plain peft folder has none)
        if problem:
            raise CheckpointError(f"{key} {path}: {problem}; use another checkpoint (a run folder gives its "
                                  "newest intact one)")
        return p
    if p.name == LATEST and p.is_file():
        p = p.parent
    if p.is_dir() and ((p / LATEST).exists() or list_checkpoints(p)):
        return resolve_resume(str(p), p)
    raise FileNotFoundError(f"{key} {path}: no adapter_config.json there (give a checkpoint folder, a run "
                            "folder or its latest)")


def same_model(a: str | None, b: str) -> bool:
    """Whether two model.name_or_path values name one model (the same text, or two paths of one folder)."""
    return not a or a == b or (Path(a).exists() and Path(b).exists() and Path(a).resolve() == Path(b).resolve())


PLAIN_LORA = {"use_rslora": False, "alpha_pattern": {}, "rank_pattern": {}, "use_dora": False}  # peft's
# adapter_config.json options that change a layer's scale or form from alpha / r (rsLoRA: alpha / sqrt(r); the
# patterns: per module; DoRA: a magnitude vector), at the values that leave it alpha / r; a start adapter must
# set them as the recipe's lora section does (DoRA, which it cannot, never)


def load_start_adapter(model, folder: Path, lora, model_name: str, key: str = "lora.init_from",
                       adapter_name: str = "default") -> None:
    """Set adapter `adapter_name` of the peft `model` to the adapter in `folder` (resolve_adapter's), after
    checking in one line that it fits: trained on the same base model (a checkpoint of ours says which; a
    plain peft folder's base is not compared, its shapes are), the same LoRA scale, and the very tensors,
    by name and shape, that the recipe's `lora` section gives the model."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict
    from safetensors.torch import load_file

    trained_on = ((saved_config(folder) or {}).get("model") or {}).get("name_or_path")
    if not same_model(trained_on, model_name):
        raise CheckpointError(f"{key} {folder} was trained on model {trained_on!r}, and the recipe names "
                              f"{model_name!r}: start from an adapter of this model")
    try:
        meta = json.loads((folder / "adapter_config.json").read_text())
        state = load_file(str(folder / "adapter_model.safetensors"))
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{key} {folder}: its adapter cannot be read ({e})") from None
    theirs = {k: plain if meta.get(k) is None else meta[k] for k, plain in PLAIN_LORA.items()}
    scaled = [f"{k}: {theirs[k]}" for k, plain in PLAIN_LORA.items() if theirs[k] != getattr(lora, k, plain)]
    if scaled:  # (a layer scaled otherwise than the recipe's lora section scales it would start elsewhere)
        raise CheckpointError(f"{key} {folder}: its adapter_config.json sets {scaled[0]}, which scales or shapes "
                              "the adapter otherwise than the recipe's lora section (lora.use_rslora, rank_pattern, "
                              "alpha_pattern; DoRA is not built): its first step would not be the policy peft loads; "
                              "set lora to the adapter's, or start from another adapter")
    own = get_peft_model_state_dict(model, adapter_name=adapter_name)
    theirs = {k: tuple(v.shape) for k, v in state.items()}
    mine = {k: tuple(v.shape) for k, v in own.items()}
    if theirs != mine or float(meta.get("lora_alpha", lora.alpha)) != float(lora.alpha):
        rank = meta.get("r")
        modules = sorted({k.split(".")[-3] for k in theirs if ".lora_A." in k})
        what = (f"shapes differ (first: {next((k for k in sorted(mine) if theirs.get(k) != mine[k]), None) or next(iter(sorted(set(theirs) - set(mine))), '?')})"
                if theirs != mine else f"lora alpha {meta.get('lora_alpha')} against {lora.alpha}")
        raise CheckpointError(f"{key} {folder}: its adapter (rank {rank}, alpha {meta.get('lora_alpha')}, on "
                              f"{', '.join(modules) or 'nothing'}) does not fit the recipe's lora (rank {lora.r}, alpha "
                              f"{lora.alpha}, on {lora.target_modules}): {what}; set lora to the adapter's shape")
    set_peft_model_state_dict(model, state, adapter_name=adapter_name)


# One rule for a config that differs from the checkpoint's on resume: a key that only says how the run is
# watched, stored, timed or computed at the same results (performance switches that keep the gradients) is
# applied and said; every other key changes what the resumed steps compute, which an exact resume and the
# checkpoint's run_config.json (the recipe of record) cannot both honour: refused, naming the key.
RESUME_APPLIED = ("run.output_dir", "run.threads", "run.overwrite", "model.device", "model.gradient_checkpointing",
                  "lora.fused", "rollout.generation_batch_size", "rollout.engine", "rollout.grouped_decode",
                  "rollout.cuda_graphs", "rollout.compile_decode", "rollout.fused_projections",
                  "rollout.merge_adapter", "rollout.vllm", "rollout.async_worker_threads", "rollout.async_timeout_s",
                  "optim.micro_batch_size", "optim.share_prompt",
                  "optim.length_buckets", "optim.logit_chunk", "optim.max_nonfinite_steps", "rewards.timeout_s",
                  "rewards.strict", "rewards.max_failed_steps", "rewards.accuracy_component", "checkpoint",
                  "logging", "eval")


def _section(config: dict, key: str):
    """The value at a dotted key of a nested config (None where a part is missing)."""
    for part in key.split("."):
        config = config.get(part) if isinstance(config, dict) else None
    return config


def _applies(key: str, config: dict) -> bool:  # (config flattened)
    """True for a key the resume rule applies (see RESUME_APPLIED); run.steps too under a constant schedule
    (a run may be lengthened; under linear/cosine the schedule's length would change mid-run)."""
    if key == "run.steps":
        return config.get("optim.schedule") == "constant"
    return any(key == a or key.startswith(a + ".") for a in RESUME_APPLIED)


def saved_config(folder: Path) -> dict | None:
    """The resolved config a checkpoint was trained with (`run_config.json`), as today's config reads it
    (None when it has none; a damaged one is one line)."""
    path = Path(folder) / "run_config.json"
    if not path.exists():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))["config"]
    except (OSError, ValueError, KeyError, TypeError):
        config = None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} is damaged (not a run_config with its config): give the recipe with --config")
    rollout = config.get("rollout")
    if isinstance(rollout, dict) and rollout.get("engine") == "hf" and rollout.get("grouped_decode") is True:
        # (written before grouped_decode was decided per engine: on for a decode loop the hf engine never runs)
        config = {**config, "rollout": {**rollout, "grouped_decode": False}}
    return config


SFT_MARK = "sft_targets.jsonl"  # (the file only `docuchat-rl sft` writes into its run folder)


def check_stage(folder: Path, command: str) -> None:
    """A checkpoint is resumed by the stage that wrote it: `train` refuses an SFT stage's (its folder holds
    sft_targets.jsonl), `sft` a train run's; one line saying which command resumes it, before anything is
    claimed or loaded."""
    sft = (Path(folder).parent / SFT_MARK).exists() or (Path(folder) / SFT_MARK).exists()
    if command == "train" and sft:
        raise CheckpointError(f"{folder} is a checkpoint of the SFT stage (docuchat-rl sft wrote it): resume it with "
                              "`docuchat-rl sft --resume`, or start RL from its adapter (lora.init_from, or the "
                              "recipe's sft section)")
    if command == "sft" and not sft:
        raise CheckpointError(f"{folder} is a checkpoint of an RL run (docuchat-rl train wrote it), not of the SFT "
                              "stage: resume it with `docuchat-rl train --resume`")


def check_resumable(folder: Path, config: dict, applied: tuple[str, ...] = ()) -> list[str]:
    """Compare `config` with the one `folder` was trained with: refuse (one line naming every such key with both
    values) a change to what the resumed steps compute; return the applied changes as `key: old -> new`.
    `applied`: keys this command also applies (the folder it writes: sft's sft.output_dir)."""
    recorded = saved_config(folder)
    if recorded is None:
        return []
    saved = flat_keys(recorded)
    now = flat_keys(json.loads(json.dumps(config)))  # (tuples as the saved JSON's lists)
    # (`now` has every auto decided for this device; a checkpoint written before the dtype was decided at the
    # start holds model.dtype auto, which says nothing of what it trained in)
    changed = [k for k in now if k in saved and saved[k] != now[k] and saved[k] != "auto"]
    # a section set where it was null, or null where it was set (data.curriculum): flattened, the two sides
    # hold different keys, so compare the section whole
    for one, other in ((saved, now), (now, saved)):
        for k in [k for k, v in one.items() if v is None and any(o.startswith(f"{k}.") for o in other)]:
            saved[k], now[k] = _section(recorded, k), _section(config, k)
            changed.append(k)
    refused = [f"{k}={saved[k]!r} -> {now[k]!r}" for k in changed if not _applies(k, now) and k not in applied]
    if refused:
        raise CheckpointError(f"{Path(folder).name} was trained with a different recipe: {'; '.join(refused)}. "
                              "Resuming exactly needs the checkpoint's values (change only logging, checkpoint, "
                              "eval, timeouts, speed switches or, under a constant schedule, run.steps), or "
                              "start a new run in another run.output_dir")
    return [f"{k}: {saved[k]!r} -> {now[k]!r}" for k in changed]


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


@dataclass
class TrainerState:
    """What the loop itself carries from one step to the next (`trainer_state.json`); the adapter,
    optimizer, scheduler and RNG states are saved beside it by their own libraries."""

    step: int  # the last finished step (the checkpoint follows it)
    run_id: str  # the main process's id of this run (wandb's run id, the traces' run_id)
    sampler: dict = field(default_factory=dict)  # PromptSampler.state(): data order and position (with
    # data.difficulty, every drawn prompt's pass rate and standing too: DifficultySampler.state())
    offsets: dict[str, int] = field(default_factory=dict)  # byte size of each output file (main process)
    nonfinite_streak: int = 0  # optimizer steps skipped in a row for a non-finite loss or gradient
    no_reward_streak: int = 0  # steps in a row in which no reward component gave any completion a value
    world_size: int = 1  # processes that wrote the checkpoint
    data: dict = field(default_factory=dict)  # data.fingerprint of the training rows (rows, sha256)
    curriculum: dict = field(default_factory=dict)  # data.curriculum: Curriculum.state() (level, recent accuracies)
    seconds: float = 0.0  # training wall-clock up to this step, over every resume (eval.jsonl's minutes count on)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> TrainerState:
        """From `trainer_state.json`; fields that older checkpoints lack take their defaults above."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def write_training_state(folder: Path, *, model, tokenizer, critic, accelerator, config: dict,
                         trainer_state: TrainerState, main: bool = True) -> None:
    """Fill `folder` with everything a resume reads: the peft adapter(s) (model weights are skipped by
    accelerate's hooks), tokenizer, value head, accelerate's optimizer/scheduler/RNG states (one RNG file
    per process: every process calls this, only the main one writes the rest), the resolved config and
    `trainer_state` (its "step" is the step the checkpoint follows)."""
    accelerator.save_state(str(folder), safe_serialization=True)
    if not main:
        return
    model.save_pretrained(folder, safe_serialization=True)  # policy at the root, the critic's adapter in critic/
    tokenizer.save_pretrained(folder)
    if critic is not None:
        from safetensors.torch import save_file

        save_file(critic.state_dict(), folder / "critic.safetensors")
    write_json(folder / "run_config.json", {"step": trainer_state.step, "config": config})
    write_json(folder / TRAINER_STATE, trainer_state.to_json())


def read_trainer_state(folder: Path) -> TrainerState:
    """A checkpoint's `trainer_state.json` (one line naming the file when it cannot be read)."""
    path = Path(folder) / TRAINER_STATE
    try:
        return TrainerState.from_json(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError) as e:
        raise CheckpointError(f"{path} cannot be read: {e}") from None


def load_training_state(folder: Path, *, model, critic, separate_critic: bool, accelerator) -> TrainerState:
    """Load what `write_training_state` wrote into the live objects; returns the trainer state."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    state = read_trainer_state(folder)
    set_peft_model_state_dict(model, load_file(str(folder / "adapter_model.safetensors")))
    if separate_critic:  # peft saves a second adapter in a folder named after it
        set_peft_model_state_dict(model, load_file(str(folder / CRITIC_ADAPTER / "adapter_model.safetensors")),
                                  adapter_name=CRITIC_ADAPTER)
    if critic is not None:
        critic.load_state_dict(load_file(str(folder / "critic.safetensors")))
    accelerator.load_state(str(folder))
    return state
