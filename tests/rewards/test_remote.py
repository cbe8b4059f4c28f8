"""The reward server and its client, for real on localhost: a served function scores like a
direct call, and every failure (down, slow, garbage, 5xx) is named or falls back, counted."""

from __future__ import annotations

import contextlib
import http.client
import json
import math
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch

from proxima.rewards import FunctionReward, RemoteReward, RewardError
from proxima.rewards.server import RewardServer, serve

ROOT = Path(__file__).resolve().parents[2]
PROMPTS = [f"{i}+{i}=" for i in range(8)]
RESPONSES = [str(2 * i if i % 3 else i) for i in range(8)]
COLUMNS = {"answer": [str(2 * i) for i in range(8)], "weight": [0.5 + i for i in range(8)]}


def exact(prompts, responses, answer, weight):
    return [w * float(r == a) for r, a, w in zip(responses, answer, weight, strict=True)]


@contextlib.contextmanager
def running(server):
    """Serve in a thread for the block; the server's URL."""
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        host, port = server.server_address[:2]
        yield f"http://{host}:{port}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


@contextlib.contextmanager
def reward_server(fn, workers=4):
    with running(RewardServer(FunctionReward(fn, "exact"), "127.0.0.1", 0, workers)) as url:
        yield url


class _Quiet(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):  # clients that time out hang up
        pass


@contextlib.contextmanager
def fake_server(answer):
    """A server whose every request is answered by `answer(handler, request_number, body)
    -> (status, body bytes)`."""
    count = {"n": 0}
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def _reply(self):
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            with lock:
                count["n"] += 1
                n = count["n"]
            status, data = answer(self, n, body)
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _reply

        def log_message(self, *args):
            pass

    with running(_Quiet(("127.0.0.1", 0), Handler)) as url:
        yield url, count


