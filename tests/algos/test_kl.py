import math

import pytest
import torch

from proxima.algos import (
    KL_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    kl_full,
    kl_penalty,
)

LOGP = torch.tensor([[-1.0, -2.0, -0.5]])
REF = torch.tensor([[-1.5, -1.0, -0.5]])
# d = logp - ref = [0.5, -1.0, 0.0]


def test_k1_and_alias():
    expected = torch.tensor([[0.5, -1.0, 0.0]])
    torch.testing.assert_close(kl_penalty(LOGP, REF, "k1"), expected)
    torch.testing.assert_close(kl_penalty(LOGP, REF, "kl"), expected)
    torch.testing.assert_close(kl_penalty(LOGP, REF), expected)  # default kind is k1


def test_abs():
    torch.testing.assert_close(kl_penalty(LOGP, REF, "abs"), torch.tensor([[0.5, 1.0, 0.0]]))


def test_k2_and_alias():
    # 0.5 d^2 = [0.125, 0.5, 0]
    expected = torch.tensor([[0.125, 0.5, 0.0]])
    torch.testing.assert_close(kl_penalty(LOGP, REF, "k2"), expected)
    torch.testing.assert_close(kl_penalty(LOGP, REF, "mse"), expected)


def test_k3_and_alias():
    # exp(-d) + d - 1: d = 0.5 -> e^-0.5 - 0.5 = 0.10653066; d = -1 -> e - 2 = 0.71828183;
    # d = 0 -> 0.
    expected = torch.tensor([[math.exp(-0.5) - 0.5, math.e - 2.0, 0.0]])
    torch.testing.assert_close(kl_penalty(LOGP, REF, "k3"), expected)
    torch.testing.assert_close(kl_penalty(LOGP, REF, "low_var_kl"), expected)


def test_k3_clamps_log_ratio_and_value():
    # d = 5 -> e^-5 + 4 = 4.00673795 (inside the bounds);
    # d = 12 -> e^-12 + 11 > 10 -> clamped to 10; d = -3 -> e^3 - 4 = 16.09 -> 10;
    # d = 1000 / -1000 -> clamped to +-20 first, then to 10 (finite, no overflow).
    d = torch.tensor([5.0, 12.0, -3.0, 1000.0, -1000.0])
    out = kl_penalty(d, torch.zeros_like(d), "k3")
    torch.testing.assert_close(out, torch.tensor([math.exp(-5) + 4.0, 10.0, 10.0, 10.0, 10.0]))


def test_k3_is_accurate_for_tiny_log_ratios():
    # For d = 1e-4 the float64 value is d^2/2 - d^3/6 + ... = 4.99983e-9; a naive float32
    # exp(-d) - 1 + d is wrong by ~1e-8 / 5e-9 = 200%; the result must be relatively exact.
    d = torch.tensor([1e-4, -1e-4, 3e-3])
    out = kl_penalty(d, torch.zeros_like(d), "k3")
    exact = torch.expm1(-d.double()) + d.double()
    torch.testing.assert_close(out.double(), exact, rtol=1e-6, atol=0.0)
    assert out.dtype == torch.float32


# Straight-through names: base estimator and the name with its "+" suffix.
PLUS = [
    ("k1", "k1+"),
    ("kl", "kl+"),
    ("abs", "abs+"),
    ("k2", "k2+"),
    ("mse", "mse+"),
    ("k3", "k3+"),
    ("low_var_kl", "low_var_kl+"),
]


