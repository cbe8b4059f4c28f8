"""What every command's recipe starts with: threads, seed and device, an output folder that
holds no model yet, and a place its results can be written to."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from proxima.config import Config, ConfigError
from proxima.rng import seed_everything
from proxima.trainer.setup import resolve_device


def process_setup(cfg: Config) -> torch.device:
    """Seed, torch threads (trainer.threads) and the device of a one-process command."""
    seed_everything(cfg.trainer.seed)
    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)
    return resolve_device(cfg.model.device)


def fresh_out(path: str) -> Path:
    """An output folder that holds no model yet: nothing already written is overwritten."""
    out = Path(path)
    if (out / "config.json").exists():
        raise FileExistsError(f"{out} already holds a model (config.json); choose another --out.")
    return out


def _folder_problem(folder: Path) -> str | None:
    """Why `folder` cannot be written into (after creating it, with its parents, when it is
    missing), or None."""
    if folder.exists() and not folder.is_dir():
        return f"{folder} is a file, not a folder"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        blocker = next((p for p in folder.parents if p.exists()), None)
        if blocker is not None and not blocker.is_dir():
            return f"cannot create the folder {folder}: {blocker} is a file"
        return f"cannot create the folder {folder} ({err.strerror or err})"
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"the folder {folder} is not writable"
    return None


def writable_folder(path: str | Path, name: str) -> Path:
    """`path` as a folder that exists (created with its parents when missing) and can be
    written into; a ConfigError naming `name` (the key or flag that set it) otherwise.
    Checked before any work, so that nothing is computed only to find no place to write it."""
    folder = Path(path)
    problem = _folder_problem(folder)
    if problem:
        raise ConfigError(f"{_named(name, path)}: {problem}; point {name} at a writable folder.")
    return folder


def writable_file(path: str | Path, name: str) -> Path:
    """`path` as a file that can be written (its folder created when missing); a ConfigError
    naming `name` otherwise, as `writable_folder`."""
    file = Path(path)
    if file.is_dir():
        problem = f"{file} is a folder; name a file in it, e.g. {name}={file / 'results.json'}"
    elif file.exists() and not os.access(file, os.W_OK):
        problem = f"{file} exists and is not writable; point {name} at another file"
    else:
        problem = _folder_problem(file.parent)
        problem = problem and f"{problem}; point {name} at a file in a writable folder"
    if problem:
        raise ConfigError(f"{_named(name, path)}: {problem}.")
    return file


def _named(name: str, path: str | Path) -> str:
    """`key`=value for a config key, --flag value for a flag."""
    return f"{name} {path}" if name.startswith("-") else f"{name}={path}"
