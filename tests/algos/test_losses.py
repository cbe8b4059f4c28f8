import math
import statistics
import warnings

import pytest
import torch

from proxima.algos import (
    AGG_MODES,
    POLICY_LOSSES,
    EmptyMaskWarning,
    PolicyLossOptions,
    entropy_from_logits,
    explained_variance,
    first_token_explained_variance,
    leave_one_out_mean,
    logprobs_and_entropy,
    logprobs_from_logits,
    policy_loss,
    register_policy_loss,
    value_loss,
)

LN = math.log
# Position 0: logits [0, ln 3, 0] -> p = [1/5, 3/5, 1/5];
# position 1: logits [ln 2, ln 2, ln 4] -> p = [1/4, 1/4, 1/2].
LOGITS = torch.tensor([[[0.0, LN(3.0), 0.0], [LN(2.0), LN(2.0), LN(4.0)]]])
LABELS = torch.tensor([[1, 2]])


def naive_logprobs(logits, labels, temperature=1.0):
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    return logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def test_logprobs_literal():
    # log p(label): ln(3/5), ln(1/2).
    out = logprobs_from_logits(LOGITS, LABELS)
    assert out.dtype == torch.float32 and out.shape == (1, 2)
    torch.testing.assert_close(out, torch.tensor([[LN(0.6), LN(0.5)]]))


def test_logprobs_temperature():
    # T = 2 halves the logits: position 0 -> [1, sqrt 3, 1] / (2 + sqrt 3), label 1;
    # position 1 -> [sqrt 2, sqrt 2, 2] / (2 + 2 sqrt 2), label 2 -> 1 / (1 + sqrt 2).
    out = logprobs_from_logits(LOGITS, LABELS, temperature=2.0)
    s3, s2 = math.sqrt(3.0), math.sqrt(2.0)
    torch.testing.assert_close(out, torch.tensor([[LN(s3 / (2 + s3)), LN(1 / (1 + s2))]]))


def test_logprobs_gradient_is_onehot_minus_softmax():
    # d log p_label / d logits = onehot(label) - softmax: position 0 -> [-0.2, 0.4, -0.2].
    logits = LOGITS.clone().requires_grad_(True)
    logprobs_from_logits(logits, LABELS, chunk_size=1).sum().backward()
    expected = torch.tensor([[[-0.2, 0.4, -0.2], [-0.25, -0.25, 0.5]]])
    torch.testing.assert_close(logits.grad, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_logprobs_match_naive_for_dtypes_and_chunks(dtype):
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(3, 5, 17, generator=gen) * 4).to(dtype)
    labels = torch.randint(0, 17, (3, 5), generator=gen)
    expected = naive_logprobs(logits.float(), labels, 0.7)
    for chunk_size in (None, 1, 4, 15, 1000):
        out = logprobs_from_logits(logits, labels, temperature=0.7, chunk_size=chunk_size)
        assert out.dtype == torch.float32
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_logprobs_errors():
    with pytest.raises(ValueError, match=r"logits \[1, 2, 3\] vs labels \[1, 3\]"):
        logprobs_from_logits(LOGITS, torch.tensor([[1, 2, 0]]))
    with pytest.raises(ValueError, match="temperature must be > 0"):
        logprobs_from_logits(LOGITS, LABELS, temperature=-1.0)
    with pytest.raises(ValueError, match="chunk_size must be >= 1"):
        logprobs_from_logits(LOGITS, LABELS, chunk_size=0)


def test_entropy_literal():
    # H = -sum p ln p: position 0 -> -(2 * 0.2 ln 0.2 + 0.6 ln 0.6) = 0.95027054;
    # position 1 -> 2 * 0.25 ln 4 + 0.5 ln 2 = 1.5 ln 2 = 1.03972077.
    out = entropy_from_logits(LOGITS)
    expected = [-(2 * 0.2 * LN(0.2) + 0.6 * LN(0.6)), 1.5 * LN(2.0)]
    torch.testing.assert_close(out, torch.tensor([expected]))


