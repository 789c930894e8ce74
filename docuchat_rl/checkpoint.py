"""Checkpoints: `checkpoint-{step}/` with the peft adapter, tokenizer, resolved config and full state.

Layout of one checkpoint:
    adapter_model.safetensors, adapter_config.json   the LoRA adapter (PeftModel.from_pretrained loads it)
    critic.safetensors                               the value head, when the algorithm has one
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

LATEST = "latest"


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
    if not (p / "trainer_state.json").exists():
        raise FileNotFoundError(f"no checkpoint to resume at {p} (expected trainer_state.json; "
                                f"checkpoints: {[c.name for c in list_checkpoints(Path(out_dir))]})")
    return p


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")
