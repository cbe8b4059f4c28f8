"""Async reward functions, and the guarded mode (one sample per call, `concurrency` at once,
`timeout_s` each, a failed sample named or given the `fallback`, counted)."""

from __future__ import annotations

import asyncio
import math
import sys
import threading
import time

import pytest
import torch

from proxima.rewards.function import FunctionReward, RewardError

PROMPTS = ["1+1=", "2+2=", "3+3=", "4+4="]
RESPONSES = ["2", "5", "6", "8"]
COLUMNS = {"answer": ["2", "4", "6", "8"]}


def score(source):
    return source(PROMPTS, RESPONSES, COLUMNS)


async def exact(prompts, responses, answer):
    await asyncio.sleep(0)
    return [float(r == a) for r, a in zip(responses, answer, strict=True)]


def test_async_function_scores_the_batch_on_one_loop_kept_between_batches():
    loops = []

    async def fn(prompts, responses, answer):
        loops.append(asyncio.get_running_loop())
        return await exact(prompts, responses, answer)

    source = FunctionReward(fn, "fn")
    assert not source.guarded and source.is_async
    scores = score(source)
    assert scores.dtype == torch.float32 and scores.tolist() == [1.0, 0.0, 1.0, 1.0]
    assert score(source).tolist() == [1.0, 0.0, 1.0, 1.0]
    assert len(loops) == 2 and loops[0] is loops[1]  # one call per batch, the same loop
    assert source.pop_stats()["calls"] == 2
    source.close()
    assert score(source).tolist() == [1.0, 0.0, 1.0, 1.0]  # a new loop after close()


def test_async_function_failures_are_named_like_sync_ones():
    async def picky(prompts, responses, **kw):
        if "5" in responses:
            raise ValueError("cannot read 5")
        return [1.0] * len(responses)

    with pytest.raises(RewardError) as err:
        score(FunctionReward(picky, "picky"))
    assert "reward function picky raised ValueError: cannot read 5; first failing sample 1: " in (
        str(err.value)
    )

    async def leaves(prompts, responses, **kw):
        sys.exit(3)

    source = FunctionReward(leaves, "leaves")
    with pytest.raises(RewardError, match=r"called sys.exit\(3\); first failing sample 0"):
        score(source)
    with pytest.raises(RewardError, match=r"called sys.exit\(3\)"):  # the loop survived it
        score(source)


def test_guarded_calls_one_sample_at_a_time_and_scores_right():
    seen = []

    def fn(prompts, responses, answer):
        seen.append((len(prompts), len(responses), len(answer)))
        return [float(responses[0] == answer[0])]

    for f in (fn, exact):
        source = FunctionReward(f, "fn", concurrency=2)
        assert source.guarded
        assert score(source).tolist() == [1.0, 0.0, 1.0, 1.0]
        assert source.pop_stats()["calls"] == 4
    assert seen == [(1, 1, 1)] * 4


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_concurrency_overlaps_calls(kind):
    async def a(prompts, responses, **kw):
        await asyncio.sleep(0.15)
        return [1.0]

    def s(prompts, responses, **kw):
        time.sleep(0.15)
        return [1.0]

    fn = a if kind == "async" else s
    start = time.perf_counter()
    assert score(FunctionReward(fn, "fn", concurrency=4)).tolist() == [1.0] * 4
    together = time.perf_counter() - start
    start = time.perf_counter()
    score(FunctionReward(fn, "fn", timeout_s=5))  # concurrency unset: one call at a time
    one_by_one = time.perf_counter() - start
    assert together < 0.45, f"4 calls of 0.15 s at concurrency 4 took {together:.2f} s"
    assert one_by_one >= 0.6


