"""The workflow around a run's steps that the CLI and the Python API share: the held-out evaluation before and
after training, written into the run folder's eval.json as soon as each is known.

Deliberately left out: the messages (the CLI prints its own lines; the API returns the numbers).
"""

from __future__ import annotations

from pathlib import Path

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
        add_to_report(Path(out) / "eval.json", when, result)
    return result