@pytest.mark.parametrize(
    ("plus", "expected"),
    [
        # Values are the base estimator's, on d = [0.5, -1, 0] (see the tests above).
        ("k1+", [0.5, -1.0, 0.0]),
        ("kl+", [0.5, -1.0, 0.0]),
        ("abs+", [0.5, 1.0, 0.0]),
        ("k2+", [0.125, 0.5, 0.0]),
        ("mse+", [0.125, 0.5, 0.0]),
        ("k3+", [math.exp(-0.5) - 0.5, math.e - 2.0, 0.0]),
        ("low_var_kl+", [math.exp(-0.5) - 0.5, math.e - 2.0, 0.0]),
    ],
)
def test_straight_through_value_is_the_base_estimators(plus, expected):
    out = kl_penalty(LOGP, REF, plus)
    torch.testing.assert_close(out, torch.tensor([expected]))
    base = plus[:-1]
    assert torch.equal(out, kl_penalty(LOGP, REF, base))  # bit for bit


@pytest.mark.parametrize(("base", "plus"), PLUS)
def test_straight_through_gradient_is_k2s(base, plus):
    # Gradient of k2 = 0.5 d^2: d/d logprobs = d = [0.5, -1, 0], d/d ref_logprobs = -d.
    logp = LOGP.clone().requires_grad_(True)
    ref = REF.clone().requires_grad_(True)
    kl_penalty(logp, ref, plus).sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.5, -1.0, 0.0]]))
    torch.testing.assert_close(ref.grad, torch.tensor([[-0.5, 1.0, 0.0]]))


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        # d/dd of d is 1; of |d| is sign(d) (0 at 0); of exp(-d) - 1 + d is 1 - exp(-d):
        # 1 - e^-0.5 = 0.39346934, 1 - e = -1.71828183, 0.
        ("k1", [1.0, 1.0, 1.0]),
        ("abs", [1.0, -1.0, 0.0]),
        ("k2", [0.5, -1.0, 0.0]),
        ("k3", [1.0 - math.exp(-0.5), 1.0 - math.e, 0.0]),
    ],
)
def test_plain_estimators_keep_their_own_gradient(kind, expected):
    logp = LOGP.clone().requires_grad_(True)
    kl_penalty(logp, REF, kind).sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([expected]))


def test_k3_plus_keeps_the_clamped_value_and_the_unclamped_k2_gradient():
    # d = -3: k3 = e^3 - 4 = 16.09 -> clamped to 10, gradient still d = -3;
    # d = 1000: k3 clamped to 10 (d clamped to 20 first), gradient d = 1000.
    d = torch.tensor([-3.0, 1000.0], requires_grad=True)
    out = kl_penalty(d, torch.zeros(2), "k3+")
    assert out.tolist() == [10.0, 10.0]
    out.sum().backward()
    assert d.grad.tolist() == [-3.0, 1000.0]


def test_full_plus_is_unknown():
    with pytest.raises(ValueError, match="unknown KL estimator 'full\\+'"):
        kl_penalty(LOGP, REF, "full+")


def test_full_points_to_kl_full():
    with pytest.raises(ValueError, match="kl_full"):
        kl_penalty(LOGP, REF, "full")


def test_unknown_estimator_lists_valid_names():
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'") as err:
        kl_penalty(LOGP, REF, "k4")
    for name in KL_ESTIMATORS:
        assert name in str(err.value)


def test_kl_penalty_shape_mismatch():
    with pytest.raises(ValueError, match=r"logprobs \[1, 3\] vs ref_logprobs \[1, 2\]"):
        kl_penalty(LOGP, REF[:, :2], "k1")


def test_kl_full_literal():
    # p = softmax([0, ln 3]) = [1/4, 3/4], q = softmax([0, 0]) = [1/2, 1/2]:
    # KL = 1/4 ln(1/2) + 3/4 ln(3/2) = 0.13081203.
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    ref = torch.zeros(1, 1, 2)
    expected = 0.25 * math.log(0.5) + 0.75 * math.log(1.5)
    out = kl_full(logits, ref)
    assert out.shape == (1, 1) and out.dtype == torch.float32
    assert out.item() == pytest.approx(expected, rel=1e-6)


