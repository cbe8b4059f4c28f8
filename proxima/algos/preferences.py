"""Synthetic preference labels from a gold score (Bradley-Terry), as in Gao et al. 2022,
"Scaling Laws for Reward Model Overoptimization" (arXiv:2210.10760): a gold scorer stands
in for the human labeller, and the labels it gives are noisy the way human ones are.

Given the gold scores g_a, g_b of two responses to one prompt, the labeller prefers a with
the Bradley-Terry probability (InstructGPT eq. 1, Ouyang et al. 2022)

    P(a > b) = sigmoid((g_a - g_b) / (temperature * scale))

(`scale`: the gold scores' spread, so that `temperature` is free of the gold's units; a
temperature of 0 gives the deterministic label, the better response always wins), then flips
the label with probability `noise` (a careless labeller), so that overall

    P(a > b) = noise + (1 - 2 noise) * sigmoid((g_a - g_b) / (temperature * scale)).

Pairs whose gold scores are equal carry no preference: they are left out (the usual
treatment of ties when binarising rated comparisons).
"""

from __future__ import annotations

import torch


def preference_probability(
    gold_a: torch.Tensor,
    gold_b: torch.Tensor,
    temperature: float,
    noise: float = 0.0,
    scale: float = 1.0,
) -> torch.Tensor:
    """P(a preferred over b) [N] for gold scores gold_a, gold_b [N] (module docstring).
    temperature >= 0 (0: the better one with probability 1 - noise), 0 <= noise <= 0.5,
    scale > 0. Ties give 0.5."""
    if temperature < 0 or not 0 <= noise <= 0.5 or scale <= 0:
        raise ValueError(
            f"preference_probability: need temperature >= 0, 0 <= noise <= 0.5 and scale > 0, "
            f"got temperature={temperature}, noise={noise}, scale={scale}"
        )
    diff = (gold_a - gold_b).double()
    if temperature == 0:
        p = (diff > 0).double() + 0.5 * (diff == 0).double()
    else:
        p = torch.sigmoid(diff / (temperature * scale))
    return (noise + (1 - 2 * noise) * p).to(gold_a.dtype)


def sample_preferences(
    gold_a: torch.Tensor,
    gold_b: torch.Tensor,
    temperature: float,
    noise: float,
    scale: float,
    generator: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sampled labels for N pairs: (a_wins [N] bool, kept [N] bool: the pairs whose gold
    scores differ). a_wins is drawn for every pair; only the kept ones are labels."""
    p = preference_probability(gold_a.double(), gold_b.double(), temperature, noise, scale)
    a_wins = torch.rand(p.shape, generator=generator, dtype=torch.float64) < p
    return a_wins, gold_a != gold_b
