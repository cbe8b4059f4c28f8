"""An ASGI app (Starlette) served by uvicorn in a thread of this process (`Served`: the agent
endpoint), on a socket bound here (`listen`).

The socket is bound here rather than by uvicorn so that its port (port 0: a free one) is
known before serving starts, and created with its protocol named (IPPROTO_TCP): asyncio sets
TCP_NODELAY on the connections of such a socket only, and without it each reply's body
waits for the client's delayed ACK of its headers (about 40 ms per request on Linux)."""

from __future__ import annotations

import socket
import threading

import uvicorn

STOP_S = 5.0  # how long `Served.stop` waits for uvicorn's shutdown


def listen(host: str, port: int, backlog: int = 128) -> socket.socket:
    """A TCP socket listening on host:port (port 0: a free one); OSError when it cannot."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


class Served:
    """`app` served on `sock` by uvicorn in a daemon thread, from `start()` to `stop()`."""

    def __init__(self, app, sock: socket.socket, name: str, keep_alive_s: int = 5) -> None:
        self.sock, self.name = sock, name
        # quiet: a line per request would be a line per model call; the app answers its
        # own errors
        config = uvicorn.Config(
            app,
            lifespan="off",
            log_level="warning",
            access_log=False,
            timeout_keep_alive=keep_alive_s,
        )
        self.server = uvicorn.Server(config)
        self.thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return self.sock.getsockname()[1]

    def start(self) -> None:
        """Serve; returns once uvicorn accepts connections (RuntimeError if it stopped)."""
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [self.sock]}, name=self.name, daemon=True
        )
        self.thread.start()
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"{self.name}: uvicorn stopped before serving")
            self.thread.join(0.005)

    def stop(self) -> None:
        """Stop serving (uvicorn closes the connections, the requests in flight finish) and
        release the port."""
        if self.thread is not None:
            self.server.should_exit = True
            self.thread.join(STOP_S)
            self.thread = None
        self.sock.close()
