"""The user's environment of multi-turn episodes (`rollout.env`): imported and checked
before any model loads (`check_env`), and its calls run concurrently, each with a time
limit (`run_calls`).

An environment is a class named as `path/to/file.py:Env` or `package.module:Env`:

    class Env:
        def __init__(self, row: dict): ...      # one per sample: the prompt record
        def step(self, action: str) -> tuple[str | None, float, bool]: ...

`step` gets the model's text for the turn and returns the observation to append to the
context (or None), the turn's reward and whether the episode is done. An optional class
attribute `max_reward` is the best total reward of an episode: evaluation's `accuracy` is
the share of episodes that reach it.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import queue
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from proxima.config import Config, ConfigError

FORMAT = "path/to/file.py:Env or package.module:Env"


def _import(spec: str, module_part: str) -> Any:
    if not module_part.endswith(".py") and "/" not in module_part:
        try:
            return importlib.import_module(module_part)
        except Exception as exc:  # noqa: BLE001 - reported with the fix
            raise ConfigError(
                f"`rollout.env`={spec!r}: importing module {module_part!r} failed with "
                f"{type(exc).__name__}: {exc}; install it, add its folder to PYTHONPATH, or "
                "give a file path ending in .py."
            ) from exc
    path = Path(module_part)
    if not path.is_file():
        raise ConfigError(
            f"`rollout.env`={spec!r}: file {path} not found (relative paths start at "
            f"{Path.cwd()}); fix the path."
        )
    path = path.resolve()
    # one module name per file, so two env.py files do not collide
    name = f"proxima_env_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module  # before execution: dataclasses and pickle in it find it
    if str(path.parent) not in sys.path:  # appended, not prepended: sibling helpers import
        sys.path.append(str(path.parent))
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:  # noqa: BLE001 - reported with the fix
        del sys.modules[name]
        raise ConfigError(
            f"`rollout.env`={spec!r}: importing {path} failed with {type(exc).__name__}: "
            f"{exc}; fix the error in that file."
        ) from exc
    return module


@functools.cache
def load_env_class(spec: str) -> type:
    """The environment class `spec` names (imported once per process); ConfigError naming
    what is wrong and the fix."""
    module_part, sep, attr = spec.rpartition(":")
    if not sep or not module_part or not attr:
        raise ConfigError(f"`rollout.env`={spec!r} must name a class as {FORMAT}.")
    module = _import(spec, module_part)
    cls = getattr(module, attr, None)
    if cls is None:
        found = sorted(n for n, v in vars(module).items() if inspect.isclass(v))
        raise ConfigError(
            f"`rollout.env`={spec!r}: {module_part} has no attribute {attr!r}; classes "
            f"found: {found or 'none'}."
        )
    if not inspect.isclass(cls) or not callable(getattr(cls, "step", None)):
        raise ConfigError(
            f"`rollout.env`={spec!r}: {attr} must be a class with a method "
            "step(self, action: str) -> (observation or None, reward, done), built as "
            f"{attr}(row); got {type(cls).__name__}."
        )
    return cls


def check_env(cfg: Config) -> None:
    """Start-up: the class `rollout.env` names imports and has a `step` method."""
    if cfg.rollout.env:
        load_env_class(cfg.rollout.env)


@dataclass
class CallResult:
    """What one environment call gave: its value, or the error that ended it (`kind`:
    "error" for an exception, "timeout" for a call past the limit)."""

    value: Any = None
    error: str = ""
    kind: str = ""

    @property
    def ok(self) -> bool:
        return not self.kind


def run_calls(calls: list[Callable[[], Any]], workers: int, timeout_s: float) -> list[CallResult]:
    """Each of `calls` in a thread of its own, at most `workers` at once, each allowed
    `timeout_s` seconds from its start (0 = no limit); results in the order of `calls`.

    A call past its limit is left running in its (daemon) thread and its slot is given to
    the next call, so a hung environment delays the batch by at most the limit and never
    stops the run (Python cannot kill a thread; the abandoned call's result is ignored)."""
    results: list[CallResult | None] = [None] * len(calls)
    done: queue.Queue = queue.Queue()
    started: dict[int, float] = {}  # running calls: their start times
    waiting = list(range(len(calls)))[::-1]

    def run(i: int) -> None:
        try:
            done.put((i, CallResult(calls[i]())))
        except Exception as exc:  # noqa: BLE001 - the episode ends with it, named
            done.put((i, CallResult(error=f"{type(exc).__name__}: {exc}", kind="error")))

    while waiting or started:
        while waiting and len(started) < workers:
            i = waiting.pop()
            started[i] = time.monotonic()
            threading.Thread(target=run, args=(i,), daemon=True).start()
        wait = None
        if timeout_s:
            wait = max(0.0, min(started.values()) + timeout_s - time.monotonic())
        try:
            i, result = done.get(timeout=wait)
            if i in started:  # not already given up on
                del started[i]
                results[i] = result
        except queue.Empty:
            now = time.monotonic()
            for i, t0 in list(started.items()):
                if now - t0 >= timeout_s:
                    del started[i]
                    message = f"took more than rollout.env_timeout_s={timeout_s:g} s"
                    results[i] = CallResult(error=message, kind="timeout")
    return results
