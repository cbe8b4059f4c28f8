"""logprob_diff, truncated_is_weights, rejection_mask, RolloutCorrection (TIS and rejection
together: TRL's masked IS, IcePop) and mismatch_stats on literal tensors, the derivation
beside each value; and policy_loss with importance weights, rejected tokens included."""

import math

import pytest
import torch

from proxima.algos import (
    RolloutCorrection,
    logprob_diff,
    mismatch_stats,
    policy_loss,
    rejection_mask,
    truncated_is_weights,
)

MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


def test_logprob_diff_over_real_tokens_only():
    rollout = torch.tensor([[-1.0, -2.0, -50.0], [-0.5, 9.0, 9.0]])
    old = torch.tensor([[-1.5, -1.0, 0.0], [-0.25, 0.0, 0.0]])
    d = logprob_diff(rollout, old, MASK)
    # |diffs| on real tokens: 0.5, 1.0, 0.25 -> mean 1.75 / 3, max 1.0 (the 50 and 9s are pads)
    assert d["mean"].item() == pytest.approx(1.75 / 3)
    assert d["max"].item() == pytest.approx(1.0)
    empty = logprob_diff(rollout, old, torch.zeros_like(MASK))
    assert empty["mean"].item() == 0.0 and empty["max"].item() == 0.0


def test_token_level_weights_truncate_at_the_cap():
    old = torch.tensor([[-1.0, -1.0, 0.0], [-2.0, 0.0, 0.0]])
    rollout = torch.tensor([[-1.5, -0.5, -30.0], [-1.0, 0.0, 0.0]])
    w, stats = truncated_is_weights(old, rollout, MASK, cap=1.5)
    # log pi_old / mu = 0.5, -0.5, (pad), -1.0: exp -> 1.6487 (> cap: 1.5), 0.6065, 0.3679
    want = torch.tensor([[1.5, math.exp(-0.5), 0.0], [math.exp(-1.0), 0.0, 0.0]])
    torch.testing.assert_close(w, want)
    assert stats["is_weight_mean"].item() == pytest.approx(
        (1.5 + math.exp(-0.5) + math.exp(-1)) / 3
    )
    assert stats["is_truncated_frac"].item() == pytest.approx(1 / 3)


def test_sequence_level_weight_is_the_product_of_the_ratios():
    old = torch.tensor([[-1.0, -1.0, 0.0], [-2.0, 0.0, 0.0]])
    rollout = torch.tensor([[-1.2, -1.1, 5.0], [-1.0, 0.0, 0.0]])
    w, stats = truncated_is_weights(old, rollout, MASK, cap=2.0, level="sequence")
    # row 0: exp(0.2 + 0.1) = 1.3499 on both real tokens; row 1: exp(-1) on its one token
    want = torch.tensor([[math.exp(0.3), math.exp(0.3), 0.0], [math.exp(-1.0), 0.0, 0.0]])
    torch.testing.assert_close(w, want)
    assert stats["is_truncated_frac"].item() == 0.0


def test_weights_are_constants_and_arguments_are_checked():
    old = torch.zeros(2, 3, requires_grad=True)
    w, _ = truncated_is_weights(old, torch.zeros(2, 3), MASK)
    assert not w.requires_grad
    with pytest.raises(ValueError, match="cap must be >= 1"):
        truncated_is_weights(old, torch.zeros(2, 3), MASK, cap=0.5)
    with pytest.raises(ValueError, match="level must be one of"):
        truncated_is_weights(old, torch.zeros(2, 3), MASK, level="geometric")
    with pytest.raises(ValueError, match="shape mismatch"):
        truncated_is_weights(old, torch.zeros(2, 4), MASK)


def test_policy_loss_scales_each_token_by_its_weight():
    # ratio 1 everywhere (new == old): loss per token = -A; token-mean of -A * w
    logp = torch.zeros(2, 3)
    adv = torch.tensor([[1.0, -2.0, 7.0], [3.0, 7.0, 7.0]])
    w = torch.tensor([[0.5, 2.0, 100.0], [1.0, 100.0, 100.0]])  # weights on pads never count
    loss, _ = policy_loss(logp, logp, adv, MASK, is_weights=w)
    # (-1 * 0.5 + 2 * 2.0 - 3 * 1.0) / 3 = 0.5 / 3
    assert loss.item() == pytest.approx(0.5 / 3)
    plain, _ = policy_loss(logp, logp, adv, MASK)
    assert plain.item() == pytest.approx((-1 + 2 - 3) / 3)


# Log-ratios log(pi_old / mu) on the real tokens of MASK: 0.5, -0.8 (row 0), -0.2 (row 1);
# the pads hold junk (NaN, -30) that must never count.
OLD = torch.tensor([[-1.0, -1.0, 0.0], [-2.0, 0.0, 0.0]])
ROLLOUT = torch.tensor([[-1.5, -0.2, float("nan")], [-1.8, -30.0, 0.0]])


