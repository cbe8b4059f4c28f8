"""What a running loop shows and when it saves: `PhaseWatch` names the running phase in
the progress bar and says when one is slow; `SaveSchedule` says when a periodic checkpoint
is due (every N iterations and/or minutes)."""

from __future__ import annotations

import threading
import time

from proxima.config import TrainerConfig


class SaveSchedule:
    """A periodic checkpoint is due every `save_every` iterations, and once
    `save_every_minutes` have passed since the last one; always at the last iteration."""

    def __init__(self, t: TrainerConfig, clock=time.monotonic) -> None:
        self.t, self.clock = t, clock
        self.last = clock()

    def due(self, iteration: int) -> bool:
        t = self.t
        if iteration >= t.iterations or (t.save_every and iteration % t.save_every == 0):
            return True
        return bool(t.save_every_minutes) and self.clock() - self.last >= 60 * t.save_every_minutes

    def saved(self) -> None:
        self.last = self.clock()


SLOW_PHASE_S = 30.0


class PhaseWatch:
    """Listener of the trainer's PhaseTimer: the running phase in the progress bar's postfix,
    and a line when a phase runs longer than `slow_s` (from a timer thread, so a phase that
    hangs, e.g. a slow reward function, is named while it runs). `iteration()` is the
    iteration being run, for that line."""

    def __init__(self, bar, iteration=lambda: 1, slow_s: float = SLOW_PHASE_S) -> None:
        self.bar, self.iteration, self.slow_s = bar, iteration, slow_s
        self._timer: threading.Timer | None = None

    def start(self, name: str) -> None:
        self.bar.set_postfix_str(f"{name}...", refresh=True)
        self._timer = threading.Timer(self.slow_s, self._slow, args=(name, self.iteration()))
        self._timer.daemon = True
        self._timer.start()

    def _slow(self, name: str, iteration: int) -> None:
        self.bar.write(
            f"iteration {iteration}: phase `{name}` has been running for more than "
            f"{self.slow_s:g} s (its time is logged as time/{name})"
        )

    def end(self, name: str, seconds: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.bar.set_postfix_str(f"{name} {seconds:.1f}s", refresh=False)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
