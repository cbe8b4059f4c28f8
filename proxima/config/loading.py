"""Loading: YAML and `section.key=value` overrides -> a checked tree of dicts -> `Config`,
validated for the command (`load_config`). Every value is checked against its field's type
(`_coerce`), every key against the schema (unknown keys get a "did you mean")."""

from __future__ import annotations

import dataclasses
import difflib
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from proxima.config.run import worker_problem
from proxima.config.schema import Config, ConfigError
from proxima.config.validation import check_sources, validate

# the most rollout workers a run gets without asking: each holds a copy of the actor
MAX_DEFAULT_WORKERS = 4


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _suggest(key: str, valid: list[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f" Did you mean `{prefix}{close[0]}`?" if close else ""
    return f"{hint} Valid keys: {', '.join(valid)}."


def _unknown_key(key: str, value: Any, ftypes: dict[str, Any], prefix: str) -> str:
    """The message for a key `_build` does not know. A dotted key in a YAML file
    (`actor.optim.lr: 1e-5`) is the command line's spelling: YAML nests the sections."""
    where = prefix + key
    head = str(key).split(".", 1)[0]
    if "." in str(key) and dataclasses.is_dataclass(ftypes.get(head)):
        nested: Any = value
        for part in reversed(where.split(".")):
            nested = {part: nested}
        shown = yaml.safe_dump(nested, default_flow_style=False, sort_keys=False)
        return (
            f"Config key `{where}` is written with dots; in a YAML file the sections nest "
            f"(dotted keys are for command-line overrides, {where}=...). Write it as:\n"
            + "".join(f"  {line}\n" for line in shown.splitlines()).rstrip("\n")
        )
    return f"Unknown config key `{where}`." + _suggest(str(key), list(ftypes), prefix)


def _coerce(value: Any, typ: Any, where: str) -> Any:
    """Check a YAML value against a field type; ints are accepted for floats."""
    if isinstance(typ, types.UnionType) or typing.get_origin(typ) is typing.Union:
        if value is None:
            return None
        inner = [t for t in typing.get_args(typ) if t is not type(None)]
        return _coerce(value, inner[0], where) if len(inner) == 1 else value
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is float and isinstance(value, str):  # YAML 1.1 reads `1e-5` (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if typ is bool and not isinstance(value, bool):
        raise ConfigError(f"`{where}` must be true or false, got {value!r}.")
    if typ is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"`{where}` must be an integer, got {value!r}.")
    if typ is float and not isinstance(value, float):
        raise ConfigError(f"`{where}` must be a number, got {value!r}.")
    if typ is str and not isinstance(value, str):
        if value is None:
            return ""
        raise ConfigError(f"`{where}` must be a string, got {value!r}. Quote it in YAML.")
    if (typ is list or typing.get_origin(typ) is list) and not isinstance(value, list):
        raise ConfigError(f"`{where}` must be a list like [1, 2], got {value!r}.")
    if typing.get_origin(typ) is list:  # each item checked as its own value is
        (item,) = typing.get_args(typ)
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    return value


def _build(cls: type, data: dict, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"`{prefix.rstrip('.') or 'config'}` must be a mapping, got {data!r}.")
    ftypes = _field_types(cls)
    kwargs = {}
    for key, value in data.items():
        where = prefix + key
        moved = getattr(cls, "MOVED", {}).get(key)
        if moved:
            raise ConfigError(
                f"`{where}` is now `{prefix}{moved}`: rename the key (in the YAML file, "
                f"under `{prefix}{moved.rsplit('.', 1)[0]}:`; on the command line "
                f"{prefix}{moved}=...)."
            )
        replaced = getattr(cls, "REPLACED", {}).get(key)
        if replaced:
            raise ConfigError(f"`{where}` is gone: use {replaced}.")
        if key not in ftypes:
            raise ConfigError(_unknown_key(key, value, ftypes, prefix))
        typ = ftypes[key]
        if dataclasses.is_dataclass(typ):
            kwargs[key] = _build(typ, _expand_shorthand(typ, value, where) or {}, where + ".")
        else:
            kwargs[key] = _coerce(value, typ, where)
    return cls(**kwargs)


# A section given as a plain value (`actor.policy_loss=gspo`) that then gets keys of its own
# (`actor.policy_loss.dro_beta=0.1`) keeps that value under this key until `_build` knows
# the section's shorthand field (`loss_mode`).
SHORTHAND_MARK = "="


def _expand_shorthand(typ: type, value: Any, where: str) -> Any:
    """A section's shorthand (`actor.policy_loss=gspo`, also when keys follow it) as its
    field (`loss_mode: gspo`)."""
    shorthand = getattr(typ, "SHORTHAND", None)
    if isinstance(value, dict) and SHORTHAND_MARK in value:
        value = dict(value)
        mark = value.pop(SHORTHAND_MARK)
        if not shorthand:
            raise ConfigError(f"`{where}` is a section: set its keys, not `{where}={mark}`.")
        value.setdefault(shorthand, mark)
    elif shorthand and isinstance(value, str):
        value = {shorthand: value}
    return value


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if isinstance(child, str):  # a section's shorthand, keys following it
            child = node[part] = {SHORTHAND_MARK: child}
        if not isinstance(child, dict):
            raise ConfigError(f"Cannot set `{dotted}`: `{part}` is not a section.")
        node = child
    node[parts[-1]] = value


def _yaml_problem(err: yaml.YAMLError) -> str:
    """What PyYAML was parsing and what it found, with 1-based line and column."""
    parts = []
    for text, mark in (
        (getattr(err, "context", None), getattr(err, "context_mark", None)),
        (getattr(err, "problem", None), getattr(err, "problem_mark", None)),
    ):
        if text:
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            parts.append(text + where)
    return "; ".join(parts) or str(err)


class _Yaml12Loader(yaml.SafeLoader):
    """YAML with the booleans of YAML 1.2, true and false only: YAML 1.1 (PyYAML's default)
    also reads yes/no/on/off as booleans, which made `model.mixed_precision=no` False."""


_Yaml12Loader.yaml_implicit_resolvers = {
    first: [(tag, rx) for tag, rx in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Yaml12Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool",
    re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"),
    list("tTfF"),
)


def load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Yaml12Loader)


def parse_overrides(items: list[str]) -> dict:
    """`["a.b=1", "c.d=x"]` -> nested dict; values parsed as YAML scalars."""
    tree: dict = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"Override `{item}` is not of the form section.key=value.")
        key, raw = item.split("=", 1)
        if not key.strip() or "" in key.strip().split("."):
            raise ConfigError(f"Override `{item}` has no key: write section.key=value.")
        try:
            value = load_yaml(raw) if raw.strip() else ""
        except yaml.YAMLError as err:
            raise ConfigError(
                f"Override `{item}`: the value {raw!r} is not valid YAML ({_yaml_problem(err)}). "
                f"Fix it, e.g. {key}=[1, 2] for a list, or quote a string: {key}='{raw}'."
            ) from None
        _set_dotted(tree, key.strip(), value)
    return tree


