"""What the training loop says on the terminal while it runs: tqdm's bar on a terminal, else a plain line
every few steps (a log file gets no carriage-return frames), and warnings on lines of their own.

Deliberately left out: a live dashboard (rich's live display, curses); the metrics file and wandb carry
everything the bar shows.
"""

from __future__ import annotations

import sys
import time


class Progress:
    """The run's progress display (`enabled` on the main process with logging.progress) and its warnings."""

    LINES = 50  # without a terminal: about this many progress lines over a whole run

    def __init__(self, total: int, initial: int = 0, enabled: bool = False, name: str = "train"):
        self.total, self.started, self.name = total, time.perf_counter(), name
        self._bar, self._every = None, None
        if enabled and sys.stderr.isatty():
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=initial, desc=name, dynamic_ncols=True)
        elif enabled:
            self._every = max(1, total // self.LINES)

    def step(self, step: int, m: dict) -> None:
        """Show a finished step's reward, tokens/s and accuracy (when the run has an accuracy component)."""
        # (train_acc: the step's own samples at the rollout's temperature, not the held-out accuracy; tok/s: the
        # rollout's sampled tokens a second)
        shown = {"reward": f"{m['reward/mean']:.3f}", "tok/s": f"{m['rollout_tokens_per_s'] or 0:.0f}"}
        if m.get("accuracy") is not None:
            shown["train_acc"] = f"{m['accuracy']:.3f}"
        self.show(step, shown)

    def show(self, step: int, shown: dict[str, str]) -> None:
        """A finished step's figures, on the bar or (every few steps) as a line."""
        if self._bar is not None:
            self._bar.update(1)
            self._bar.set_postfix(shown)
        elif self._every and (step % self._every == 0 or step == self.total):
            self.say(f"{self.name} step {step}/{self.total}: " + ", ".join(f"{k} {v}" for k, v in shown.items())
                     + f", {time.perf_counter() - self.started:.0f} s")

    def say(self, line: str) -> None:
        """A line on stderr, on its own line: with the bar drawn, through tqdm (which clears the bar, writes the
        line and redraws it; a plain print would land after the bar's text, where the next redraw hides it)."""
        if self._bar is not None:
            self._bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
