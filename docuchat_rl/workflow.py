"""The workflow around a run's steps that the CLI and the Python API share: the held-out evaluation before and
after training, written into the run folder's eval.json as soon as each is known, and the change between them
(each accuracy's difference with its 95% interval: evaluation.compare) once both are.

Deliberately left out: the messages (the CLI prints its own lines; the API returns the numbers).
"""

from __future__ import annotations

from pathlib import Path

from .evaluation import compare
from .outputs import add_to_report


def evaluation(trainer, out: Path, when: str) -> dict:
    """The held-out numbers `when` ("before" or "after") training, added to out/eval.json by the main process
    (now: a run stopped or killed later keeps them; a resume leaves them). After a run whose last step was
    evaluated already (eval.every), that evaluation is reused: it is the same one."""
    last = trainer.last_eval
    if when == "after" and last and last["step"] == trainer.step:
        result = {k: v for k, v in last.items() if k not in ("step", "minutes")}
    else:
        result = trainer.evaluate()
    if trainer.is_main:
        report = add_to_report(Path(out) / "eval.json", when, result)
        if when == "after" and isinstance(report.get("before"), dict):  # (the change, with its 95% intervals)
            add_to_report(Path(out) / "eval.json", "change", compare(result, report["before"]))
    return result
