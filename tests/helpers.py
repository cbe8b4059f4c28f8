"""What many tests compare: a run's metrics without its wall-clock readings, and the weights
of a saved model folder."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from proxima.logging import read_metrics

WALL_CLOCK = ("time/", "tokens_per_s")  # readings of the clock, different on every run


def run_metrics(run: Path, skip: tuple[str, ...] = WALL_CLOCK) -> dict[int, dict]:
    """{step: metrics} of a run folder (read_metrics' rows, one per step), without the keys
    that start with `skip`."""
    rows = read_metrics(Path(run) / "metrics.jsonl")
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(skip)} for r in rows}


def model_weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(Path(folder) / "model.safetensors")


def assert_same_weights(a: Path, b: Path) -> None:
    """The model folders a and b hold the same tensors, bit for bit."""
    wa, wb = model_weights(a), model_weights(b)
    assert wa.keys() == wb.keys()
    assert [k for k in wa if not torch.equal(wa[k], wb[k])] == []
