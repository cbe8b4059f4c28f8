"""Literal-value tests of the policy losses in ``proxima.algos.policy_losses``: every expected
value is worked out by hand below (math.log / math.exp on the numbers of the case), never
by calling the code under test or verl. Gradients are d loss / d log_prob."""

import dataclasses
import math
import warnings

import pytest
import torch

from proxima.algos import AGG_MODES, POLICY_LOSSES, EmptyMaskWarning, PolicyLossOptions
from proxima.config.sections import PolicyLossConfig

LN, EXP = math.log, math.exp
F64 = torch.float64


def sigmoid(x):
    return 1 / (1 + EXP(-x))


def t(rows):
    return torch.tensor(rows, dtype=F64)


def run(name, log_prob, old_log_prob, advantages, mask, agg="token-mean", is_weights=None, **kw):
    """(loss as a float, stats as floats, d loss / d log_prob); float64 tensors, so the loss
    and gradient are compared to 1e-9, the stats (float32, as all stats) to 1e-6. `kw`: the
    loss's options (`PolicyLossOptions`)."""
    lp = t(log_prob).requires_grad_(True)
    options = PolicyLossOptions(**kw)
    loss, stats = POLICY_LOSSES[name](
        lp, t(old_log_prob), t(advantages), t(mask), agg, options, is_weights
    )
    (grad,) = torch.autograd.grad(loss, lp)
    return float(loss.detach()), {k: float(v) for k, v in stats.items()}, grad


def close(actual, expected, tol=1e-9):
    torch.testing.assert_close(torch.as_tensor(actual, dtype=F64), t(expected), rtol=tol, atol=tol)


# --------------------------------------------------------------------------- gspo


def gspo_case():
    # row 0: log-ratios ln 1.2, ln 0.8 -> sequence ratio s0 = exp((ln 1.2 + ln 0.8) / 2)
    #        = sqrt(0.96), inside [0.8, 1.2]; A = +1 and +3
    # row 1: one real token, log-ratio ln 1.5 -> s1 = 1.5 > 1.2 with A = +2: clipped
    lp = [[LN(0.6), LN(0.4)], [LN(0.6), -5.0]]
    old = [[LN(0.5), LN(0.5)], [LN(0.4), -1.0]]
    adv = [[1.0, 3.0], [2.0, 7.0]]
    mask = [[1, 1], [1, 0]]
    return lp, old, adv, mask


def test_gspo_token_mean():
    s0 = math.sqrt(0.96)
    loss, stats, grad = run("gspo", *gspo_case())
    # per token: row 0: max(-A s0, -A clip(s0)) = -s0, -3 s0; row 1: max(-3, -2.4) = -2.4
    close(loss, (-s0 - 3 * s0 - 2.4) / 3)
    # d/d log_prob of a token's s_it is s_i (value s_i, gradient s_i d log_prob: each token
    # its own advantage, not the row's mean); the clipped row has none
    close(grad, [[-s0 / 3, -3 * s0 / 3], [0.0, 0.0]])
    close(stats["clipfrac"], 1 / 3, tol=1e-6)
    close(stats["ppo_kl"], -(LN(1.2) + LN(0.8) + LN(1.5)) / 3, tol=1e-6)


def test_gspo_seq_mean_token_mean_is_the_papers_sequence_average():
    s0 = math.sqrt(0.96)
    loss, _, grad = run("gspo", *gspo_case(), agg="seq-mean-token-mean")
    close(loss, ((-s0 - 3 * s0) / 2 + -2.4) / 2)
    close(grad, [[-s0 / 4, -3 * s0 / 4], [0.0, 0.0]])


def test_gspo_sequence_log_ratio_capped_at_10():
    # log-ratio 12 with A = -1: the ratio is e^10 (capped), unclipped side binds (-A r is
    # larger than -A * 1.2), and no gradient flows through the cap
    loss, _, grad = run("gspo", [[0.0]], [[-12.0]], [[-1.0]], [[1]])
    close(loss, EXP(10.0))
    close(grad, [[0.0]])


