"""Every random stream a run draws from: seeding, saving and restoring them.

torch (CPU and CUDA), numpy and Python's `random`. A checkpoint stores `rng_state()` so a
resumed run draws exactly what the uninterrupted one would have.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def rng_state() -> dict[str, Any]:
    """torch (CPU + CUDA), numpy and python RNG states, in types `torch.load` accepts with
    weights_only=True (numpy's key array becomes a tensor)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {
            "name": name,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state((n["name"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


@contextmanager
def preserve_rng() -> Iterator[None]:
    """Run a block (e.g. an evaluation) without shifting any global random stream."""
    saved = rng_state()
    try:
        yield
    finally:
        set_rng_state(saved)