def test_token_rejection_masks_each_token_outside_the_band():
    keep, stats = rejection_mask(OLD, ROLLOUT, MASK)  # verl's default band [1/2, 2]
    # ratios e^0.5 = 1.649 (in), e^-0.8 = 0.449 (< 0.5: out); row 1: e^-0.2 = 0.819 (in)
    assert torch.equal(keep, torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))
    assert stats["rejected_token_frac"].item() == pytest.approx(1 / 3)
    assert stats["rejected_seq_frac"].item() == pytest.approx(1 / 2)  # row 0 lost a token
    # an empty row is not a sequence: it does not count in rejected_seq_frac
    pad = torch.zeros(1, 3)
    _, stats = rejection_mask(
        torch.cat([OLD, pad]), torch.cat([ROLLOUT, pad]), torch.cat([MASK, pad])
    )
    assert stats["rejected_seq_frac"].item() == pytest.approx(1 / 2)
    # a band wide enough for every token keeps them all
    keep, stats = rejection_mask(OLD, ROLLOUT, MASK, upper=3.0, lower=0.4)
    assert torch.equal(keep, MASK.float()) and stats["rejected_token_frac"].item() == 0.0


def test_sequence_rejection_takes_the_product_geometric_the_mean():
    # row 0: product e^(0.5 - 0.8) = e^-0.3 = 0.741, geometric mean e^-0.15 = 0.861;
    # row 1 (one token): both e^-0.2 = 0.819. The band [0.8, 1.2] (0.8 given: 1/1.2 = 0.833)
    keep, stats = rejection_mask(OLD, ROLLOUT, MASK, "sequence", upper=1.2, lower=0.8)
    assert torch.equal(keep, torch.tensor([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))  # whole row 0
    assert stats["rejected_token_frac"].item() == pytest.approx(2 / 3)
    assert stats["rejected_seq_frac"].item() == pytest.approx(1 / 2)
    # [0.85, 1.2]: the geometric mean keeps row 0 (0.861) and drops row 1 (0.819)
    keep, stats = rejection_mask(OLD, ROLLOUT, MASK, "geometric", upper=1.2, lower=0.85)
    assert torch.equal(keep, torch.tensor([[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]]))
    assert stats["rejected_token_frac"].item() == pytest.approx(1 / 3)
    # geometric's default band is verl's [1/1.001, 1.001]: both rows are outside
    keep, stats = rejection_mask(OLD, ROLLOUT, MASK, "geometric")
    assert keep.sum().item() == 0.0 and stats["rejected_seq_frac"].item() == 1.0


def test_the_bounds_are_kept_and_nan_is_rejected():
    ln2 = math.log(2.0)
    old = torch.tensor([[ln2, -ln2, 0.0, 0.0]])  # ratios exactly 2 and 1/2, 1, NaN
    rollout = torch.tensor([[0.0, 0.0, 0.0, float("nan")]])
    keep, _ = rejection_mask(old, rollout, torch.ones(1, 4))
    assert keep.tolist() == [[1.0, 1.0, 1.0, 0.0]]


def test_an_empty_mask_and_empty_rows_reject_nothing():
    empty = torch.zeros(2, 3)
    keep, stats = rejection_mask(OLD, ROLLOUT, empty, "sequence")
    assert keep.sum().item() == 0.0
    assert stats["rejected_token_frac"].item() == 0.0 and stats["rejected_seq_frac"].item() == 0.0
    w, stats = RolloutCorrection(level="token", rejection="token").weights(OLD, ROLLOUT, empty)
    assert w.sum().item() == 0.0 and stats["is_weight_mean"].item() == 0.0


def test_tis_and_rejection_multiply():
    corr = RolloutCorrection(level="token", cap=2.0, rejection="token")
    w, stats = corr.weights(OLD, ROLLOUT, MASK)
    # TIS weights e^0.5 = 1.649, e^-0.8 = 0.449, e^-0.2 = 0.819 (none above the cap 2);
    # the rejection (band [1/2, 2]) drops the 0.449
    want = torch.tensor([[math.exp(0.5), 0.0, 0.0], [math.exp(-0.2), 0.0, 0.0]])
    torch.testing.assert_close(w, want)
    assert stats["is_weight_mean"].item() == pytest.approx((math.exp(0.5) + math.exp(-0.2)) / 3)
    assert stats["is_truncated_frac"].item() == 0.0
    assert stats["rejected_token_frac"].item() == pytest.approx(1 / 3)
    assert stats["rejected_seq_frac"].item() == pytest.approx(1 / 2)
    # rejection alone: weight 1 on the kept tokens (verl's rollout_rs without rollout_is)
    w, stats = RolloutCorrection(rejection="token").weights(OLD, ROLLOUT, MASK)
    assert torch.equal(w, torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))
    assert set(stats) == {"rejected_token_frac", "rejected_seq_frac"}
    assert RolloutCorrection().weights(OLD, ROLLOUT, MASK) == (None, {})  # both off


