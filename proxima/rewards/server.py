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

The function is called by :class:`FunctionReward` (so an ``async def`` function works, and
scores are checked as in training), on up to ``workers`` requests at once, each in a thread
of a fixed pool: with ``workers > 1`` the function must be thread-safe. Requests beyond
``workers`` wait in the listen queue.
"""

from __future__ import annotations

import json
import sys
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any

from proxima.rewards.function import FunctionReward, RewardError

MAX_BODY = 256 * 1024 * 1024  # bytes of one request, a guard against a wrong Content-Length


class RewardServer(HTTPServer):
    """An HTTP server scoring with ``source`` on a pool of ``workers`` threads. Bind with
    port 0 for a free port (``server.url`` says which); ``serve_forever()`` serves,
    ``shutdown()`` (from another thread) and ``server_close()`` stop."""

    request_queue_size = 128  # connections waiting for a worker

    def __init__(
        self, source: FunctionReward, host: str = "127.0.0.1", port: int = 8000, workers: int = 4
    ) -> None:
        if workers < 1:
            raise ValueError(f"--workers {workers}: give at least 1 worker thread.")
        self.source = source
        self.workers = workers
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="reward-worker")
        super().__init__((host, port), _Handler)  # binds: server_close() on failure

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        host = "127.0.0.1" if host in ("0.0.0.0", "") else host
        return f"http://{host}:{port}"

    def process_request(self, request, client_address) -> None:
        self._pool.submit(self._work, request, client_address)

    def _work(self, request, client_address) -> None:
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self.shutdown_request(request)

    def handle_error(self, request, client_address) -> None:
        """A client that hung up (it timed out) is one line, not a traceback."""
        error = sys.exc_info()[1]
        if isinstance(error, ConnectionError):
            print(f"client {client_address[0]} went away: {error}", file=sys.stderr, flush=True)
        else:
            super().handle_error(request, client_address)

    def server_close(self) -> None:
        super().server_close()
        self._pool.shutdown(wait=False, cancel_futures=True)


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


class _Handler(BaseHTTPRequestHandler):
    server: RewardServer
    server_version = "proxima-reward/1"

    def do_GET(self) -> None:
        if self.path.split("?")[0].rstrip("/") == "/health":
            self._answer(200, {"ok": True, "function": self.server.source.name})
        elif self.path.split("?")[0].rstrip("/") == "/score":
            self._answer(405, {"error": "/score takes POST with a JSON body"})
        else:
            self._answer(404, {"error": f"no {self.path}; POST /score or GET /health"})

    def do_POST(self) -> None:
        if self.path.split("?")[0].rstrip("/") != "/score":
            self._answer(404, {"error": f"no {self.path}; POST /score or GET /health"})
            return
        length = self.headers.get("Content-Length")
        if length is None or not length.isdigit():
            self._answer(411, {"error": "send a Content-Length header with the JSON body"})
            return
        if int(length) > MAX_BODY:
            self._answer(413, {"error": f"body of {length} bytes; send at most {MAX_BODY}"})
            return
        body = self.rfile.read(int(length))
        try:
            payload = json.loads(body)
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError
            self._answer(400, {"error": f"the body is not JSON ({exc})"})
            return
        try:
            prompts, responses, columns = parse_request(payload)
        except ValueError as exc:
            self._answer(400, {"error": str(exc)})
            return
        try:
            scores = self.server.source(prompts, responses, columns)
        except RewardError as exc:
            self._answer(500, {"error": str(exc)})
            return
        except Exception as exc:  # a bug of the server's own: still an answer, not a hang-up
            self._answer(500, {"error": f"{type(exc).__name__}: {exc}"})
            return
        self._answer(200, {"scores": scores.tolist()})

    def _answer(self, status: int, payload: dict[str, Any]) -> None:
        body = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
        if status >= 400:
            print(
                f"{self.command} {self.path} from {self.client_address[0]} -> {status}: "
                f"{payload.get('error')}",
                file=sys.stderr,
                flush=True,
            )

    def log_message(self, format: str, *args: Any) -> None:
        """Quiet per request: the errors are printed by `_answer`."""


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
        server.serve_forever()
    except KeyboardInterrupt:
        print("stopped", flush=True)
    finally:
        server.server_close()
        source.close()