def test_entropy_uniform_and_temperature():
    # Equal logits -> uniform over V = 7 -> ln 7 for any temperature; a very low temperature
    # on distinct logits approaches a one-hot distribution -> entropy ~ 0.
    assert entropy_from_logits(torch.zeros(1, 1, 7), temperature=3.0).item() == pytest.approx(
        LN(7.0)
    )
    peaked = entropy_from_logits(torch.tensor([[[0.0, 1.0, 2.0]]]), temperature=0.01)
    assert peaked.item() == pytest.approx(0.0, abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_entropy_matches_naive(dtype):
    gen = torch.Generator().manual_seed(1)
    logits = (torch.randn(2, 6, 13, generator=gen) * 3).to(dtype)
    logp = torch.log_softmax(logits.double() / 1.3, dim=-1)
    expected = -(logp.exp() * logp).sum(-1)
    for chunk_size in (None, 1, 5):
        out = entropy_from_logits(logits, temperature=1.3, chunk_size=chunk_size)
        torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_logprobs_and_entropy_literal_and_gradients():
    # the values of test_logprobs_literal and test_entropy_literal, from one pass
    logits = LOGITS.clone().requires_grad_(True)
    lp, ent = logprobs_and_entropy(logits, LABELS, chunk_size=1)
    torch.testing.assert_close(lp, torch.tensor([[LN(0.6), LN(0.5)]]))
    expected = [-(2 * 0.2 * LN(0.2) + 0.6 * LN(0.6)), 1.5 * LN(2.0)]
    torch.testing.assert_close(ent, torch.tensor([expected]))
    # dH/dz_j = -p_j (z_j - E_p[z]): position 0, E[z] = 0.6 ln 3 -> [0.12, -0.24, 0.12] ln 3;
    # position 1 (a = ln 2, z = [a, a, 2a]), E[z] = 1.5a -> [0.125, 0.125, -0.25] a;
    # plus onehot - softmax from the log-prob
    (lp.sum() + ent.sum()).backward()
    a, l3 = LN(2.0), LN(3.0)
    entropy_grad = torch.tensor(
        [[[0.12 * l3, -0.24 * l3, 0.12 * l3], [0.125 * a, 0.125 * a, -0.25 * a]]]
    )
    onehot_minus_p = torch.tensor([[[-0.2, 0.4, -0.2], [-0.25, -0.25, 0.5]]])
    torch.testing.assert_close(logits.grad, onehot_minus_p + entropy_grad)
    # entropy_grad=False: the entropy is a stat, only the log-prob's gradient remains
    logits.grad = None
    lp, ent = logprobs_and_entropy(logits, LABELS, entropy_grad=False)
    (lp.sum() + ent.sum()).backward()
    torch.testing.assert_close(logits.grad, onehot_minus_p)


def test_entropy_of_huge_logits_does_not_cancel():
    # a collapsed policy's logits: 1e5 plus [0, ln 3, 0], which float32 holds as 1e5 +
    # [0, 1.1015625, 0] (its spacing there is 2^-7): p = [1, e^a, 1] / (2 + e^a) with
    # a = 1.1015625, label 1. Without the shift, lse - sum p z cancels to that spacing.
    logits = LOGITS[:, :1] + 1e5
    assert (logits[0, 0] - 1e5).tolist() == [0.0, 1.1015625, 0.0]
    e = math.exp(1.1015625)
    p = [1 / (2 + e), e / (2 + e), 1 / (2 + e)]
    want = -sum(x * LN(x) for x in p)
    lp, ent = logprobs_and_entropy(logits, LABELS[:, :1])
    assert ent.item() == pytest.approx(want, abs=1e-6)
    assert entropy_from_logits(logits).item() == pytest.approx(want, abs=1e-6)
    assert lp.item() == pytest.approx(LN(p[1]), abs=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_and_entropy_match_the_separate_functions(dtype):
    gen = torch.Generator().manual_seed(2)
    logits = (torch.randn(3, 7, 19, generator=gen) * 3).to(dtype)
    labels = torch.randint(0, 19, (3, 7), generator=gen)
    for chunk_size in (None, 1, 4, 100):
        lp, ent = logprobs_and_entropy(logits, labels, 0.7, chunk_size=chunk_size)
        assert lp.dtype == ent.dtype == torch.float32 and lp.shape == ent.shape == (3, 7)
        torch.testing.assert_close(lp, logprobs_from_logits(logits, labels, 0.7))
        torch.testing.assert_close(ent, entropy_from_logits(logits, 0.7))
    empty_lp, empty_ent = logprobs_and_entropy(torch.zeros(0, 19), torch.zeros(0, dtype=torch.long))
    assert empty_lp.shape == empty_ent.shape == (0,)
    with pytest.raises(ValueError, match=r"logits \[1, 2, 3\] vs labels \[1, 3\]"):
        logprobs_and_entropy(LOGITS, torch.tensor([[1, 2, 0]]))


# Policy loss fixture: six real tokens (log-ratio, advantage) and two padding tokens whose
# log-probs are -inf (NaN log-ratio) and advantages NaN, which must not matter.
# clip 0.2, dual clip c = 3:
#   1. r 1.1, A  2: inside the clip          -> max(-2.2, -2.2) = -2.2
#   2. r 1.5, A  1: upper clip binds         -> max(-1.5, -1.2) = -1.2    (clipped)
#   3. r 0.5, A  1: clip would help, ignored -> max(-0.5, -0.8) = -0.5
#   4. r 0.5, A -1: lower clip binds         -> max( 0.5,  0.8) =  0.8    (clipped)
#   5. r 1.5, A -1: clip would help, ignored -> max( 1.5,  1.2) =  1.5    (below cap 3)
#   6. r 4.0, A -1: dual clip binds          -> min(max(4, 1.2), 3 * 1) = 3  (dual)
# token-mean loss = (-2.2 - 1.2 - 0.5 + 0.8 + 1.5 + 3) / 6 = 1.4 / 6.
RATIOS = [1.1, 1.5, 0.5, 0.5, 1.5, 4.0]
NEG_INF = float("-inf")
LOGPROBS = torch.tensor(
    [[LN(1.1), LN(1.5), LN(0.5), NEG_INF], [LN(0.5), LN(1.5), LN(4.0), NEG_INF]]
)
OLD = torch.tensor([[0.0, 0.0, 0.0, NEG_INF], [0.0, 0.0, 0.0, NEG_INF]])
NAN = float("nan")
ADV = torch.tensor([[2.0, 1.0, 1.0, NAN], [-1.0, -1.0, -1.0, NAN]])
PMASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]])


