"""logprob_diff and truncated_is_weights on literal tensors, the derivation beside each value;
and policy_loss with importance weights."""

import math

import pytest
import torch

from proxima.algos import logprob_diff, policy_loss, truncated_is_weights

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
