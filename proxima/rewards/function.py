"""Python reward functions: ``"path/to/file.py:fn"`` or ``"package.module:fn"``.

The function receives the batch as lists and returns one number per response::

    def reward(prompts: list[str], responses: list[str], **columns) -> list[float]

``columns`` are the dataset's other columns (e.g. ``answer``), one list entry per sample.
A function that names only some columns (no ``**kwargs``) receives only those.

The function may be ``async def`` (or return an awaitable): it then runs on one event loop
owned by the source, in a background thread, the same loop for every batch (so a client
made on first use, e.g. an ``httpx.AsyncClient``, may be kept between batches).

Guarded mode. By default the whole batch is one call, and a call that fails stops the run
with the offending sample named. With any of ``concurrency``, ``timeout_s`` or
``on_error="fallback"`` set, the batch is scored one sample per call instead (the function
still receives lists, of length 1):

- up to ``concurrency`` calls at once (default 1), each within ``timeout_s`` seconds
  (default: no limit), run by :mod:`proxima.guarded` (an async function on the source's
  loop, a sync one in a thread per call, which must then be thread-safe when
  ``concurrency > 1``);
- a sample whose call raises, times out or returns anything but one finite number is
  *failed*: with ``on_error="raise"`` the batch stops with a :class:`RewardError` naming
  the failure and the sample's prompt and response; with ``on_error="fallback"`` it scores
  ``fallback`` and is counted in ``failures`` and in :meth:`FunctionReward.pop_stats`.
"""

from __future__ import annotations

import asyncio
import inspect
import math
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any

import torch

from proxima import guarded, plugins

RETRY_LIMIT = 32  # samples re-run one by one to locate the input that breaks a function
ON_ERROR = ("raise", "fallback")  # what a guarded source does with a failed sample


class RewardError(RuntimeError):
    """A reward source failed or returned unusable scores during training."""


def load_reward_function(spec: str) -> Callable[..., Any]:
    """Import the callable named by ``spec``; raise with what is wrong and how to fix it."""
    return plugins.load(spec, f"reward function spec {spec!r}")


def shorten(text: Any, limit: int = 200) -> str:
    """``repr(text)``, cut after ``limit`` characters."""
    text = repr(text)
    return text if len(text) <= limit else text[:limit] + "...'"


def check_options(where: str, **options: Any) -> None:
    """The options a reward source shares with the others (``reward.sources`` entry keys),
    each checked by name: ``batch_size``, ``concurrency``, ``retries``, ``timeout_s``,
    ``backoff_s``, ``on_error``, ``fallback``; None means "not set" and passes."""
    for key in ("batch_size", "concurrency"):
        value = options.get(key)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 1
        ):
            raise ValueError(f"{where}: `{key}`={value!r} must be an integer >= 1.")
    value = options.get("retries")
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"{where}: `retries`={value!r} must be an integer >= 0.")
    for key in ("timeout_s", "backoff_s"):
        value = options.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
            raise ValueError(f"{where}: `{key}`={value!r} must be a number of seconds >= 0.")
        if key == "timeout_s" and value == 0:
            raise ValueError(f"{where}: `timeout_s`=0 leaves no time for a call; give seconds > 0.")
    if "on_error" in options and options["on_error"] not in ON_ERROR:
        raise ValueError(
            f"{where}: `on_error`={options['on_error']!r} must be one of {list(ON_ERROR)} "
            "('raise': a failure stops the run; 'fallback': the failed samples score `fallback`)."
        )
    value = options.get("fallback")
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
    ):
        raise ValueError(f"{where}: `fallback`={value!r} must be a finite number.")