def test_policy_loss_literal_and_stats():
    loss, stats = policy_loss(LOGPROBS, OLD, ADV, PMASK)
    assert loss.item() == pytest.approx(1.4 / 6, rel=1e-6)
    log_ratios = [LN(r) for r in RATIOS]
    expected_stats = {
        "clipfrac": 2 / 6,  # tokens 2 and 4
        "clipfrac_lower": 1 / 6,  # token 6
        "ppo_kl": -sum(log_ratios) / 6,  # mean(old - new)
        "approx_kl": sum(0.5 * x * x for x in log_ratios) / 6,
        "ratio_mean": sum(RATIOS) / 6,
        "ratio_max": 4.0,
    }
    assert set(stats) == set(expected_stats)
    for name, value in expected_stats.items():
        assert stats[name].item() == pytest.approx(value, rel=1e-6), name
        assert stats[name].dim() == 0 and not stats[name].requires_grad


def test_policy_loss_without_dual_clip():
    # Token 6 keeps its loss 4: (1.4 - 3 + 4) / 6 = 2.4 / 6.
    no_dual_clip = PolicyLossOptions(clip_ratio_c=None)
    loss, stats = policy_loss(LOGPROBS, OLD, ADV, PMASK, options=no_dual_clip)
    assert loss.item() == pytest.approx(2.4 / 6, rel=1e-6)
    assert stats["clipfrac_lower"].item() == 0.0


