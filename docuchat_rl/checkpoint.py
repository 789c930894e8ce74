"""Checkpoints: `checkpoint-{step}/` with the peft adapter, tokenizer, resolved config and full state.

Layout of one checkpoint:
    adapter_model.safetensors, adapter_config.json   the LoRA adapter (PeftModel.from_pretrained loads it)
    critic.safetensors                               the value head, when the algorithm has one
    critic/adapter_model.safetensors                 the separate critic's LoRA adapter, when it has one
    tokenizer files
    run_config.json                                  {"step": k, "config": {...resolved config...}}
    trainer_state.json                               data order/position, output offsets, run id
    optimizer.bin, scheduler.bin, random_states_0.pkl   accelerate's save_state (model weights skipped)

Writes go to `checkpoint-{step}.tmp/`, which is renamed when complete; then `latest` (a file holding the
folder name) is replaced atomically, last. A crash at any point leaves the previous checkpoint and
`latest` intact. Only the newest `keep_last` checkpoints are kept.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .modeling import CRITIC_ADAPTER

LATEST = "latest"
TRAINER_STATE = "trainer_state.json"


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def save_checkpoint(out_dir: Path, step: int, write_into, keep_last: int) -> Path:
    """`write_into(folder)` fills a temporary folder; it then becomes checkpoint-{step}."""
    final = out_dir / f"checkpoint-{step}"
    tmp = out_dir / f"checkpoint-{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_into(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    _atomic_write(out_dir / LATEST, final.name + "\n")
    prune(out_dir, keep_last)
    return final


def list_checkpoints(out_dir: Path) -> list[Path]:
    found = []
    for p in Path(out_dir).glob("checkpoint-*"):
        if p.is_dir() and p.name.split("-", 1)[1].isdigit():
            found.append(p)
    return sorted(found, key=lambda p: int(p.name.split("-", 1)[1]))


def prune(out_dir: Path, keep_last: int) -> None:
    for old in list_checkpoints(out_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in Path(out_dir).glob("checkpoint-*.tmp"):
        shutil.rmtree(stale, ignore_errors=True)


def resolve_resume(path: str, out_dir: Path) -> Path:
    """`latest` (the pointer in out_dir), a run folder (its latest), or a checkpoint folder."""
    p = Path(out_dir) if path == "latest" else Path(path)
    if (p / LATEST).exists():
        p = p / (p / LATEST).read_text().strip()
    if not (p / TRAINER_STATE).exists():
        raise FileNotFoundError(f"no checkpoint to resume at {p} (expected trainer_state.json; "
                                f"checkpoints: {[c.name for c in list_checkpoints(Path(out_dir))]})")
    return p


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def write_training_state(folder: Path, *, model, tokenizer, critic, accelerator, config: dict,
                         trainer_state: dict) -> None:
    """Fill `folder` with everything a resume reads: the peft adapter(s) (model weights are skipped by
    accelerate's hooks), tokenizer, value head, accelerate's optimizer/scheduler/RNG states, the
    resolved config and `trainer_state` (its "step" is the step the checkpoint follows)."""
    model.save_pretrained(folder, safe_serialization=True)  # policy at the root, the critic's adapter in critic/
    tokenizer.save_pretrained(folder)
    if critic is not None:
        from safetensors.torch import save_file

        save_file(critic.state_dict(), folder / "critic.safetensors")
    accelerator.save_state(str(folder), safe_serialization=True)
    write_json(folder / "run_config.json", {"step": trainer_state["step"], "config": config})
    write_json(folder / TRAINER_STATE, trainer_state)


def load_training_state(folder: Path, *, model, critic, separate_critic: bool, accelerator) -> dict:
    """Load what `write_training_state` wrote into the live objects; returns the trainer state."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    state = json.loads((folder / TRAINER_STATE).read_text())
    set_peft_model_state_dict(model, load_file(str(folder / "adapter_model.safetensors")))
    if separate_critic:  # peft saves a second adapter in a folder named after it
        set_peft_model_state_dict(model, load_file(str(folder / CRITIC_ADAPTER / "adapter_model.safetensors")),
                                  adapter_name=CRITIC_ADAPTER)
    if critic is not None:
        critic.load_state_dict(load_file(str(folder / "critic.safetensors")))
    accelerator.load_state(str(folder))
    return state
