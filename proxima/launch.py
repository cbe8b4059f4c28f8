"""This process's place in a torchrun job, read from the environment torchrun sets (RANK,
WORLD_SIZE, LOCAL_RANK): the one reader of it. A plain `python` launch is rank 0 of a world
of 1. And how it stops on a signal (`Interrupted`: exit status 128 + the signal's number).
Imports nothing from proxima."""

from __future__ import annotations

import os
import signal


class Interrupted(KeyboardInterrupt):
    """A stop by a signal, like Ctrl-C, that keeps the signal's number: the command exits
    with 128 + `signum` (130 for SIGINT, 143 for SIGTERM)."""

    def __init__(self, message: str, signum: int = signal.SIGINT) -> None:
        super().__init__(message)
        self.signum = int(signum)


def signum_of(err: KeyboardInterrupt) -> int:
    """The signal behind an interruption (SIGINT for a plain KeyboardInterrupt)."""
    return getattr(err, "signum", signal.SIGINT)


_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK")

_LAUNCH = (
    "torchrun sets RANK, WORLD_SIZE and LOCAL_RANK together: to run one process, unset them "
    "(`unset RANK WORLD_SIZE LOCAL_RANK`); to run N processes, launch with "
    "`torchrun --nproc_per_node N -m proxima train ...`"
)


class LaunchEnvironmentError(ValueError):
    """torchrun's variables are partly set or not integers (a stray environment): the
    process cannot know its place in the job. A ValueError, so the CLI reports it as
    `error: ...` with exit status 2."""


def _read(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None:
        return None
    try:
        return int(raw)
    except ValueError:
        raise LaunchEnvironmentError(
            f"{name}={raw!r} in the environment is not an integer. {_LAUNCH}."
        ) from None


def world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from torchrun's environment; (0, 1, 0) without it.
    LaunchEnvironmentError when the variables do not describe a place in a job: a world of
    several processes without RANK or LOCAL_RANK (a WORLD_SIZE left over in the shell), a
    rank outside the world, values that are not integers."""
    rank, size, local = (_read(name) for name in _NAMES)
    world_size = 1 if size is None else size
    if world_size < 1:
        raise LaunchEnvironmentError(f"WORLD_SIZE={size} must be >= 1. {_LAUNCH}.")
    if world_size > 1 and (rank is None or local is None):
        unset = [n for n, v in (("RANK", rank), ("LOCAL_RANK", local)) if v is None]
        verb = "are" if len(unset) > 1 else "is"
        raise LaunchEnvironmentError(
            f"WORLD_SIZE={world_size} is set but {' and '.join(unset)} {verb} not: this "
            f"process does not know its place in a job of {world_size} processes. {_LAUNCH}."
        )
    rank, local = rank or 0, local or 0
    if not 0 <= rank < world_size or local < 0:
        what = f"RANK={rank}" if not 0 <= rank < world_size else f"LOCAL_RANK={local}"
        raise LaunchEnvironmentError(
            f"{what} does not fit a job of WORLD_SIZE={world_size} process(es) (ranks 0 to "
            f"{world_size - 1}). {_LAUNCH}."
        )
    return rank, world_size, local


def rank() -> int:
    """This process's rank in the job: torchrun's RANK, 0 without torchrun."""
    return world()[0]


def world_size() -> int:
    """Processes in this job: torchrun's WORLD_SIZE, 1 without torchrun."""
    return world()[1]


def local_world_size(default: int) -> int:
    """Processes of this job on this machine: torchrun's LOCAL_WORLD_SIZE, else `default`."""
    local = _read("LOCAL_WORLD_SIZE")
    return default if local is None else local


def is_main_process() -> bool:
    """Rank 0 of a torchrun job, or a plain single process: the one that prints."""
    return rank() == 0