# --------------------------------------------------------------------------- sapo


def sapo_case():
    # row 0: r = 1 (A = +1), r = 2 (A = +1); row 1: r = 0.5 (A = -1), then padding
    lp = [[LN(0.3), LN(0.4)], [LN(0.1), 0.0]]
    old = [[LN(0.3), LN(0.2)], [LN(0.2), 0.0]]
    adv = [[1.0, 1.0], [-1.0, 5.0]]
    return lp, old, adv, [[1, 1], [1, 0]]


def test_sapo_soft_gate_and_its_gradient():
    tau_neg = 1.05
    g = [4 * sigmoid(0.0), 4 * sigmoid(1.0), 4 * sigmoid(tau_neg * (0.5 - 1)) / tau_neg]
    # loss = -A * gate, reduced per row (seq-mean-token-mean) whatever agg says
    expected = ((-g[0] - g[1]) / 2 + g[2]) / 2
    # d gate / d log_prob = 4 sigmoid(x) (1 - sigmoid(x)) * r, x = tau (r - 1)
    d = [
        4 * sigmoid(0.0) * (1 - sigmoid(0.0)) * 1.0,
        4 * sigmoid(1.0) * (1 - sigmoid(1.0)) * 2.0,
        4 * sigmoid(-0.525) * (1 - sigmoid(-0.525)) * 0.5,
    ]
    for agg in AGG_MODES:
        loss, stats, grad = run("sapo", *sapo_case(), agg=agg, tau_pos=1.0, tau_neg=tau_neg)
        close(loss, expected)
        close(grad, [[-d[0] / 4, -d[1] / 4], [d[2] / 2, 0.0]])
    close(stats["ppo_kl"], -(0 + LN(2) + LN(0.5)) / 3, tol=1e-6)
    assert d[0] == 1.0  # at r = 1 the gradient is the policy gradient's, -A


def test_sapo_huge_ratio_saturates():
    # log-ratio 50 is clamped to 20: gate = 4 / tau * sigmoid(tau (e^20 - 1)) = 4 / tau
    loss, _, grad = run("sapo", [[0.0]], [[-50.0]], [[1.0]], [[1]], tau_pos=2.0)
    close(loss, -2.0)
    close(grad, [[0.0]])


# --------------------------------------------------------------------------- cispo


def test_cispo_clipped_detached_weight():
    # r = 1.5 -> 1.2 (A = 1), r = 0.5 -> 0.8 (A = -2), r = 1 (A = 1)
    lp = [[LN(0.6), LN(0.2), LN(0.3)]]
    old = [[LN(0.4), LN(0.4), LN(0.3)]]
    loss, stats, grad = run("cispo", lp, old, [[1.0, -2.0, 1.0]], [[1, 1, 1]])
    close(loss, (-1.2 * LN(0.6) + 0.8 * 2 * LN(0.2) - LN(0.3)) / 3)
    # the weight is a constant: every token keeps the gradient -w A (clipped ones too)
    close(grad, [[-1.2 / 3, 1.6 / 3, -1 / 3]])
    close(stats["clipfrac"], 2 / 3, tol=1e-6)


def test_cispo_huge_ratio_is_clamped_as_vanilla():
    # log-ratio 30 is clamped to 20 (ppo_kl -20); the weight is clipped to 1.2 either way
    loss, stats, grad = run("cispo", [[LN(0.5)]], [[LN(0.5) - 30]], [[1.0]], [[1]])
    close(loss, -1.2 * LN(0.5))
    close(grad, [[-1.2]])
    close(stats["ppo_kl"], -20.0, tol=1e-6)
    close(stats["clipfrac"], 1.0, tol=1e-6)


# --------------------------------------------------------------------------- gpg


def gpg_agg_case():
    # rows of 2, 1 and 0 real tokens (T = 3); loss per token -A log_prob
    lp = [[LN(0.5), LN(0.25), 9.0], [LN(0.2), -1.0, -1.0], [-3.0, -3.0, -3.0]]
    adv = [[2.0, -1.0, 4.0], [3.0, 4.0, 4.0], [1.0, 1.0, 1.0]]
    mask = [[1, 1, 0], [1, 0, 0], [0, 0, 0]]
    return lp, lp, adv, mask


