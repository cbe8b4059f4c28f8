"""Literal values of the estimators added under verl's names: remax, opo, grpo_passk, gpg,
gdpo, optimal_token_baseline, tir_optimal_token_baseline, rloo_vectorized and the
grpo_vectorized alias. Every expected value is worked out by hand in the comments (with
Python arithmetic for the irrational ones), never by calling proxima or verl."""

import math
import warnings

import pytest
import torch

from proxima.algos import (
    ADVANTAGE_ESTIMATORS,
    EXTRA_INPUTS,
    SingletonGroupWarning,
    compute_advantages,
    gdpo,
    gpg,
    grpo,
    grpo_passk,
    opo,
    optimal_token_baseline,
    register_advantage,
    remax,
    rloo,
    rloo_vectorized,
    tir_optimal_token_baseline,
)

EPS = 1e-6  # GRPO's epsilon


def rows(adv: torch.Tensor, mask: torch.Tensor) -> list[float]:
    """The per-row value of a broadcast advantage (0 for an empty row); checks that it is the
    same on every real token and 0 on masked ones."""
    out = []
    for row, m in zip(adv, mask, strict=True):
        assert torch.all(row[m == 0] == 0)
        real = row[m != 0]
        if real.numel() == 0:
            out.append(0.0)
            continue
        assert torch.all(real == real[0])
        out.append(real[0].item())
    return out


# ------------------------------------------------------------------------ registry, needs


def test_needs_options_and_inputs_of_each_estimator():
    needs = {n: e.needs for n, e in ADVANTAGE_ESTIMATORS.items() if e.needs}
    assert needs == {
        "remax": ("reward_baselines",),
        "optimal_token_baseline": ("old_logprobs", "sum_pi_squared"),
        "tir_optimal_token_baseline": ("old_logprobs", "sum_pi_squared"),
        "distill": ("old_logprobs", "teacher_logprobs"),
    }
    inputs = {n: e.inputs for n, e in ADVANTAGE_ESTIMATORS.items() if e.inputs}
    assert inputs == {
        "remax": ("reward_baselines",),
        "optimal_token_baseline": ("old_logprobs", "sum_pi_squared", "is_weights"),
        "tir_optimal_token_baseline": ("old_logprobs", "sum_pi_squared", "is_weights"),
        "gdpo": ("score_components",),
        "distill": ("old_logprobs", "teacher_logprobs"),
    }
    options = {n: e.options for n, e in ADVANTAGE_ESTIMATORS.items()}
    assert options["grpo_passk"] == ("norm_adv_by_std_in_grpo",)
    assert options["gdpo"] == ("norm_adv_by_std_in_grpo", "gdpo_reward_weights")
    assert options["optimal_token_baseline"] == ("handle_zero_tail",)
    assert options["tir_optimal_token_baseline"] == ("handle_zero_tail",)
    for name in ("remax", "opo", "gpg", "rloo_vectorized"):
        assert options[name] == ()
    assert ADVANTAGE_ESTIMATORS["grpo_vectorized"].fn is grpo
    assert options["grpo_vectorized"] == options["grpo"]
    assert set(EXTRA_INPUTS) == {
        "reward_baselines",
        "old_logprobs",
        "sum_pi_squared",
        "is_weights",
        "score_components",
        "teacher_logprobs",
    }


