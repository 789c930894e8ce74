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


RUN_FILES = ("traces.jsonl", "metrics.jsonl", "eval.jsonl", "eval.json", "latest", "sft_targets.jsonl")
STEP_FILES = {"traces": "traces.jsonl", "metrics": "metrics.jsonl", "evals": "eval.jsonl"}  # checkpoint offset keys


def _started_only(path: Path) -> bool:
    """An eval.json holding only the evaluation before training: a start that trained nothing."""
    try:
        report = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(report, dict) and set(report) <= {"before"}


def run_files(out_dir: Path) -> list[Path]:
    """What an earlier run left in `out_dir` that a new one would mix with: its non-empty run files and its
    checkpoints (empty files and a before-training evaluation alone are a start that trained nothing)."""
    out_dir = Path(out_dir)
    files = [out_dir / n for n in RUN_FILES if (out_dir / n).is_file() and (out_dir / n).stat().st_size > 0]
    found = [p for p in files if not (p.name == "eval.json" and _started_only(p))]
    return found + sorted(p for p in out_dir.glob("checkpoint-*") if p.is_dir())


def undo_start(out_dir: Path):
    """What a start is about to create in `out_dir`, made undoable: returns `undo()`, which removes every entry of
    the folder that was not there now (the folder itself when it is new). A refused start calls it, so that the
    refusal leaves nothing behind (a history copied from another run, a lock, files that would block the fixed
    command): the class of "refused, and the folder changed" fixed once, where runs start."""
    out_dir = Path(out_dir)
    existed = out_dir.is_dir()
    before = {p.name for p in out_dir.iterdir()} if existed else set()

    def undo() -> None:
        if not existed:
            shutil.rmtree(out_dir, ignore_errors=True)
            return
        for p in out_dir.iterdir() if out_dir.is_dir() else []:
            if p.name not in before:
                shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)

    return undo


def claim_output_dir(out_dir: Path, overwrite: bool, resuming: Path | None = None) -> None:
    """Make `out_dir` ready for a fresh run (or for a run resumed from another folder's checkpoint,
    `resuming`): the outputs files append, so an earlier run's records would mix with this run's. Raises
    ValueError naming what is there, or removes it when `overwrite`. Only the files a run writes are
    touched; anything else in the folder stays."""
    out_dir = Path(out_dir)
    found = run_files(out_dir)
    if found and not overwrite:
        names = ", ".join(p.name for p in found[:4]) + (", ..." if len(found) > 4 else "")
        if resuming is not None:
            raise ValueError(f"run.output_dir {out_dir} already holds another run ({names}); resuming "
                             f"{resuming} there would cut its files: choose a new run.output_dir (the resumed run "
                             f"copies {resuming.parent.name}'s traces and metrics up to that checkpoint into it)")
        resumable = any(p.name.startswith("checkpoint-") and not p.name.endswith(".tmp") for p in found) or \
            (out_dir / "latest").exists()
        how = ("continue it with --resume latest, choose" if resumable else
               "it has no checkpoint to resume from: choose")
        raise ValueError(f"run.output_dir {out_dir} already holds a run ({names}): {how} another run.output_dir, "
                         f"or set run.overwrite=true to replace it")
    for path in [out_dir / n for n in RUN_FILES if (out_dir / n).exists()] + list(out_dir.glob("checkpoint-*")):
        shutil.rmtree(path) if path.is_dir() else path.unlink()


def adopt_history(out_dir: Path, source: Path, offsets: dict[str, int]) -> None:
    """A run resumed into `out_dir` from a checkpoint of another folder (`source`, its run folder) starts
    with that run's history up to the checkpoint: each file's first `offsets` bytes, and its evaluation
    before training. The source is only read."""
    for key, name in STEP_FILES.items():
        src = Path(source) / name
        if key in offsets and src.is_file():
            with open(src, "rb") as f, open(Path(out_dir) / name, "wb") as dst:
                dst.write(f.read(offsets[key]))
                os.fsync(dst.fileno())
    before = Path(source) / "eval.json"
    if before.is_file():
        try:
            report = json.loads(before.read_text())
        except (OSError, ValueError):
            return
        if isinstance(report, dict) and "before" in report:
            write_report(Path(out_dir) / "eval.json", {"before": report["before"]})


