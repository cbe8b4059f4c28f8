"""Python reward functions: ``"path/to/file.py:fn"`` or ``"package.module:fn"``.

The function receives the batch as lists and returns one number per response::

    def reward(prompts: list[str], responses: list[str], **columns) -> list[float]

``columns`` are the dataset's other columns (e.g. ``answer``), one list entry per sample.
A function that names only some columns (no ``**kwargs``) receives only those.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

RETRY_LIMIT = 32  # samples re-run one by one to locate the input that breaks a function
SPEC_FORMAT = "'path/to/file.py:function' or 'package.module:function'"


class RewardError(RuntimeError):
    """A reward source failed or returned unusable scores during training."""


def load_reward_function(spec: str) -> Callable[..., Any]:
    """Import the callable named by ``spec``; raise with what is wrong and how to fix it."""
    module_part, sep, attr = spec.rpartition(":")
    if not sep or not module_part or not attr:
        raise ValueError(
            f"reward function spec {spec!r} needs a ':' and a name; use {SPEC_FORMAT}."
        )
    is_file = module_part.endswith(".py") or "/" in module_part or "\\" in module_part
    module = _import_file(spec, Path(module_part)) if is_file else _import_module(spec, module_part)
    if not hasattr(module, attr):
        found = sorted(
            name
            for name, value in vars(module).items()
            if callable(value) and not name.startswith("_") and not inspect.isclass(value)
        )
        raise ValueError(
            f"reward function spec {spec!r}: {module_part} has no attribute {attr!r}; "
            f"public functions found: {found or 'none'}."
        )
    fn = getattr(module, attr)
    if not callable(fn):
        raise ValueError(
            f"reward function spec {spec!r}: {attr!r} is a {type(fn).__name__}, not callable; "
            "point the spec at a function."
        )
    return fn


def _import_file(spec: str, path: Path) -> Any:
    if not path.is_file():
        raise FileNotFoundError(
            f"reward function spec {spec!r}: file {path} not found (relative paths start at "
            f"{Path.cwd()}); fix the path."
        )
    path = path.resolve()
    # A unique module name per file so two reward files called reward.py do not collide.
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    name = f"proxima_reward_{path.stem}_{digest}"
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"reward function spec {spec!r}: cannot import {path} as Python.")
    module = importlib.util.module_from_spec(module_spec)
    # Registered before execution so dataclasses/pickle inside the file can find it, and
    # the folder is appended (not prepended: no shadowing) so sibling helpers import.
    sys.modules[name] = module
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:
        del sys.modules[name]
        raise ValueError(
            f"reward function spec {spec!r}: importing {path} failed with "
            f"{type(exc).__name__}: {exc}; fix the error in that file."
        ) from exc
    return module


def _import_module(spec: str, module_name: str) -> Any:
    try:
        return importlib.import_module(module_name)
    except Exception as exc:
        raise ValueError(
            f"reward function spec {spec!r}: importing module {module_name!r} failed with "
            f"{type(exc).__name__}: {exc}; install it, add its folder to PYTHONPATH, or give "
            "a file path ending in .py."
        ) from exc


def _short(text: Any, limit: int = 200) -> str:
    text = repr(text)
    return text if len(text) <= limit else text[:limit] + "...'"


class FunctionReward:
    """Reward source around a Python function; see the module docstring for its contract.

    Called as ``source(prompts, responses, columns, sequences, attention_mask)`` and returns
    a float32 CPU tensor [B]. ``sequences``/``attention_mask`` [B, L] are not used here.
    """

    def __init__(self, fn: Callable[..., Any], name: str | None = None) -> None:
        self.fn = fn
        self.name = name or getattr(fn, "__qualname__", repr(fn))
        self._accepted = _accepted_columns(fn)

    @classmethod
    def from_spec(cls, spec: str) -> FunctionReward:
        return cls(load_reward_function(spec), name=spec)

    def __call__(
        self,
        prompts: list[str],
        responses: list[str],
        columns: dict[str, list[Any]],
        sequences: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        kwargs = self._select(columns)
        try:
            raw = self.fn(prompts, responses, **kwargs)
        except (Exception, SystemExit) as exc:  # a reward function must not end the run
            raise RewardError(self._failure_message(prompts, responses, kwargs, exc)) from exc
        scores = self._to_tensor(raw, len(responses))
        bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
        if bad:
            raise RewardError(
                f"reward function {self.name} returned non-finite scores at indices "
                f"{bad[:10]}{' ...' if len(bad) > 10 else ''} (first: {scores[bad[0]].item()} for "
                f"prompt {_short(prompts[bad[0]])}, response {_short(responses[bad[0]])}); "
                "return finite numbers for every response."
            )
        return scores

    def _select(self, columns: dict[str, list[Any]]) -> dict[str, list[Any]]:
        if self._accepted is None:
            return dict(columns)
        return {k: v for k, v in columns.items() if k in self._accepted}

    def _failure_message(self, prompts, responses, kwargs, exc: BaseException) -> str:
        if isinstance(exc, SystemExit):
            head = f"reward function {self.name} called sys.exit({exc.code!r})"
        else:
            head = f"reward function {self.name} raised {type(exc).__name__}: {exc}"
        culprit = self._first_failing_sample(prompts, responses, kwargs)
        if culprit is not None:
            head += (
                f"; first failing sample {culprit}: prompt {_short(prompts[culprit])}, "
                f"response {_short(responses[culprit])}"
            )
        return head + f". Columns passed: {sorted(kwargs)}. Fix the function."

    def _first_failing_sample(self, prompts, responses, kwargs) -> int | None:
        """Re-run the function one sample at a time to point at the input that breaks it.

        Only on the error path, and over the first ``RETRY_LIMIT`` samples so an expensive
        function (a sandbox, an API) is not re-run on a whole large batch. Returns None when
        no single sample fails (the function only fails on batches).
        """
        for i in range(min(len(responses), RETRY_LIMIT)):
            one = {k: v[i : i + 1] for k, v in kwargs.items()}
            try:
                self.fn(prompts[i : i + 1], responses[i : i + 1], **one)
            except (Exception, SystemExit):
                return i
        return None

    def _to_tensor(self, raw: Any, batch: int) -> torch.Tensor:
        where = f"reward function {self.name}"
        if isinstance(raw, torch.Tensor):
            values = raw.detach().cpu()
        elif hasattr(raw, "__array__"):  # numpy arrays and the like
            try:
                values = torch.as_tensor(raw.__array__())
            except (TypeError, RuntimeError) as exc:
                raise RewardError(f"{where} returned an array torch cannot read ({exc}).") from exc
        elif isinstance(raw, Sequence) and not isinstance(raw, (str, bytes)):
            values = torch.tensor([_as_number(x, i, where) for i, x in enumerate(raw)])
        else:
            raise RewardError(
                f"{where} returned a {type(raw).__name__}; return a list of {batch} numbers."
            )
        if values.is_complex():
            raise RewardError(f"{where} returned complex values; return real numbers.")
        if values.dim() != 1 or values.shape[0] != batch:
            raise RewardError(
                f"{where} returned shape {tuple(values.shape)} for a batch of {batch} responses; "
                f"return one number per response (length {batch})."
            )
        return values.to(torch.float32)


def _as_number(x: Any, index: int, where: str) -> float:
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        x = x.item()
    elif hasattr(x, "item") and not isinstance(x, (str, bytes)):
        x = x.item()  # numpy scalars
    if isinstance(x, (bool, int, float)):
        return float(x)
    raise RewardError(
        f"{where} returned {x!r} ({type(x).__name__}) at index {index}; return real numbers."
    )


def _accepted_columns(fn: Callable[..., Any]) -> set[str] | None:
    """Names of the keyword columns ``fn`` takes, or None when it takes ``**kwargs``."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # builtins and some C callables have no signature
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return None
    # The first two parameters receive prompts and responses positionally.
    return {p.name for p in params[2:] if p.kind is not inspect.Parameter.VAR_POSITIONAL}
