"""Signals outside the training loop: the imports every command starts with, with SIGINT
and SIGTERM held back, and a signal during a command turned into `Interrupted`."""

from __future__ import annotations

import importlib
import signal
import threading

from proxima.launch import Interrupted

# the stack every command imports first, with SIGINT and SIGTERM held back: a signal that
# lands inside torch's or transformers' import machinery surfaces as another error there
# (an ImportError, "SystemError: bad call flags"), not as the interruption it is
STACK = ("torch", "transformers", "transformers.modeling_utils")


def import_holding_signals(modules: tuple[str, ...]) -> int | None:
    """Import `modules` with SIGINT and SIGTERM held back; the first signal that came
    meanwhile (its number), or None."""
    got: list[int] = []
    main = threading.current_thread() is threading.main_thread()  # handlers: main thread only
    held = {
        s: signal.signal(s, lambda n, f: got.append(n))
        for s in (signal.SIGINT, signal.SIGTERM)
        if main
    }
    try:
        for name in modules:
            importlib.import_module(name)
    finally:
        for signum, handler in held.items():
            signal.signal(signum, handler)
    return got[0] if got else None


def interrupt_on(signum: int):
    """Turn `signum` into `Interrupted` for this command (main thread only); returns the
    handler it replaced (None when it could not install one)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handle(received: int, frame) -> None:  # outside the training loop (it has its own)
        raise Interrupted(f"{signal.Signals(received).name} received", received)

    return signal.signal(signum, handle)