def test_a_missing_input_is_an_error_naming_it_and_the_estimator():
    rewards, mask, ids = torch.ones(2, 2), torch.ones(2, 2), torch.tensor([0, 0])
    with pytest.raises(ValueError, match="estimator 'remax' needs reward_baselines, \\[B\\]"):
        compute_advantages("remax", rewards, mask)
    with pytest.raises(ValueError, match="remax: needs reward_baselines"):
        remax(rewards, mask)
    with pytest.raises(ValueError, match="'optimal_token_baseline' needs sum_pi_squared"):
        compute_advantages(
            "optimal_token_baseline", rewards, mask, group_ids=ids, old_logprobs=rewards
        )
    with pytest.raises(ValueError, match="tir_optimal_token_baseline: needs old_logprobs"):
        tir_optimal_token_baseline(rewards, mask, group_ids=ids, sum_pi_squared=rewards)
    with pytest.raises(ValueError, match="optimal_token_baseline: needs group_ids"):
        optimal_token_baseline(rewards, mask, old_logprobs=rewards, sum_pi_squared=rewards)
    with pytest.raises(ValueError, match=r"reward_baselines \[3\] vs token_rewards \[2, 2\]"):
        remax(rewards, mask, reward_baselines=torch.ones(3))
    with pytest.raises(ValueError, match=r"token_rewards \[2, 2\] vs is_weights \[2, 3\]"):
        optimal_token_baseline(
            rewards,
            mask,
            group_ids=ids,
            old_logprobs=rewards,
            sum_pi_squared=rewards,
            is_weights=torch.ones(2, 3),
        )
    with pytest.raises(ValueError, match="needs \\['bogus'\\] must be among"):
        register_advantage("test_bogus", needs=("bogus",))(lambda r, m, bogus=None: (r, r))
    assert "test_bogus" not in ADVANTAGE_ESTIMATORS


def test_extra_inputs_reach_only_the_estimators_that_read_them():
    # grpo ignores reward_baselines; remax gets it through compute_advantages.
    rewards, mask, ids = torch.tensor([[1.0], [3.0]]), torch.ones(2, 1), torch.tensor([0, 0])
    base = torch.tensor([0.25, 0.5])
    g, _ = compute_advantages(
        "grpo", rewards, mask, group_ids=ids, reward_baselines=base, norm_adv_by_std_in_grpo=False
    )
    torch.testing.assert_close(g, torch.tensor([[-1.0], [1.0]]))
    r, _ = compute_advantages("remax", rewards, mask, group_ids=ids, reward_baselines=base)
    torch.testing.assert_close(r, torch.tensor([[0.75], [2.5]]))


# ---------------------------------------------------------------------------------- remax


def test_remax_literal():
    # Row 0: rewards 0.1, -0.2, 1.0 -> returns-to-go G = [0.9, 0.8, 1.0]; baseline 0.5
    #   -> A = [0.4, 0.3, 0.5].
    # Row 1: a hole at t=1 (its 9 is ignored): G = [0.5 + 2, -, 2] = [2.5, 0, 2]; baseline 1
    #   -> A = [1.5, 0, 1].
    # Row 2: no real token -> zeros whatever its rewards and baseline.
    rewards = torch.tensor([[0.1, -0.2, 1.0], [0.5, 9.0, 2.0], [3.0, 3.0, 3.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 1], [0, 0, 0]])
    baselines = torch.tensor([0.5, 1.0, 7.0])
    adv, ret = remax(rewards, mask, reward_baselines=baselines)
    torch.testing.assert_close(
        adv, torch.tensor([[0.4, 0.3, 0.5], [1.5, 0.0, 1.0], [0.0, 0.0, 0.0]])
    )
    torch.testing.assert_close(
        ret, torch.tensor([[0.9, 0.8, 1.0], [2.5, 0.0, 2.0], [0.0, 0.0, 0.0]])
    )
    # Undiscounted, as verl: gamma does not reach it.
    again, _ = compute_advantages("remax", rewards, mask, gamma=0.5, reward_baselines=baselines)
    torch.testing.assert_close(again, adv)


def test_remax_outcome_reward_is_score_minus_greedy_score():
    # Score 1 on the last token, greedy response scored 0.25: A = 0.75 on every token.
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    adv, _ = remax(rewards, torch.ones(1, 3), reward_baselines=torch.tensor([0.25]))
    torch.testing.assert_close(adv, torch.full((1, 3), 0.75))


# ------------------------------------------------------------------------------------ opo


