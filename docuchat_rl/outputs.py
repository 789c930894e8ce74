"""Append-only JSONL outputs (traces.jsonl, metrics.jsonl) that survive a crash and resume exactly.

Each step's lines are written, flushed and fsync'ed together, so `kill -9` loses at most the step in
flight (a torn last line is possible and readers skip it). A checkpoint records each file's byte size;
resuming truncates the file back to it, so steps replayed after the checkpoint are neither lost nor
written twice.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any


def _clean(x: Any) -> Any:
    """JSON-safe: non-finite floats become null (JSON has no NaN)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


RUN_FILES = ("traces.jsonl", "metrics.jsonl", "eval.jsonl", "eval.json", "latest")


def claim_output_dir(out_dir: Path, overwrite: bool) -> None:
    """Make `out_dir` ready for a fresh run: the outputs files append, so an earlier run's records would
    mix with this run's. Raises ValueError naming what is there, or removes it when `overwrite`.
    Only the files a run writes are touched; anything else in the folder stays."""
    out_dir = Path(out_dir)
    files = [out_dir / n for n in RUN_FILES if (out_dir / n).exists()]
    checkpoints = sorted(out_dir.glob("checkpoint-*"))
    # empty run files (a start that failed before writing anything) hold nothing to lose or to resume
    found = [p for p in files if p.stat().st_size > 0] + checkpoints
    if found and not overwrite:
        names = ", ".join(p.name for p in found[:4]) + (", ..." if len(found) > 4 else "")
        resumable = checkpoints or (out_dir / "latest").exists()
        how = ("continue it with --resume latest, choose" if resumable else
               "it has no checkpoint to resume from: choose")
        raise ValueError(f"run.output_dir {out_dir} already holds a run ({names}): {how} another run.output_dir, "
                         f"or set run.overwrite=true to replace it")
    for path in files + checkpoints:
        shutil.rmtree(path) if path.is_dir() else path.unlink()


class JsonlWriter:
    """An append-only JSONL file, cut back to a checkpointed offset when opened for a resume."""

    def __init__(self, path: Path, truncate_to: int | None = None):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if truncate_to is not None and self.path.exists():
            with open(self.path, "r+b") as f:
                f.truncate(truncate_to)
        self._f = open(self.path, "ab", buffering=0)  # unbuffered: nothing is left in a buffer after a failed write

    def write(self, records: list[dict]) -> None:
        """Append the records as one flushed, fsync'ed write; a write that fails (a full disk) is cut
        back to the previous end of the file before the error goes up, so no partial line stays."""
        data = "".join(json.dumps(_clean(r), ensure_ascii=False) + "\n" for r in records).encode()
        start = self._f.tell()
        try:
            view = memoryview(data)
            while view:  # a raw write may be short (a size limit reached mid-write)
                view = view[self._f.write(view):]
            os.fsync(self._f.fileno())
        except OSError:
            with contextlib.suppress(OSError):
                self._f.seek(start)
                self._f.truncate(start)
            raise

    @property
    def offset(self) -> int:
        return self._f.tell()

    def close(self) -> None:
        self._f.close()


def read_jsonl(path: str | Path) -> list[dict]:
    """All complete, valid records: a torn line (a run killed mid-write), one that is not an object or not
    UTF-8 (a damaged or hand-edited file) is skipped."""
    out = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict):
                out.append(rec)
    return out


class RunLock:
    """One live run per output folder: an exclusive `flock` on `<output_dir>/.lock`, held while the run
    lives. The kernel drops it when the process dies, `kill -9` included, so a killed run never leaves a
    stale lock; the file keeps the holder's pid for the error message."""

    NAME = ".lock"

    def __init__(self, out_dir: Path):
        import fcntl

        self.path = Path(out_dir) / self.NAME
        self._f = open(self.path, "a+")
        try:
            fcntl.flock(self._f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._f.seek(0)
            holder = self._f.read().strip() or "unknown"
            self._f.close()
            raise RuntimeError(f"run.output_dir {out_dir} is in use by a live run (pid {holder}); wait for it, "
                               "stop it, or choose another run.output_dir") from None
        self._f.seek(0)
        self._f.truncate()
        self._f.write(f"{os.getpid()}\n")
        self._f.flush()

    def release(self) -> None:
        if not self._f.closed:
            self._f.close()  # closing the file drops the flock


def check_writable(out_dir: Path) -> None:
    """Create `out_dir` (and its parents) and write a probe file there; raise RuntimeError naming the
    folder when that fails, so a run never loads a model only to fail at its first checkpoint."""
    out_dir = Path(out_dir)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise RuntimeError(f"run.output_dir {out_dir} is not writable: {e.strerror or e}") from None