def read_yaml(path: Path) -> dict:
    """The mapping a YAML config file holds; ConfigError naming the file otherwise."""
    try:
        tree = load_yaml(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ConfigError(
            f"Config file {path} is not valid YAML ({_yaml_problem(err)}). Fix that line "
            "(indentation, a missing colon or bracket, an unquoted special character)."
        ) from None
    except (UnicodeDecodeError, OSError) as err:
        raise ConfigError(f"Config file {path} cannot be read as text ({err}).") from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ConfigError(
            f"Config file {path} holds a {type(tree).__name__} at the top level; a config is a "
            "mapping of sections, e.g.\n  model:\n    actor_path: path/to/model\n  trainer:\n"
            "    iterations: 100"
        )
    return tree


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), str):  # a shorthand, then keys
            out[key] = {SHORTHAND_MARK: out[key]}
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def _async_defaults(cfg: Config, tree: dict) -> Config:
    """With rollout.max_staleness the engine samples from weights up to that many versions
    behind the trainer's: the truncated importance weights pi_old / mu correct for it
    (verl's rollout_is in its off-policy modes), on per token unless the YAML or an override
    set algorithm.rollout_correction (also to empty: off). Unless set, rollout.workers is
    the number of batches the pipeline holds (`default_workers`)."""

    def chosen(section: str, key: str) -> bool:
        return isinstance(tree.get(section), dict) and key in tree[section]

    k = cfg.rollout.max_staleness
    if k and not chosen("algorithm", "rollout_correction"):
        cfg = cfg.replace({"algorithm.rollout_correction": "token"})
    if k and not chosen("rollout", "workers"):
        cfg = cfg.replace({"rollout.workers": default_workers(cfg)})
    return cfg


def default_workers(cfg: Config) -> int:
    """rollout.workers when unset: one per batch the pipeline holds (k = max_staleness,
    never more than the run's iterations), so each batch can be sampled while the k - 1
    before it train; at most `MAX_DEFAULT_WORKERS`, each holding a copy of the actor; 0
    where workers cannot sample the run (`worker_problem`), which then samples ahead in
    the trainer's process."""
    if worker_problem(cfg):
        return 0
    return max(1, min(cfg.rollout.max_staleness, cfg.trainer.iterations, MAX_DEFAULT_WORKERS))


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    base: dict | None = None,
    command: str = "train",
) -> Config:
    """Read YAML (or start from `base`, e.g. a checkpoint's saved config), apply `a.b=c`
    overrides, build and validate the config for `command` (train|sft|rm|eval)."""
    tree: dict = dict(base or {})
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(
                f"Config file {path} not found. Pass an existing YAML file "
                "or no file at all for the built-in default example."
            )
        tree = read_yaml(path)
    tree = _merge(tree, parse_overrides(overrides or []))
    cfg = _build(Config, tree, "")
    cfg = _async_defaults(cfg, tree)
    validate(cfg)
    if command != "train" or not cfg.task.name:  # a task names its sources when prepared
        check_sources(cfg, command)
    return cfg