def test_kl_full_temperature():
    # Temperature 2 halves both logits: p = softmax([0, ln(3)/2]) = [1, sqrt 3] / (1 + sqrt 3),
    # q = softmax([ln(3)/2, 0]) = [sqrt 3, 1] / (1 + sqrt 3) (the mirror image), so
    # KL = p1 ln(p1 / p2) + p2 ln(p2 / p1) = (p2 - p1) ln(p2 / p1) = (p2 - p1) ln(sqrt 3).
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    ref = torch.tensor([[[math.log(3.0), 0.0]]])
    p1 = 1.0 / (1.0 + math.sqrt(3.0))
    p2 = 1.0 - p1
    expected = (p2 - p1) * math.log(math.sqrt(3.0))
    assert kl_full(logits, ref, temperature=2.0).item() == pytest.approx(expected, rel=1e-5)
    # At temperature 1: p = [1/4, 3/4], q = [3/4, 1/4] -> KL = (3/4 - 1/4) ln 3 = 0.5 ln 3.
    assert kl_full(logits, ref).item() == pytest.approx(0.5 * math.log(3.0), rel=1e-6)


def test_kl_full_matches_naive_float64_for_any_chunk_size():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=gen) * 3
    ref = torch.randn(3, 5, 11, generator=gen) * 3
    p = torch.log_softmax(logits.double(), -1)
    q = torch.log_softmax(ref.double(), -1)
    naive = (p.exp() * (p - q)).sum(-1)
    for chunk_size in (None, 1, 4, 15, 100):
        out = kl_full(logits, ref, chunk_size=chunk_size)
        torch.testing.assert_close(out.double(), naive, rtol=1e-5, atol=1e-6)
    assert kl_full(logits, logits).abs().max().item() < 1e-6


def test_kl_full_bf16_and_errors():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 7, generator=gen)
    ref = torch.randn(2, 3, 7, generator=gen)
    out = kl_full(logits.bfloat16(), ref.bfloat16())
    assert out.dtype == torch.float32
    expected = kl_full(logits.bfloat16().float(), ref.bfloat16().float())
    torch.testing.assert_close(out, expected)
    with pytest.raises(ValueError, match=r"logits \[2, 3, 7\] vs ref_logits \[2, 3, 6\]"):
        kl_full(logits, ref[..., :6])
    with pytest.raises(ValueError, match="temperature must be > 0"):
        kl_full(logits, ref, temperature=0.0)


def test_fixed_controller_never_moves():
    ctl = FixedKLController(0.1)
    ctl.update(current_kl=100.0, n_steps=64)
    assert ctl.value == 0.1


@pytest.mark.parametrize(
    ("current_kl", "expected"),
    [
        # error clip(9/6 - 1 = 0.5) = 0.2 -> 0.1 * (1 + 0.2 * 100/1000) = 0.102
        (9.0, 0.1 * (1 + 0.2 * 0.1)),
        # error 6.6/6 - 1 = 0.1 (inside the clip) -> 0.1 * (1 + 0.1 * 0.1) = 0.101
        (6.6, 0.1 * (1 + 0.1 * 0.1)),
        # error 6/6 - 1 = 0 -> unchanged
        (6.0, 0.1),
        # error clip(1/6 - 1) = -0.2 -> 0.1 * (1 - 0.02) = 0.098
        (1.0, 0.1 * (1 - 0.2 * 0.1)),
    ],
)
def test_adaptive_controller_update(current_kl, expected):
    ctl = AdaptiveKLController(init_kl_coef=0.1, target_kl=6.0, horizon=1000)
    ctl.update(current_kl, n_steps=100)
    assert ctl.value == pytest.approx(expected, rel=1e-12)


def test_adaptive_controller_validates():
    with pytest.raises(ValueError, match="target_kl must be > 0"):
        AdaptiveKLController(0.1, 0.0, 1000)
    with pytest.raises(ValueError, match="horizon must be > 0"):
        AdaptiveKLController(0.1, 6.0, 0)