GPG_TOKEN_LOSS = [-2 * LN(0.5), LN(0.25), -3 * LN(0.2)]  # row 0: first two; row 1: last
GPG_EXPECTED = {
    "token-mean": (sum(GPG_TOKEN_LOSS) / 3, [[-2 / 3, 1 / 3, 0], [-1, 0, 0]]),
    "token-sum": (sum(GPG_TOKEN_LOSS), [[-2, 1, 0], [-3, 0, 0]]),
    # the empty row is not a row of the mean
    "seq-mean-token-sum": (
        (GPG_TOKEN_LOSS[0] + GPG_TOKEN_LOSS[1] + GPG_TOKEN_LOSS[2]) / 2,
        [[-1, 0.5, 0], [-1.5, 0, 0]],
    ),
    "seq-mean-token-mean": (
        ((GPG_TOKEN_LOSS[0] + GPG_TOKEN_LOSS[1]) / 2 + GPG_TOKEN_LOSS[2]) / 2,
        [[-0.5, 0.25, 0], [-1.5, 0, 0]],
    ),
    # row sums divided by T = 3, then the mean over the 2 non-empty rows
    "seq-mean-token-sum-norm": (
        (GPG_TOKEN_LOSS[0] + GPG_TOKEN_LOSS[1] + GPG_TOKEN_LOSS[2]) / 3 / 2,
        [[-1 / 3, 1 / 6, 0], [-0.5, 0, 0]],
    ),
}


@pytest.mark.parametrize("agg", AGG_MODES)
def test_gpg_every_agg_mode(agg):
    assert set(GPG_EXPECTED) == set(AGG_MODES)
    expected_loss, expected_grad = GPG_EXPECTED[agg]
    loss, stats, grad = run("gpg", *gpg_agg_case(), agg=agg)
    close(loss, expected_loss)
    close(grad, [*expected_grad, [0, 0, 0]])
    close(stats["ppo_kl"], 0.0, tol=1e-6)


def test_gpg_is_weights_multiply_each_token():
    w = t([[0.5, 2.0]])
    loss, _, grad = run(
        "gpg", [[LN(0.5), LN(0.25)]], [[0, 0]], [[2, -1]], [[1, 1]], agg="token-sum", is_weights=w
    )
    # -(2 ln 0.5) * 0.5 + (ln 0.25) * 2 = ln 2 - 4 ln 2
    close(loss, -3 * LN(2))
    close(grad, [[-1.0, 2.0]])


# --------------------------------------------------------------------------- clip_cov


def clip_cov_case():
    # one row, r = 1 everywhere (no PPO clip). mean A = 0.5, mean log_prob = -2:
    # cov = (A - 0.5) (log_prob + 2) = [1.5 * 1, -1.5 * -1, 0.5 * 0, -0.5 * 0] = [1.5, 1.5, 0, 0]
    lp = [[-1.0, -3.0, -2.0, -2.0]]
    return lp, lp, [[2.0, -1.0, 1.0, 0.0]], [[1, 1, 1, 1]]


def test_clip_cov_cuts_the_candidates():
    # lb 0.5 < cov < 5: tokens 0 and 1; clip_cov_ratio 0.5 -> int(0.5 * 4) = 2 cut: both
    loss, stats, grad = run("clip_cov", *clip_cov_case(), clip_cov_ratio=0.5, clip_cov_lb=0.5)
    # per token -A r = [-2, 1, -1, 0]; the cut ones are 0 but still count in the mean
    close(loss, -1 / 4)
    close(grad, [[0.0, 0.0, -1 / 4, 0.0]])
    close(stats["clipfrac"], 2 / 4, tol=1e-6)
    uncut, _, _ = run("clip_cov", *clip_cov_case(), clip_cov_lb=2.0)  # no candidate
    close(uncut, (-2 + 1 - 1 + 0) / 4)