def test_opo_literal_length_weighted_baseline():
    # Rows (width 4, prompt ids not adjacent):
    #   r0: id 5, 1 token, outcome 2      r1: id 2, 2 tokens, outcome 1
    #   r2: id 5, 3 tokens, outcome 1+1+2 = 4
    #   r3: id 9 alone, 2 tokens, outcome 3
    #   r4: id 2, no token                r5, r6: id 4, no tokens
    # id 5: b = (1*2 + 3*4) / (1 + 3) = 3.5 -> A = -1.5, 0.5 (the plain mean 3 would give
    #   -1, 1). id 2: b = (2*1 + 0*0) / 2 = 1 -> A(r1) = 0 (the empty row is a member of
    #   length 0). id 9: one member, b = 0 -> 3. id 4: all empty -> 0, not NaN.
    rewards = torch.tensor(
        [
            [2.0, 9.0, 9.0, 9.0],
            [0.5, 0.5, 9.0, 9.0],
            [1.0, 1.0, 2.0, 9.0],
            [1.0, 2.0, 9.0, 9.0],
            [9.0, 9.0, 9.0, 9.0],
            [9.0, 9.0, 9.0, 9.0],
            [9.0, 9.0, 9.0, 9.0],
        ]
    )
    mask = torch.tensor(
        [
            [1, 0, 0, 0],
            [1, 1, 0, 0],
            [1, 1, 1, 0],
            [1, 1, 0, 0],
            [0, 0, 0, 0],
            [0, 0, 0, 0],
            [0, 0, 0, 0],
        ]
    )
    ids = torch.tensor([5, 2, 5, 9, 2, 4, 4])
    with pytest.warns(SingletonGroupWarning, match="opo: "):
        adv, ret = opo(rewards, mask, group_ids=ids)
    assert rows(adv, mask) == pytest.approx([-1.5, 0.0, 0.5, 3.0, 0.0, 0.0, 0.0])
    torch.testing.assert_close(ret, adv)


# ----------------------------------------------------------------------------- grpo_passk

# Outcomes (width 1): group 1 = rows 0, 2, 4, 6 -> 1, 4, 2, 0; group 0 = rows 1, 3, 5 -> a
# tie for the max 3, 3, 1; group 8 = rows 7, 8 -> -1, -2.
PASSK_REWARDS = torch.tensor([[1.0], [3.0], [4.0], [3.0], [2.0], [1.0], [0.0], [-1.0], [-2.0]])
PASSK_MASK = torch.ones(9, 1)
PASSK_IDS = torch.tensor([1, 0, 1, 0, 1, 0, 1, 8, 8])


def test_grpo_passk_best_minus_second_best_literal():
    # Group 1: best 4 (row 2), second best 2 -> 4 - 2 = 2; unbiased std of 1, 4, 2, 0:
    #   mean 1.75, squared deviations 0.5625 + 5.0625 + 0.0625 + 3.0625 = 8.75, / 3.
    #   (GRPO would give the best (4 - 1.75) / std: the baseline is the second best here.)
    # Group 0: the max 3 is tied -> r_max - r_second = 0 for everyone.
    # Group 8: best -1, second -2 -> 1 / (sqrt(0.5) + eps). Every other row gets 0.
    adv, ret = grpo_passk(PASSK_REWARDS, PASSK_MASK, group_ids=PASSK_IDS)
    best_1 = 2.0 / (math.sqrt(8.75 / 3.0) + EPS)
    best_8 = 1.0 / (math.sqrt(0.5) + EPS)
    want = [0.0, 0.0, best_1, 0.0, 0.0, 0.0, 0.0, best_8, 0.0]
    assert rows(adv, PASSK_MASK) == pytest.approx(want, rel=1e-6)
    torch.testing.assert_close(ret, adv)
    plain, _ = grpo_passk(
        PASSK_REWARDS, PASSK_MASK, group_ids=PASSK_IDS, norm_adv_by_std_in_grpo=False
    )
    assert rows(plain, PASSK_MASK) == pytest.approx([0, 0, 2.0, 0, 0, 0, 0, 1.0, 0])


