"""pass@k against the closed form 1 - C(n - c, k) / C(n, k), worked out by hand."""

import math

import pytest
import torch

from proxima.algos import mean_at_k, pass_at_k, pass_at_k_table


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (4, 1, 1, 1 / 4),  # one correct of four, one draw
        (4, 1, 2, 1 - 3 / 6),  # C(3,2)=3 of C(4,2)=6 pairs miss it
        (4, 2, 2, 1 - 1 / 6),  # only the pair of the two wrong ones misses
        (4, 2, 3, 1.0),  # three draws cannot all be wrong with two wrong
        (5, 0, 3, 0.0),
        (5, 5, 1, 1.0),
        (10, 3, 4, 1 - 35 / 210),  # C(7,4)=35, C(10,4)=210
    ],
)
def test_pass_at_k_is_the_closed_form(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
    assert expected == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k))


def test_pass_at_k_is_not_the_bootstrapped_best_of_k():
    # c = 1 of n = 2, k = 2: both samples are drawn, pass@2 is exactly 1; a bootstrap that
    # resamples with replacement gives 1 - (1/2)^2 = 0.75.
    assert pass_at_k(2, 1, 2) == 1.0


def test_pass_at_k_refuses_k_above_n():
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(2, 1, 3)


def test_table_averages_prompts_for_every_k():
    correct = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]])
    table = pass_at_k_table(correct)
    assert sorted(table) == [1, 2, 3, 4]
    assert table[1] == pytest.approx((1 / 4 + 2 / 4 + 0) / 3)
    assert table[2] == pytest.approx((1 / 2 + 5 / 6 + 0) / 3)
    assert table[4] == pytest.approx((1 + 1 + 0) / 3)
    assert mean_at_k(torch.tensor([[1.0, 0.0], [0.5, 0.5]])) == 0.5
