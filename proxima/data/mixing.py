"""Several prompt sets at once: their `dataset` column, and batches mixed from them with weights.

`data.train_path` (and `data.eval_path`) may list several files. Each set is named by its
file (`set_names`) and every record of it carries that name in a `dataset` column, so that a
reward function can score each set its own way and evaluation reports each set apart.
Training batches mix the sets by `data.train_weights` (`MixedPromptLoader`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from proxima.data.prompts import PromptLoader

DATASET_COLUMN = "dataset"  # the column naming a record's prompt set, when there are several


def mixing_weights(weights: Sequence[float], sizes: Sequence[int]) -> list[float]:
    """The share of each set in a batch: `weights` normalised, or, when none are given, in
    proportion to the sets' sizes (as if the files were one)."""
    raw = [float(w) for w in weights] if weights else [float(n) for n in sizes]
    total = sum(raw)
    return [w / total for w in raw]


def batch_counts(shares: Sequence[float], batch_size: int, generator: torch.Generator):
    """How many prompts of each set one batch takes: each set its whole part of
    `share * batch_size`, and the slots left over drawn by systematic sampling on the
    fractional parts, so that a set's expected count is exactly `share * batch_size` and
    every batch is within one prompt of it."""
    exact = [s * batch_size for s in shares]
    counts = [math.floor(x) for x in exact]
    left = batch_size - sum(counts)
    if left:
        fractions = [x - c for x, c in zip(exact, counts, strict=True)]
        scale = left / sum(fractions)  # the fractions sum to `left` up to rounding
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        edge, point, i = 0.0, u, 0
        for _ in range(left):
            while i < len(shares) - 1 and edge + fractions[i] * scale <= point:
                edge += fractions[i] * scale
                i += 1
            counts[i] += 1
            point += 1.0
            # a set is hit at most once: its fraction is below 1
    return counts


class MixedPromptLoader:
    """Endless batches mixed from several prompt sets with `weights` (see `mixing_weights`),
    each set reshuffled whenever it is used up; resumable.

    Batch `b`'s make-up and order depend only on `(seed, b)` and each set's own order only on
    `(seed, set, epoch)`, so :meth:`load_state_dict` resumes exactly where an uninterrupted
    run would be. The same interface as `PromptLoader`.
    """

    def __init__(
        self,
        sets: Mapping[str, Sequence[Any]],
        weights: Sequence[float],
        batch_size: int,
        seed: int,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1; set `data.train_batch_size`.")
        self.names = list(sets)
        self.sets = [sets[n] for n in self.names]
        self.shares = mixing_weights(weights, [len(s) for s in self.sets])
        self.batch_size, self.seed = batch_size, seed
        self.batch = 0  # batches served
        self.epochs = [0] * len(self.sets)  # each set's epoch and position in it
        self.positions = [0] * len(self.sets)
        self._orders: list[list[int] | None] = [None] * len(self.sets)

    def __len__(self) -> int:
        return sum(len(s) for s in self.sets)

    def expected_counts(self) -> dict[str, float]:
        """Each set's prompts per batch, on average."""
        return {n: s * self.batch_size for n, s in zip(self.names, self.shares, strict=True)}

    def _order(self, i: int) -> list[int]:
        if self._orders[i] is None:
            key = (self.seed * 1_000_003 + (i + 1) * 7_919_993 + self.epochs[i]) % (2**63)
            gen = torch.Generator().manual_seed(key)
            self._orders[i] = torch.randperm(len(self.sets[i]), generator=gen).tolist()
        return self._orders[i]

    def _take(self, i: int) -> Any:
        if self.positions[i] >= len(self.sets[i]):
            self.epochs[i], self.positions[i], self._orders[i] = self.epochs[i] + 1, 0, None
        item = self.sets[i][self._order(i)[self.positions[i]]]
        self.positions[i] += 1
        return item

    def __iter__(self) -> MixedPromptLoader:
        return self

    def __next__(self) -> list[Any]:
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + self.batch) % (2**63) + 1)
        counts = batch_counts(self.shares, self.batch_size, gen)
        drawn = [self._take(i) for i, c in enumerate(counts) for _ in range(c)]
        # the sets interleaved, so that every process's share of the batch holds each of them
        order = torch.randperm(len(drawn), generator=gen).tolist()
        self.batch += 1
        return [drawn[j] for j in order]

    def state_dict(self) -> dict[str, Any]:
        return {
            "seed": self.seed,
            "batch": self.batch,
            "sets": {
                n: [e, p] for n, e, p in zip(self.names, self.epochs, self.positions, strict=True)
            },
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("seed") != self.seed or "sets" not in state:
            raise ValueError(
                "the checkpoint's prompt loader is not this run's (another seed or a single "
                "prompt set); resume with the same `trainer.seed` and `data.train_path`."
            )
        missing = [n for n in self.names if n not in state["sets"]]
        if missing:
            raise ValueError(
                f"the checkpoint has no position for the prompt set(s) {missing} (it mixed "
                f"{sorted(state['sets'])}); resume with the same `data.train_path`."
            )
        self.batch = int(state["batch"])
        for i, n in enumerate(self.names):
            self.epochs[i], self.positions[i] = (int(v) for v in state["sets"][n])
        self._orders = [None] * len(self.sets)


def tag_records(records: Sequence[Mapping[str, Any]], name: str) -> list[dict]:
    """`records` with their set's name in the `dataset` column; a record that has a column
    of that name already is refused (the name would be lost)."""
    out = []
    for i, record in enumerate(records):
        if DATASET_COLUMN in record:
            raise ValueError(
                f"record {i} has a column {DATASET_COLUMN!r}, the column proxima "
                "gives each record of several prompt files (the name of its file's set); "
                "rename that column."
            )
        out.append({**record, DATASET_COLUMN: name})
    return out


def prompt_loader(
    prompts: Sequence[Any] | Mapping[str, Sequence[Any]],
    batch_size: int,
    seed: int,
    weights: Sequence[float] = (),
) -> PromptLoader | MixedPromptLoader:
    """The training prompts' loader: one set's, or, for {name: set}, batches mixed from the
    sets by `weights` (`data.train_weights`)."""
    if isinstance(prompts, Mapping):
        return MixedPromptLoader(prompts, weights, batch_size, seed)
    return PromptLoader(prompts, batch_size, seed=seed)


def all_items(prompts: Sequence[Any] | Mapping[str, Sequence[Any]]) -> list[Any]:
    """Every prompt of one set, or of {name: set}."""
    sets = prompts.values() if isinstance(prompts, Mapping) else [prompts]
    return [item for s in sets for item in s]