def test_grpo_passk_empty_row_can_be_the_best_and_its_advantage_lands_nowhere():
    # Group 0: row 0 outcome -3, row 1 empty (outcome 0): the empty row is the best
    # (0 - (-3) = 3), but it has no token; row 0 is not the best -> 0 everywhere.
    rewards, mask = torch.tensor([[-3.0], [5.0]]), torch.tensor([[1], [0]])
    adv, _ = grpo_passk(rewards, mask, group_ids=torch.tensor([0, 0]))
    assert torch.equal(adv, torch.zeros(2, 1))


def test_grpo_passk_group_of_one_is_an_error():
    with pytest.raises(ValueError, match=r"at least 2 responses per prompt.*\[7\]"):
        grpo_passk(torch.ones(3, 1), torch.ones(3, 1), group_ids=torch.tensor([3, 3, 7]))


# ------------------------------------------------------------------------------------ gpg


def test_gpg_literal():
    # Outcomes: group 0 = rows 0, 2, 4 -> 1, 0, 0 (row 4 has no real token: outcome 0, a
    # member); group 1 = rows 1, 3 -> 2, 0; group 2 = row 5 alone -> 0.5.
    # alpha = B / (rows with a nonzero outcome) = 6 / 3 = 2 (verl's alpha).
    # Group 0 mean 1/3 -> 2 (1 - 1/3) = 4/3, 2 (0 - 1/3) = -2/3 (row 4: no token).
    # Group 1 mean 1 -> 2, -2 (no division by the std sqrt 2). Row 5: mean 0 -> 1.
    rewards = torch.tensor([[0.5, 0.5], [2.0, 0.0], [0.0, 0.0], [0.0, 9.0], [4.0, 4.0], [0.5, 0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 1], [1, 0], [0, 0], [1, 1]])
    ids = torch.tensor([0, 1, 0, 1, 0, 2])
    with pytest.warns(SingletonGroupWarning, match="gpg: "):
        adv, ret = gpg(rewards, mask, group_ids=ids)
    assert rows(adv, mask) == pytest.approx([4 / 3, 2.0, -2 / 3, -2.0, 0.0, 1.0])
    torch.testing.assert_close(ret, adv)


def test_gpg_alpha_counts_nonzero_outcomes_over_the_whole_batch():
    # Two rows, outcomes 0 and 1: alpha = 2 / 1 = 2, mean 0.5 -> -1, 1.
    adv, _ = gpg(torch.tensor([[0.0], [1.0]]), torch.ones(2, 1), group_ids=torch.tensor([4, 4]))
    torch.testing.assert_close(adv, torch.tensor([[-1.0], [1.0]]))


# ----------------------------------------------------------------------------------- gdpo

# Four rows with two real tokens each; groups a = rows 0, 1 and b = rows 2, 3.
GDPO_MASK = torch.ones(4, 2)
GDPO_IDS = torch.tensor([30, 30, 11, 11])
GDPO_COMPONENTS = torch.tensor([[1.0, 0.2], [0.0, 0.4], [1.0, 0.5], [1.0, 0.1]])


def test_gdpo_literal_weighted_without_std():
    # Component 1 minus its group mean: a [1, 0] -> 0.5, -0.5; b [1, 1] -> 0, 0.
    # Component 2: a [0.2, 0.4] -> -0.1, 0.1; b [0.5, 0.1] -> 0.2, -0.2.
    # Weights [2, 1]: totals 0.9, -0.9, 0.2, -0.2, each on 2 tokens: mean 0, sum of squares
    # 2 (0.81 + 0.81 + 0.04 + 0.04) = 3.4, unbiased var 3.4 / 7 -> A = total / sqrt(3.4/7).
    adv, ret = gdpo(
        torch.zeros(4, 2),
        GDPO_MASK,
        group_ids=GDPO_IDS,
        score_components=GDPO_COMPONENTS,
        norm_adv_by_std_in_grpo=False,
        gdpo_reward_weights=[2.0, 1.0],
    )
    scale = 1 / math.sqrt(3.4 / 7 + 1e-8)
    assert rows(adv, GDPO_MASK) == pytest.approx(
        [0.9 * scale, -0.9 * scale, 0.2 * scale, -0.2 * scale]
    )
    torch.testing.assert_close(ret, adv)


