"""The house's rules that a review would otherwise keep: the import layers, no import circle, rewards/ free of
torch (.importlinter, checked by import-linter's own command, as a contributor runs it)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .conftest import ROOT


def test_the_import_contracts_hold():
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    if not Path(exe).exists():
        pytest.fail("lint-imports is not installed: pip install -e '.[dev]' (import-linter)")
    done = subprocess.run([exe], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]
    assert "0 broken" in done.stdout and "no import circle between sibling modules KEPT" in done.stdout


def test_a_circle_is_caught(tmp_path):
    """The acyclic contract is not vacuous: a copy of the package with one arrow pointing up breaks it."""
    copy = tmp_path / "src"
    shutil.copytree(ROOT / "docuchat_rl", copy / "docuchat_rl", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(ROOT / "rewards", copy / "rewards", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / ".importlinter", copy / ".importlinter")
    config = copy / "docuchat_rl" / "config.py"
    config.write_text(config.read_text() + "\nfrom .trainer import Trainer  # noqa\n")
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    done = subprocess.run([exe], cwd=copy, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(copy), "PATH": "/usr/bin:/bin"})
    assert done.returncode != 0 and "no import circle between sibling modules BROKEN" in done.stdout, (
        done.stdout[-2000:] + done.stderr[-500:])


def test_the_loops_stay_one_read():
    """The RL loop's class at most 200 lines and its file at most 300 (the redesign's rule); the same for the
    supervised loop. What grows moves into the phase it belongs to (step_log.py, workflow.py, ...)."""
    import ast

    for path, cls in ((ROOT / "docuchat_rl/trainer.py", "Trainer"),
                      (ROOT / "docuchat_rl/supervised/trainer.py", "SupervisedTrainer")):
        src = path.read_text()
        node = next(n for n in ast.parse(src).body if isinstance(n, ast.ClassDef) and n.name == cls)
        assert node.end_lineno - node.lineno + 1 <= 200, (cls, node.end_lineno - node.lineno + 1)
        assert len(src.splitlines()) <= 300, (path.name, len(src.splitlines()))


def _names_in(path: Path) -> set[str]:
    import ast

    return {n.id for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Name)} | {
        a.name.rsplit(".", 1)[-1] for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}


def test_the_learner_and_the_algorithms_take_their_own_sections():
    """learning/ never names the whole Config: an algorithm is built from its own section (and the reward
    weights it is handed), the learner from optim and a `Handed` record decided where the run is assembled;
    a planted `cfg: Config` is caught."""
    learning = sorted((ROOT / "docuchat_rl" / "learning").glob("*.py"))
    assert {p.name for p in learning} >= {"learner.py", "algorithms.py"}
    assert [p.name for p in learning if "Config" in _names_in(p)] == []
    planted = Path(__file__).parent / "_planted_learner.py"
    try:
        planted.write_text("from docuchat_rl.config import Config\n")
        assert "Config" in _names_in(planted)
    finally:
        planted.unlink()


def test_nothing_after_the_engine_choice_switches_on_rollout_engine():
    """The engine is chosen once (sampling/decoding.py, from the config that Config.for_device decided): no
    other module compares `rollout.engine` with an engine's name (a trace's recorded engine is data, not a choice)."""
    import re

    pattern = re.compile(r"\.engine\s*(==|!=|\bin\b)")  # (r.engine == "vllm", cfg.rollout.engine in (...))
    offenders = []
    for path in sorted((ROOT / "docuchat_rl").rglob("*.py")):
        if path.name in ("decoding.py", "config.py"):  # (the choice, and the checks of what a recipe may combine)
            continue
        offenders += [f"{path.relative_to(ROOT)}:{i}" for i, line in enumerate(path.read_text().splitlines(), 1)
                      if pattern.search(line) and not line.lstrip().startswith("#")]
    assert offenders == []