def dead_url() -> str:
    """An address nothing listens on: a port the OS just handed out and took back."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def score(source):
    return source(PROMPTS, RESPONSES, COLUMNS)


def post(url, body: bytes, path="/score"):
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
    response = conn.getresponse()
    status, data = response.status, json.loads(response.read())
    conn.close()
    return status, data


def test_served_function_scores_like_a_direct_call():
    direct = score(FunctionReward(exact, "exact"))
    assert direct.tolist() == [0.5, 1.5, 2.5, 0.0, 4.5, 5.5, 0.0, 7.5]  # sanity
    with reward_server(exact) as url:
        remote = RemoteReward(url, name="judge", batch_size=3, concurrency=2)
        assert remote.check() == {"ok": True, "function": "exact"}
        scores = score(remote)
        assert scores.dtype == torch.float32 and torch.equal(scores, direct)
        stats = remote.pop_stats()
        assert stats["requests"] == 3 and stats["retries"] == 0  # 8 samples in 3s
        assert stats["fallback_samples"] == 0 and stats["seconds"] > 0
        assert remote.pop_stats()["requests"] == 0  # reset
        assert remote(PROMPTS[:0], RESPONSES[:0], {"answer": []}).shape == (0,)


def test_server_names_bad_requests_and_function_failures():
    def picky(prompts, responses, **kw):
        return [float(r) if r != "2" else int("x") for r in responses]

    with reward_server(picky) as url:
        status, data = post(url, b"{not json")
        assert status == 400 and data["error"].startswith("the body is not JSON")
        status, data = post(url, json.dumps({"prompts": ["a"]}).encode())
        assert (status, data) == (400, {"error": 'missing field "responses" (a list of strings)'})
        body = {"prompts": ["a", "b"], "responses": ["1"]}
        assert post(url, json.dumps(body).encode())[1] == {"error": "2 prompts but 1 responses"}
        body = {"prompts": ["a"], "responses": ["1"], "columns": {"answer": ["1", "2"]}}
        error = post(url, json.dumps(body).encode())[1]["error"]
        assert (
            error == 'column "answer" must be a list of 1 entries (one per prompt), got 2 entries'
        )
        assert post(url, b"{}", path="/other")[0] == 404
        # the function raising: 500, with the function's message and the failing sample
        body = {"prompts": ["p0", "p1", "p2"], "responses": ["1", "2", "3"], "columns": {}}
        status, data = post(url, json.dumps(body).encode())
        assert status == 500
        assert "raised ValueError: invalid literal for int() with base 10: 'x'" in data["error"]
        assert "first failing sample 1: prompt 'p1', response '2'" in data["error"]
        # ... which the client passes on, after retrying (5xx), naming the attempts
        remote = RemoteReward(url, retries=1, backoff_s=0.01)
        with pytest.raises(RewardError) as err:
            remote(["p0", "p1"], ["1", "2"], {})
        msg = str(err.value)
        assert msg.startswith(f"reward server {url}: POST /score: HTTP 500: reward function exact")
        assert "first failing sample 1: prompt 'p1', response '2'" in msg
        assert "(2 attempts: 1 + retries=1)" in msg
        assert remote.pop_stats()["retries"] == 1


def test_dead_server_is_named_by_check_and_by_a_call():
    url = dead_url()
    remote = RemoteReward(url, name="judge", retries=1, backoff_s=0.01)
    with pytest.raises(RewardError) as err:
        remote.check()
    assert str(err.value) == (
        f"reward source judge ({url}): GET /health: connection refused: nothing listens there; "
        f"is `proxima serve-reward` running at {url}?"
    )
    with pytest.raises(RewardError) as err:
        score(remote)
    assert str(err.value) == (
        f"reward source judge ({url}): POST /score: connection refused: nothing listens there "
        f"(2 attempts: 1 + retries=1); is `proxima serve-reward` running at {url}?"
    )
    fallback = RemoteReward(url, retries=0, on_error="fallback", fallback=-1.0)
    assert score(fallback).tolist() == [-1.0] * 8
    assert fallback.failures == 8 and "connection refused" in fallback.last_error
    assert fallback.pop_stats()["fallback_samples"] == 8 and fallback.failures == 0


def test_slow_server_times_out_with_the_timeout_and_retries_named():
    def slow(handler, n, body):
        time.sleep(1.0)
        return 200, json.dumps({"scores": [1.0] * len(body["prompts"])}).encode()

    with fake_server(slow) as (url, count):
        remote = RemoteReward(url, timeout_s=0.2, retries=1, backoff_s=0.01, batch_size=64)
        start = time.perf_counter()
        with pytest.raises(RewardError) as err:
            score(remote)
        assert time.perf_counter() - start < 0.9  # 2 x 0.2 s, not the server's 1 s
        assert str(err.value) == (
            f"reward server {url}: POST /score: timed out: no answer within 0.2 s (2 attempts: "
            "1 + retries=1); raise this source's `timeout_s` (now 0.2) or `retries`, or lower "
            "its `batch_size` (now 64) so that each request takes less time."
        )
        # with a fallback: every sample of the timed-out requests, counted
        remote = RemoteReward(url, timeout_s=0.2, retries=0, batch_size=4, on_error="fallback")
        assert score(remote).tolist() == [0.0] * 8
        stats = remote.pop_stats()
        assert (stats["fallback_samples"], stats["requests"], stats["retries"]) == (8, 2, 0)
        assert 0.2 <= stats["seconds"] < 0.9  # the 2 requests at once: one timeout_s


@pytest.mark.parametrize(
    ("reply", "message"),
    [
        (
            b"<html>oops</html>",
            "the answer is not JSON: '<html>oops</html>'; a reward server answers "
            '{"scores": [8 numbers]}',
        ),
        (
            b'{"score": [1, 2]}',
            "the answer has no \"scores\" list (got ['score']); a reward server answers "
            '{"scores": [8 numbers]}',
        ),
        (
            b'{"scores": [1, "high", 0, 0, 0, 0, 0, 0]}',
            "\"scores\"[1] is 'high' (str), not a number; a reward server answers "
            '{"scores": [8 numbers]}',
        ),
        (
            b'{"scores": [1, 2, 3]}',
            "the answer has 3 scores for 8 responses; the server must return one score per "
            "response, in order",
        ),
    ],
)
def test_garbage_answers_are_named_and_not_retried(reply, message):
    with fake_server(lambda h, n, body: (200, reply)) as (url, count):
        with pytest.raises(RewardError) as err:
            score(RemoteReward(url, retries=2, backoff_s=0.01))
        assert str(err.value) == f"reward server {url}: POST /score: {message}."
        assert count["n"] == 1
        fallback = RemoteReward(url, on_error="fallback", fallback=0.25)
        assert score(fallback).tolist() == [0.25] * 8 and fallback.failures == 8


def test_non_finite_scores_are_named_or_only_those_samples_fall_back():
    reply = b'{"scores": [1, NaN, 0, 0, Infinity, 0, 0, 0]}'  # what Python's json writes
    with fake_server(lambda h, n, body: (200, reply)) as (url, _):
        with pytest.raises(RewardError) as err:
            score(RemoteReward(url, name="judge"))
        assert str(err.value) == (
            f"reward source judge ({url}): the server returned non-finite scores at indices "
            "[1, 4] (first: nan for prompt '1+1=', response '2'); the reward function must "
            "return finite numbers for every response."
        )
        remote = RemoteReward(url, on_error="fallback", fallback=-1.0)
        assert score(remote).tolist() == [1, -1, 0, 0, -1, 0, 0, 0]
        assert remote.pop_stats()["fallback_samples"] == 2


def test_5xx_is_retried_and_4xx_is_not():
    def flaky(handler, n, body):
        if n == 1:
            return 503, b'{"error": "warming up"}'
        return 200, json.dumps({"scores": [float(len(r)) for r in body["responses"]]}).encode()

    with fake_server(flaky) as (url, count):
        remote = RemoteReward(url, retries=2, backoff_s=0.01)
        assert score(remote).tolist() == [float(len(r)) for r in RESPONSES]
        assert count["n"] == 2
        stats = remote.pop_stats()
        assert stats["requests"] == 2 and stats["retries"] == 1

    with fake_server(lambda h, n, body: (422, b'{"error": "no such column"}')) as (url, count):
        with pytest.raises(RewardError) as err:
            score(RemoteReward(url, retries=2, backoff_s=0.01))
        assert str(err.value) == (
            f"reward server {url}: POST /score: rejected with HTTP 422 (not retried): no such "
            "column."
        )
        assert count["n"] == 1

    with fake_server(lambda h, n, body: (503, b"busy")) as (url, count):
        start = time.perf_counter()
        with pytest.raises(RewardError, match=r"HTTP 503: 'busy' \(3 attempts: 1 \+ retries=2\)"):
            score(RemoteReward(url, retries=2, backoff_s=0.05))
        assert count["n"] == 3
        assert time.perf_counter() - start >= 0.05 + 0.1  # back-off: 0.05 s, then 0.1 s


def test_requests_overlap_up_to_concurrency():
    def slow(handler, n, body):
        time.sleep(0.2)
        return 200, json.dumps({"scores": [0.0] * len(body["prompts"])}).encode()

    with fake_server(slow) as (url, count):
        remote = RemoteReward(url, batch_size=2, concurrency=4)  # 8 samples: 4 requests
        start = time.perf_counter()
        score(remote)
        together = time.perf_counter() - start
        remote = RemoteReward(url, batch_size=2, concurrency=1)
        start = time.perf_counter()
        score(remote)
        one_by_one = time.perf_counter() - start
    assert count["n"] == 8
    assert one_by_one >= 0.8
    assert together < 0.55, f"4 requests of 0.2 s at concurrency 4 took {together:.2f} s"


def test_server_workers_score_requests_at_once():
    def sleepy(prompts, responses, **kw):
        time.sleep(0.2)
        return [1.0] * len(responses)

    for workers, low, high in ((4, 0.2, 0.55), (1, 0.8, 5.0)):
        with reward_server(sleepy, workers=workers) as url:
            start = time.perf_counter()
            score(RemoteReward(url, batch_size=2, concurrency=4))
            took = time.perf_counter() - start
        assert low <= took < high, f"--workers {workers}: 4 requests took {took:.2f} s"


def test_options_and_url_are_checked():
    with pytest.raises(ValueError, match="is not an http"):
        RemoteReward("127.0.0.1:8000")
    with pytest.raises(ValueError, match=r"`on_error`='ignore' must be one of \['raise', "):
        RemoteReward("http://127.0.0.1:8000", on_error="ignore")
    with pytest.raises(ValueError, match=r"`batch_size`=0 must be an integer >= 1"):
        RemoteReward("http://127.0.0.1:8000", batch_size=0)
    with pytest.raises(ValueError, match=r"`fallback`=nan must be a finite number"):
        RemoteReward("http://127.0.0.1:8000", fallback=math.nan)
    assert RemoteReward("http://127.0.0.1:8000/score/").url == "http://127.0.0.1:8000"


REWARD_FILE = """
    import asyncio

    async def exact(prompts, responses, answer):
        await asyncio.sleep(0)
        return [float(r == a) for r, a in zip(responses, answer)]