def test_gdpo_literal_equal_weights_with_std():
    # Per component, (c - mean) / (std + eps):
    #   1: a -> +-0.5 / (sqrt(0.5) + eps); b ties -> 0 / (0 + eps) = 0.
    #   2: a -> -+0.1 / (sqrt(0.02) + eps); b -> +-0.2 / (sqrt(0.08) + eps).
    # Summed (weights 1, 1), put on 2 tokens per row, whitened (mean 0 by symmetry).
    u = 0.5 / (math.sqrt(0.5) + EPS)
    v = 0.1 / (math.sqrt(0.02) + EPS)
    w = 0.2 / (math.sqrt(0.08) + EPS)
    totals = [u - v, -u + v, w, -w]
    var = 2 * sum(t * t for t in totals) / 7
    want = [t / math.sqrt(var + 1e-8) for t in totals]
    for weights in ([], [1.0, 1.0]):
        adv, _ = compute_advantages(
            "gdpo",
            torch.zeros(4, 2),
            GDPO_MASK,
            group_ids=GDPO_IDS,
            score_components=GDPO_COMPONENTS,
            gdpo_reward_weights=weights,
        )
        assert rows(adv, GDPO_MASK) == pytest.approx(want, rel=1e-5, abs=1e-6)


def test_gdpo_without_components_uses_the_outcome():
    # Outcomes 1, 0 (group a), 1.5, 0.5 (group b), one token each; grpo without std:
    # 0.5, -0.5, 0.5, -0.5 -> mean 0, unbiased var 1/3 -> +-0.5 / sqrt(1/3).
    rewards = torch.tensor([[1.0], [0.0], [1.5], [0.5]])
    adv, _ = gdpo(rewards, torch.ones(4, 1), group_ids=GDPO_IDS, norm_adv_by_std_in_grpo=False)
    a = 0.5 / math.sqrt(1 / 3 + 1e-8)
    assert rows(adv, torch.ones(4, 1)) == pytest.approx([a, -a, a, -a])


def test_gdpo_component_of_a_row_without_tokens_is_0():
    # Group 0: rows 0, 1 and row 4 (no token, its component 5 is ignored: outcome 0);
    # group 1: rows 2, 3. One component, no std:
    #   group 0 mean (1 + 0 + 0) / 3 = 1/3 -> 2/3, -1/3; group 1 mean 1 -> -0.5, 0.5.
    # Tokens 2/3, -1/3, -1/2, 1/2: mean 1/12; deviations 7/12, -5/12, -7/12, 5/12; sum of
    # squares 148/144, unbiased var 148/432 = 37/108.
    # (Reading the 5 would give group 0 mean 2 -> -1, -2: other values.)
    mask = torch.tensor([[1], [1], [1], [1], [0]])
    comps = torch.tensor([[1.0], [0.0], [0.5], [1.5], [5.0]])
    adv, _ = gdpo(
        torch.zeros(5, 1),
        mask,
        group_ids=torch.tensor([0, 0, 1, 1, 0]),
        score_components=comps,
        norm_adv_by_std_in_grpo=False,
    )
    scale = 1 / math.sqrt(37 / 108 + 1e-8)
    want = [7 / 12 * scale, -5 / 12 * scale, -7 / 12 * scale, 5 / 12 * scale, 0.0]
    assert rows(adv, mask) == pytest.approx(want, rel=1e-6)


