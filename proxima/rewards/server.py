"""`proxima serve-reward file.py:fn`: any reward function served over HTTP.

Protocol (JSON in, JSON out, UTF-8):

``POST /score`` with ``{"prompts": [str, ...], "responses": [str, ...], "columns": {"answer":
[...], ...}}`` (``columns`` optional; every list as long as ``prompts``) answers
``{"scores": [float, ...]}``, one finite score per response, in order.

``GET /health`` answers ``{"ok": true, "function": "file.py:fn"}``.

Errors answer ``{"error": "..."}`` naming the cause: 400 for a request that is not what the
protocol says (not JSON, a missing or mistyped field, lists of different lengths), 404 for
another path, 405 for another method, 411 without a Content-Length, 500 when the function
raises or returns unusable scores (the message is :class:`FunctionReward`'s: the exception,
the first failing sample's prompt and response). A client retries 5xx, never 4xx.

The server is a Starlette app on uvicorn (:mod:`proxima.asgi`). The function is called by
:class:`FunctionReward` (so an ``async def`` function works, and scores are checked as in
training) on a worker thread, for up to ``workers`` requests at once: with ``workers > 1``
the function must be thread-safe. Requests beyond ``workers`` wait for a free worker.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from proxima import asgi
from proxima.rewards.function import FunctionReward, RewardError

MAX_BODY = 256 * 1024 * 1024  # bytes of one request, a guard against a wrong Content-Length
BACKLOG = 128  # connections waiting to be accepted


class RewardServer:
    """``source`` served over HTTP (Starlette on uvicorn, :mod:`proxima.asgi`), scoring on
    up to ``workers`` threads at once. Binds at construction (port 0: a free one,
    ``server.url`` says which; OSError when it cannot); ``serve()`` serves in this thread
    until Ctrl-C or SIGTERM, or ``start()`` in a thread until ``stop()``."""

    def __init__(
        self, source: FunctionReward, host: str = "127.0.0.1", port: int = 8000, workers: int = 4
    ) -> None:
        if workers < 1:
            raise ValueError(f"--workers {workers}: give at least 1 worker thread.")
        self.source = source
        self.workers = workers
        self.limiter: anyio.CapacityLimiter | None = None  # made in the event loop
        self.sock = asgi.listen(host, port, BACKLOG)
        self.app = Starlette(
            routes=[Route("/{path:path}", self._route, methods=["GET", "POST"])],
            exception_handlers={HTTPException: self._refused_method},
        )
        self.served = asgi.Served(self.app, self.sock, "reward server")

    @property
    def url(self) -> str:
        host, port = self.sock.getsockname()[:2]
        host = "127.0.0.1" if host in ("0.0.0.0", "") else host
        return f"http://{host}:{port}"

    def serve(self) -> None:
        asgi.serve_until_stopped(self.app, self.sock)

    def start(self) -> None:
        self.served.start()

    def stop(self) -> None:
        self.served.stop()

    async def _route(self, request: Request) -> Response:
        path = request.url.path.rstrip("/")
        if request.method == "GET" and path == "/health":
            return self._answer(request, 200, {"ok": True, "function": self.source.name})
        if request.method == "GET" and path == "/score":
            return self._answer(request, 405, {"error": "/score takes POST with a JSON body"})
        if path != "/score":
            return self._answer(
                request, 404, {"error": f"no {_target(request)}; POST /score or GET /health"}
            )
        return await self._score(request)

    async def _score(self, request: Request) -> Response:
        """``POST /score``: the body checked, then scored on a worker thread."""
        length = request.headers.get("content-length")
        if length is None or not length.isdigit():
            error = "send a Content-Length header with the JSON body"
            return self._answer(request, 411, {"error": error})
        if int(length) > MAX_BODY:
            error = f"body of {length} bytes; send at most {MAX_BODY}"
            return self._answer(request, 413, {"error": error})
        try:
            payload = json.loads(await request.body())
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            return self._answer(request, 400, {"error": f"the body is not JSON ({exc})"})
        try:
            prompts, responses, columns = parse_request(payload)
        except ValueError as exc:
            return self._answer(request, 400, {"error": str(exc)})
        self.limiter = self.limiter or anyio.CapacityLimiter(self.workers)
        try:
            scores = await anyio.to_thread.run_sync(
                self.source, prompts, responses, columns, limiter=self.limiter
            )
        except RewardError as exc:
            return self._answer(request, 500, {"error": str(exc)})
        except Exception as exc:  # a bug of the server's own: still an answer, not a hang-up
            return self._answer(request, 500, {"error": f"{type(exc).__name__}: {exc}"})
        return self._answer(request, 200, {"scores": scores.tolist()})

    async def _refused_method(self, request: Request, exc: HTTPException) -> Response:
        error = f"{request.method} is not served; POST /score or GET /health"
        return self._answer(request, exc.status_code, {"error": error})

    def _answer(self, request: Request, status: int, payload: dict[str, Any]) -> Response:
        """The JSON answer; an error is also printed, one line (the server is quiet per
        request otherwise)."""
        if status >= 400:
            client = request.client.host if request.client else "?"
            print(
                f"{request.method} {_target(request)} from {client} -> {status}: "
                f"{payload.get('error')}",
                file=sys.stderr,
                flush=True,
            )
        return JSONResponse(payload, status)


def _target(request: Request) -> str:
    """The request's path and query, as the client wrote them."""
    query = request.url.query
    return request.url.path + (f"?{query}" if query else "")


def parse_request(payload: Any) -> tuple[list[str], list[str], dict[str, list[Any]]]:
    """prompts, responses, columns of a ``POST /score`` body; ValueError naming what is wrong."""
    if not isinstance(payload, dict):
        raise ValueError(
            f"the body is a JSON {type(payload).__name__}; send an object "
            '{"prompts": [...], "responses": [...], "columns": {...}}'
        )
    for key in ("prompts", "responses"):
        if key not in payload:
            raise ValueError(f'missing field "{key}" (a list of strings)')
        value = payload[key]
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            raise ValueError(f'field "{key}" must be a list of strings')
    prompts, responses = payload["prompts"], payload["responses"]
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    columns = payload.get("columns") or {}
    if not isinstance(columns, dict):
        raise ValueError('field "columns" must be an object of lists')
    for key, value in columns.items():
        if not isinstance(value, list) or len(value) != len(prompts):
            got = f"{len(value)} entries" if isinstance(value, list) else type(value).__name__
            raise ValueError(
                f'column "{key}" must be a list of {len(prompts)} entries (one per prompt), '
                f"got {got}"
            )
    unknown = sorted(set(payload) - {"prompts", "responses", "columns"})
    if unknown:
        raise ValueError(f'unknown fields {unknown}; dataset columns go under "columns"')
    return prompts, responses, columns


def serve(spec: str, host: str = "127.0.0.1", port: int = 8000, workers: int = 4) -> None:
    """Load the function of ``spec``, serve it until Ctrl-C (or SIGTERM), then stop cleanly."""
    source = FunctionReward.from_spec(spec)
    try:
        server = RewardServer(source, host, port, workers)
    except OSError as exc:
        raise OSError(
            f"cannot listen on {host}:{port} ({exc.strerror or exc}); choose another --port "
            "(or --host)"
        ) from exc
    print(
        f"serving {spec} at {server.url} (POST /score, GET /health; {workers} workers); "
        "Ctrl-C stops",
        flush=True,
    )
    try:
        server.serve()
    except KeyboardInterrupt:  # uvicorn stopped gracefully, then raised the signal again
        print("stopped", flush=True)
    finally:
        source.close()
