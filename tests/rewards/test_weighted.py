"""Several reward sources as one (`rewards.weighted`): the weighted sum, each source's
clip and standardisation."""

from __future__ import annotations

import torch

from proxima.rewards import WeightedPart, WeightedReward


def test_weighted_reward_combines_standardises_and_clips():
    def const(values):
        return lambda prompts, responses, columns, *_: torch.tensor(values)

    reward = WeightedReward(
        [
            WeightedPart("a", 2.0, const([1.0, 3.0])),
            WeightedPart("b", -1.0, const([10.0, -10.0]), clip=4.0, normalize=True),
        ]
    )
    comps = reward.components(["p", "q"], ["x", "y"], {})
    assert comps.tolist() == [[1.0, 10.0], [3.0, -10.0]]
    # raw: 2 x a - clip(b, 4)
    assert reward(["p", "q"], ["x", "y"], {}).tolist() == [2.0 - 4.0, 6.0 + 4.0]
    # standardised b (mean 0, std 10), then clipped, then weighted
    got = reward.combine(comps, torch.tensor([0.0, 0.0]), torch.tensor([1.0, 10.0]))
    assert got.tolist() == [2.0 - 1.0, 6.0 + 1.0]