def test_clip_cov_draws_one_of_two_with_torchs_generator():
    # default ratio 0.0002: max(int(0.0008), 1) = 1 of the 2 candidates, drawn as verl:
    # the candidates in row-major order, permuted by torch.randperm(2), the first one kept
    for seed in range(6):
        torch.manual_seed(seed)
        first = int(torch.randperm(2)[0])
        torch.manual_seed(seed)
        loss, stats, grad = run("clip_cov", *clip_cov_case(), clip_cov_lb=0.5)
        close(stats["clipfrac"], 1 / 4, tol=1e-6)
        kept = [-2.0, 1.0]
        kept[first] = 0.0
        close(loss, (kept[0] + kept[1] - 1) / 4)
        expected_grad = [-2 / 4, 1 / 4, -1 / 4, 0.0]
        expected_grad[first] = 0.0
        close(grad, [expected_grad])


@pytest.mark.parametrize(("ratio", "n_cut"), [(0.2, 1), (0.74, 2), (0.76, 3), (5.0, 4)])
def test_clip_cov_number_cut_is_int_of_ratio_times_tokens(ratio, n_cut):
    # bounds (-10, 10) make all 4 tokens candidates: max(int(ratio * 4), 1) are cut (at
    # most 4): int truncates, 0.74 * 4 = 2.96 -> 2
    _, stats, _ = run(
        "clip_cov", *clip_cov_case(), clip_cov_ratio=ratio, clip_cov_lb=-10, clip_cov_ub=10
    )
    close(stats["clipfrac"], n_cut / 4, tol=1e-6)


def test_clip_cov_never_cuts_a_ppo_clipped_token():
    # token 0 now has r = 2 with A = 2 > 0: PPO-clipped (loss -2 * 1.2, no gradient), so
    # not a candidate although its covariance is the largest
    lp = [[-1.0, -3.0, -2.0, -2.0]]
    old = [[-1.0 - LN(2), -3.0, -2.0, -2.0]]
    adv, mask = [[2.0, -1.0, 1.0, 0.0]], [[1, 1, 1, 1]]
    loss, stats, grad = run("clip_cov", lp, old, adv, mask, clip_cov_ratio=0.5, clip_cov_lb=0.5)
    close(stats["clipfrac"], 1 / 4, tol=1e-6)  # only token 1
    close(loss, (-2 * 1.2 + 0 - 1 + 0) / 4)
    close(grad, [[0.0, 0.0, -1 / 4, 0.0]])


# --------------------------------------------------------------------------- kl_cov


def kl_cov_case():
    # mean A = 0.5, mean log_prob = -2: cov = (A - 0.5)(log_prob + 2)
    #   = [1.5 * 1, -1.5 * -1.5, 0.5 * 0, -0.5 * 0.5] = [1.5, 2.25, 0, -0.25]
    # (by old_log_prob the order would differ: token 0 first)
    lp = [-1.0, -3.5, -2.0, -1.5]
    d = [0.1, -1.0, 0.05, 0.3]  # log-ratios
    old = [[a - b for a, b in zip(lp, d, strict=True)]]
    return [lp], old, [[2.0, -1.0, 1.0, 0.0]], [[1, 1, 1, 1]]


def test_kl_cov_penalises_the_top_covariance_token():
    # k = max(1, int(0.25 * 4)) = 1: token 1 (cov 2.25) gets + 0.5 |log-ratio|
    loss, stats, grad = run("kl_cov", *kl_cov_case(), kl_cov_ratio=0.25, ppo_kl_coef=0.5)
    close(loss, (-2 * EXP(0.1) + (EXP(-1.0) + 0.5 * 1.0) - EXP(0.05) + 0) / 4)
    # d(-A r)/d log_prob = -A r; the penalty adds coef * sign(log-ratio)
    close(grad, [[-2 * EXP(0.1) / 4, (EXP(-1.0) - 0.5) / 4, -EXP(0.05) / 4, 0.0]])
    close(stats["kl_abs"], (0.1 + 1.0 + 0.05 + 0.3) / 4, tol=1e-6)
    close(stats["ppo_kl"], -(0.1 - 1.0 + 0.05 + 0.3) / 4, tol=1e-6)