def _one_token_loss(ratio: float, advantage: float, **kwargs) -> float:
    one = torch.ones(1, 1)
    lp = torch.tensor([[LN(ratio)]])
    options = PolicyLossOptions(**kwargs)
    return policy_loss(lp, 0 * one, advantage * one, one, options=options)[0].item()


def test_policy_loss_asymmetric_clip():
    # Upper bound from clip_ratio_high: r 1.5, A 1 -> max(-1.5, -1.28) = -1.28.
    assert _one_token_loss(1.5, 1.0, clip_ratio_high=0.28) == pytest.approx(-1.28)
    # ... and clip_ratio_low does not touch it: max(-1.5, -1.2) = -1.2.
    assert _one_token_loss(1.5, 1.0, clip_ratio_low=0.4) == pytest.approx(-1.2)
    # Lower bound from clip_ratio_low: r 0.5, A -1 -> max(0.5, 0.6) = 0.6.
    assert _one_token_loss(0.5, -1.0, clip_ratio_low=0.4) == pytest.approx(0.6)
    assert _one_token_loss(0.5, -1.0, clip_ratio_high=0.28) == pytest.approx(0.8)
    # both bounds at 0.1 (the trainer's actor.clip_ratio when neither bound is set)
    both = {"clip_ratio_low": 0.1, "clip_ratio_high": 0.1}
    assert _one_token_loss(1.5, 1.0, **both) == pytest.approx(-1.1)
    assert _one_token_loss(0.5, -1.0, **both) == pytest.approx(0.9)


def test_policy_loss_gradients():
    # d loss / d logprob = -A r / 6 where the unclipped term is active, 0 where a clip binds
    # (tokens 2, 4 and 6) and 0 on padding (finite despite the -inf log-probs).
    logprobs = LOGPROBS.clone().requires_grad_(True)
    policy_loss(logprobs, OLD, ADV, PMASK)[0].backward()
    expected = torch.tensor([[-2.2, 0.0, -0.5, 0.0], [0.0, 1.5, 0.0, 0.0]]) / 6
    torch.testing.assert_close(logprobs.grad, expected)


def test_policy_loss_aggregation_mode_is_used():
    # seq-mean-token-sum: row sums (-2.2 - 1.2 - 0.5) = -3.9 and (0.8 + 1.5 + 3) = 5.3
    # -> mean 0.7.
    loss, _ = policy_loss(LOGPROBS, OLD, ADV, PMASK, agg="seq-mean-token-sum")
    assert loss.item() == pytest.approx(0.7, rel=1e-6)


def test_policy_loss_token_sum():
    # token-sum: the six per-token losses summed, -2.2 - 1.2 - 0.5 + 0.8 + 1.5 + 3 = 1.4.
    loss, _ = policy_loss(LOGPROBS, OLD, ADV, PMASK, agg="token-sum")
    assert loss.item() == pytest.approx(1.4, rel=1e-6)


def test_policy_loss_clamps_log_ratio():
    # log-ratio 100 is clamped to 20: ratio e^20 stays finite; A = 1 so the upper clip binds.
    loss, stats = policy_loss(
        torch.tensor([[100.0]]), torch.tensor([[0.0]]), torch.tensor([[1.0]]), torch.ones(1, 1)
    )
    assert loss.item() == pytest.approx(-1.2)
    assert stats["ratio_max"].item() == pytest.approx(math.exp(20.0), rel=1e-6)


