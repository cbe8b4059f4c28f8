"""What every command's recipe starts with: threads, seed and device, and an output folder
that holds no model yet."""

from __future__ import annotations

from pathlib import Path

import torch

from proxima.config import Config
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
