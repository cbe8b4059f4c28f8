"""A reward source that asks a reward server over HTTP (`proxima serve-reward`, or any server
speaking its protocol: see :mod:`proxima.rewards.server`).

``RemoteReward(url, name=..., batch_size=64, concurrency=4, timeout_s=30.0, retries=2,
backoff_s=0.5, on_error="raise", fallback=0.0)``:

- the batch is split into requests of ``batch_size`` samples, up to ``concurrency`` of them
  in flight at once (:mod:`proxima.guarded`: a thread and a connection each);
- each request may wait ``timeout_s`` seconds for the server (to connect, and for each read
  of its answer);
- a request that finds no server, times out, loses its connection or gets an HTTP 5xx is
  sent again, up to ``retries`` more times, after ``backoff_s``, then 2x, 4x ... that
  (exponential back-off); a 4xx (the request itself is wrong) and an answer that is not
  ``{"scores": [one finite number per response]}`` are not retried;
- a request that still fails, and a non-finite score, either stop the run with a
  :class:`RewardError` naming the failure (``on_error="raise"``), or give the samples
  concerned the ``fallback`` score (``on_error="fallback"``): they are counted in
  ``failures`` and ``pop_stats()``, and the last failure's message is kept in ``last_error``.

``check()`` asks ``GET /health`` once, with a short timeout: call it at start-up, before any
model loads, so that a server that is not running is named at once.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from dataclasses import dataclass
from functools import partial
from typing import Any
from urllib.parse import urlsplit

import torch

from proxima.guarded import run_all
from proxima.rewards.function import RewardError, check_options, shorten

HEALTH_TIMEOUT_S = 5.0  # check()'s wait at most (less when timeout_s is less)


@dataclass
class _Answer:
    """One request's outcome: ``scores`` (non-finite ones kept as they came) or ``error``,
    after ``attempts`` tries."""

    start: int
    stop: int
    scores: list[float] | None = None
    error: str | None = None
    attempts: int = 0


class _Failure(Exception):
    """One attempt failed: ``message`` says how, ``retry`` whether another may succeed."""

    def __init__(self, message: str, retry: bool) -> None:
        super().__init__(message)
        self.message, self.retry = message, retry


class RemoteReward:
    """Reward source scoring through a reward server's ``POST /score``; see the module
    docstring. Its options are the keys of a ``reward.sources`` entry."""

    def __init__(
        self,
        url: str,
        *,
        name: str | None = None,
        batch_size: int = 64,
        concurrency: int = 4,
        timeout_s: float = 30.0,
        retries: int = 2,
        backoff_s: float = 0.5,
        on_error: str = "raise",
        fallback: float = 0.0,
    ) -> None:
        self.url = _base_url(url)
        self.name = name or self.url
        self._where = (
            f"reward source {self.name} ({self.url})"
            if self.name != self.url
            else f"reward server {self.url}"
        )
        check_options(
            self._where,
            batch_size=batch_size,
            concurrency=concurrency,
            timeout_s=timeout_s,
            retries=retries,
            backoff_s=backoff_s,
            on_error=on_error,
            fallback=fallback,
        )
        self.batch_size, self.concurrency = batch_size, concurrency
        self.timeout_s, self.retries, self.backoff_s = float(timeout_s), retries, float(backoff_s)
        self.on_error, self.fallback = on_error, float(fallback)
        parts = urlsplit(self.url)
        self._https = parts.scheme == "https"
        self._host, self._port, self._path = parts.hostname, parts.port, parts.path
        self.failures = 0  # samples scored `fallback` since the last pop_stats()
        self.last_error: str | None = None  # the last failure's message (fallback mode)
        self._requests = self._retried = 0
        self._seconds = 0.0
        self._lock = threading.Lock()

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
            return self._score(list(prompts), list(responses), dict(columns or {}))
        finally:
            with self._lock:
                self._seconds += time.perf_counter() - start

    def check(self) -> dict[str, Any]:
        """``GET /health`` once, waiting at most ``min(timeout_s, 5)`` s; the server's answer,
        or a RewardError naming why there is no usable server at ``url``."""
        timeout = min(self.timeout_s, HEALTH_TIMEOUT_S)
        try:
            status, body = self._exchange("GET", "/health", None, timeout)
        except _Failure as failure:
            fix = (
                f"is the server at {self.url} stuck or overloaded?"
                if failure.message.startswith("timed out")
                else f"is `proxima serve-reward` running at {self.url}?"
            )
            raise RewardError(f"{self._where}: GET /health: {failure.message}; {fix}") from None
        try:
            answer = json.loads(body)
        except ValueError:
            answer = None
        if status != 200 or not isinstance(answer, dict) or answer.get("ok") is not True:
            raise RewardError(
                f"{self._where}: GET /health answered HTTP {status} {_text(body)}, not "
                f'{{"ok": true, ...}}; is {self.url} a `proxima serve-reward` server?'
            )
        return answer

    def pop_stats(self) -> dict[str, float]:
        """Counts since the last call, then reset: ``fallback_samples`` (samples scored
        ``fallback``), ``requests`` (HTTP requests sent, retries included), ``retries``,
        ``seconds`` (time spent scoring)."""
        with self._lock:
            stats = {
                "fallback_samples": float(self.failures),
                "requests": float(self._requests),
                "retries": float(self._retried),
                "seconds": self._seconds,
            }
            self.failures = self._requests = self._retried = 0
            self._seconds = 0.0
        return stats

    # -- one batch -------------------------------------------------------------------------

    def _score(self, prompts, responses, columns) -> torch.Tensor:
        n = len(responses)
        if len(prompts) != n:
            raise RewardError(f"{self._where}: {len(prompts)} prompts but {n} responses.")
        if n == 0:
            return torch.zeros(0, dtype=torch.float32)
        spans = [(a, min(a + self.batch_size, n)) for a in range(0, n, self.batch_size)]
        bodies = [self._body(prompts, responses, columns, a, b) for a, b in spans]
        requests = [
            partial(self._request, a, b, body, n)
            for (a, b), body in zip(spans, bodies, strict=True)
        ]
        # on_error="raise": a request that fails raises, and those not sent yet are not sent
        outcomes = run_all(requests, self.concurrency, fail_fast=self.on_error == "raise")
        scores = torch.full((n,), self.fallback, dtype=torch.float64)
        fell_back = 0
        for outcome in outcomes:
            if outcome.skipped:  # not sent: an earlier request failed (and was raised)
                continue
            if outcome.error is not None:
                raise outcome.error
            answer = outcome.value
            if answer.error is not None:
                self.last_error = self._part(answer, n) + answer.error
                fell_back += answer.stop - answer.start
                continue
            values = torch.tensor(answer.scores, dtype=torch.float64)
            bad = (~torch.isfinite(values)).nonzero().flatten().tolist()
            if bad and self.on_error == "raise":
                first = answer.start + bad[0]
                where = [answer.start + i for i in bad]
                more = " ..." if len(where) > 10 else ""
                raise RewardError(
                    f"{self._where}: the server returned non-finite scores at indices "
                    f"{where[:10]}{more} (first: {values[bad[0]].item()} for prompt "
                    f"{shorten(prompts[first])}, response {shorten(responses[first])}); the "
                    "reward function must return finite numbers for every response."
                )
            if bad:
                self.last_error = f"{self._where}: {len(bad)} non-finite score(s)"
                values[bad] = self.fallback
                fell_back += len(bad)
            scores[answer.start : answer.stop] = values
        with self._lock:
            self.failures += fell_back
        return scores.to(torch.float32)

    def _part(self, answer: _Answer, n: int) -> str:
        if answer.stop - answer.start == n:
            return f"{self._where}: "
        return f"{self._where}, request for samples {answer.start}-{answer.stop - 1} of {n}: "

    def _body(self, prompts, responses, columns, a: int, b: int) -> bytes:
        payload = {
            "prompts": prompts[a:b],
            "responses": responses[a:b],
            "columns": {k: list(v[a:b]) for k, v in columns.items()},
        }
        try:
            return json.dumps(payload, default=_plain).encode()
        except (TypeError, ValueError) as exc:
            raise RewardError(
                f"{self._where}: the batch cannot be sent as JSON ({exc}); the dataset's "
                f"columns ({sorted(columns)}) must hold strings, numbers, lists or objects."
            ) from exc

    # -- one request -----------------------------------------------------------------------

    def _request(self, start: int, stop: int, body: bytes, n: int) -> _Answer:
        """POST samples start..stop-1 of a batch of n, retrying what may succeed on another
        try; a request that still fails raises its RewardError with on_error="raise"."""
        answer = _Answer(start, stop)
        while True:
            answer.attempts += 1
            with self._lock:
                self._requests += 1
                self._retried += answer.attempts > 1
            try:
                status, data = self._exchange("POST", "/score", body, self.timeout_s)
                answer.scores = self._read(status, data, stop - start)
                return answer
            except _Failure as failure:
                if not failure.retry or answer.attempts > self.retries:
                    tries = (
                        f" ({answer.attempts} attempts: 1 + retries={self.retries})"
                        if failure.retry
                        else ""
                    )
                    answer.error = f"POST /score: {failure.message}{tries}{self._fix(failure)}"
                    if self.on_error == "raise":
                        raise RewardError(self._part(answer, n) + answer.error) from None
                    return answer
            time.sleep(self.backoff_s * 2 ** (answer.attempts - 1))

    def _fix(self, failure: _Failure) -> str:
        if failure.message.startswith("timed out"):
            return (
                f"; raise this source's `timeout_s` (now {self.timeout_s}) or `retries`, or "
                f"lower its `batch_size` (now {self.batch_size}) so that each request takes "
                "less time."
            )
        if failure.retry and not failure.message.startswith("HTTP"):
            return f"; is `proxima serve-reward` running at {self.url}?"
        return "."

    def _exchange(
        self, method: str, path: str, body: bytes | None, timeout: float
    ) -> tuple[int, bytes]:
        """One HTTP request on a new connection: (status, body), or a _Failure."""
        kind = http.client.HTTPSConnection if self._https else http.client.HTTPConnection
        conn = kind(self._host, self._port, timeout=timeout)
        try:
            headers = {"Content-Type": "application/json"} if body is not None else {}
            conn.request(method, self._path + path, body=body, headers=headers)
            response = conn.getresponse()
            data = response.read()
        except ConnectionRefusedError:
            raise _Failure("connection refused: nothing listens there", retry=True) from None
        except TimeoutError:
            raise _Failure(f"timed out: no answer within {timeout} s", retry=True) from None
        except socket.gaierror as exc:
            raise _Failure(f"cannot resolve host {self._host!r} ({exc})", retry=True) from None
        except (OSError, http.client.HTTPException) as exc:
            raise _Failure(
                f"the connection failed ({type(exc).__name__}: {exc})", retry=True
            ) from None
        finally:
            conn.close()
        return response.status, data

    def _read(self, status: int, data: bytes, n: int) -> list[float]:
        """The scores of a POST /score answer, or a _Failure saying what is wrong with it."""
        if status != 200:
            reason = _error_text(data)
            if status >= 500:
                raise _Failure(f"HTTP {status}: {reason}", retry=True)
            hint = (
                f" (is {self.url} a `proxima serve-reward` server? it answers POST /score)"
                if status in (404, 405)
                else ""
            )
            raise _Failure(
                f"rejected with HTTP {status} (not retried): {reason}{hint}", retry=False
            )
        expected = f'a reward server answers {{"scores": [{n} numbers]}}'
        try:
            answer = json.loads(data)
        except ValueError:
            raise _Failure(
                f"the answer is not JSON: {_text(data)}; {expected}", retry=False
            ) from None
        if not isinstance(answer, dict) or not isinstance(answer.get("scores"), list):
            got = sorted(answer) if isinstance(answer, dict) else type(answer).__name__
            raise _Failure(f'the answer has no "scores" list (got {got}); {expected}', retry=False)
        scores = answer["scores"]
        for i, x in enumerate(scores):
            if isinstance(x, str) or not isinstance(x, (bool, int, float)):
                raise _Failure(
                    f'"scores"[{i}] is {shorten(x, 100)} ({type(x).__name__}), not a number; '
                    f"{expected}",
                    retry=False,
                )
        if len(scores) != n:
            raise _Failure(
                f"the answer has {len(scores)} scores for {n} responses; the server must "
                "return one score per response, in order",
                retry=False,
            )
        return [float(x) for x in scores]


def _base_url(url: str) -> str:
    """``http(s)://host:port[/prefix]``, without a trailing slash or ``/score``."""
    base = str(url).strip().rstrip("/")
    for tail in ("/score", "/health"):
        base = base.removesuffix(tail)
    parts = urlsplit(base)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(
            f"reward server url {url!r} is not an http(s) address; give e.g. "
            "'http://127.0.0.1:8000' (where `proxima serve-reward` listens)."
        )
    try:
        parts.port  # noqa: B018 - a port that is not a number raises here
    except ValueError as exc:
        raise ValueError(f"reward server url {url!r}: {exc}.") from None
    return base


def _error_text(data: bytes) -> str:
    """The ``error`` of a JSON error answer, else the start of the body."""
    try:
        answer = json.loads(data)
    except ValueError:
        answer = None
    if isinstance(answer, dict) and "error" in answer:
        return str(answer["error"])
    return _text(data)


def _plain(value: Any) -> Any:
    """numpy / torch values as JSON's: their numbers or lists."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"a {type(value).__name__} is not JSON")


def _text(data: bytes) -> str:
    return shorten(data.decode("utf-8", errors="replace"), 200)