def test_icepop_is_token_tis_inside_the_band_zero_outside():
    """IcePop (Ring-1T): M(k) = k for k in [alpha, beta] = [0.5, 5], else 0."""
    ratios = [0.3, 0.5, 1.0, 4.0, 5.0, 10.0]
    old = torch.tensor([[math.log(k) for k in ratios]])
    icepop = RolloutCorrection(level="token", cap=5.0, rejection="token", upper=5.0, lower=0.5)
    w, stats = icepop.weights(old, torch.zeros(1, 6), torch.ones(1, 6))
    torch.testing.assert_close(w, torch.tensor([[0.0, 0.5, 1.0, 4.0, 5.0, 0.0]]))
    assert stats["rejected_token_frac"].item() == pytest.approx(2 / 6)
    assert stats["is_weight_mean"].item() == pytest.approx(10.5 / 6)


def test_trl_sequence_mask_keeps_the_sequence_ratio_inside_the_band():
    """TRL's sequence_mask (cap 3, no lower bound): a row's weight is its ratio when <= 3,
    else 0 on all its tokens."""
    old = torch.tensor([[math.log(2.5) / 2, math.log(2.5) / 2], [math.log(3.5), 0.0]])
    mask = torch.tensor([[1, 1], [1, 1]])
    trl = RolloutCorrection(level="sequence", cap=3.0, rejection="sequence", upper=3.0, lower=1e-9)
    w, stats = trl.weights(old, torch.zeros(2, 2), mask)
    torch.testing.assert_close(w, torch.tensor([[2.5, 2.5], [0.0, 0.0]]))
    assert stats["rejected_seq_frac"].item() == pytest.approx(1 / 2)


def test_all_rejected_leaves_a_finite_loss_and_no_gradient():
    w, _ = RolloutCorrection(rejection="sequence", upper=1.1).weights(OLD, ROLLOUT, MASK)
    assert w.sum().item() == 0.0  # ratios 0.741 and 0.819, both below 1 / 1.1 = 0.909
    logp = torch.full((2, 3), -1.0, requires_grad=True)
    loss, _ = policy_loss(logp, OLD, torch.ones(2, 3), MASK, is_weights=w)
    loss.backward()
    assert loss.item() == 0.0 and torch.equal(logp.grad, torch.zeros(2, 3))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"level": "seq"}, "level must be one of"),
        ({"upper": 0.9}, r"\[1.1111111111111112, 0.9\] must hold the on-policy ratio 1"),
        ({"upper": 1.0}, "must hold the on-policy ratio 1"),
        ({"lower": 1.2}, r"\[1.2, 2.0\] must hold"),
        ({"lower": 0.0}, "must hold"),
        ({"upper": math.inf}, "must hold"),
    ],
)
def test_a_band_without_the_ratio_one_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        rejection_mask(OLD, ROLLOUT, MASK, **kwargs)


def test_rollout_correction_checks_its_choices_when_built():
    with pytest.raises(ValueError, match="rejection must be '' or one of"):
        RolloutCorrection(rejection="icepop")
    with pytest.raises(ValueError, match="level must be '' or one of"):
        RolloutCorrection(level="geometric")
    with pytest.raises(ValueError, match="cap must be >= 1"):
        RolloutCorrection(level="token", cap=0.5)
    with pytest.raises(ValueError, match=r"\[1.0005, 1.001\] must hold"):
        RolloutCorrection(rejection="geometric", lower=1.0005)  # upper 0: the default 1.001
    assert RolloutCorrection(rejection="geometric").band == (1 / 1.001, 1.001)
    assert RolloutCorrection(rejection="token", upper=4.0).band == (0.25, 4.0)


def test_mismatch_stats_over_real_tokens_and_rows():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]])  # the third row is empty
    old = torch.cat([OLD, torch.zeros(1, 3)])
    rollout = torch.cat([ROLLOUT, torch.full((1, 3), float("nan"))])
    s = mismatch_stats(old, rollout, mask)
    k3 = [math.expm1(x) - x for x in (0.5, -0.8, -0.2)]  # 0.1487, 0.2493, 0.0187
    assert s["kl_k3"].item() == pytest.approx(sum(k3) / 3, rel=1e-5)
    # row sums -0.3 and -0.2 (the empty row is not a sequence)
    assert s["seq_logratio_mean"].item() == pytest.approx(-0.25, rel=1e-5)
    assert s["seq_logratio_abs_max"].item() == pytest.approx(0.3, rel=1e-5)
    none = mismatch_stats(old, rollout, torch.zeros(3, 3))
    assert all(v.item() == 0.0 for v in none.values())