def test_kl_cov_top_two():
    # int(0.74 * 4) = int(2.96) = 2: tokens 1 and 0 (cov 2.25, 1.5)
    loss, _, grad = run("kl_cov", *kl_cov_case(), kl_cov_ratio=0.74, ppo_kl_coef=0.5)
    close(loss, ((-2 * EXP(0.1) + 0.05) + (EXP(-1.0) + 0.5) - EXP(0.05) + 0) / 4)
    close(grad, [[(-2 * EXP(0.1) + 0.5) / 4, (EXP(-1.0) - 0.5) / 4, -EXP(0.05) / 4, 0.0]])


def test_kl_cov_has_no_clip():
    # log-ratio 30 (not clamped), A = -1: loss = e^30 + 0.1 * 30 (the only token is the top)
    loss, _, grad = run("kl_cov", [[0.0]], [[-30.0]], [[-1.0]], [[1]])
    close(loss, EXP(30) + 3.0)
    close(grad, [[EXP(30) + 0.1]])


# --------------------------------------------------------------------------- geo_mean


def geo_mean_case():
    # bounds 0.4 / 0.4 on the log-ratio
    # row 0, A = +1: x = [0.2, 0.6, -0.5] -> kept min(x, clip(x)) = [0.2, 0.4, -0.5]
    #   R0 = exp(0.1 / 3), loss0 = -R0
    # row 1, A = -2 (2 real tokens): x = [0.5, -0.7] -> kept max(x, clip(x)) = [0.5, -0.4]
    #   R1 = exp(0.1 / 2), loss1 = 2 R1
    # row 2: empty, loss2 = 0; the loss is the mean over the 3 rows
    x = [[0.2, 0.6, -0.5], [0.5, -0.7, 0.0], [0.0, 0.0, 0.0]]
    old = [[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0], [-1.0, -1.0, -1.0]]
    lp = [[o + d for o, d in zip(ro, rx, strict=True)] for ro, rx in zip(old, x, strict=True)]
    adv = [[1.0, 1.0, 1.0], [-2.0, -2.0, 9.0], [3.0, 3.0, 3.0]]
    mask = [[1, 1, 1], [1, 1, 0], [0, 0, 0]]
    return lp, old, adv, mask


def test_geo_mean_literal_and_agg_ignored():
    r0, r1 = EXP(0.1 / 3), EXP(0.05)
    for agg in AGG_MODES:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            loss, stats, grad = run(
                "geo_mean", *geo_mean_case(), clip_ratio_low=0.4, clip_ratio_high=0.4, agg=agg
            )
        close(loss, (-r0 + 2 * r1 + 0) / 3)
        # gradient through the unclipped tokens only: d loss_i / d x = -A_i R_i / n_i, / 3 rows
        close(grad, [[-r0 / 9, 0.0, -r0 / 9], [r1 / 3, 0.0, 0.0], [0.0, 0.0, 0.0]])
    # outside [-0.4, 0.4]: 0.6, -0.5 (A > 0) and 0.5, -0.7 (A < 0), of 5 real tokens
    close(stats["clipfrac"], 2 / 5, tol=1e-6)
    close(stats["clipfrac_lower"], 2 / 5, tol=1e-6)
    close(stats["ppo_kl"], -(0.2 + 0.6 - 0.5 + 0.5 - 0.7) / 5, tol=1e-6)


def test_geo_mean_is_weights_by_row_geometric_mean():
    # row 0 weights 1, 4, 2 -> (8)^(1/3) = 2; row 1 weights 0.25, 1 -> 0.5
    w = t([[1.0, 4.0, 2.0], [0.25, 1.0, 7.0], [5.0, 5.0, 5.0]])
    r0, r1 = EXP(0.1 / 3), EXP(0.05)
    loss, _, grad = run(
        "geo_mean", *geo_mean_case(), clip_ratio_low=0.4, clip_ratio_high=0.4, is_weights=w
    )
    close(loss, (-r0 * 2 + 2 * r1 * 0.5) / 3, tol=1e-8)  # (verl's + 1e-10 in the log)
    close(grad, [[-2 * r0 / 9, 0.0, -2 * r0 / 9], [0.5 * r1 / 3, 0.0, 0.0], [0, 0, 0]], tol=1e-8)


