"""The endpoint's HTTP side: one server per process (Starlette on uvicorn, `proxima.asgi`,
on a free port of 127.0.0.1), started at the first rollout that needs it and stopped at
exit, routing `/episode/<id>/v1/...` to the policy server that opened the episode.

Episode ids are unique in the process, so the server outlives each rollout: a request of an
episode whose rollout has ended (a late agent function keeps running in its thread) is
answered 410, as one that ended within the rollout is, rather than finding the port closed.
Each request is answered in a worker thread (`PolicyServer.answer` tokenizes and waits for
the dispatcher); the event loop only reads and writes."""

from __future__ import annotations

import atexit
import os
import threading

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from proxima import asgi
from proxima.rollout.endpoint import schema
from proxima.rollout.endpoint.schema import RequestError, episode_ended

# requests answered at once, each holding a worker thread while it waits for the engine:
# as many as the episodes' open calls (anyio's default of 40 would queue the calls of a
# wide rollout behind each other)
THREADS = 1024
# an agent's own work between two calls (a tool, a sandbox) may take minutes: its pooled
# connection is kept open that long, since the server closing it races the next request
KEEP_ALIVE_S = 3600


class EndpointHTTP:
    """The process's endpoint: hands out episode ids (`open`), routes their requests to the
    policy server that opened them, and forgets them when it closes (`close`)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.live: dict[int, object] = {}  # episode id -> its policy server
        self.opened = 0  # ids handed out so far
        self.limiter: anyio.CapacityLimiter | None = None
        self.served = asgi.Served(
            self._app(), asgi.listen("127.0.0.1", 0), "agent endpoint", KEEP_ALIVE_S
        )
        self.port = self.served.port

    def open(self, policy) -> int:
        with self.lock:
            self.live[self.opened] = policy
            self.opened += 1
            return self.opened - 1

    def close(self, ids) -> None:
        with self.lock:
            for i in ids:
                self.live.pop(i, None)

    def _app(self) -> Starlette:
        base = "/episode/{episode:int}/v1"
        return Starlette(
            routes=[
                Route(f"{base}/models", self._models, methods=["GET"]),
                Route(f"{base}/chat/completions", self._post, methods=["POST"]),
                Route(f"{base}/completions", self._post, methods=["POST"]),
            ],
            exception_handlers={HTTPException: self._no_route},
        )

    async def _models(self, request: Request) -> Response:
        return _json(200, schema.model_list())

    async def _post(self, request: Request) -> Response:
        episode = request.path_params["episode"]
        route = request.url.path.split("/v1/", 1)[1].rstrip("/")
        try:
            with self.lock:
                policy = self.live.get(episode)
                if policy is None:
                    raise episode_ended(episode) if episode < self.opened else _unknown(episode)
            body = schema.parse_body(await request.body())
            self.limiter = self.limiter or anyio.CapacityLimiter(THREADS)
            reply = await anyio.to_thread.run_sync(
                policy.answer, episode, route, body, limiter=self.limiter
            )
            return _json(200, reply)
        except RequestError as err:
            return _json(err.status, schema.error_body(err))
        except Exception as err:  # noqa: BLE001 - e.g. a chat template that raises
            refused = RequestError(400, f"the request failed: {type(err).__name__}: {err}")
            return _json(400, schema.error_body(refused))

    async def _no_route(self, request: Request, exc: HTTPException) -> Response:
        code = "not_found" if exc.status_code == 404 else "method_not_allowed"
        message = f"no route {request.method} {request.url.path}"
        return _json(
            exc.status_code, schema.error_body(RequestError(exc.status_code, message, code))
        )


def _unknown(episode: int) -> RequestError:
    return RequestError(404, f"no episode {episode} in this rollout", "not_found")


def _json(status: int, reply) -> Response:
    return Response(schema.encode(reply), status, media_type="application/json")


_shared: tuple[int, EndpointHTTP] | None = None  # (the process id, its endpoint)
_shared_lock = threading.Lock()


def shared() -> EndpointHTTP:
    """This process's endpoint, serving from its first call until exit. A process forked
    from one that served has no serving thread: it starts its own."""
    global _shared
    with _shared_lock:
        if _shared is None or _shared[0] != os.getpid():
            endpoint = EndpointHTTP()
            endpoint.served.start()
            atexit.register(endpoint.served.stop)
            _shared = (os.getpid(), endpoint)
        return _shared[1]
