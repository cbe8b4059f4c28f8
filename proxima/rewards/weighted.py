"""Several reward sources as one: the score is the weighted sum of their raw scores.

`WeightedReward` is itself a reward source (same call, [B] scores): evaluation and anything
else that takes a source see the weighted sum. Training calls `scored`, which returns the
parts too ([B, K] raw scores, one column per source) so that each source is logged
(`reward/<name>`), standardised per source (`standardise`, `normalize`: from running
statistics over the whole batch, which it keeps and a checkpoint saves) and handed to gdpo
as its reward components.
Per source, in this order: standardise (training, `normalize`), clip to [-clip, clip]
(`clip` > 0), weight; then sum.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from proxima.algos import RunningMoments


@dataclass(frozen=True)
class WeightedPart:
    name: str
    weight: float
    source: Callable[..., torch.Tensor]
    clip: float = 0.0  # > 0: clip the (standardised) raw score to [-clip, clip]
    normalize: bool = False


class WeightedReward:
    """The weighted sum of several reward sources (see the module docstring)."""

    def __init__(self, parts: Sequence[WeightedPart]) -> None:
        if not parts:
            raise ValueError("WeightedReward needs at least one source")
        self.parts = list(parts)
        self.names = [p.name for p in self.parts]
        self.weights = torch.tensor([p.weight for p in self.parts], dtype=torch.float32)
        self.name = "the reward sources " + ", ".join(self.names)
        # one per source that is standardised (`normalize`), over the batches seen so far
        self.moments = {p.name: RunningMoments() for p in self.parts if p.normalize}

    def scored(self, *call) -> tuple[torch.Tensor, torch.Tensor]:
        """([B] the weighted sum, [B, K] the raw score of each source) for the arguments of
        a reward source's call (`proxima.rewards`): the call, with its parts."""
        components = self.components(*call)
        return self.combine(components), components

    def standardise(self, scores: torch.Tensor, components: torch.Tensor) -> torch.Tensor:
        """[B] `scores` (the weighted sum of the [B, K] `components` of the whole batch, plus
        whatever was added to it, e.g. the overlong penalty) with the sources that have
        `normalize` standardised, after their running statistics are updated with this
        batch; `scores` itself when no source has it."""
        if not self.moments:
            return scores
        mean, std = torch.zeros(components.shape[1]), torch.ones(components.shape[1])
        for k, part in enumerate(self.parts):
            if part.normalize:
                self.moments[part.name].update(components[:, k])
                mean[k] = self.moments[part.name].mean
                std[k] = self.moments[part.name].std
        shaped = self.combine(components, mean, std)
        return scores - self.combine(components) + shaped

    def state_dict(self) -> dict[str, dict[str, float]]:
        """The running statistics of each standardised source."""
        return {name: m.state_dict() for name, m in self.moments.items()}

    def load_state_dict(self, state: dict[str, dict[str, float]]) -> None:
        for name, moments in self.moments.items():
            moments.load_state_dict(state[name])

    def components(
        self,
        prompts: list[str],
        responses: list[str],
        columns: dict[str, list[Any]],
        sequences: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[B, K] float32: each source's raw score of each response (column k: source k)."""
        return torch.stack(
            [
                p.source(prompts, responses, columns, sequences, attention_mask).float().cpu()
                for p in self.parts
            ],
            dim=1,
        )

    def combine(
        self,
        components: torch.Tensor,
        mean: torch.Tensor | None = None,
        std: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[B] the weighted sum of [B, K] components: those with `normalize` standardised by
        `mean` / `std` [K] when given (training), each clipped where it has a clip."""
        x = components.float()
        if mean is not None and std is not None:
            norm = torch.tensor([p.normalize for p in self.parts])
            x = torch.where(norm, (x - mean) / std.clamp(min=1e-8), x)
        clip = torch.tensor([p.clip for p in self.parts], dtype=x.dtype)
        x = torch.where(clip > 0, torch.maximum(torch.minimum(x, clip), -clip), x)
        return (x * self.weights.to(x.device)).sum(dim=1)

    def __call__(self, prompts, responses, columns, sequences=None, attention_mask=None):
        return self.combine(self.components(prompts, responses, columns, sequences, attention_mask))

    def pop_stats(self) -> dict[str, float]:
        """The sources' own counters (a remote or guarded source's fallbacks, retries),
        as reward/<name>/<stat>, reset."""
        out = {}
        for p in self.parts:
            pop = getattr(p.source, "pop_stats", None)
            if pop is not None:
                out.update({f"reward/{p.name}/{k}": float(v) for k, v in pop().items()})
        return out