def test_policy_loss_ppo_kl_uses_the_clamped_log_ratio():
    # Log-ratios 100, -50, ln 2 are clamped to 20, -20, ln 2 before exp (verl clamps
    # negative_approx_kl to [-20, 20] and takes ppo_kl = mean(-clamped)):
    # ppo_kl = -(20 - 20 + ln 2) / 3 = -ln(2) / 3, not -(100 - 50 + ln 2) / 3.
    # approx_kl stays on the unclamped log-ratio: 0.5 (100^2 + 50^2 + ln(2)^2) / 3.
    logprobs = torch.tensor([[100.0, -50.0, LN(2.0)]])
    zeros = torch.zeros(1, 3)
    _, stats = policy_loss(logprobs, zeros, torch.ones(1, 3), torch.ones(1, 3))
    assert stats["ppo_kl"].item() == pytest.approx(-LN(2.0) / 3, rel=1e-6)
    assert stats["approx_kl"].item() == pytest.approx(
        0.5 * (100.0**2 + 50.0**2 + LN(2.0) ** 2) / 3, rel=1e-6
    )
    # ratio_mean = (e^20 + e^-20 + 2) / 3.
    expected_ratio_mean = (math.exp(20.0) + math.exp(-20.0) + 2.0) / 3
    assert stats["ratio_mean"].item() == pytest.approx(expected_ratio_mean, rel=1e-6)


def test_policy_loss_errors_and_inputs_untouched():
    with pytest.raises(ValueError, match="clip_ratio_c must be > 1"):
        policy_loss(LOGPROBS, OLD, ADV, PMASK, options=PolicyLossOptions(clip_ratio_c=1.0))
    with pytest.raises(ValueError, match=r"log_prob \[2, 4\] vs advantages \[2, 3\]"):
        policy_loss(LOGPROBS, OLD, ADV[:, :3], PMASK)
    with pytest.raises(ValueError, match="unknown loss aggregation mode"):
        policy_loss(LOGPROBS, OLD, ADV, PMASK, agg="mean")
    with pytest.raises(ValueError, match="clip ratios must satisfy"):
        policy_loss(LOGPROBS, OLD, ADV, PMASK, options=PolicyLossOptions(clip_ratio_low=1.5))
    copies = [t.clone() for t in (LOGPROBS, OLD, ADV, PMASK)]
    policy_loss(*copies)
    for copy, original in zip(copies, (LOGPROBS, OLD, ADV, PMASK), strict=True):
        torch.testing.assert_close(copy, original, rtol=0, atol=0, equal_nan=True)


@pytest.mark.filterwarnings("ignore::proxima.algos.EmptyMaskWarning")
def test_policy_loss_empty_mask():
    loss, stats = policy_loss(LOGPROBS, OLD, ADV, torch.zeros_like(PMASK))
    assert loss.item() == 0.0
    assert all(value.item() == 0.0 for value in stats.values())


