"""Property tests (hypothesis) for the invariants the PPO math must keep."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from proxima.algos import (
    ADVANTAGE_ESTIMATORS,
    AGG_MODES,
    AdaptiveKLController,
    PolicyLossOptions,
    aggregate_loss,
    compute_advantages,
    compute_gae,
    entropy_from_logits,
    kl_full,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    masked_var,
    masked_whiten,
    policy_loss,
    token_rewards,
    value_loss,
)

SETTINGS = settings(max_examples=40, deadline=None)

# Random group ids make groups of one and random masks can be all-zero; those warnings are
# tested in test_advantages.py and test_losses.py.
pytestmark = [
    pytest.mark.filterwarnings("ignore::proxima.algos.SingletonGroupWarning"),
    pytest.mark.filterwarnings("ignore::proxima.algos.EmptyMaskWarning"),
]


@st.composite
def ragged_batches(draw):
    """(mask [B, T] long, seed): masks with holes, empty rows and single tokens."""
    batch = draw(st.integers(1, 5))
    width = draw(st.integers(1, 6))
    rows = draw(
        st.lists(
            st.lists(st.booleans(), min_size=width, max_size=width), min_size=batch, max_size=batch
        )
    )
    return torch.tensor(rows, dtype=torch.long), draw(st.integers(0, 2**31 - 1))


def _pad(x: torch.Tensor, extra: int, fill: float) -> torch.Tensor:
    """Right-pad [B, T] with `extra` columns of `fill` (garbage that the mask hides)."""
    return torch.cat([x, torch.full((x.shape[0], extra), fill, dtype=x.dtype)], dim=-1)


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@SETTINGS
@given(
    data=ragged_batches(),
    extra=st.integers(1, 4),
    fill=st.sampled_from([0.0, 3.0, -1e4, float("nan")]),
    gamma=st.floats(0.5, 1.0),
    lam=st.floats(0.0, 1.0),
)
def test_right_padding_changes_nothing_on_real_tokens(data, extra, fill, gamma, lam):
    mask, seed = data
    gen = torch.Generator().manual_seed(seed)
    batch, width = mask.shape
    x, y, z = (torch.randn(batch, width, generator=gen) for _ in range(3))
    scores = torch.randn(batch, generator=gen) * 4
    group_ids = torch.randint(0, 2, (batch,), generator=gen)
    pm = _pad(mask, extra, 0)
    px, py, pz = (_pad(t, extra, fill) for t in (x, y, z))
    real = mask != 0

    def on_real(padded):
        return padded[:, :width] * real

    _close(masked_mean(px, pm), masked_mean(x, mask))
    _close(masked_mean(px, pm, dim=-1), masked_mean(x, mask, dim=-1))
    _close(masked_var(px, pm), masked_var(x, mask))
    _close(on_real(masked_whiten(px, pm)), masked_whiten(x, mask))
    for mode in AGG_MODES:
        # sum-norm divides by the width T on purpose (Dr. GRPO), so padding rescales it.
        scale = (width + extra) / width if mode == "seq-mean-token-sum-norm" else 1.0
        _close(aggregate_loss(px, pm, mode) * scale, aggregate_loss(x, mask, mode))
    rewards = token_rewards(scores, x, mask, 0.1, 5.0)
    _close(on_real(token_rewards(scores, px, pm, 0.1, 5.0)), rewards)
    for got, want in zip(
        compute_gae(px, py, pm, gamma, lam), compute_gae(x, y, mask, gamma, lam), strict=True
    ):
        _close(on_real(got), want)
    logprobs, pi_squared, is_weights = (torch.rand(batch, width, generator=gen) for _ in "abc")
    inputs = {
        "values": y,
        "group_ids": group_ids,
        "gamma": gamma,
        "reward_baselines": scores,
        "old_logprobs": -2 * logprobs,
        "sum_pi_squared": pi_squared,
        "is_weights": is_weights + 0.5,
        "score_components": torch.randn(batch, 2, generator=gen),
        "teacher_logprobs": -3 * pi_squared,
    }
    per_token = ("values", "old_logprobs", "sum_pi_squared", "is_weights", "teacher_logprobs")
    padded = {**inputs, **{k: _pad(inputs[k], extra, fill) for k in per_token}}
    alone = bool((torch.bincount(group_ids) == 1).any())
    for name in ADVANTAGE_ESTIMATORS:
        if name == "grpo_passk" and alone:  # needs two responses per prompt: an error
            with pytest.raises(ValueError, match="at least 2 responses"):
                compute_advantages(name, px, pm, **padded)
            continue
        got = compute_advantages(name, px, pm, **padded)[0]
        _close(on_real(got), compute_advantages(name, x, mask, **inputs)[0])
    for padded, plain in [
        (policy_loss(px, py, pz, pm), policy_loss(x, y, z, mask)),
        (value_loss(px, py, pz, pm), value_loss(x, y, z, mask)),
    ]:
        _close(padded[0], plain[0])
        for name in plain[1]:
            _close(padded[1][name], plain[1][name])


_MARGIN = 1e-3  # keep ratios away from the clip boundaries, where max() ties


@SETTINGS
@given(
    log_ratio=st.lists(st.floats(-2.0, 2.0), min_size=1, max_size=12),
    adv_seed=st.integers(0, 2**31 - 1),
    clip=st.floats(0.05, 0.4),
    clip_c=st.floats(1.5, 5.0),
)
def test_policy_gradient_zero_exactly_where_clipping_binds(log_ratio, adv_seed, clip, clip_c):
    lr = torch.tensor([log_ratio])
    ratio = lr.exp()
    near = [(ratio - b).abs() < _MARGIN for b in (1 - clip, 1 + clip, clip_c)]
    gen = torch.Generator().manual_seed(adv_seed)
    adv = torch.randn(lr.shape, generator=gen)
    adv = torch.where(adv.abs() < 1e-3, torch.ones_like(adv), adv)  # no zero advantage
    logprobs = lr.clone().requires_grad_(True)
    mask = torch.ones_like(lr)
    policy_loss(
        logprobs,
        torch.zeros_like(lr),
        adv,
        mask,
        options=PolicyLossOptions(clip_ratio_low=clip, clip_ratio_high=clip, clip_ratio_c=clip_c),
    )[0].backward()
    binds = (
        ((adv > 0) & (ratio > 1 + clip))  # upper clip, positive advantage
        | ((adv < 0) & (ratio < 1 - clip))  # lower clip, negative advantage
        | ((adv < 0) & (ratio > clip_c))  # dual clip
    )
    check = ~(near[0] | near[1] | near[2])
    grad = logprobs.grad
    assert torch.all(grad[binds & check] == 0)
    # Elsewhere the unclipped term is active: d(-A r)/d logp / n = -A r / n.
    free = ~binds & check
    _close(grad[free], (-adv * ratio / lr.numel())[free])


@SETTINGS
@given(
    logits=st.lists(st.floats(-30.0, 30.0), min_size=2, max_size=24),
    vocab=st.integers(1, 6),
    temperature=st.floats(0.1, 5.0),
    chunk_size=st.one_of(st.none(), st.integers(1, 4)),
    label_seed=st.integers(0, 1000),
)
def test_logprobs_and_entropy_equal_naive_float64(
    logits, vocab, temperature, chunk_size, label_seed
):
    rows = len(logits) // vocab
    if rows == 0:
        return
    x = torch.tensor(logits[: rows * vocab]).reshape(1, rows, vocab)
    labels = torch.randint(0, vocab, (1, rows), generator=torch.Generator().manual_seed(label_seed))
    logp64 = torch.log_softmax(x.double() / temperature, dim=-1)
    naive_lp = logp64.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    naive_h = -(logp64.exp() * logp64).sum(-1)
    lp = logprobs_from_logits(x, labels, temperature, chunk_size=chunk_size)
    h = entropy_from_logits(x, temperature, chunk_size=chunk_size)
    torch.testing.assert_close(lp.double(), naive_lp, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(h.double(), naive_h, rtol=1e-5, atol=1e-4)


@SETTINGS
@given(d=st.lists(st.floats(-1e4, 1e4), min_size=1, max_size=16))
def test_kl_estimators_nonnegative(d):
    logp = torch.tensor(d)
    ref = torch.zeros_like(logp)
    for kind in ("abs", "k2", "mse", "k3", "low_var_kl", "abs+", "k2+", "k3+", "low_var_kl+"):
        out = kl_penalty(logp, ref, kind)
        assert torch.all(out >= 0) and torch.all(torch.isfinite(out)), kind
    assert torch.all(kl_penalty(logp, ref, "k3") <= 10.0)
    assert torch.all(kl_penalty(logp, ref, "k3+") <= 10.0)


@SETTINGS
@given(seed=st.integers(0, 2**31 - 1), scale=st.floats(0.01, 20.0))
def test_kl_full_nonnegative_and_zero_on_self(seed, scale):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, 3, 5, generator=gen) * scale
    ref = torch.randn(2, 3, 5, generator=gen) * scale
    assert torch.all(kl_full(logits, ref) >= 0)
    assert torch.all(kl_full(logits, logits) < 1e-5)


@SETTINGS
@given(
    init=st.floats(1e-4, 1.0),
    target=st.floats(0.01, 20.0),
    current=st.floats(0.0, 100.0),
    n_steps=st.integers(1, 512),
    horizon=st.integers(1000, 20000),
)
def test_adaptive_coefficient_moves_toward_target(init, target, current, n_steps, horizon):
    ctl = AdaptiveKLController(init, target, horizon)
    ctl.update(current, n_steps)
    if current > target * (1 + 1e-9):
        assert ctl.value > init  # KL too high -> penalise harder
    elif current < target * (1 - 1e-9):
        assert ctl.value < init  # KL too low -> relax
    # The proportional error is clipped to +-0.2.
    step = 0.2 * n_steps / horizon
    assert init * (1 - step) * (1 - 1e-12) <= ctl.value <= init * (1 + step) * (1 + 1e-12)
