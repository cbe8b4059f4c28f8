"""The agent endpoint's HTTP side (`rollout.endpoint.app`) with a stand-in policy
server: episode ids routed to the rollout that opened them, the API's JSON errors for an
unknown episode, an ended rollout's episode, a wrong method or path; its socket named TCP
so that its connections send without Nagle's delay."""

from __future__ import annotations

import socket
import threading

import pytest

pytest.importorskip("uvicorn")  # the `agent` extra
httpx = pytest.importorskip("httpx")

from proxima import asgi  # noqa: E402
from proxima.rollout.endpoint import app  # noqa: E402
from proxima.rollout.endpoint.schema import RequestError  # noqa: E402


class Echo:
    """Answers with the episode and route it was asked for, or refuses `refuse` bodies."""

    def answer(self, episode: int, route: str, body: dict) -> dict:
        if body.get("refuse"):
            raise RequestError(400, "refused as asked")
        return {"episode": episode, "route": route, "thread": threading.current_thread().name}


def test_requests_reach_the_rollout_that_opened_the_episode():
    endpoint = app.shared()
    assert app.shared() is endpoint  # one per process
    first, second = Echo(), Echo()
    a, b = endpoint.open(first), endpoint.open(second)
    url = f"http://127.0.0.1:{endpoint.port}/episode"
    with httpx.Client() as client:
        got = client.post(f"{url}/{b}/v1/chat/completions", json={}).json()
        assert got["episode"] == b and got["route"] == "chat/completions"
        assert got["thread"] != threading.current_thread().name  # a worker thread
        assert client.post(f"{url}/{a}/v1/completions", json={}).json()["route"] == "completions"
        refused = client.post(f"{url}/{a}/v1/completions", json={"refuse": True})
        assert refused.status_code == 400
        assert refused.json()["error"]["message"] == "Bad Request: refused as asked"
        models = client.get(f"{url}/{a}/v1/models").json()
        assert models["data"][0]["id"] == "policy"
        endpoint.close([a, b])
        late = client.post(f"{url}/{a}/v1/completions", json={})
        assert late.status_code == 410 and late.json()["error"]["code"] == "episode_ended"
        unknown = client.post(f"{url}/{endpoint.opened + 5}/v1/completions", json={})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found"
        wrong = client.get(f"{url}/{a}/v1/completions")
        assert wrong.status_code == 405 and wrong.json()["error"]["code"] == "method_not_allowed"
        assert client.get(f"http://127.0.0.1:{endpoint.port}/v1/models").status_code == 404


def test_listen_names_the_protocol():
    """asyncio sets TCP_NODELAY only on the connections of a socket whose protocol is
    IPPROTO_TCP: without it each reply's body waits for the client's delayed ACK."""
    sock = asgi.listen("127.0.0.1", 0)
    try:
        assert sock.proto == socket.IPPROTO_TCP
    finally:
        sock.close()