# --------------------------------------------------------------------------- dppo


def dppo_tv_case():
    # (p_old, p, A): inside when p - p_old <= 0.2 (A > 0) or >= -0.2 (A <= 0)
    tokens = [
        (0.5, 0.6, 1.0),  # +0.1: inside, r = 1.2
        (0.2, 0.5, 1.0),  # +0.3: outside
        (0.5, 0.25, -1.0),  # -0.25: outside
        (0.1, 0.05, -1.0),  # -0.05: inside, r = 0.5
        (0.01, 0.1, 1.0),  # +0.09: inside, r = 10 (truncated to clip_ratio_c)
    ]
    old = [[LN(po) for po, _, _ in tokens]]
    lp = [[LN(p) for _, p, _ in tokens]]
    return lp, old, [[a for _, _, a in tokens]], [[1] * 5]


def test_dppo_tv_trust_region_and_truncation():
    loss, stats, grad = run("dppo_tv", *dppo_tv_case(), clip_ratio_c=3.0)
    # loss = -A sg[min(r, 3)] log p inside, 0 outside
    close(loss, (-1.2 * LN(0.6) + 0.5 * LN(0.05) - 3 * LN(0.1)) / 5)
    close(grad, [[-1.2 / 5, 0, 0, 0.5 / 5, -3 / 5]])
    close(stats["clipfrac"], 2 / 5, tol=1e-6)  # outside the region
    close(stats["clipfrac_lower"], 1 / 5, tol=1e-6)  # inside, r > 3
    close(stats["ppo_kl"], -(LN(1.2) + LN(2.5) + LN(0.5) + LN(0.5) + LN(10)) / 5, tol=1e-6)
    # clip_ratio_low = 0.3 lets token 2 (-0.25, A < 0, r = 0.5) in; clip_ratio_high stays 0.2
    loss, _, grad = run("dppo_tv", *dppo_tv_case(), clip_ratio_low=0.3)
    close(loss, (-1.2 * LN(0.6) + 0.5 * LN(0.25) + 0.5 * LN(0.05) - 3 * LN(0.1)) / 5)
    close(grad, [[-1.2 / 5, 0, 0.5 / 5, 0.5 / 5, -3 / 5]])


def test_dppo_clip_ratio_c_none_is_verls_20():
    loss, stats, grad = run("dppo_tv", *dppo_tv_case(), clip_ratio_c=None)
    close(loss, (-1.2 * LN(0.6) + 0.5 * LN(0.05) - 10 * LN(0.1)) / 5)  # r = 10 < 20
    close(grad, [[-1.2 / 5, 0, 0, 0.5 / 5, -10 / 5]])
    close(stats["clipfrac_lower"], 0.0, tol=1e-6)


def binary_kl(p_old, p):
    return p_old * (LN(p_old) - LN(p)) + (1 - p_old) * LN((1 - p_old + 1e-8) / (1 - p + 1e-8))


