"""`proxima.guarded`: calls side by side, at most `concurrency` at once, each within its time
limit, every failure (an exception, sys.exit, a timeout) kept as that call's Outcome."""

from __future__ import annotations

import asyncio
import sys
import time

from proxima.guarded import Outcome, describe, gather, run_all


def sleeper(i: int, seconds: float = 0.3):
    return lambda: (time.sleep(seconds), i)[1]


def test_concurrent_ordered_and_bounded():
    start = time.monotonic()
    out = run_all([sleeper(i) for i in range(4)], concurrency=4)
    assert time.monotonic() - start < 1.0  # four 0.3 s calls at once, not 1.2 s in a row
    assert [o.value for o in out] == [0, 1, 2, 3] and all(o.ok for o in out)
    start = time.monotonic()
    run_all([sleeper(i) for i in range(4)], concurrency=2)
    assert time.monotonic() - start >= 0.6  # two at a time


def test_failures_are_named_per_call():
    def boom():
        raise ValueError("no")

    def exits():
        sys.exit(3)

    def own_timeout():  # the call's own TimeoutError is an error, not the limit
        raise TimeoutError("the service gave up")

    out = run_all([boom, sleeper(1, 0.0), exits, own_timeout], concurrency=1)
    assert out[1] == Outcome(1)
    assert [o.why("t=1 s") for o in out] == [
        "raised ValueError: no",
        "",
        "called sys.exit(3)",
        "raised TimeoutError: the service gave up",
    ]
    assert not any(o.timed_out for o in out)


def test_timeout_frees_the_slot():
    """A call past its limit is given up on; its slot goes to the next call at once."""
    start = time.monotonic()
    out = run_all([sleeper(0, 2.0), sleeper(1, 0.0)], concurrency=1, timeout_s=0.3)
    assert time.monotonic() - start < 1.5
    assert out[0].timed_out and out[0].why("timeout_s=0.3 s") == "timed out after timeout_s=0.3 s"
    assert out[1] == Outcome(1)


def test_fail_fast_makes_no_later_call():
    made = []

    def call(i):
        def run():
            made.append(i)
            if i == 1:
                raise RuntimeError("down")
            return i

        return run

    out = run_all([call(i) for i in range(4)], concurrency=1, fail_fast=True)
    assert made == [0, 1] and out[0].ok and out[1].error is not None
    assert [o.skipped for o in out] == [False, False, True, True]


def test_async_calls_on_the_loop():
    async def slow(i, seconds):
        await asyncio.sleep(seconds)
        return i

    async def exits():
        sys.exit(4)

    calls = [lambda: slow(0, 0.0), lambda: slow(1, 5.0), exits]
    out = asyncio.run(gather(calls, concurrency=3, timeout_s=0.3, on_loop=True))
    assert out[0] == Outcome(0) and out[1].timed_out
    assert describe(out[2].error) == "called sys.exit(4)"


def test_an_awaitable_from_a_sync_call_is_awaited():
    async def later():
        return 7

    assert run_all([later], concurrency=1)[0] == Outcome(7)