@pytest.mark.parametrize("kind", ["async", "sync"])
def test_a_call_past_timeout_is_named_or_falls_back(kind):
    released = threading.Event()

    async def a(prompts, responses, **kw):
        if responses[0] == "5":
            await asyncio.sleep(10)
        return [1.0]

    def s(prompts, responses, **kw):
        if responses[0] == "5":
            released.wait(10)
        return [1.0]

    fn = a if kind == "async" else s
    start = time.perf_counter()
    with pytest.raises(RewardError) as err:
        score(FunctionReward(fn, "slow", concurrency=4, timeout_s=0.2))
    assert time.perf_counter() - start < 1.0
    assert str(err.value) == (
        "reward function slow failed on sample 1 of 4 (prompt '2+2=', response '5'): timed out "
        "after timeout_s=0.2 s. Columns passed: ['answer']. To go on, raise `timeout_s`, or set "
        "`on_error` to 'fallback' (failed samples then score `fallback`=0.0)."
    )
    source = FunctionReward(fn, "slow", concurrency=4, timeout_s=0.2, on_error="fallback")
    assert score(source).tolist() == [1.0, 0.0, 1.0, 1.0]
    assert source.failures == 1
    stats = source.pop_stats()
    assert stats["fallback_samples"] == 1 and stats["timeouts"] == 1 and stats["calls"] == 4
    assert source.failures == 0 and source.pop_stats()["calls"] == 0
    released.set()


def test_a_raising_sample_is_named_or_falls_back():
    async def picky(prompts, responses, **kw):
        if responses[0] in ("5", "8"):
            raise KeyError(responses[0])
        return [2.0]

    with pytest.raises(RewardError) as err:
        score(FunctionReward(picky, "picky", concurrency=2))
    assert str(err.value) == (
        "reward function picky failed on sample 1 of 4 (prompt '2+2=', response '5'): raised "
        "KeyError: '5'; 1 other sample(s) failed too. Columns passed: ['answer']. To go on, fix "
        "the function, or set `on_error` to 'fallback' (failed samples then score "
        "`fallback`=0.0)."
    )
    source = FunctionReward(picky, "picky", on_error="fallback", fallback=-1.0)
    assert source.guarded  # on_error="fallback" alone turns the guard on
    assert score(source).tolist() == [2.0, -1.0, 2.0, -1.0]
    assert source.pop_stats()["fallback_samples"] == 2


def test_bad_values_exits_and_own_timeouts_are_failures_of_their_sample():
    def fn(prompts, responses, **kw):
        r = responses[0]
        if r == "5":
            return [math.nan]
        if r == "6":
            return ["high"]
        if r == "8":
            raise TimeoutError("the judge API timed out")  # not the guard's timeout_s
        sys.exit(2)

    source = FunctionReward(fn, "fn", concurrency=4, on_error="fallback", fallback=0.5)
    assert score(source).tolist() == [0.5] * 4
    assert source.pop_stats()["timeouts"] == 0
    messages = []
    for i in range(4):
        with pytest.raises(RewardError) as err:
            FunctionReward(fn, "fn", timeout_s=5)([PROMPTS[i]], [RESPONSES[i]], {})
        messages.append(str(err.value).split("): ", 1)[1].split(". Columns")[0])
    assert messages == [
        "called sys.exit(2)",
        "returned the non-finite score nan",
        "returned 'high' (str) at index 0; return real numbers",
        "raised TimeoutError: the judge API timed out",
    ]


def test_guard_options_are_checked():
    with pytest.raises(ValueError, match=r"reward function fn: `concurrency`=0 must be an integer"):
        FunctionReward(exact, "fn", concurrency=0)
    with pytest.raises(ValueError, match=r"`timeout_s`=-1 must be a number of seconds >= 0"):
        FunctionReward(exact, "fn", timeout_s=-1)
    with pytest.raises(ValueError, match=r"`on_error`='skip' must be one of"):
        FunctionReward(exact, "fn", on_error="skip")
    unguarded = FunctionReward(exact, "fn")
    assert not unguarded.guarded and unguarded.pop_stats()["fallback_samples"] == 0
