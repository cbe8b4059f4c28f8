"""`reward.sources`: several reward sources, their weighted sum the score.

Each entry of the list is a mapping: a `name`, a `weight` (default 1), exactly one of
`function` (path.py:fn or module:fn), `model_path` (a reward model folder) or `url` (a
`proxima serve-reward` server), and the options its kind takes. The single-source keys
(`reward.function`, `reward.model_path`) are a list of one. `reward_sources(cfg)` returns
the entries checked and completed, as `RewardSource`s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from proxima.config.schema import Config, ConfigError

KINDS = ("function", "model_path", "url")
ON_ERROR = ("raise", "fallback")
# the options each kind of source takes, beyond name / weight / clip / normalize
KIND_OPTIONS = {
    "function": ("concurrency", "timeout_s", "on_error", "fallback"),
    "model_path": ("batch_size",),
    "url": ("batch_size", "concurrency", "timeout_s", "retries", "on_error", "fallback"),
}
COMMON = ("name", "weight", "clip", "normalize")
NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


@dataclass(frozen=True)
class RewardSource:
    """One reward source: `kind` (function | model_path | url) and its `target` (the
    spec, folder or URL); `weight` in the weighted sum; `clip` > 0 clips its raw score to
    [-clip, clip] before weighting (0: no clip); `normalize` standardises it by the running
    mean and std of its raw scores (in training) before the clip; `options` are its kind's
    (batch_size, concurrency, timeout_s, retries, on_error, fallback)."""

    name: str
    kind: str
    target: str
    weight: float = 1.0
    clip: float = 0.0
    normalize: bool = False
    options: dict[str, Any] = field(default_factory=dict)


def _number(entry: dict, key: str, where: str, low: float | None = None) -> None:
    """Check entry[key], a number; a string that reads as one (YAML 1.1 takes `1e30`, with
    no dot, for a string) is replaced by it."""
    value = entry.get(key)
    if value is None:
        return
    if isinstance(value, str):
        try:
            value = entry[key] = float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"`{where}.{key}` must be a number, got {value!r}.")
    if low is not None and value < low:
        raise ConfigError(f"`{where}.{key}` must be >= {low}, got {value}.")


def _source(entry: Any, i: int) -> RewardSource:
    where = f"reward.sources[{i}]"
    if not isinstance(entry, dict):
        raise ConfigError(
            f"`{where}` must be a mapping like {{name: fmt, function: reward.py:fn, weight: "
            f"0.5}}, got {entry!r}."
        )
    kinds = [k for k in KINDS if entry.get(k)]
    if len(kinds) != 1:
        raise ConfigError(
            f"`{where}` must set exactly one of function, model_path, url; got {kinds or 'none'}."
        )
    kind = kinds[0]
    allowed = (*COMMON, kind, *KIND_OPTIONS[kind])
    unknown = sorted(set(entry) - set(allowed))
    if unknown:
        raise ConfigError(
            f"`{where}` ({kind}) has unknown keys {unknown}; a {kind} source takes "
            f"{', '.join(allowed)}."
        )
    name = entry.get("name")
    if not isinstance(name, str) or not NAME.match(name):
        raise ConfigError(
            f"`{where}.name` must be a short name of letters, digits, _ . - (it names the "
            f"metric reward/<name>), got {name!r}."
        )
    _number(entry, "weight", where)
    _number(entry, "clip", where, low=0)
    for key in ("batch_size", "concurrency", "retries"):
        value = entry.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
            raise ConfigError(f"`{where}.{key}` must be an integer, got {value!r}.")
        if value is not None and value < (0 if key == "retries" else 1):
            raise ConfigError(f"`{where}.{key}` must be >= {0 if key == 'retries' else 1}.")
    _number(entry, "timeout_s", where, low=0)
    _number(entry, "fallback", where)
    if entry.get("on_error", "raise") not in ON_ERROR:
        raise ConfigError(f"`{where}.on_error` must be one of {', '.join(ON_ERROR)}.")
    if not isinstance(entry.get("normalize", False), bool):
        raise ConfigError(f"`{where}.normalize` must be true or false.")
    if kind == "url" and not str(entry["url"]).startswith(("http://", "https://")):
        raise ConfigError(f"`{where}.url` must start with http:// or https://.")
    return RewardSource(
        name=name,
        kind=kind,
        target=str(entry[kind]),
        weight=float(entry.get("weight", 1.0)),
        clip=float(entry.get("clip", 0.0)),
        normalize=bool(entry.get("normalize", False)),
        options={k: entry[k] for k in KIND_OPTIONS[kind] if k in entry},
    )


def reward_sources(cfg: Config) -> list[RewardSource]:
    """The run's reward sources: `reward.sources`, or the single-source keys as one source
    (named `function` or `reward_model`, weight 1, the options of `reward.batch_size`)."""
    r = cfg.reward
    if r.sources:
        if r.function or r.model_path:
            raise ConfigError(
                "Set either `reward.sources` or the single-source keys (`reward.function`, "
                "`reward.model_path`), not both: add the single source to the list."
            )
        sources = [_source(entry, i) for i, entry in enumerate(r.sources)]
        names = [s.name for s in sources]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ConfigError(f"`reward.sources` names must differ; {twice} appear twice.")
        if all(s.weight == 0 for s in sources):
            raise ConfigError(
                "Every source of `reward.sources` has weight 0, so every score would be 0: "
                "give at least one a non-zero weight."
            )
        return sources
    if r.function:
        return [RewardSource("function", "function", r.function)]
    if r.model_path:
        return [
            RewardSource(
                "reward_model", "model_path", r.model_path, options={"batch_size": r.batch_size}
            )
        ]
    return []


def reward_model_paths(cfg: Config) -> list[str]:
    """The reward model folders of the run's sources, in order (the first is the one
    `model.critic_init=reward_model` starts the critic from)."""
    return [s.target for s in reward_sources(cfg) if s.kind == "model_path"]
