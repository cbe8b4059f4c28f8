"""The user's environment of multi-turn episodes (`rollout.env`): imported and checked
before any model loads (`check_env`); its calls run concurrently, each with a time limit
(`proxima.guarded`, from `rollout.episodes`).

An environment is a class named as `path/to/file.py:Env` or `package.module:Env`:

    class Env:
        def __init__(self, row: dict): ...      # one per sample: the prompt record
        def step(self, action: str) -> tuple[str | None, float, bool]: ...

`step` gets the model's text for the turn and returns the observation to append to the
context (or None), the turn's reward and whether the episode is done, and may add a fourth
value, a dict of JSON values kept as the turn's `info` in samples.jsonl (e.g. how a
sandboxed run of the action's code ended: `proxima.sandbox.PythonEnv`). An optional class
attribute `max_reward` is the best total reward of an episode: evaluation's `accuracy` is
the share of episodes that reach it.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

from proxima import plugins
from proxima.config import Config, ConfigError


def _is_env_class(obj: Any) -> bool:
    return inspect.isclass(obj) and callable(getattr(obj, "step", None))


@functools.cache
def load_env_class(spec: str) -> type:
    """The environment class `spec` names (imported once per process); ConfigError naming
    what is wrong and the fix."""
    return plugins.load(
        spec,
        f"`rollout.env.cls`={spec!r}",
        kind="class",
        fits=_is_env_class,
        wanted="a class with a method step(self, action: str) -> (observation or None, "
        "reward, done[, info]), built as Env(row)",
        error=ConfigError,
    )


def check_env(cfg: Config) -> None:
    """Start-up: the class `rollout.env.cls` names imports and has a `step` method."""
    if cfg.rollout.env.cls:
        load_env_class(cfg.rollout.env.cls)
