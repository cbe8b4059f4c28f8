"""Calls of the user's code (a reward function, an environment, a reward server's requests)
run side by side, each with a time limit, each failure kept as a value instead of ending
the run.

`gather` (a coroutine, for a caller with an event loop) and `run_all` (for one without, on
threads alone) run zero-argument calls, at most ``concurrency`` at once, and give one
`Outcome` per call, in the order of the calls:

- a sync call runs in a daemon thread of its own; an awaitable it returns is awaited. With
  ``on_loop`` every call is async instead: called and awaited on the loop;
- each call may take ``timeout_s`` seconds from its start (None: no limit). A late async call
  is cancelled; a late sync call cannot be stopped (Python cannot kill a thread): its thread
  runs on in the background, its slot goes to the next call and its result is discarded;
- what a call raises is caught, ``SystemExit`` included (user code that calls ``sys.exit``
  would otherwise end a worker thread in silence, or stop the event loop);
- ``fail_fast``: once a call has failed, the calls not started yet are not made.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import queue
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class Outcome:
    """One call's result: its ``value``, or the ``error`` it raised, or ``timed_out``, or
    ``skipped`` (not made: ``fail_fast`` after an earlier failure)."""

    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False
    skipped: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timed_out and not self.skipped

    def why(self, timeout: str) -> str:
        """Why the call failed, in words ("" when it did not); ``timeout`` names the limit,
        e.g. "timeout_s=2 s"."""
        if self.timed_out:
            return f"timed out after {timeout}"
        if self.skipped:
            return "not made: an earlier call failed"
        return "" if self.error is None else describe(self.error)


def describe(error: BaseException) -> str:
    """``raised ValueError: ...``, or ``called sys.exit(3)`` for a SystemExit."""
    if isinstance(error, SystemExit):
        return f"called sys.exit({error.code!r})"
    return f"raised {type(error).__name__}: {error}"


def run_all(
    calls: Sequence[Callable[[], Any]],
    concurrency: int,
    timeout_s: float | None = None,
    *,
    fail_fast: bool = False,
) -> list[Outcome]:
    """`gather` for a caller without an event loop, on threads alone: each call in a daemon
    thread of its own (an awaitable it returns awaited there), the results waited for on a
    queue. No event loop is started per batch (an environment's turn is one batch: starting
    a loop for each costs more than the turn's calls)."""
    results: list[Outcome | None] = [None] * len(calls)
    done: queue.SimpleQueue = queue.SimpleQueue()
    started: dict[int, float] = {}  # the calls running: their start times
    waiting = collections.deque(range(len(calls)))
    failed = False

    def work(i: int) -> None:
        done.put((i, _outcome(calls[i])))

    while waiting or started:
        while waiting and len(started) < concurrency:
            i = waiting.popleft()
            if failed and fail_fast:
                results[i] = Outcome(skipped=True)
                continue
            started[i] = time.monotonic()
            threading.Thread(target=work, args=(i,), name="guarded call", daemon=True).start()
        if not started:
            continue
        wait = None
        if timeout_s is not None:
            wait = max(0.0, min(started.values()) + timeout_s - time.monotonic())
        try:
            i, outcome = done.get(timeout=wait)
        except queue.Empty:  # the oldest call is past its limit: its slot is freed
            now = time.monotonic()
            for i, start in list(started.items()):
                if now - start >= timeout_s:
                    del started[i]
                    results[i], failed = Outcome(timed_out=True), True
            continue
        if i in started:  # else given up on already: its late result is discarded
            del started[i]
            results[i] = outcome
            failed = failed or not outcome.ok
    return results


def _outcome(call: Callable[[], Any]) -> Outcome:
    """``call()``'s Outcome, in this thread; an awaitable it returns is awaited here."""
    try:
        value = call()
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the caller names it
        return Outcome(error=exc)
    if inspect.isawaitable(value):
        return asyncio.run(awaited(value))
    return Outcome(value)


async def gather(
    calls: Sequence[Callable[[], Any]],
    concurrency: int,
    timeout_s: float | None = None,
    *,
    on_loop: bool = False,
    fail_fast: bool = False,
) -> list[Outcome]:
    """One `Outcome` per call, ``concurrency`` calls at once (see the module docstring)."""
    gate = asyncio.Semaphore(concurrency)
    failed = False

    async def one(call: Callable[[], Any]) -> Outcome:
        nonlocal failed
        async with gate:
            if failed and fail_fast:
                return Outcome(skipped=True)
            work = _on_loop(call) if on_loop else _in_thread(call)
            try:
                outcome = await asyncio.wait_for(work, timeout_s)
            except TimeoutError:  # the call's own TimeoutError is in its Outcome
                outcome = Outcome(timed_out=True)
            failed = failed or not outcome.ok
            return outcome

    return list(await asyncio.gather(*(one(call) for call in calls)))


async def awaited(awaitable: Awaitable[Any]) -> Outcome:
    """The Outcome of awaiting ``awaitable``: a SystemExit in it would stop the event loop
    itself, so it is caught like any error."""
    try:
        return Outcome(await awaitable)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the caller names it
        return Outcome(error=exc)


async def _on_loop(call: Callable[[], Awaitable[Any]]) -> Outcome:
    try:
        awaitable = call()
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - the caller names it
        return Outcome(error=exc)
    return await awaited(awaitable)


async def _in_thread(call: Callable[[], Any]) -> Outcome:
    """``call()`` in a daemon thread of its own; an awaitable it returns is awaited here."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(outcome: Outcome) -> None:
        if not done.done():  # else timed out and cancelled: the result is discarded
            done.set_result(outcome)

    def work() -> None:
        try:
            outcome = Outcome(call())
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - the caller names it
            outcome = Outcome(error=exc)
        try:
            loop.call_soon_threadsafe(settle, outcome)
        except RuntimeError:  # the loop was closed meanwhile: nobody waits for this
            pass

    threading.Thread(target=work, name="guarded call", daemon=True).start()
    outcome = await done
    if outcome.ok and inspect.isawaitable(outcome.value):
        return await awaited(outcome.value)
    return outcome
