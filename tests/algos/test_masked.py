import math

import pytest
import torch

from proxima.algos import (
    AGG_MODES,
    RunningMoments,
    aggregate_loss,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)

X = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 10.0, 11.0, 12.0]])
# Row 0: a hole at t=1; row 1: one token; row 2: empty.
M = torch.tensor([[1, 0, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]])


def test_masked_sum_and_mean_global():
    # Real values: 1, 3, 4, 5 -> sum 13, mean 13 / 4 = 3.25.
    assert masked_sum(X, M).item() == 13.0
    assert masked_mean(X, M).item() == 3.25


def test_masked_mean_per_row_empty_row_is_zero():
    # Row 0: (1 + 3 + 4) / 3 = 8/3; row 1: 5; row 2 has no real token -> 0, not NaN.
    out = masked_mean(X, M, dim=-1)
    torch.testing.assert_close(out, torch.tensor([8.0 / 3.0, 5.0, 0.0]))


def test_masked_mean_empty_mask_is_zero():
    assert masked_mean(X, torch.zeros_like(M)).item() == 0.0


def test_masked_reductions_ignore_nan_and_inf_on_padding():
    x = X.clone()
    x[0, 1] = float("nan")
    x[2, 0] = float("-inf")
    assert masked_mean(x, M).item() == 3.25
    assert masked_var(x, M).item() == pytest.approx(35.0 / 12.0)
    assert torch.isfinite(masked_whiten(x, M)).all()


def test_masked_mean_accepts_bool_and_float_masks():
    assert masked_mean(X, M.bool()).item() == 3.25
    assert masked_mean(X, M.float()).item() == 3.25


def test_masked_var_unbiased_and_biased():
    # Values 1, 3, 4, 5: mean 3.25, squared deviations 5.0625 + 0.0625 + 0.5625 + 3.0625
    # = 8.75; biased 8.75 / 4 = 2.1875, unbiased 8.75 / 3 = 35/12.
    assert masked_var(X, M, unbiased=False).item() == pytest.approx(2.1875)
    assert masked_var(X, M).item() == pytest.approx(35.0 / 12.0)


def test_masked_var_fewer_than_two_tokens_is_zero():
    one = torch.tensor([[0, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]])
    assert masked_var(X, one).item() == 0.0
    assert masked_var(X, torch.zeros_like(M)).item() == 0.0
    assert masked_var(X, torch.zeros_like(M), unbiased=False).item() == 0.0


def test_masked_whiten_literal():
    # Values 1, 3, 4, 5: mean 3.25, unbiased var 35/12 -> (x - 3.25) / sqrt(35/12 + 1e-8).
    out = masked_whiten(X, M)
    scale = 1.0 / math.sqrt(35.0 / 12.0 + 1e-8)
    expected = torch.tensor(
        [
            [-2.25 * scale, 0.0, -0.25 * scale, 0.75 * scale],
            [1.75 * scale, 0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0],
        ]
    )
    torch.testing.assert_close(out, expected)
    assert masked_mean(out, M).abs().item() < 1e-6
    assert masked_var(out, M).item() == pytest.approx(1.0, abs=1e-5)


def test_masked_whiten_without_shift_keeps_mean():
    # shift_mean=False adds the mean 3.25 back on real tokens only.
    out = masked_whiten(X, M, shift_mean=False)
    scale = 1.0 / math.sqrt(35.0 / 12.0 + 1e-8)
    assert out[0, 0].item() == pytest.approx(-2.25 * scale + 3.25)
    assert out[0, 1].item() == 0.0
    assert masked_mean(out, M).item() == pytest.approx(3.25)


def test_masked_whiten_constant_input_is_zero():
    # var 0 -> rsqrt(1e-8) = 1e4 times (x - mean) = 0 exactly.
    out = masked_whiten(torch.full((2, 3), 7.0), torch.ones(2, 3))
    assert torch.equal(out, torch.zeros(2, 3))


def test_masked_whiten_constant_is_exactly_zero_when_float32_mean_rounds():
    # 0.7 on 7 tokens: in float32, sum / 7 misses 0.7 by 6e-8, which rsqrt(1e-8) = 1e4
    # would turn into 6e-4; in float64 7 * 0.7f / 7 is exactly 0.7f, so the result is 0.
    x = torch.full((2, 5), 0.7)
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    out = masked_whiten(x, mask)
    assert torch.equal(out, torch.zeros(2, 5)) and out.dtype == torch.float32


