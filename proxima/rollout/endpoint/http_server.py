"""The endpoint's HTTP side: routes `/episode/<id>/v1/...` to the policy server's `answer`,
each request in a thread of its own (stdlib `ThreadingHTTPServer` on a free port of
127.0.0.1), refusals as the API's JSON errors."""

from __future__ import annotations

import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from proxima.rollout.endpoint import schema
from proxima.rollout.endpoint.schema import RequestError

ROUTE = re.compile(r"^/episode/(\d+)/v1/(chat/completions|completions|models)/?$")


class EndpointHTTPServer:
    """Serves `policy.answer(episode_id, route, body)` from `start()` to `stop()`."""

    def __init__(self, policy) -> None:
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), _handler(policy))
        self.http.daemon_threads = True
        self.port = self.http.server_address[1]

    def start(self) -> None:
        threading.Thread(target=self.http.serve_forever, name="policy server", daemon=True).start()

    def stop(self) -> None:
        self.http.shutdown()
        self.http.server_close()


def _handler(policy) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the openai client reuses connections

        def log_message(self, *args) -> None:  # quiet: a request per model call
            pass

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            m = ROUTE.match(self.path)
            if m and m[2] == "models":
                self._send(200, schema.model_list())
            else:
                error = RequestError(404, f"no route {self.path}", "not_found")
                self._send(404, schema.error_body(error))

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            m = ROUTE.match(self.path)
            try:
                if not m or m[2] == "models":
                    raise RequestError(404, f"no route POST {self.path}", "not_found")
                self._send(200, policy.answer(int(m[1]), m[2], schema.parse_body(raw)))
            except RequestError as err:
                self._send(err.status, schema.error_body(err))
            except Exception as err:  # noqa: BLE001 - e.g. a chat template that raises
                refused = RequestError(400, f"the request failed: {type(err).__name__}: {err}")
                self._send(400, schema.error_body(refused))

        def _send(self, status: int, payload) -> None:
            data = schema.encode(payload)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler
