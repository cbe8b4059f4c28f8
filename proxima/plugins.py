"""The user's code named in the config: ``path/to/file.py:name`` or ``package.module:name``
(a reward function, an environment class, a gold scorer).

`load` imports the object a spec names, or raises an error that says what is wrong and how
to fix it: a spec without ``:name``, a missing file, an error while the file or module
imports (a syntax error included), a missing name (listing the names the module has), an
object of the wrong kind. A file is executed afresh on each `load` (its module state starts
anew), under a module name of its own (two ``reward.py`` files in different folders do not
collide); its folder is appended to ``sys.path``, so that modules beside it import.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


class PluginError(ValueError):
    """A spec that names no usable object; the message says what to change."""


def split_spec(
    spec: str, where: str, noun: str = "function", error: type[Exception] = PluginError
) -> tuple[str, str, bool]:
    """``(module part, name, whether the module part is a file)`` of ``spec``; `error`
    (raised with ``where`` first) when it has no ``:name``."""
    module_part, sep, attr = str(spec).rpartition(":")
    if not sep or not module_part or not attr:
        example = "Env" if noun == "class" else "fn"
        raise error(
            f"{where} needs a ':' and a name: give the {noun} as 'path/to/file.py:{example}' "
            f"or 'package.module:{example}'."
        )
    is_file = module_part.endswith(".py") or "/" in module_part or "\\" in module_part
    return module_part, attr, is_file


def load(
    spec: str,
    where: str,
    *,
    kind: str = "function",
    fits: Callable[[Any], bool] = callable,
    wanted: str = "a function (callable)",
    error: type[Exception] = PluginError,
) -> Any:
    """The object ``spec`` names. ``where`` starts every message (e.g. "`rollout.env.cls`='x'");
    ``kind`` ("function" or "class") says which names to list when the name is missing;
    ``fits(obj)`` is False for an object of the wrong kind, reported as not ``wanted``;
    ``error`` is the exception type raised."""
    module_part, attr, is_file = split_spec(spec, where, kind, error)
    if is_file:
        module = _import_file(Path(module_part), where, error)
    else:
        module = _import_module(module_part, where, error)
    if not hasattr(module, attr):
        found = sorted(
            name
            for name, value in vars(module).items()
            if not name.startswith("_")
            and (
                inspect.isclass(value)
                if kind == "class"
                else callable(value) and not inspect.isclass(value)
            )
        )
        listed = "classes" if kind == "class" else "public functions"
        raise error(
            f"{where}: {module_part} has no attribute {attr!r}; {listed} found: {found or 'none'}."
        )
    obj = getattr(module, attr)
    if not fits(obj):
        raise error(
            f"{where}: {attr!r} is {_described(obj)}; it must be {wanted}: point the spec at one."
        )
    return obj


def _described(obj: Any) -> str:
    """What an object that does not fit is: a class with its public methods listed (so the
    missing one shows), else its type."""
    if not inspect.isclass(obj):
        return f"a {type(obj).__name__}"
    methods = sorted(n for n, v in vars(obj).items() if callable(v) and not n.startswith("_"))
    return (
        f"a class with the methods {', '.join(methods)}" if methods else "a class with no methods"
    )


def _import_file(path: Path, where: str, error: type[Exception]) -> Any:
    if not path.is_file():
        raise error(
            f"{where}: file {path} not found (relative paths start at {Path.cwd()}); fix the path."
        )
    path = path.resolve()
    name = f"proxima_plugin_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise error(f"{where}: cannot import {path} as Python; name a .py file.")
    module = importlib.util.module_from_spec(module_spec)
    # Registered before execution so that dataclasses and pickle inside the file find it;
    # the folder is appended (not prepended: nothing is shadowed) so sibling helpers import.
    sys.modules[name] = module
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:  # noqa: BLE001 - reported with the fix
        del sys.modules[name]
        raise error(
            f"{where}: importing {path} failed with {type(exc).__name__}: {exc}; fix the "
            "error in that file."
        ) from exc
    return module


def _import_module(module_name: str, where: str, error: type[Exception]) -> Any:
    try:
        return importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - reported with the fix
        raise error(
            f"{where}: importing module {module_name!r} failed with {type(exc).__name__}: "
            f"{exc}; install it, add its folder to PYTHONPATH, or give a file path ending "
            "in .py."
        ) from exc
