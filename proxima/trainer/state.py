"""The trainer's stateful parts in one registry: a checkpoint (`state_dict` /
`load_state_dict`), the snapshot an iteration starts from and `undo` (put back after it
raised) are each one loop over it.

Each part is registered once, by name (the key of the checkpoint's dict), with how it is
saved and loaded; a part that an iteration changes before its first optimizer step is also
snapshotted (by default as it is saved), so that `PPOTrainer.undo_iteration` can put it back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Part:
    """How one part is saved and loaded; with `snapshot` / `restore`, what an iteration that
    raised puts back."""

    save: Callable[[], Any]
    load: Callable[[Any], None]
    snapshot: Callable[[], Any] | None = None
    restore: Callable[[Any], None] | None = None


def stateful(obj, undo: bool = True) -> Part:
    """The part of an object with `state_dict()` / `load_state_dict()` (torch's protocol);
    `undo`: snapshotted by its own `snapshot()` / `restore()` when it has them (e.g. a batch
    kept by reference), else by its state dict."""
    if not undo:
        return Part(obj.state_dict, obj.load_state_dict)
    snapshot = getattr(obj, "snapshot", obj.state_dict)
    restore = getattr(obj, "restore", obj.load_state_dict)
    return Part(obj.state_dict, obj.load_state_dict, snapshot, restore)


class StateRegistry:
    """Named parts; the checkpoint holds them in the order they were registered and loads them
    in that order (the iteration before the random streams that are reseeded from it)."""

    def __init__(self) -> None:
        self.parts: dict[str, Part] = {}

    def add(self, name: str, part: Part) -> None:
        if name in self.parts:
            raise ValueError(f"trainer state {name!r} registered twice")
        self.parts[name] = part

    def state_dict(self) -> dict:
        return {name: part.save() for name, part in self.parts.items()}

    def load_state_dict(self, state: dict) -> None:
        """Every part the checkpoint holds (a part it lacks, e.g. sampling ahead turned on at
        resume, keeps its fresh state)."""
        for name, part in self.parts.items():
            if state.get(name) is not None:
                part.load(state[name])

    def snapshot(self) -> dict:
        return {n: p.snapshot() for n, p in self.parts.items() if p.snapshot is not None}

    def restore(self, snapshot: dict) -> None:
        for name, value in snapshot.items():
            self.parts[name].restore(value)
