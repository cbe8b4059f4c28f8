"""What the recipes start with: threads, seed and device (one process, or this rank's place
in a torchrun job), a run folder that overwrites nothing, an output folder that holds no
model yet, and a place results can be written to."""

from __future__ import annotations

import os
import re
import tempfile
import uuid
from pathlib import Path

import torch

from proxima import launch
from proxima.checkpoint import remove_orphans
from proxima.config import Config, ConfigError
from proxima.files import describe_write_error, write_error, write_whole
from proxima.models.loading import quiet_transformers
from proxima.rng import seed_everything
from proxima.trainer.device import resolve_device
from proxima.trainer.dist import Dist
from proxima.trainer.dist import init as init_dist


def process_setup(cfg: Config) -> torch.device:
    """Seed, torch threads (trainer.threads) and the device of a one-process command."""
    seed_everything(cfg.trainer.seed)
    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)
    return resolve_device(cfg.model.device)


def fresh_out(path: str, name: str = "--out") -> Path:
    """An output folder that holds no model yet (nothing already written is overwritten)
    and can be written: checked before the work, named by `name`."""
    out = Path(path)
    if (out / "config.json").exists():
        raise FileExistsError(f"{out} already holds a model (config.json); choose another --out.")
    if not out.is_dir():
        writable_place(out, name)
    else:
        writable_folder(out, name)
    return out


def save_model(model, tokenizer, out: Path, name: str = "--out") -> None:
    """`model` and `tokenizer` as the Hugging Face folder `out`, each file whole
    (`files.write_whole`); a write that fails (a full disk) names `name` (the key or flag
    that set `out`, if any) and the folder."""

    def write(tmp: Path) -> None:
        with quiet_transformers():
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)

    try:
        write_whole(out, write)
    except Exception as err:
        cause = write_error(err)
        if cause is None:
            raise
        raise OSError(
            f"{_named(name, out) if name else out}: the model cannot be written "
            f"({describe_write_error(cause)}); the partial write was removed"
        ) from err


def start_dist(cfg: Config) -> tuple[Dist, torch.device]:
    """The process group (under torchrun) and this process's device; threads."""
    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)
    _, _, local = launch.world()
    device = resolve_device(cfg.model.device, local)
    t = cfg.trainer
    return init_dist(t.strategy, t.dist_backend, t.dist_timeout_s, device), device


RUN_MARKER = ".proxima-run"  # written by rank 0 into a new run folder, read by every rank


def check_shared_run_dir(run_dir: Path, dist: Dist) -> None:
    """Every process sees the run folder rank 0 created: rank 0 writes a one-time token into
    it, every rank reads it back. Several nodes write checkpoints and read them back on
    resume, so they need `trainer.output_dir` on a filesystem they share; a node that does
    not see the token stops the run on every rank, naming the folder and the fix."""
    if not dist.active:
        return
    marker = run_dir / RUN_MARKER
    token = uuid.uuid4().hex if dist.is_main else None
    if dist.is_main:
        marker.write_text(token)
    token = dist.broadcast_object(token)

    def check() -> None:
        seen = marker.read_text() if marker.is_file() else None
        if seen != token:
            raise ConfigError(
                f"rank {dist.rank} does not see the run folder {run_dir} that rank 0 created "
                f"(no {RUN_MARKER} with rank 0's token there): the nodes of a job must share "
                "`trainer.output_dir` (a shared filesystem such as NFS or Lustre); point it "
                "at a folder every node mounts at the same path."
            )

    try:
        dist.agree(check, "the shared run folder check")  # returns once every rank has read
    finally:
        if dist.is_main:
            marker.unlink(missing_ok=True)


def new_run_dir(path: str | Path) -> Path:
    """`path`, or `path-2`, `path-3`, ... if it already holds a run: nothing is overwritten.
    A folder that cannot be created is a ConfigError naming trainer.output_dir."""
    base = Path(path)
    candidate, k = base, 1
    try:
        while candidate.exists() and (not candidate.is_dir() or any(candidate.iterdir())):
            k += 1
            candidate = base.with_name(f"{base.name}-{k}")
        candidate.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(
            f"`trainer.output_dir`={path}: cannot create the run folder {candidate} "
            f"({err.strerror or err}). Point trainer.output_dir at a folder you can write to."
        ) from None
    return candidate


def remove_orphans_near(output_dir: str | Path) -> None:
    """Temporary checkpoint folders left by killed writes in the runs at `output_dir`
    (`output_dir`, `output_dir-2`, ...), removed when the next run starts."""
    base = Path(output_dir)
    if not base.parent.is_dir():
        return
    pattern = re.compile(re.escape(base.name) + r"(-\d+)?")
    for run in base.parent.iterdir():
        if pattern.fullmatch(run.name) and run.is_dir():
            for orphan in remove_orphans(run / "checkpoints"):
                print(f"removed {orphan}: an unfinished checkpoint of a killed run")


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
    try:  # os.access says yes to root everywhere, also where writes fail (/sys, read-only)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as err:
        return f"the folder {folder} is not writable ({err.strerror or err})"
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


def writable_place(path: str | Path, name: str) -> Path:
    """`path` as a new file or folder that can be written: its folder exists (created with
    its parents when missing) and takes writes; a ConfigError naming `name` otherwise."""
    target = Path(path)
    problem = _folder_problem(target.parent)
    if problem:
        raise ConfigError(
            f"{_named(name, path)}: {problem}; point {name} at a place in a writable folder."
        )
    return target


def _named(name: str, path: str | Path) -> str:
    """`key`=value for a config key, --flag value for a flag."""
    return f"{name} {path}" if name.startswith("-") else f"{name}={path}"