def test_gdpo_errors():
    with pytest.raises(ValueError, match="2 weights for 3 reward components"):
        gdpo(
            torch.zeros(2, 1),
            torch.ones(2, 1),
            group_ids=torch.tensor([0, 0]),
            score_components=torch.ones(2, 3),
            gdpo_reward_weights=[1.0, 2.0],
        )
    with pytest.raises(ValueError, match=r"score_components \[3, 2\] vs token_rewards \[2, 1\]"):
        gdpo(
            torch.zeros(2, 1),
            torch.ones(2, 1),
            group_ids=torch.tensor([0, 0]),
            score_components=torch.ones(3, 2),
        )
    with pytest.raises(ValueError, match=r"score_components \[2, 0\] vs"):
        gdpo(
            torch.zeros(2, 1),
            torch.ones(2, 1),
            group_ids=torch.tensor([0, 0]),
            score_components=torch.ones(2, 0),
        )


# ---------------------------------------------------------------- optimal token baselines


def otb_inputs(p: list[list[float]], s: list[list[float]]):
    """old_logprobs = log p and sum_pi_squared = s, so w = 1 - 2 p + s."""
    return torch.tensor(p).log(), torch.tensor(s)


def test_optimal_token_baseline_literal():
    # Group 0: row A (3 tokens), row B (2 tokens); row C alone in group 1.
    #   w = 1 - 2p + s: A (p, s) = (0.25, 0.5), (0.5, 0.5), (0.5, 0.5) -> w = 1, 0.5, 0.5,
    #   W = cumsum = 1, 1.5, 2; B (0.5, 0.5), (0.1, 0.7) -> w = 0.5, 1.5, W = 0.5, 2.
    #   Rewards A 0, 0, 2 -> G = 2, 2, 2; B 0, 1 -> G = 1, 1.
    #   B_0 = (2*1 + 1*0.5) / (1 + 0.5) = 5/3; B_1 = (2*1.5 + 1*2) / (1.5 + 2) = 10/7;
    #   B_2 = (2*2) / 2 = 2, but A is the only longest response (3 > 2): with
    #   handle_zero_tail its baseline is 0 from position 2 (the second longest's length) on.
    #   A: 2 - 5/3 = 1/3, 2 - 10/7 = 4/7, 2 - 0 = 2 (without handle_zero_tail 2 - 2 = 0).
    #   B: 1 - 5/3 = -2/3, 1 - 10/7 = -3/7.
    # Row C (alone): rewards 1, 1 -> G = 2, 1, no baseline -> A = G.
    rewards = torch.tensor([[0.0, 0.0, 2.0], [0.0, 1.0, 9.0], [1.0, 1.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 0]])
    logp, s = otb_inputs(
        [[0.25, 0.5, 0.5], [0.5, 0.1, 0.5], [0.5, 0.5, 0.5]],
        [[0.5, 0.5, 0.5], [0.5, 0.7, 0.5], [0.5, 0.5, 0.5]],
    )
    ids = torch.tensor([0, 0, 1])
    with pytest.warns(SingletonGroupWarning, match="optimal_token_baseline: "):
        adv, ret = optimal_token_baseline(
            rewards, mask, group_ids=ids, old_logprobs=logp, sum_pi_squared=s
        )
    want = torch.tensor([[1 / 3, 4 / 7, 2.0], [-2 / 3, -3 / 7, 0.0], [2.0, 1.0, 0.0]])
    torch.testing.assert_close(adv, want)
    torch.testing.assert_close(
        ret, torch.tensor([[2.0, 2.0, 2.0], [1.0, 1.0, 0.0], [2.0, 1.0, 0.0]])
    )
    with pytest.warns(SingletonGroupWarning):
        no_tail, _ = compute_advantages(
            "optimal_token_baseline",
            rewards,
            mask,
            group_ids=ids,
            old_logprobs=logp,
            sum_pi_squared=s,
            handle_zero_tail=False,
        )
    want[0, 2] = 0.0
    torch.testing.assert_close(no_tail, want)
    # With importance weights rho: w is scaled by rho^2. rho_A = 2, 1, 1 -> w_A = 4, 0.5,
    # 0.5, W_A = 4, 4.5, 5; B unchanged (rho 1). B_0 = (2*4 + 1*0.5) / 4.5 = 17/9;
    # B_1 = (2*4.5 + 1*2) / 6.5 = 22/13. A: 1/9, 4/13, 2; B: -8/9, -9/13.
    rho = torch.tensor([[2.0, 1.0, 1.0], [1.0, 1.0, 1.0], [1.0, 1.0, 1.0]])
    with pytest.warns(SingletonGroupWarning):
        weighted, _ = optimal_token_baseline(
            rewards, mask, group_ids=ids, old_logprobs=logp, sum_pi_squared=s, is_weights=rho
        )
    torch.testing.assert_close(
        weighted[:2],
        torch.tensor([[1 / 9, 4 / 13, 2.0], [-8 / 9, -9 / 13, 0.0]]),
    )


