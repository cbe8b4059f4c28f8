"""DPO, cDPO and IPO losses on literal log-probs worked out by hand, their gradients, and
TRL DPOTrainer's formulas written out here from its documentation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from proxima.algos import DPO_LOSS_TYPES, dpo_logits, dpo_loss

LOG2, LOG3 = math.log(2.0), math.log(3.0)


def _leaf(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def _const(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_logits_are_the_policy_gap_beyond_the_reference_gap():
    # (pi_c - pi_r) - (ref_c - ref_r) = (-1 - -4) - (-2 - -3) = 3 - 1 = 2
    out = dpo_logits(_const(-1.0), _const(-4.0), _const(-2.0), _const(-3.0))
    assert out.tolist() == [2.0]


def test_sigmoid_loss_is_log_2_where_policy_and_reference_agree():
    # logits = (-3 - -5) - (-3 - -5) = 0: -log sigmoid(0) = -log(1/2) = log 2 = 0.693147...
    # Rewards beta (pi - ref) are 0 on both sides: the tie counts as a wrong order.
    loss, stats = dpo_loss(_leaf(-3.0), _leaf(-5.0), _const(-3.0), _const(-5.0), beta=0.1)
    assert loss.item() == pytest.approx(LOG2, abs=1e-12)
    assert stats["loss"] == pytest.approx(0.6931471805599453, abs=1e-12)
    assert stats["rewards/chosen"] == stats["rewards/rejected"] == 0.0
    assert stats["rewards/margins"] == 0.0 and stats["rewards/accuracies"] == 0.0


def test_sigmoid_loss_literal_and_its_rewards():
    # beta = 0.1, logits = 10 log 3 (pi_c - pi_r = 10 log 3, ref_c - ref_r = 0), so
    # beta * logits = log 3, sigmoid(log 3) = 3 / (3 + 1) = 3/4: loss = log(4/3) = 0.287682...
    # Rewards: chosen 0.1 (10 log 3 - 2 - -4) = log 3 + 0.2, rejected 0.1 (-2 - -4) = 0.2,
    # margin log 3, accuracy 1.
    pc, pr = _leaf(10 * LOG3 - 2.0), _leaf(-2.0)
    loss, stats = dpo_loss(pc, pr, _const(-4.0), _const(-4.0), beta=0.1)
    assert loss.item() == pytest.approx(math.log(4 / 3), abs=1e-12)
    assert stats["rewards/chosen"] == pytest.approx(LOG3 + 0.2, abs=1e-12)
    assert stats["rewards/rejected"] == pytest.approx(0.2, abs=1e-12)
    assert stats["rewards/margins"] == pytest.approx(LOG3, abs=1e-12)
    assert stats["rewards/accuracies"] == 1.0
    assert stats["logits"] == pytest.approx(10 * LOG3, abs=1e-12)
    # d/dpi_c -log sigmoid(beta l) = -beta sigmoid(-beta l) = -0.1 * 1/4 = -0.025; +0.025 for
    # pi_r (one pair, so the batch mean divides by 1).
    loss.backward()
    assert pc.grad.item() == pytest.approx(-0.025, abs=1e-12)
    assert pr.grad.item() == pytest.approx(0.025, abs=1e-12)


def test_sigmoid_gradient_is_averaged_over_the_batch():
    # Two pairs at logits 0: each d/dpi_c = -beta sigmoid(0) / B = -0.5 * 1/2 / 2 = -0.125.
    pc = _leaf(-1.0, -2.0)
    loss, _ = dpo_loss(pc, _leaf(-1.0, -2.0), _const(-1.0, -2.0), _const(-1.0, -2.0), beta=0.5)
    loss.backward()
    assert pc.grad.tolist() == pytest.approx([-0.125, -0.125], abs=1e-12)


def test_reference_enters_as_the_mirror_of_the_policy():
    # logits = (pi_c - pi_r) - (ref_c - ref_r): d loss / d ref_c = -d loss / d pi_c
    # = +beta sigmoid(-beta l) = 0.1 * 1/2 at l = 0 (the trainer passes it detached).
    pc, rc = _leaf(-1.0), _leaf(-1.0)
    loss, _ = dpo_loss(pc, _leaf(-2.0), rc, _const(-2.0), beta=0.1)
    loss.backward()
    assert rc.grad.item() == pytest.approx(0.05, abs=1e-12) == -pc.grad.item()


def test_label_smoothing_literal_and_its_optimum():
    # eps = 1/4, beta logits = log 3 (as above): -(3/4) log(3/4) - (1/4) log(1/4)
    # = (3/4) log 4 - (3/4) log 3 + (1/4) log 4 = log 4 - (3/4) log 3 = 0.562335...
    pc = _leaf(10 * LOG3)
    loss, _ = dpo_loss(pc, _leaf(0.0), _const(0.0), _const(0.0), beta=0.1, label_smoothing=0.25)
    assert loss.item() == pytest.approx(2 * LOG2 - 0.75 * LOG3, abs=1e-12)
    # d/dl = beta (-(1 - eps) sigmoid(-beta l) + eps sigmoid(beta l))
    # = 0.1 (-(3/4)(1/4) + (1/4)(3/4)) = 0: cDPO stops pushing once sigmoid(beta l) = 1 - eps.
    loss.backward()
    assert pc.grad.item() == pytest.approx(0.0, abs=1e-12)


def test_label_smoothing_zero_is_plain_dpo():
    pc, pr, rc, rr = (torch.randn(5, dtype=torch.float64) for _ in range(4))
    plain, _ = dpo_loss(pc, pr, rc, rr, beta=0.3)
    smoothed, _ = dpo_loss(pc, pr, rc, rr, beta=0.3, label_smoothing=0.0)
    assert plain.item() == smoothed.item()


def test_ipo_literal_on_per_token_log_probs_and_its_gradient():
    # beta = 1/2: target 1 / (2 beta) = 1. Per-token log-probs (sum / tokens):
    # pair 1: pi_c -2/2 = -1, pi_r -6/3 = -2, ref_c -4/2 = -2, ref_r -6/3 = -2 -> logits 1,
    #         loss (1 - 1)^2 = 0;
    # pair 2: pi_c -1/1 = -1, pi_r -16/4 = -4, ref_c -2/1 = -2, ref_r -8/4 = -2 -> logits 3,
    #         loss (3 - 1)^2 = 4. Mean 2.
    # Rewards (per token, as TRL reports them): chosen 0.5 (-1 - -2) = 0.5 for both pairs;
    # rejected 0.5 (-2 - -2) = 0 and 0.5 (-4 - -2) = -1, mean -0.5; margin 1; accuracy 1.
    pc, pr = _leaf(-2.0, -1.0), _leaf(-6.0, -16.0)
    loss, stats = dpo_loss(
        pc,
        pr,
        _const(-4.0, -2.0),
        _const(-6.0, -8.0),
        beta=0.5,
        loss_type="ipo",
        chosen_tokens=_const(2, 1),
        rejected_tokens=_const(3, 4),
    )
    assert loss.item() == pytest.approx(2.0, abs=1e-12)
    assert stats["rewards/chosen"] == pytest.approx(0.5, abs=1e-12)
    assert stats["rewards/rejected"] == pytest.approx(-0.5, abs=1e-12)
    assert stats["rewards/margins"] == pytest.approx(1.0, abs=1e-12)
    assert stats["rewards/accuracies"] == 1.0
    # d/dsum_c of mean (l - 1)^2 = 2 (l - 1) / tokens_c / B: pair 1: 0; pair 2: 2*2/1/2 = 2.
    # d/dsum_r = -2 (l - 1) / tokens_r / B: pair 2: -2*2/4/2 = -0.5.
    loss.backward()
    assert pc.grad.tolist() == pytest.approx([0.0, 2.0], abs=1e-12)
    assert pr.grad.tolist() == pytest.approx([0.0, -0.5], abs=1e-12)


def test_ipo_is_bounded_where_dpo_keeps_pushing():
    # A gap far past the target: IPO's gradient pulls it back (positive for pi_c), DPO's
    # still pushes it further (negative), only ever more weakly.
    kw = {"chosen_tokens": _const(1.0), "rejected_tokens": _const(1.0)}
    for loss_type, sign in (("ipo", 1.0), ("sigmoid", -1.0)):
        pc = _leaf(50.0)
        loss, _ = dpo_loss(pc, _leaf(0.0), _const(0.0), _const(0.0), 0.1, loss_type, **kw)
        loss.backward()
        assert math.copysign(1.0, pc.grad.item()) == sign, loss_type


def _trl_dpo(pc, pr, rc, rr, beta, loss_type, label_smoothing, len_c=None, len_r=None):
    """TRL DPOTrainer's loss and reward metrics, from its documentation
    (https://huggingface.co/docs/trl/dpo_trainer, "Loss functions" and "Logged metrics"):
    for ipo every sequence log-prob is first divided by its completion length; then
    logits = (chosen - rejected) - (ref_chosen - ref_rejected);
    sigmoid: -logsigmoid(beta logits) (1 - ls) - logsigmoid(-beta logits) ls;
    ipo: (logits - 1 / (2 beta))^2; rewards/chosen = beta (chosen - ref_chosen), and the
    accuracy is the mean of rewards/chosen > rewards/rejected."""
    if loss_type == "ipo":
        pc, pr, rc, rr = pc / len_c, pr / len_r, rc / len_c, rr / len_r
    logits = (pc - pr) - (rc - rr)
    if loss_type == "ipo":
        losses = (logits - 1 / (2 * beta)) ** 2
    else:
        losses = (
            -F.logsigmoid(beta * logits) * (1 - label_smoothing)
            - F.logsigmoid(-beta * logits) * label_smoothing
        )
    chosen, rejected = beta * (pc - rc), beta * (pr - rr)
    return losses.mean(), {
        "rewards/chosen": chosen.mean().item(),
        "rewards/rejected": rejected.mean().item(),
        "rewards/margins": (chosen - rejected).mean().item(),
        "rewards/accuracies": (chosen > rejected).double().mean().item(),
    }


@pytest.mark.parametrize(
    ("loss_type", "beta", "label_smoothing"),
    [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.1), ("sigmoid", 2.0, 0.3), ("ipo", 0.1, 0.0)],
)
def test_matches_trl_dpo_trainer_formulas(loss_type, beta, label_smoothing):
    gen = torch.Generator().manual_seed(0)
    # log-probs of 8 pairs, summed over 3-40 tokens of about -1.5 nats each
    len_c = torch.randint(3, 40, (8,), generator=gen).double()
    len_r = torch.randint(3, 40, (8,), generator=gen).double()
    pc, pr, rc, rr = (
        -1.5 * n + torch.randn(8, generator=gen, dtype=torch.float64) * 3
        for n in (len_c, len_r, len_c, len_r)
    )
    ours_pc, theirs_pc = pc.clone().requires_grad_(), pc.clone().requires_grad_()
    counts = {"chosen_tokens": len_c, "rejected_tokens": len_r}
    ours, stats = dpo_loss(ours_pc, pr, rc, rr, beta, loss_type, label_smoothing, **counts)
    theirs, expected = _trl_dpo(
        theirs_pc, pr, rc, rr, beta, loss_type, label_smoothing, *counts.values()
    )
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12)
    for key, value in expected.items():
        assert stats[key] == pytest.approx(value, rel=1e-12, abs=1e-12), key
    ours.backward()
    theirs.backward()
    assert torch.allclose(ours_pc.grad, theirs_pc.grad, rtol=1e-12, atol=1e-15)


def test_loss_types_are_the_registry():
    assert DPO_LOSS_TYPES == ("sigmoid", "ipo")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"loss_type": "hinge"}, "loss_type='hinge'"),
        ({"beta": 0.0}, "beta must be > 0"),
        ({"label_smoothing": 0.5}, "label_smoothing"),
        ({"loss_type": "ipo"}, "pass chosen_tokens"),
        ({"loss_type": "ipo", "label_smoothing": 0.1}, "not to ipo"),
    ],
)
def test_bad_options_are_refused(kwargs, message):
    x = _const(-1.0)
    with pytest.raises(ValueError, match=message):
        dpo_loss(x, x, x, x, **kwargs)


def test_shapes_must_match():
    with pytest.raises(ValueError, match="shape mismatch"):
        dpo_logits(_const(1.0, 2.0), _const(1.0), _const(1.0), _const(1.0))
