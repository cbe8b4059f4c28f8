"""Nothing lost on Ctrl-C: the first SIGINT or SIGTERM (what a cluster scheduler sends
before it kills a job) asks the loop to stop once the current iteration is done; the loop
then writes a checkpoint and the summary. A second signal aborts at once.

The loop (recipes/ppo.py) asks `should_stop`, which reads only the stop signal and the
metrics' verdict; both are the same on every rank (`StopSignals.agreed`), so a
multi-process run stops at one iteration.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import TYPE_CHECKING

from proxima.launch import Interrupted

if TYPE_CHECKING:
    from proxima.trainer.health import Divergence


class StopSignals:
    """Context manager: SIGINT / SIGTERM set `received` (the first one); a second raises
    KeyboardInterrupt. Handlers are installed only in the main thread and restored on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else ""

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def agreed(self, dist) -> StopSignals:
        """The signal as every rank of a torchrun job sees it: a signal on any rank stops
        them all, at the same iteration (a collective: every rank calls it at the same
        point of the loop)."""
        if dist.active:
            seen = [s for s in dist.all_gather_object(self.received) if s is not None]
            if self.received is None and seen:
                self.received = seen[0]
        return self

    def _handle(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            raise Interrupted(f"second {name}: aborted at once", signum)
        self.received = signum
        # os.write, not print: the signal may arrive while the main thread is printing
        os.write(
            2,
            f"\n{name} received: finishing this iteration, then writing a checkpoint and the "
            "summary (send it again to abort at once)\n".encode(),
        )


def should_stop(signals: StopSignals, divergence: Divergence | None) -> str | None:
    """Why the loop stops before trainer.iterations: "signal", "diverged" or None. Decided
    only from the signal and from metrics, which are identical on every rank."""
    if divergence is not None:
        return "diverged"
    if signals.received:
        return "signal"
    return None
