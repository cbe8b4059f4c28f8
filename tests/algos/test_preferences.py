"""Bradley-Terry labels from gold scores: exact probabilities and sampling statistics."""

from __future__ import annotations

import math

import pytest
import torch

from proxima.algos import preference_probability, sample_preferences


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_probability_literals():
    a = torch.tensor([2.0, 1.0, 0.5, 3.0], dtype=torch.float64)
    b = torch.tensor([1.0, 1.0, 1.5, 0.0], dtype=torch.float64)
    # diff = [1, 0, -1, 3]; temperature 0.5, scale 2: divide by 1 -> sigmoid(diff)
    got = preference_probability(a, b, temperature=0.5, scale=2.0)
    want = [_sigmoid(1.0), 0.5, _sigmoid(-1.0), _sigmoid(3.0)]
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64))
    # a flip rate of 0.1: 0.1 + 0.8 p
    noisy = preference_probability(a, b, temperature=0.5, noise=0.1, scale=2.0)
    torch.testing.assert_close(
        noisy, torch.tensor([0.1 + 0.8 * p for p in want], dtype=torch.float64)
    )


def test_temperature_zero_is_the_gold_order_and_half_noise_is_a_coin():
    a = torch.tensor([2.0, 1.0, 0.0])
    b = torch.tensor([1.0, 1.0, 5.0])
    assert preference_probability(a, b, 0.0).tolist() == [1.0, 0.5, 0.0]
    assert preference_probability(a, b, 0.0, noise=0.2).tolist() == pytest.approx([0.8, 0.5, 0.2])
    assert preference_probability(a, b, 1.0, noise=0.5).tolist() == [0.5, 0.5, 0.5]


def test_scale_makes_the_temperature_unit_free():
    a, b = torch.tensor([3.0]), torch.tensor([1.0])
    p = preference_probability(a, b, 0.5, scale=2.0)
    # the same scores in other units (x 100) with the matching scale give the same labels
    assert preference_probability(100 * a, 100 * b, 0.5, scale=200.0).item() == pytest.approx(
        p.item()
    )
    assert p.item() == pytest.approx(_sigmoid(2.0))


@pytest.mark.parametrize(
    "kwargs", [{"temperature": -1.0}, {"noise": 0.6}, {"noise": -0.1}, {"scale": 0.0}]
)
def test_bad_arguments_are_refused(kwargs):
    args = {"temperature": 1.0, "noise": 0.0, "scale": 1.0, **kwargs}
    with pytest.raises(ValueError, match="preference_probability"):
        preference_probability(torch.zeros(1), torch.ones(1), **args)


def test_sampled_labels_follow_the_probability_and_ties_are_left_out():
    n = 40_000
    a = torch.full((n,), 1.0)
    b = torch.cat([torch.zeros(n // 2), torch.ones(n // 2)])  # first half: diff 1; then ties
    gen = torch.Generator().manual_seed(0)
    a_wins, kept = sample_preferences(a, b, temperature=1.0, noise=0.1, scale=1.0, generator=gen)
    assert kept.tolist() == [True] * (n // 2) + [False] * (n // 2)
    p = 0.1 + 0.8 * _sigmoid(1.0)
    freq = a_wins[: n // 2].double().mean().item()
    # binomial std of the frequency: sqrt(p (1 - p) / 20000) ~ 0.003; 5 sigma
    assert abs(freq - p) < 5 * math.sqrt(p * (1 - p) / (n // 2))
    again = sample_preferences(a, b, 1.0, 0.1, 1.0, torch.Generator().manual_seed(0))[0]
    assert torch.equal(again, a_wins)  # the generator alone decides