"""


@pytest.mark.slow
def test_serve_reward_command(tmp_path):
    """`proxima serve-reward` as a subprocess: prints its URL, serves, stops on Ctrl-C."""
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent(REWARD_FILE))
    proc = subprocess.Popen(
        [sys.executable, "-m", "proxima", "serve-reward", f"{path}:exact", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"serving {path}:exact at http://127.0.0.1:"), line
        url = line.split(" at ")[1].split()[0]
        remote = RemoteReward(url)
        assert remote.check()["function"] == f"{path}:exact"
        assert score(remote).tolist() == [
            float(r == a) for r, a in zip(RESPONSES, COLUMNS["answer"], strict=True)
        ]
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=20)
        assert proc.returncode == 0, err
        assert out.strip() == "stopped"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_port_in_use_is_named(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(textwrap.dedent(REWARD_FILE))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=rf"cannot listen on 127.0.0.1:{port} \(Address already"):
            serve(f"{path}:exact", port=port)


@pytest.mark.parametrize("port", ["99999", "-1", "http"])
def test_serve_reward_refuses_a_port_out_of_range(port, capsys):
    from proxima.cli import main

    with pytest.raises(SystemExit) as exc:  # argparse: before the function loads
        main(["serve-reward", "missing.py:fn", "--port", port])
    assert exc.value.code == 2
    assert f"argument --port: '{port}' is not a port: give 0-65535" in capsys.readouterr().err