# Two responses with holes, w = 1 everywhere ((p, s) = (0.25, 0.5)):
#   A: mask 1, 0, 1 (hole), rewards 1, junk, 1 -> G = 2, -, 1; W = 1, -, 2.
#   B: mask 1, 1, 0, rewards 0, 3 -> G = 3, 3; W = 1, 2.
HOLE_REWARDS = torch.tensor([[1.0, 50.0, 1.0], [0.0, 3.0, 50.0]])
HOLE_MASK = torch.tensor([[1, 0, 1], [1, 1, 0]])
HOLE_LOGP, HOLE_S = otb_inputs([[0.25] * 3] * 2, [[0.5] * 3] * 2)


def test_optimal_token_baseline_aligns_columns():
    # Column t of the batch: B_0 = (2*1 + 3*1) / 2 = 2.5; B_1: only B is real there,
    # (3*2) / 2 = 3; B_2: only A, (1*2) / 2 = 1. Both are 2 tokens long: no zero tail.
    # A: 2 - 2.5 = -0.5, -, 1 - 1 = 0; B: 3 - 2.5 = 0.5, 3 - 3 = 0.
    adv, _ = optimal_token_baseline(
        HOLE_REWARDS,
        HOLE_MASK,
        group_ids=torch.tensor([0, 0]),
        old_logprobs=HOLE_LOGP,
        sum_pi_squared=HOLE_S,
    )
    torch.testing.assert_close(adv, torch.tensor([[-0.5, 0.0, 0.0], [0.5, 0.0, 0.0]]))