def write_report(path: Path, report: dict) -> None:
    """A small JSON file written whole or not at all (a temporary file renamed over it)."""
    tmp = Path(path).with_name(Path(path).name + ".tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, path)


def add_to_report(path: Path, key: str, value: dict) -> dict:
    """`path`'s JSON object with `key` set to `value`, written back whole; a missing or damaged file
    starts empty. Returns the report."""
    try:
        report = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        report = {}
    report = {**(report if isinstance(report, dict) else {}), key: value}
    write_report(path, report)
    return report


def is_run_folder(folder: Path) -> bool:
    """Whether `folder` holds a training run (its `latest`, a checkpoint, or its traces)."""
    folder = Path(folder)
    return folder.is_dir() and bool((folder / "latest").exists() or (folder / "traces.jsonl").exists()
                                    or any(folder.glob("checkpoint-*")))


def check_new_file(path: str | Path, flag: str) -> Path:
    """Refuse (FileExistsError, one line) to write a command's output file over anything: a training run's
    own files, or any file that exists (a command writes only files it creates). Returns the path."""
    path = Path(path)
    if path.is_dir():
        raise FileExistsError(f"{flag} {path} is a folder: give a file name")
    if (path.name in RUN_FILES + (RunLock.NAME,) and is_run_folder(path.parent)) or \
            path.resolve().parent.name.startswith("checkpoint-"):
        raise FileExistsError(f"{flag} {path} is a file of the training run in {path.parent}: write the output "
                              "beside the run, under another name")
    if path.is_symlink() and not path.exists():  # (a dangling link: writing it would create its target elsewhere)
        raise FileExistsError(f"{flag} {path} is a symbolic link to {os.readlink(path)}, which does not exist: "
                              "give a new file name (nothing is written through a link)")
    if path.exists():
        raise FileExistsError(f"{flag} {path} already exists: give a new file name (nothing is overwritten)")
    return path


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
        except OSError as e:
            with contextlib.suppress(OSError):
                self._f.seek(start)
                self._f.truncate(start)
            raise OSError(e.errno, e.strerror, str(self.path)) from e  # (the error names the file)

    @property
    def offset(self) -> int:
        return self._f.tell()

    def close(self) -> None:
        self._f.close()


def read_jsonl(path: str | Path, skipped: list[int] | None = None, why: dict[int, str] | None = None) -> list[dict]:
    """All complete, valid records: a torn line (a run killed mid-write), one that is not an object or not
    UTF-8 (a damaged or hand-edited file) is skipped, never read with replacement characters, its line number
    appended to `skipped` when given (a command that reads a user's file says how many it skipped) and the
    reason put in `why` (line -> "not UTF-8 text" / "not a JSON object"). A folder is one line saying so."""
    path = Path(path)
    if path.is_dir():
        raise FileNotFoundError(f"{path} is a folder, where a JSON lines file is meant")
    out = []
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError:
                line, reason = None, "not UTF-8 text"
            rec = None
            if line is not None:
                try:
                    rec = json.loads(line)
                except (json.JSONDecodeError, RecursionError):
                    rec = None
                reason = "not a JSON object"
            if isinstance(rec, dict):
                out.append(rec)
            elif raw.strip():
                if skipped is not None:
                    skipped.append(number)
                if why is not None:
                    why[number] = reason
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


def check_writable(out_dir: Path, key: str = "run.output_dir") -> None:
    """Create `out_dir` (and its parents) and write a probe file there; raise RuntimeError naming the
    folder and its `key` when that fails, so a run never loads a model only to fail at its first checkpoint.
    The working folder itself is refused: a run's files would mix with the user's."""
    out_dir = Path(out_dir)
    if out_dir.resolve() == Path.cwd().resolve():
        raise RuntimeError(f"{key} {out_dir} is the working folder itself: name a folder of its own (a run's "
                              "files would mix with yours)")
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".write-probe-{os.getpid()}"
        probe.write_bytes(b"ok")
        probe.unlink()
    except OSError as e:
        raise RuntimeError(f"{key} {out_dir} is not writable: {e.strerror or e}") from None
