"""What the recipes start with: threads, seed and device (one process, or this rank's place
in a torchrun job), a run folder that overwrites nothing, an output folder that holds no
model yet."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from proxima import env
from proxima.checkpoint import remove_orphans
from proxima.config import Config, ConfigError
from proxima.rng import seed_everything
from proxima.trainer.dist import Dist
from proxima.trainer.dist import init as init_dist
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


def start_dist(cfg: Config) -> tuple[Dist, torch.device]:
    """The process group (under torchrun) and this process's device; threads."""
    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)
    _, _, local = env.world()
    device = resolve_device(cfg.model.device, local)
    t = cfg.trainer
    return init_dist(t.strategy, t.dist_backend, t.dist_timeout_s, device), device


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