def test_tir_optimal_token_baseline_aligns_real_tokens():
    # The k-th real token of each response: A's are columns 0 and 2 (G 2, 1; W 1, 2), B's
    # columns 0 and 1 (G 3, 3; W 1, 2). B_0 = (2*1 + 3*1) / 2 = 2.5;
    # B_1 = (1*2 + 3*2) / (2 + 2) = 2. A: 2 - 2.5 = -0.5 at column 0, 1 - 2 = -1 at column 2;
    # B: 0.5, 1.
    adv, ret = tir_optimal_token_baseline(
        HOLE_REWARDS,
        HOLE_MASK,
        group_ids=torch.tensor([0, 0]),
        old_logprobs=HOLE_LOGP,
        sum_pi_squared=HOLE_S,
    )
    torch.testing.assert_close(adv, torch.tensor([[-0.5, 0.0, -1.0], [0.5, 1.0, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[2.0, 0.0, 1.0], [3.0, 3.0, 0.0]]))


def test_an_empty_row_is_a_member_in_optimal_token_baseline_but_not_in_the_tir_one():
    # Row 0: 2 tokens, rewards 1, 1 (G = 2, 1), w = 1 (W = 1, 2); row 1: no token, same
    # prompt.
    # optimal_token_baseline: the group has 2 members; row 0 is the only longest (2 > 0) ->
    #   with handle_zero_tail its baseline is 0 from position 0: A = G = 2, 1. Without it
    #   B_t = G_t W_t / (W_t + 1e-8) = G_t (1 - 1e-8 / (W_t + 1e-8)) -> A = 2e-8, 0.5e-8.
    # tir: row 1 is no member, row 0 is alone: no baseline, A = G, and it warns.
    rewards, mask = torch.tensor([[1.0, 1.0], [4.0, 4.0]]), torch.tensor([[1, 1], [0, 0]])
    logp, s = otb_inputs([[0.25] * 2] * 2, [[0.5] * 2] * 2)
    common = {"group_ids": torch.tensor([6, 6]), "old_logprobs": logp, "sum_pi_squared": s}
    want = torch.tensor([[2.0, 1.0], [0.0, 0.0]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        adv, _ = optimal_token_baseline(rewards, mask, **common)
        no_tail, _ = optimal_token_baseline(rewards, mask, handle_zero_tail=False, **common)
    torch.testing.assert_close(adv, want)
    torch.testing.assert_close(no_tail, torch.tensor([[2e-8, 0.5e-8], [0.0, 0.0]]))
    with pytest.warns(SingletonGroupWarning, match="tir_optimal_token_baseline: "):
        tir, _ = tir_optimal_token_baseline(rewards, mask, handle_zero_tail=False, **common)
    torch.testing.assert_close(tir, want)


def test_optimal_token_baseline_ties_for_longest_keep_their_baseline():
    # Two responses of 2 tokens and one of 1: the longest is tied, so no zero tail.
    # w = 1 (W = 1, 2). Rewards: r0 0, 1 (G 1, 1); r1 0, 3 (G 3, 3); r2 2 (G 2).
    # B_0 = (1 + 3 + 2) / 3 = 2; B_1 = (1*2 + 3*2) / 4 = 2.
    # A: r0 -1, -1; r1 1, 1; r2 0.
    rewards = torch.tensor([[0.0, 1.0], [0.0, 3.0], [2.0, 7.0]])
    mask = torch.tensor([[1, 1], [1, 1], [1, 0]])
    logp, s = otb_inputs([[0.25] * 2] * 3, [[0.5] * 2] * 3)
    adv, _ = optimal_token_baseline(
        rewards,
        mask,
        group_ids=torch.zeros(3, dtype=torch.long),
        old_logprobs=logp,
        sum_pi_squared=s,
    )
    torch.testing.assert_close(adv, torch.tensor([[-1.0, -1.0], [1.0, 1.0], [0.0, 0.0]]))


# ------------------------------------------------------------- the vectorised variants


def test_rloo_vectorized_gives_a_group_of_one_zero_where_rloo_gives_its_outcome():
    # Group 0: outcomes 1, 3, 5 -> leave-one-out -3, 0, 3 in both; row 3 alone (outcome 7):
    # rloo 7 (verl's loop), rloo_vectorized 0 (verl multiplies by [n > 1]).
    rewards = torch.tensor([[1.0], [3.0], [5.0], [7.0]])
    mask, ids = torch.ones(4, 1), torch.tensor([2, 2, 2, 9])
    with pytest.warns(SingletonGroupWarning, match="rloo_vectorized: .*advantage is 0"):
        vec, _ = rloo_vectorized(rewards, mask, group_ids=ids)
    with pytest.warns(SingletonGroupWarning, match="rloo: "):
        loop, _ = rloo(rewards, mask, group_ids=ids)
    assert rows(vec, mask) == pytest.approx([-3.0, 0.0, 3.0, 0.0])
    assert rows(loop, mask) == pytest.approx([-3.0, 0.0, 3.0, 7.0])


def test_grpo_vectorized_is_grpo():
    # Outcomes 1, 3 in one group: (+-1) / (sqrt 2 + eps) under either name.
    rewards, mask, ids = torch.tensor([[1.0], [3.0]]), torch.ones(2, 1), torch.tensor([0, 0])
    a = 1 / (math.sqrt(2) + EPS)
    for name in ("grpo", "grpo_vectorized"):
        adv, _ = compute_advantages(name, rewards, mask, group_ids=ids)
        torch.testing.assert_close(adv, torch.tensor([[-a], [a]]))
