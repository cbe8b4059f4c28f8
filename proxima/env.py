"""This process's place in a torchrun job, read from the environment torchrun sets (RANK,
WORLD_SIZE, LOCAL_RANK): the one reader of it. A plain `python` launch is rank 0 of a world
of 1. Imports nothing from proxima."""

from __future__ import annotations

import os


def _read(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) without it."""
    return _read("RANK", 0), _read("WORLD_SIZE", 1), _read("LOCAL_RANK", 0)


def rank() -> int:
    """This process's rank in the job: torchrun's RANK, 0 without torchrun."""
    return _read("RANK", 0)


def world_size() -> int:
    """Processes in this job: torchrun's WORLD_SIZE, 1 without torchrun."""
    return _read("WORLD_SIZE", 1)


def is_main_process() -> bool:
    """Rank 0 of a torchrun job, or a plain single process: the one that prints."""
    return rank() == 0