# Value loss fixture (V, V_old, R), cliprange 0.2 -> clip(V) in V_old -+ 0.2:
#   1. (1.0, 1.1,  1.2): inside the clip, err 0.04                    -> 0.5 * 0.04 = 0.02
#   2. (2.0, 1.0,  0.0): clip(V) 1.2, err 4 > clipped 1.44            -> 0.5 * 4    = 2
#   3. (2.0, 1.0,  3.0): clip(V) 1.2, err 1 < clipped 3.24 (upper)    -> 0.5 * 3.24 = 1.62
#   4. (0.0, 1.0, -1.0): clip(V) 0.8, err 1 < clipped 3.24 (lower)    -> 0.5 * 3.24 = 1.62
#   5. (0.0, 1.0,  1.5): clip(V) 0.8, err 2.25 > clipped 0.49         -> 0.5 * 2.25 = 1.125
# token-mean = (0.02 + 2 + 1.62 + 1.62 + 1.125) / 5 = 6.385 / 5; vf_clipfrac = 2 / 5.
V = torch.tensor([[1.0, 2.0, 2.0], [0.0, 0.0, 5.0]])
V_OLD = torch.tensor([[1.1, 1.0, 1.0], [1.0, 1.0, float("nan")]])
RET = torch.tensor([[1.2, 0.0, 3.0], [-1.0, 1.5, float("inf")]])
VMASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_value_loss_literal_and_stats():
    loss, stats = value_loss(V, V_OLD, RET, VMASK)
    assert loss.item() == pytest.approx(6.385 / 5, rel=1e-6)
    returns, values = [1.2, 0.0, 3.0, -1.0, 1.5], [1.0, 2.0, 2.0, 0.0, 0.0]
    residual = [r - v for r, v in zip(returns, values, strict=True)]
    explained = 1 - statistics.variance(residual) / statistics.variance(returns)
    assert set(stats) == {"vf_clipfrac", "explained_variance", "vpred_mean"}
    assert stats["vf_clipfrac"].item() == pytest.approx(0.4)
    assert stats["explained_variance"].item() == pytest.approx(explained, rel=1e-5)
    assert stats["vpred_mean"].item() == pytest.approx(1.0)  # (1 + 2 + 2 + 0 + 0) / 5
    assert all(s.dim() == 0 and not s.requires_grad for s in stats.values())


def test_value_loss_gradients_zero_where_clip_binds():
    # d/dV of 0.5 (V - R)^2 / 5 = (V - R) / 5 on unclipped tokens, 0 on tokens 3 and 4.
    values = V.clone().requires_grad_(True)
    value_loss(values, V_OLD, RET, VMASK)[0].backward()
    expected = torch.tensor([[-0.2, 2.0, 0.0], [0.0, -1.5, 0.0]]) / 5
    torch.testing.assert_close(values.grad, expected)


def test_value_loss_token_sum():
    # token-sum: 0.02 + 2 + 1.62 + 1.62 + 1.125 = 6.385 (0.5 inside each token's loss).
    loss, _ = value_loss(V, V_OLD, RET, VMASK, agg="token-sum")
    assert loss.item() == pytest.approx(6.385, rel=1e-6)


def test_value_loss_without_clip():
    # 0.5 * mean(err) = 0.5 * (0.04 + 4 + 1 + 1 + 2.25) / 5 = 0.829.
    loss, stats = value_loss(V, V_OLD, RET, VMASK, cliprange_value=None)
    assert loss.item() == pytest.approx(0.829, rel=1e-6)
    assert stats["vf_clipfrac"].item() == 0.0


def test_explained_variance_edge_cases():
    ones = torch.ones(2, 3)
    # Constant returns: Var(R) = 0 -> explained variance defined as 0.
    _, stats = value_loss(ones * 2, ones, ones, ones)
    assert stats["explained_variance"].item() == 0.0
    # Perfect critic: V = R (not constant) -> 1.
    returns = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    _, stats = value_loss(returns, returns, returns, ones)
    assert stats["explained_variance"].item() == pytest.approx(1.0)


def test_value_loss_errors():
    with pytest.raises(ValueError, match=r"values \[2, 3\] vs returns \[2, 2\]"):
        value_loss(V, V_OLD, RET[:, :2], VMASK)
    with pytest.raises(ValueError, match="cliprange_value must be >= 0"):
        value_loss(V, V_OLD, RET, VMASK, cliprange_value=-0.1)


# All-zero masks: the padding holds NaN / inf everywhere, so any leak shows up as NaN.
@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("clip_ratio_c", [3.0, None])
def test_policy_loss_all_zero_mask_every_mode(agg, clip_ratio_c):
    # Nothing to average: loss exactly 0 (verl: 0 / 0 = NaN), gradient exactly 0, stats 0.
    logprobs = torch.tensor([[NEG_INF, 1.0, NAN], [0.0, 5.0, 100.0]], requires_grad=True)
    old = torch.tensor([[NEG_INF, NAN, 0.0], [float("inf"), -5.0, 0.0]])
    adv = torch.tensor([[NAN, 1.0, -1.0], [float("inf"), -2.0, 3.0]])
    with pytest.warns(EmptyMaskWarning, match="policy_loss: response_mask has no real token"):
        loss, stats = policy_loss(
            logprobs,
            old,
            adv,
            torch.zeros(2, 3),
            agg=agg,
            options=PolicyLossOptions(clip_ratio_c=clip_ratio_c),
        )
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(logprobs.grad, torch.zeros(2, 3))
    assert {name: value.item() for name, value in stats.items()} == dict.fromkeys(stats, 0.0)