def test_dppo_kl_trust_region():
    tokens = [
        (0.5, 0.6, 1.0),  # KL 0.0204 <= 0.2: inside, r = 1.2
        (0.2, 0.9, 1.0),  # KL 1.36 > 0.2 and p > p_old with A > 0: outside
        (0.5, 0.1, 1.0),  # KL large but p < p_old with A > 0: inside, r = 0.2
        (0.5, 0.1, -1.0),  # KL 0.51 with p < p_old, A < 0: inside for low 0.6, not 0.2
        (0.2, 0.9, -1.0),  # p > p_old with A < 0: inside, r = 4.5 -> 3
    ]
    assert binary_kl(0.5, 0.6) < 0.2 < binary_kl(0.5, 0.1) < 0.6 < binary_kl(0.2, 0.9)
    old = [[LN(po) for po, _, _ in tokens]]
    lp = [[LN(p) for _, p, _ in tokens]]
    adv = [[a for _, _, a in tokens]]
    loss, stats, grad = run("dppo_kl", lp, old, adv, [[1] * 5], clip_ratio_c=3.0)
    close(loss, (-1.2 * LN(0.6) - 0.2 * LN(0.1) + 3 * LN(0.9)) / 5)
    close(grad, [[-1.2 / 5, 0, -0.2 / 5, 0, 3 / 5]])
    close(stats["clipfrac"], 2 / 5, tol=1e-6)
    close(stats["clipfrac_lower"], 1 / 5, tol=1e-6)
    # clip_ratio_low = 0.6 (A < 0 side) lets token 3 in (r = 0.2); A > 0 keeps 0.2
    loss, stats, grad = run("dppo_kl", lp, old, adv, [[1] * 5], clip_ratio_low=0.6)
    close(loss, (-1.2 * LN(0.6) - 0.2 * LN(0.1) + 0.2 * LN(0.1) + 3 * LN(0.9)) / 5)
    close(grad, [[-1.2 / 5, 0, -0.2 / 5, 0.2 / 5, 3 / 5]])
    close(stats["clipfrac"], 1 / 5, tol=1e-6)


# --------------------------------------------------------------------------- dro


def test_dro_quadratic_penalty():
    lp = [[LN(0.5), LN(0.25)]]
    old = [[LN(0.25), LN(0.25)]]
    loss, stats, grad = run("dro", lp, old, [[1.0, -2.0]], [[1, 1]], dro_beta=0.5)
    # -(A log p - beta / 2 (log p - log p_old)^2): log-ratios ln 2, 0
    close(loss, (-(LN(0.5) - 0.25 * LN(2) ** 2) + 2 * LN(0.25)) / 2)
    # d/d log p = -A + beta (log p - log p_old)
    close(grad, [[(-1 + 0.5 * LN(2)) / 2, 2 / 2]])
    close(stats["ppo_kl"], -LN(2) / 2, tol=1e-6)


@pytest.mark.parametrize("beta", [0.0, -0.1])
def test_dro_refuses_a_non_positive_beta(beta):
    with pytest.raises(ValueError, match=r"dro_loss: dro_beta must be > 0, got"):
        run("dro", [[0.0]], [[0.0]], [[1.0]], [[1]], dro_beta=beta)


# --------------------------------------------------------------------------- all losses

OPTIONS = {"dro": PolicyLossOptions(dro_beta=0.1)}
DEFAULTS = PolicyLossOptions()
NEW_LOSSES = sorted(set(POLICY_LOSSES) - {"vanilla"})


def test_registry_names_and_options_are_verls_and_the_configs():
    verl_names = "vanilla gspo sapo cispo gpg clip_cov kl_cov geo_mean dppo_tv dppo_kl dro"
    assert set(POLICY_LOSSES) == set(verl_names.split())
    fields = {f.name for f in dataclasses.fields(PolicyLossConfig)} - {"loss_mode"}
    read = set().union(*(entry.options for entry in POLICY_LOSSES.values()))
    assert read == fields  # every option is a config field, every field is some loss's
    assert POLICY_LOSSES["clip_cov"].options == ("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub")
    assert POLICY_LOSSES["kl_cov"].options == ("kl_cov_ratio", "ppo_kl_coef")
    assert POLICY_LOSSES["sapo"].options == ("tau_pos", "tau_neg")
    assert POLICY_LOSSES["dro"].options == ("dro_beta",)


def test_options_are_the_configs_fields_with_their_defaults():
    """`PolicyLossOptions` holds the clip ratios and every `actor.policy_loss.*` option, with
    the config's defaults (the trainer builds it from the config field by field)."""
    config = {f.name: f.default for f in dataclasses.fields(PolicyLossConfig)}
    del config["loss_mode"]
    options = {f.name: f.default for f in dataclasses.fields(PolicyLossOptions)}
    clips = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": 3.0}
    assert options == {**clips, **config}