class FunctionReward:
    """Reward source around a Python function; see the module docstring for its contract.

    Called as ``source(prompts, responses, columns, sequences, attention_mask)`` and returns
    a float32 CPU tensor [B]. ``sequences``/``attention_mask`` [B, L] are not used here.
    ``concurrency``, ``timeout_s``, ``on_error`` and ``fallback`` (the keys of a
    ``reward.sources`` entry) turn on the guarded, one-sample-per-call mode.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str | None = None,
        *,
        concurrency: int | None = None,
        timeout_s: float | None = None,
        on_error: str = "raise",
        fallback: float = 0.0,
    ) -> None:
        self.fn = fn
        self.name = name or getattr(fn, "__qualname__", repr(fn))
        check_options(
            f"reward function {self.name}",
            concurrency=concurrency,
            timeout_s=timeout_s,
            on_error=on_error,
            fallback=fallback,
        )
        self._accepted = _accepted_columns(fn)
        self.guarded = concurrency is not None or timeout_s is not None or on_error != "raise"
        self.concurrency = concurrency or 1
        self.timeout_s = None if timeout_s is None else float(timeout_s)
        self.on_error, self.fallback = on_error, float(fallback)
        self.is_async = _is_async(fn)
        self.failures = 0  # samples scored `fallback` since the last pop_stats()
        self.last_error: str | None = None  # the last failure's message (fallback mode)
        self._calls = self._timeouts = 0
        self._seconds = 0.0
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def from_spec(cls, spec: str, **options: Any) -> FunctionReward:
        return cls(load_reward_function(spec), name=spec, **options)

    def __call__(
        self,
        prompts: list[str],
        responses: list[str],
        columns: dict[str, list[Any]],
        sequences: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        start = time.perf_counter()
        try:
            kwargs = self._select(columns)
            if self.guarded:
                return self._score_each(prompts, responses, kwargs)
            return self._score_batch(prompts, responses, kwargs)
        finally:
            with self._lock:
                self._seconds += time.perf_counter() - start

    def pop_stats(self) -> dict[str, float]:
        """Counts since the last call, then reset: ``fallback_samples`` (samples scored
        ``fallback``), ``calls`` (calls of the function), ``timeouts`` (calls past
        ``timeout_s``), ``seconds`` (time spent scoring)."""
        with self._lock:
            stats = {
                "fallback_samples": float(self.failures),
                "calls": float(self._calls),
                "timeouts": float(self._timeouts),
                "seconds": self._seconds,
            }
            self.failures = self._calls = self._timeouts = 0
            self._seconds = 0.0
        return stats

    def close(self) -> None:
        """Stop the event loop of an async function (a new one starts on the next call)."""
        with self._lock:
            loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(loop.stop)

    def __getstate__(self) -> dict[str, Any]:  # the loop and the lock stay behind
        state = dict(self.__dict__)
        state["_lock"], state["_loop"] = None, None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    # -- whole batch -------------------------------------------------------------------

    def _score_batch(self, prompts, responses, kwargs) -> torch.Tensor:
        try:
            raw = self._invoke(prompts, responses, kwargs)
        except (Exception, SystemExit) as exc:  # a reward function must not end the run
            raise RewardError(self._failure_message(prompts, responses, kwargs, exc)) from exc
        scores = self._to_tensor(raw, len(responses))
        bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
        if bad:
            raise RewardError(
                f"reward function {self.name} returned non-finite scores at indices "
                f"{bad[:10]}{' ...' if len(bad) > 10 else ''} (first: {scores[bad[0]].item()} for "
                f"prompt {shorten(prompts[bad[0]])}, response {shorten(responses[bad[0]])}); "
                "return finite numbers for every response."
            )
        return scores

    def _invoke(self, prompts, responses, kwargs) -> Any:
        """One call of the function; an awaitable result is awaited on the source's loop."""
        with self._lock:
            self._calls += 1
        raw = self.fn(prompts, responses, **kwargs)
        if not inspect.isawaitable(raw):
            return raw
        outcome = self._run(guarded.awaited(raw))
        if outcome.error is not None:
            raise outcome.error
        return outcome.value

    def _run(self, coro: Awaitable[Any]) -> Any:
        """Run ``coro`` on the source's own event loop (started on first use) and wait."""
        with self._lock:
            if self._loop is None or self._loop.is_closed():
                self._loop = asyncio.new_event_loop()
                threading.Thread(
                    target=_serve_loop, args=(self._loop,), name="reward-loop", daemon=True
                ).start()
            loop = self._loop
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    def _select(self, columns: dict[str, list[Any]]) -> dict[str, list[Any]]:
        if self._accepted is None:
            return dict(columns)
        return {k: v for k, v in columns.items() if k in self._accepted}

    def _failure_message(self, prompts, responses, kwargs, exc: BaseException) -> str:
        if isinstance(exc, SystemExit):
            head = f"reward function {self.name} called sys.exit({exc.code!r})"
        else:
            head = f"reward function {self.name} raised {type(exc).__name__}: {exc}"
        culprit = self._first_failing_sample(prompts, responses, kwargs)
        if culprit is not None:
            head += (
                f"; first failing sample {culprit}: prompt {shorten(prompts[culprit])}, "
                f"response {shorten(responses[culprit])}"
            )
        return head + f". Columns passed: {sorted(kwargs)}. Fix the function."

    def _first_failing_sample(self, prompts, responses, kwargs) -> int | None:
        """Re-run the function one sample at a time to point at the input that breaks it.

        Only on the error path, and over the first ``RETRY_LIMIT`` samples so an expensive
        function (a sandbox, an API) is not re-run on a whole large batch. Returns None when
        no single sample fails (the function only fails on batches).
        """
        for i in range(min(len(responses), RETRY_LIMIT)):
            try:
                self._invoke(prompts[i : i + 1], responses[i : i + 1], _row(kwargs, i))
            except (Exception, SystemExit):
                return i
        return None

    # -- guarded: one sample per call ----------------------------------------------------

    def _score_each(self, prompts, responses, kwargs) -> torch.Tensor:
        calls = [
            partial(self.fn, prompts[i : i + 1], responses[i : i + 1], **_row(kwargs, i))
            for i in range(len(responses))
        ]
        outcomes = self._run(
            guarded.gather(calls, self.concurrency, self.timeout_s, on_loop=self.is_async)
        )
        with self._lock:
            self._calls += len(calls)
            self._timeouts += sum(o.timed_out for o in outcomes)
        scored = [self._score_of(o) for o in outcomes]
        failed = [(i, why) for i, (_, why) in enumerate(scored) if why is not None]
        if failed and self.on_error == "raise":
            i, why = failed[0]
            others = f"; {len(failed) - 1} other sample(s) failed too" if len(failed) > 1 else ""
            hint = "raise `timeout_s`" if why.startswith("timed out") else "fix the function"
            raise RewardError(
                f"reward function {self.name} failed on sample {i} of {len(responses)} (prompt "
                f"{shorten(prompts[i])}, response {shorten(responses[i])}): {why}{others}. "
                f"Columns passed: {sorted(kwargs)}. To go on, {hint}, or set `on_error` to "
                f"'fallback' (failed samples then score `fallback`={self.fallback})."
            )
        with self._lock:
            self.failures += len(failed)
            if failed:
                i, why = failed[0]
                self.last_error = f"sample {i} ({shorten(responses[i])}): {why}"
        values = [self.fallback if why is not None else value for value, why in scored]
        return torch.tensor(values, dtype=torch.float32)

    def _score_of(self, outcome: guarded.Outcome) -> tuple[float, str | None]:
        """(score, None) from one sample's call, or (nan, why it failed)."""
        if not outcome.ok:
            return math.nan, outcome.why(f"timeout_s={self.timeout_s} s")
        try:
            value = self._to_tensor(outcome.value, 1)[0].item()
        except RewardError as exc:  # its message starts with "reward function NAME "
            return math.nan, str(exc).removeprefix(f"reward function {self.name} ").rstrip(".")
        if not math.isfinite(value):
            return math.nan, f"returned the non-finite score {value}"
        return value, None

    def _to_tensor(self, raw: Any, batch: int) -> torch.Tensor:
        where = f"reward function {self.name}"
        if isinstance(raw, torch.Tensor):
            values = raw.detach().cpu()
        elif hasattr(raw, "__array__"):  # numpy arrays and the like
            try:
                values = torch.as_tensor(raw.__array__())
            except (TypeError, RuntimeError) as exc:
                raise RewardError(f"{where} returned an array torch cannot read ({exc}).") from exc
        elif isinstance(raw, Sequence) and not isinstance(raw, (str, bytes)):
            values = torch.tensor([_as_number(x, i, where) for i, x in enumerate(raw)])
        else:
            raise RewardError(
                f"{where} returned a {type(raw).__name__}; return a list of {batch} numbers."
            )
        if values.is_complex():
            raise RewardError(f"{where} returned complex values; return real numbers.")
        if values.dim() != 1 or values.shape[0] != batch:
            raise RewardError(
                f"{where} returned shape {tuple(values.shape)} for a batch of {batch} responses; "
                f"return one number per response (length {batch})."
            )
        return values.to(torch.float32)


def _as_number(x: Any, index: int, where: str) -> float:
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        x = x.item()
    elif hasattr(x, "item") and not isinstance(x, (str, bytes)):
        x = x.item()  # numpy scalars
    if isinstance(x, (bool, int, float)):
        return float(x)
    raise RewardError(
        f"{where} returned {x!r} ({type(x).__name__}) at index {index}; return real numbers."
    )


def _serve_loop(loop: asyncio.AbstractEventLoop) -> None:
    """The body of a source's loop thread: run until `close()` stops it, then close."""
    try:
        loop.run_forever()
    finally:
        loop.close()


def _row(kwargs: dict[str, list[Any]], i: int) -> dict[str, list[Any]]:
    """Sample i's columns, as lists of one."""
    return {k: v[i : i + 1] for k, v in kwargs.items()}


def _is_async(fn: Callable[..., Any]) -> bool:
    """``async def`` functions, and objects whose ``__call__`` is one."""
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


def _accepted_columns(fn: Callable[..., Any]) -> set[str] | None:
    """Names of the keyword columns ``fn`` takes, or None when it takes ``**kwargs``."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    # The first two parameters receive prompts and responses positionally.
    return {p.name for p in params[2:] if p.kind is not inspect.Parameter.VAR_POSITIONAL}