@pytest.mark.parametrize("agg", AGG_MODES)
@pytest.mark.parametrize("cliprange_value", [0.2, None])
def test_value_loss_all_zero_mask_every_mode(agg, cliprange_value):
    values = torch.tensor([[NAN, 1.0, 1e30], [float("inf"), -2.0, 0.0]], requires_grad=True)
    old = torch.tensor([[0.0, NAN, 1.0], [NEG_INF, 0.0, 0.0]])
    returns = torch.tensor([[float("inf"), 3.0, NAN], [1.0, 1e-20, 0.0]])
    with pytest.warns(EmptyMaskWarning, match="value_loss: response_mask has no real token"):
        loss, stats = value_loss(
            values, old, returns, torch.zeros(2, 3), cliprange_value=cliprange_value, agg=agg
        )
    assert loss.item() == 0.0
    loss.backward()
    assert torch.equal(values.grad, torch.zeros(2, 3))
    assert {name: value.item() for name, value in stats.items()} == dict.fromkeys(stats, 0.0)


@pytest.mark.parametrize("agg", AGG_MODES)
def test_zero_width_mask_every_mode(agg):
    # No response tokens at all ([B, 0]): the same finite zeros, for both losses.
    logprobs = torch.zeros(2, 0, requires_grad=True)
    empty = torch.zeros(2, 0)
    with pytest.warns(EmptyMaskWarning):
        loss, _ = policy_loss(logprobs, empty, empty, empty, agg=agg)
    loss.backward()
    assert loss.item() == 0.0 and logprobs.grad.shape == (2, 0)
    with pytest.warns(EmptyMaskWarning):
        vloss, vstats = value_loss(empty, empty, empty, empty, agg=agg)
    assert vloss.item() == 0.0 and all(v.item() == 0.0 for v in vstats.values())


def test_empty_mask_warning_points_at_the_caller_and_not_for_empty_rows():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        policy_loss(LOGPROBS, OLD, ADV, torch.zeros_like(PMASK))
        value_loss(V, V_OLD, RET, torch.zeros_like(VMASK))
    assert [w.category for w in caught] == [EmptyMaskWarning, EmptyMaskWarning]
    assert all(w.filename == __file__ for w in caught)
    # Some empty rows, but not all: no warning (empty rows are handled by the aggregation).
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        policy_loss(LOGPROBS, OLD, ADV, torch.tensor([[1, 1, 1, 0], [0, 0, 0, 0]]))
        value_loss(V, V_OLD, RET, torch.tensor([[0, 0, 0], [1, 1, 0]]))


def test_explained_variance_stays_finite_for_a_tiny_return_variance():
    # R = [0, 1e-20], V = [0, 10]: Var(R) = (1e-20)^2 / 2 = 5e-41 (unbiased, n = 2) and
    # Var(R - V) = (10 - 1e-20)^2 / 2 ~ 50, so 1 - 50 / 5e-41 = -1e42, beyond float32
    # (a float32 division gives -inf); it is clamped to float32's lowest value.
    _, stats = value_loss(
        torch.tensor([[0.0, 10.0]]),
        torch.tensor([[0.0, 10.0]]),
        torch.tensor([[0.0, 1e-20]]),
        torch.ones(1, 2),
    )
    assert stats["explained_variance"].item() == -torch.finfo(torch.float32).max