# Per-token losses for aggregate_loss: row 0 real (1, 3, 4) -> sum 8, mean 8/3;
# row 1 real (5) -> sum 5, mean 5; row 2 empty and not counted in the seq modes.
@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("token-mean", 13.0 / 4.0),  # (1 + 3 + 4 + 5) / 4
        ("token-sum", 13.0),  # 1 + 3 + 4 + 5 (verl token-sum; the empty row adds nothing)
        ("seq-mean-token-sum", (8.0 + 5.0) / 2.0),
        ("seq-mean-token-mean", (8.0 / 3.0 + 5.0) / 2.0),
        ("seq-mean-token-sum-norm", (8.0 / 4.0 + 5.0 / 4.0) / 2.0),  # width T = 4
    ],
)
def test_aggregate_loss_modes(mode, expected):
    assert aggregate_loss(X, M, mode).item() == pytest.approx(expected)


def test_aggregate_loss_token_sum_gradient_is_one_on_real_tokens():
    # d/dx sum over real tokens = 1 on each real token, 0 elsewhere (no 1/N normalisation).
    x = X.clone().requires_grad_(True)
    aggregate_loss(x, M, "token-sum").backward()
    torch.testing.assert_close(x.grad, M.float())


def test_aggregate_loss_default_is_token_mean():
    assert aggregate_loss(X, M).item() == 3.25


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_loss_all_empty_is_zero_not_nan(mode):
    assert aggregate_loss(X, torch.zeros_like(M), mode).item() == 0.0


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_loss_all_empty_has_zero_gradient_despite_nan(mode):
    # verl's agg_loss gives 0 / 0 = NaN here; proxima gives 0 and a zero gradient.
    x = X.clone()
    x[0, 0], x[1, 1] = float("nan"), float("inf")
    x.requires_grad_(True)
    loss = aggregate_loss(x, torch.zeros_like(M), mode)
    loss.backward()
    assert loss.item() == 0.0
    assert torch.equal(x.grad, torch.zeros_like(X))


@pytest.mark.parametrize("mode", AGG_MODES)
def test_aggregate_loss_gradient_only_on_real_tokens(mode):
    x = X.clone().requires_grad_(True)
    aggregate_loss(x, M, mode).backward()
    assert torch.equal(x.grad != 0, M != 0)


def test_aggregate_loss_unknown_mode_lists_valid_modes():
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'sum'") as err:
        aggregate_loss(X, M, "sum")
    for mode in AGG_MODES:
        assert mode in str(err.value)


def test_shape_mismatch_names_both_shapes():
    with pytest.raises(ValueError, match=r"x \[3, 4\] vs mask \[3, 3\]"):
        masked_mean(X, M[:, :3])
    with pytest.raises(ValueError, match=r"loss_mat \[3, 4\] vs mask \[2, 4\]"):
        aggregate_loss(X, M[:2])


def test_inputs_not_modified():
    x, m = X.clone(), M.clone()
    masked_whiten(x, m)
    masked_var(x, m)
    aggregate_loss(x, m, "seq-mean-token-mean")
    assert torch.equal(x, X) and torch.equal(m, M)


def test_running_moments_match_concatenation():
    # Batch 1: 1, 2, 3 (mean 2, unbiased std 1); batch 2: 4, 5, 6, 7, 8.
    # All of 1..8: mean 4.5, unbiased var = 42 / 7 = 6.
    rm = RunningMoments()
    assert rm.update(torch.tensor([1.0, 2.0, 3.0])) == pytest.approx((2.0, 1.0))
    rm.update(torch.tensor([[4.0, 5.0], [6.0, 7.0]]))
    rm.update(torch.tensor([8.0]))
    assert rm.count == 8
    assert rm.mean == pytest.approx(4.5)
    assert rm.var == pytest.approx(6.0)
    assert rm.std == pytest.approx(math.sqrt(6.0))


def test_running_moments_of_equal_values_divide_by_one():
    # every score 0, or 0.1 (whose float64 mean may round): x - mean is 0 for all of them,
    # and std 1.0 keeps a division by it defined; the first distinct value restores the std
    for value in (0.0, 0.1, -3e6):
        rm = RunningMoments()
        rm.update(torch.full((64,), value))
        assert rm.std == 1.0 and rm.var == pytest.approx(0.0, abs=1e-20)
    rm.update(torch.tensor([value + 2.0]))  # 64 x -3e6 and -3e6 + 2: var 4 x 64 / 65 / 64
    assert rm.std == pytest.approx(math.sqrt(4 * 64 / 65 / 64))


def test_running_moments_defaults_and_state_roundtrip():
    rm = RunningMoments()
    assert (rm.count, rm.mean, rm.var, rm.std) == (0, 0.0, 0.0, 1.0)
    assert rm.update(torch.tensor([])) == (0.0, 0.0)
    rm.update(torch.tensor([2.0, 4.0]))  # mean 3, var 2
    restored = RunningMoments()
    restored.load_state_dict(rm.state_dict())
    restored.update(torch.tensor([6.0]))  # 2, 4, 6: mean 4, var 4
    assert restored.mean == pytest.approx(4.0)
    assert restored.var == pytest.approx(4.0)