@pytest.mark.parametrize("name", NEW_LOSSES)
def test_empty_mask_gives_zero_and_warns(name):
    lp = t([[float("nan"), -float("inf")], [1.0, 2.0]]).requires_grad_(True)
    mask = torch.zeros(2, 2)
    for agg in AGG_MODES:
        with pytest.warns(EmptyMaskWarning, match="response_mask has no real token"):
            loss, stats = POLICY_LOSSES[name](
                lp, lp, t([[1, -1], [2, 3]]), mask, agg, OPTIONS.get(name, DEFAULTS)
            )
        (grad,) = torch.autograd.grad(loss, lp)
        assert float(loss.detach()) == 0.0 and not grad.any()
        assert all(float(v) == 0.0 for v in stats.values())


@pytest.mark.parametrize("name", NEW_LOSSES)
def test_non_finite_padding_never_reaches_the_loss(name):
    """NaN / inf on padding (log-probs, advantages, weights) change nothing."""
    g = torch.Generator().manual_seed(0)
    lp = -torch.rand(3, 4, generator=g, dtype=F64) * 2
    old = -torch.rand(3, 4, generator=g, dtype=F64) * 2
    adv = torch.randn(3, 4, generator=g, dtype=F64)
    w = torch.rand(3, 4, generator=g, dtype=F64)
    mask = t([[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 0, 1]])
    dirty = [x.clone() for x in (lp, old, adv, w)]
    for x, bad in zip(dirty, [math.nan, -math.inf, math.inf, math.nan], strict=True):
        x[mask == 0] = bad
    results = []
    for a, b, c, d in [(lp, old, adv, w), dirty]:
        a = a.clone().requires_grad_(True)
        torch.manual_seed(0)
        options = OPTIONS.get(name, DEFAULTS)
        loss, stats = POLICY_LOSSES[name](a, b, c, mask, options=options, is_weights=d)
        (grad,) = torch.autograd.grad(loss, a)
        results.append((loss, grad, {k: float(v) for k, v in stats.items()}))
    (clean_loss, clean_grad, clean_stats), (loss, grad, stats) = results
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    torch.testing.assert_close(loss, clean_loss)
    torch.testing.assert_close(grad, clean_grad)
    assert stats == pytest.approx(clean_stats)


@pytest.mark.parametrize("name", NEW_LOSSES)
def test_argument_errors(name):
    x = t([[0.0, 0.0]])
    with pytest.raises(ValueError, match="shape mismatch"):
        POLICY_LOSSES[name](x, x, x, t([[1]]), options=OPTIONS.get(name, DEFAULTS))
    with pytest.raises(ValueError, match="unknown loss aggregation mode 'mean'"):
        POLICY_LOSSES[name](x, x, x, x + 1, "mean", OPTIONS.get(name, DEFAULTS))


@pytest.mark.parametrize(
    ("name", "kwargs", "message"),
    [
        ("gspo", {"clip_ratio_low": 1.0}, "0 <= low < 1"),
        ("cispo", {"clip_ratio_high": -0.1}, "0 <= low < 1"),
        ("clip_cov", {"clip_cov_ratio": 0.0}, "clip_cov_ratio must be > 0"),
        ("kl_cov", {"kl_cov_ratio": 1.5}, r"kl_cov_ratio must be in \(0, 1\]"),
        ("sapo", {"tau_neg": 0.0}, "tau_pos and tau_neg must be > 0"),
        ("geo_mean", {"clip_ratio_low": -0.1}, "must be >= 0"),
        ("dppo_tv", {"clip_ratio_c": -1.0}, "clip_ratio_c .* must be > 0"),
    ],
)
def test_bad_options(name, kwargs, message):
    x = t([[0.0]])
    with pytest.raises(ValueError, match=message):
        POLICY_LOSSES[name](x, x, x, x + 1, options=PolicyLossOptions(**kwargs))