def test_policy_losses_are_a_registry_under_verls_names():
    assert POLICY_LOSSES["vanilla"].fn is policy_loss
    assert POLICY_LOSSES["vanilla"].options == ()

    @register_policy_loss("test_zero", options=("tau",))
    def zero(log_prob, old_log_prob, advantages, response_mask, **_):
        return (log_prob * 0).sum(), {}

    try:
        assert POLICY_LOSSES["test_zero"].fn is zero
        assert POLICY_LOSSES["test_zero"].options == ("tau",)
    finally:
        del POLICY_LOSSES["test_zero"]


def test_explained_variance_floor():
    # returns [1, 2, 3] (Var 1), values [1, 2, 2] (residual [0, 0, 1], Var 1/3): EV 2/3.
    returns, values, mask = (
        torch.tensor([[1.0, 2.0, 3.0]]),
        torch.tensor([[1.0, 2.0, 2.0]]),
        torch.ones(1, 3),
    )
    assert explained_variance(values, returns, mask).item() == pytest.approx(2 / 3)
    assert explained_variance(values, returns, mask, min_var=0.5).item() == pytest.approx(2 / 3)
    # a floor above Var(R) = 1: nothing to explain, 0
    assert explained_variance(values, returns, mask, min_var=1.0).item() == 0.0
    # returns that are all about 0 (Var 1e-12) against values of size 1: -1e12 without a
    # floor, 0 with the trainer's 1e-8
    tiny = torch.tensor([[0.0, 1e-6, 2e-6]])
    assert explained_variance(values, tiny, mask).item() < -1e11
    assert explained_variance(values, tiny, mask, min_var=1e-8).item() == 0.0


def test_sum_pi_squared_is_the_collision_probability():
    from proxima.algos import sum_pi_squared

    logits = torch.tensor([[[0.0, math.log(3.0)]]])  # probabilities 1/4, 3/4
    assert sum_pi_squared(logits).item() == pytest.approx(1 / 16 + 9 / 16)
    # temperature 2: probabilities proportional to 1 and sqrt(3)
    assert sum_pi_squared(logits, temperature=2.0).item() == pytest.approx(
        4 / (4 + 2 * math.sqrt(3))
    )


def test_leave_one_out_mean():
    x = torch.tensor([1.0, 2.0, 3.0, 10.0, 5.0])
    out = leave_one_out_mean(x, torch.tensor([0, 0, 0, 1, 2]))
    torch.testing.assert_close(out[:3], torch.tensor([2.5, 2.0, 1.5]), rtol=0, atol=0)
    assert out[3:].isnan().all()  # alone in their groups: no other row


def test_first_token_explained_variance():
    """The critic's value at each response's first token, and the group's leave-one-out
    mean, against the return there; a row with no response token is left out."""
    r = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 100.0]
    v = [0.6, 0.6, 0.6, 0.4, 0.4, 0.4, 100.0]
    returns = torch.tensor([[x, 7.0] for x in r])  # the second token's are never read
    values = torch.tensor([[x, -3.0] for x in v])
    mask = torch.tensor([[1, 1]] * 6 + [[0, 0]])
    groups = torch.tensor([0, 0, 0, 1, 1, 1, 1])
    critic, group = first_token_explained_variance(values, returns, mask, groups)
    # residuals 0.4 -0.6 0.4 0.6 -0.4 -0.4 (mean 0, squares 1.36); returns' squares 1.5
    torch.testing.assert_close(
        critic, torch.tensor(1 - 1.36 / 1.5, dtype=torch.float64), rtol=1e-6, atol=1e-6
    )
    # leave-one-out means 0.5 1 0.5 | 0 0.5 0.5: residuals 0.5 -1 0.5 1 -0.5 -0.5 (3.0)
    torch.testing.assert_close(
        group, torch.tensor(1 - 3.0 / 1.5, dtype=torch.float64), rtol=1e-6, atol=1e-6
    )
