import math
import warnings

import pytest
import torch

from proxima.algos import (
    ADVANTAGE_ESTIMATORS,
    SingletonGroupWarning,
    compute_advantages,
    compute_gae,
    discounted_returns,
    grpo,
    register_advantage,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    rloo,
)
from proxima.algos.advantages import GRPO_EPS

# The shared fixture has a group of one on purpose; the tests that are about its warning
# catch it explicitly (pytest.warns overrides this filter).
pytestmark = pytest.mark.filterwarnings("ignore::proxima.algos.SingletonGroupWarning")


def random_ragged_mask(batch: int, width: int, gen: torch.Generator) -> torch.Tensor:
    """Random [B, T] 0/1 mask whose rows cover the awkward cases: row 0 empty, row 1 a
    single token, row 2 with a hole, the rest random lengths with random holes."""
    mask = torch.zeros(batch, width, dtype=torch.long)
    mask[1, int(torch.randint(0, width, (1,), generator=gen))] = 1
    mask[2, : min(3, width)] = 1
    mask[2, 1] = 0
    for b in range(3, batch):
        length = int(torch.randint(0, width + 1, (1,), generator=gen))
        mask[b, :length] = 1
        holes = torch.rand(width, generator=gen) < 0.25
        mask[b, holes] = 0
    return mask


def ref_gae(rewards, values, mask, gamma, lam):
    """Plain-loop GAE: per row, run the textbook recursion on the real tokens only."""
    adv = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        idx = [t for t in range(rewards.shape[1]) if mask[b, t]]
        running, next_value = 0.0, 0.0
        for t in reversed(idx):
            delta = rewards[b, t].item() + gamma * next_value - values[b, t].item()
            running = delta + gamma * lam * running
            adv[b, t] = running
            next_value = values[b, t].item()
    return adv, (adv + values) * (mask != 0)


def ref_discounted_returns(rewards, mask, gamma):
    out = torch.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        running = 0.0
        for t in reversed(range(rewards.shape[1])):
            if mask[b, t]:
                running = rewards[b, t].item() + gamma * running
                out[b, t] = running
    return out


def ref_group_advantages(name, rewards, mask, group_ids):
    """Plain-loop group estimators with the statistics module (float64 on Python floats).

    Every row is a member of its group, a row with no real token with outcome 0 (verl). A
    group of one gets mean 0 and std 1 (verl), so its advantage is the raw outcome (divided
    by 1 + 1e-6 in grpo, and whitened with the rest in reinforce_plus_plus_baseline).
    """
    import statistics

    outcome = [
        sum(r for r, m in zip(row.tolist(), mrow.tolist(), strict=True) if m)
        for row, mrow in zip(rewards, mask, strict=True)
    ]
    members = {}
    for b, gid in enumerate(group_ids.tolist()):
        members.setdefault(gid, []).append(outcome[b])
    per_row = []
    for b, gid in enumerate(group_ids.tolist()):
        group = members.get(gid, [])
        if not mask[b].any():
            per_row.append(0.0)
            continue
        alone = len(group) == 1
        mean = 0.0 if alone else statistics.fmean(group)
        if name == "grpo":
            std = 1.0 if alone else statistics.stdev(group)
            per_row.append((outcome[b] - mean) / (std + 1e-6))
        elif name == "rloo":
            others = 0.0 if alone else (sum(group) - outcome[b]) / (len(group) - 1)
            per_row.append(outcome[b] - others)
        else:
            per_row.append(outcome[b] - mean)
    adv = torch.tensor(per_row).unsqueeze(-1) * (mask != 0)
    if name == "reinforce_plus_plus_baseline":
        real = adv[mask != 0].double()
        whitened = (adv.double() - real.mean()) / math.sqrt(real.var().item() + 1e-8)
        adv = (whitened * (mask != 0)).float()
    return adv


def test_gae_literal_with_hole_empty_row_and_single_token():
    # Row 0 has a hole at t=2 (its reward 50 and value 99 must be ignored).
    # gamma 0.9, lam 0.5, gamma * lam = 0.45:
    #   t=3: delta = 4.9 + 0.9 * 0 - 3 = 1.9,                A3 = 1.9
    #   t=1: delta = -0.1 + 0.9 * V3 (=3, across the hole) - 2 = 0.6,
    #        A1 = 0.6 + 0.45 * 1.9 = 1.455
    #   t=0: delta = -0.1 + 0.9 * 2 - 1 = 0.7,               A0 = 0.7 + 0.45 * 1.455 = 1.35475
    # returns = A + V = [2.35475, 3.455, 0, 4.9]
    # Row 1 is empty -> zeros. Row 2 has one token: A = 2 - 0.5 = 1.5, return 2.
    rewards = torch.tensor([[-0.1, -0.1, 50.0, 4.9], [1.0, 1.0, 1.0, 1.0], [2.0, 9.0, 9.0, 9.0]])
    values = torch.tensor([[1.0, 2.0, 99.0, 3.0], [5.0, 5.0, 5.0, 5.0], [0.5, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0, 1], [0, 0, 0, 0], [1, 0, 0, 0]])
    adv, ret = compute_gae(rewards, values, mask, gamma=0.9, lam=0.5)
    torch.testing.assert_close(
        adv, torch.tensor([[1.35475, 1.455, 0.0, 1.9], [0.0] * 4, [1.5, 0.0, 0.0, 0.0]])
    )
    torch.testing.assert_close(
        ret, torch.tensor([[2.35475, 3.455, 0.0, 4.9], [0.0] * 4, [2.0, 0.0, 0.0, 0.0]])
    )
    assert adv.dtype == ret.dtype == torch.float32


def test_gae_default_gamma_lam_literal():
    # Reward 1 at the last of 3 tokens, constant value 0.5, gamma 1, lam 0.95:
    # delta = [0, 0, 0.5] -> A_t = 0.95^(2 - t) * 0.5 = [0.45125, 0.475, 0.5].
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    adv, ret = compute_gae(rewards, torch.full((1, 3), 0.5), torch.ones(1, 3))
    torch.testing.assert_close(adv, torch.tensor([[0.45125, 0.475, 0.5]]))
    torch.testing.assert_close(ret, torch.tensor([[0.95125, 0.975, 1.0]]))


@pytest.mark.parametrize("gamma", [1.0, 0.99, 0.5])
@pytest.mark.parametrize("lam", [1.0, 0.95, 0.3, 0.0])
def test_gae_oracle_terminal_reward_constant_values(gamma, lam):
    # Reward R only at the last token (t = L-1), value c everywhere, V after the end = 0:
    #   delta_t = gamma c - c for t < L-1, delta_{L-1} = R - c, so
    #   A_t = (gamma - 1) c sum_{l=0}^{L-2-t} (gamma lam)^l + (gamma lam)^(L-1-t) (R - c).
    length, reward, c = 5, 2.0, 0.7
    rewards = torch.zeros(1, length)
    rewards[0, -1] = reward
    adv, _ = compute_gae(rewards, torch.full((1, length), c), torch.ones(1, length), gamma, lam)
    gl = gamma * lam
    by_hand = [
        (gamma - 1) * c * sum(gl**k for k in range(length - 1 - t))
        + gl ** (length - 1 - t) * (reward - c)
        for t in range(length)
    ]
    torch.testing.assert_close(adv[0], torch.tensor(by_hand), rtol=1e-6, atol=1e-6)


def test_gae_gamma_lam_one_is_monte_carlo_minus_values():
    gen = torch.Generator().manual_seed(3)
    rewards = torch.randn(4, 6, generator=gen)
    values = torch.randn(4, 6, generator=gen)
    adv, ret = compute_gae(rewards, values, torch.ones(4, 6), gamma=1.0, lam=1.0)
    # Monte Carlo return: sum of the rewards from t to the end.
    mc = rewards.flip(-1).cumsum(-1).flip(-1)
    torch.testing.assert_close(adv, mc - values, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret, mc, rtol=1e-5, atol=1e-5)


def test_gae_lam_zero_is_one_step_td():
    gen = torch.Generator().manual_seed(4)
    rewards = torch.randn(3, 5, generator=gen)
    values = torch.randn(3, 5, generator=gen)
    gamma = 0.9
    adv, _ = compute_gae(rewards, values, torch.ones(3, 5), gamma=gamma, lam=0.0)
    next_values = torch.cat([values[:, 1:], torch.zeros(3, 1)], dim=-1)  # V after the end = 0
    torch.testing.assert_close(adv, rewards + gamma * next_values - values)


@pytest.mark.parametrize("seed", range(6))
def test_gae_matches_python_loop_on_ragged_masks(seed):
    gen = torch.Generator().manual_seed(seed)
    mask = random_ragged_mask(8, 7, gen)
    rewards = torch.randn(8, 7, generator=gen)
    values = torch.randn(8, 7, generator=gen)
    gamma, lam = [(1.0, 0.95), (0.9, 0.5), (0.99, 1.0), (0.5, 0.0), (1.0, 1.0), (0.7, 0.8)][seed]
    adv, ret = compute_gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = ref_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, ref_adv, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ret, ref_ret, rtol=1e-5, atol=1e-5)


def test_discounted_returns_literal():
    # gamma 0.5; row 0: [1, 2, 3] -> G = [1 + 0.5 * 3.5, 2 + 0.5 * 3, 3] = [2.75, 3.5, 3];
    # row 1 has a hole (reward 100 ignored): G = [4 + 0.5 * 2, 0, 2] = [5, 0, 2].
    rewards = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 2.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
    out = discounted_returns(rewards, mask, gamma=0.5)
    torch.testing.assert_close(out, torch.tensor([[2.75, 3.5, 3.0], [5.0, 0.0, 2.0]]))


@pytest.mark.parametrize("seed", range(4))
def test_discounted_returns_match_python_loop(seed):
    gen = torch.Generator().manual_seed(100 + seed)
    mask = random_ragged_mask(6, 9, gen)
    rewards = torch.randn(6, 9, generator=gen)
    out = discounted_returns(rewards, mask, gamma=0.8)
    torch.testing.assert_close(out, ref_discounted_returns(rewards, mask, 0.8))


def test_reinforce_plus_plus_literal():
    # Discounted returns from test_discounted_returns_literal on real tokens:
    # 2.75, 3.5, 3, 5, 2 -> mean 3.25, deviations -0.5, 0.25, -0.25, 1.75, -1.25,
    # squares sum to 5.0, unbiased var 5 / 4 = 1.25 -> advantage = deviation / sqrt(1.25).
    rewards = torch.tensor([[1.0, 2.0, 3.0], [4.0, 100.0, 2.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 1]])
    adv, ret = reinforce_plus_plus(rewards, mask, gamma=0.5)
    scale = 1.0 / math.sqrt(1.25 + 1e-8)
    expected = torch.tensor([[-0.5, 0.25, -0.25], [1.75, 0.0, -1.25]]) * scale
    torch.testing.assert_close(adv, expected)
    # Returns are the discounted returns before whitening (verl), 0 on the hole.
    torch.testing.assert_close(ret, torch.tensor([[2.75, 3.5, 3.0], [5.0, 0.0, 2.0]]))


def test_reinforce_plus_plus_returns_are_unwhitened_discounted_returns():
    # gamma 1: row 0 rewards [0, 0, 1] -> G = [1, 1, 1]; row 1 [0, 2, pad 9] -> G = [2, 2, 0].
    # Advantages whiten G over the 5 real tokens (mean 7/5, not the returns); the returns
    # are G itself, as verl's reinforce_plus_plus returns them, also through the registry.
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 2.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    expected_returns = torch.tensor([[1.0, 1.0, 1.0], [2.0, 2.0, 0.0]])
    adv, ret = compute_advantages("reinforce_plus_plus", rewards, mask, gamma=1.0)
    torch.testing.assert_close(ret, expected_returns)
    # Squared deviations from 7/5: 3 * (2/5)^2 + 2 * (3/5)^2 = 30/25, unbiased var 30/100.
    scale = 1.0 / math.sqrt(0.3 + 1e-8)
    expected_adv = torch.tensor([[-0.4, -0.4, -0.4], [0.6, 0.6, 0.0]]) * scale
    torch.testing.assert_close(adv, expected_adv)


# Six rows whose outcomes (sums of real-token rewards) are 1, 2, 3, 4, 5, 7; junk (50) sits on
# padding and holes. Groups are not adjacent: group 0 = rows 0, 2, 4; group 1 = rows 1, 3;
# group 2 = row 5 alone. Every row has exactly two real tokens.
GROUP_REWARDS = torch.tensor(
    [
        [0.5, 0.5, 50.0],
        [1.0, 50.0, 1.0],
        [1.0, 2.0, 50.0],
        [50.0, 3.0, 1.0],
        [2.0, 3.0, 50.0],
        [3.0, 50.0, 4.0],
    ]
)
GROUP_MASK = torch.tensor([[1, 1, 0], [1, 0, 1], [1, 1, 0], [0, 1, 1], [1, 1, 0], [1, 0, 1]])
GROUP_IDS = torch.tensor([10, 11, 10, 11, 10, 12])


def _row_values(adv: torch.Tensor) -> list[float]:
    """The per-row scalar of a broadcast advantage (checks it is constant on real tokens)."""
    out = []
    for row, m in zip(adv, GROUP_MASK, strict=True):
        real = row[m != 0]
        assert torch.all(real == real[0])
        assert torch.all(row[m == 0] == 0)
        out.append(real[0].item())
    return out


def test_grpo_literal():
    # Group 0: outcomes 1, 3, 5 -> mean 3, unbiased std sqrt((4 + 0 + 4) / 2) = 2.
    # Group 1: outcomes 2, 4 -> mean 3, unbiased std sqrt((1 + 1) / 1) = sqrt 2.
    # Group 2: one member, outcome 7 -> mean 0, std 1 (verl) -> 7 / (1 + 1e-6).
    adv, ret = grpo(GROUP_REWARDS, GROUP_MASK, group_ids=GROUP_IDS)
    s2 = math.sqrt(2.0) + 1e-6
    expected = [-2 / 2.000001, -1 / s2, 0.0, 1 / s2, 2 / 2.000001, 7 / 1.000001]
    assert _row_values(adv) == pytest.approx(expected, rel=1e-6)
    torch.testing.assert_close(ret, adv)


def test_grpo_without_std():
    # Mean subtraction only: group 0 -> -2, 0, 2; group 1 -> -1, 1; singleton 7 - 0 = 7.
    adv, _ = grpo(GROUP_REWARDS, GROUP_MASK, group_ids=GROUP_IDS, norm_adv_by_std_in_grpo=False)
    assert _row_values(adv) == pytest.approx([-2.0, -1.0, 0.0, 1.0, 2.0, 7.0])


def test_grpo_identical_outcomes_give_zero():
    adv, _ = grpo(torch.ones(3, 2), torch.ones(3, 2), group_ids=torch.tensor([0, 0, 0]))
    assert torch.equal(adv, torch.zeros(3, 2))


def test_rloo_literal():
    # A_i = outcome_i - mean of the other members.
    # Group 0: 1 - (3 + 5) / 2 = -3, 3 - (1 + 5) / 2 = 0, 5 - (1 + 3) / 2 = 3.
    # Group 1: 2 - 4 = -2, 4 - 2 = 2. Singleton: no other member -> raw outcome 7 (verl).
    adv, ret = rloo(GROUP_REWARDS, GROUP_MASK, group_ids=GROUP_IDS)
    assert _row_values(adv) == pytest.approx([-3.0, -2.0, 0.0, 2.0, 3.0, 7.0])
    torch.testing.assert_close(ret, adv)


def test_reinforce_plus_plus_baseline_literal():
    # outcome - group mean = -2, -1, 0, 1, 2 and 7 - 0 = 7 for the singleton (mean 0, verl),
    # on both real tokens of each row: 12 token values, sum 2 * 7 = 14, mean 7/6,
    # sum of squares 2 * (4 + 1 + 0 + 1 + 4 + 49) = 118, squared deviations
    # 118 - 12 * (7/6)^2 = 305/3, unbiased var (305/3) / 11 = 305/33
    # -> advantage = (centred - 7/6) / sqrt(305/33 + 1e-8).
    adv, ret = reinforce_plus_plus_baseline(GROUP_REWARDS, GROUP_MASK, group_ids=GROUP_IDS)
    scale = 1.0 / math.sqrt(305.0 / 33.0 + 1e-8)
    expected = [(v - 7.0 / 6.0) * scale for v in (-2.0, -1.0, 0.0, 1.0, 2.0, 7.0)]
    assert _row_values(adv) == pytest.approx(expected, rel=1e-6, abs=1e-7)
    torch.testing.assert_close(ret, adv)


# rollout.n = 1: every prompt has one response. Outcomes (sums over real tokens):
# row 0: 1 + 2 = 3, row 1: -4 (the 100 sits on padding), row 2: 0.5.
SOLO_REWARDS = torch.tensor([[1.0, 2.0], [-4.0, 100.0], [0.5, 0.0]])
SOLO_MASK = torch.tensor([[1, 1], [1, 0], [1, 1]])
SOLO_IDS = torch.tensor([0, 1, 2])


def test_grpo_group_of_one_is_raw_score_like_verl():
    # verl: a group of one has mean 0 and std 1 -> A = (outcome - 0) / (1 + 1e-6);
    # without std normalisation A = outcome - 0.
    with pytest.warns(SingletonGroupWarning, match="grpo: some groups hold a single response"):
        adv, ret = grpo(SOLO_REWARDS, SOLO_MASK, group_ids=SOLO_IDS)
    expected = torch.tensor([[3.0, 3.0], [-4.0, 0.0], [0.5, 0.5]]) / 1.000001
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected)
    with pytest.warns(SingletonGroupWarning):
        adv, _ = grpo(SOLO_REWARDS, SOLO_MASK, group_ids=SOLO_IDS, norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(adv, torch.tensor([[3.0, 3.0], [-4.0, 0.0], [0.5, 0.5]]))


def test_rloo_group_of_one_is_raw_score_like_verl():
    # verl's rloo leaves a score alone when its group has one response: A = outcome.
    with pytest.warns(SingletonGroupWarning, match="rloo: "):
        adv, ret = rloo(SOLO_REWARDS, SOLO_MASK, group_ids=SOLO_IDS)
    expected = torch.tensor([[3.0, 3.0], [-4.0, 0.0], [0.5, 0.5]])
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(ret, expected)


def test_reinforce_plus_plus_baseline_group_of_one_whitens_raw_scores():
    # Baseline 0 for groups of one -> the raw outcomes 3, 3, -4, 0.5, 0.5 are whitened over
    # the 5 real tokens: sum 3, mean 0.6; squared deviations 2 * 2.4^2 + 4.6^2 + 2 * 0.1^2
    # = 11.52 + 21.16 + 0.02 = 32.7, unbiased var 32.7 / 4 = 8.175.
    with pytest.warns(SingletonGroupWarning, match="reinforce_plus_plus_baseline: "):
        adv, _ = reinforce_plus_plus_baseline(SOLO_REWARDS, SOLO_MASK, group_ids=SOLO_IDS)
    scale = 1.0 / math.sqrt(8.175 + 1e-8)
    expected = torch.tensor([[2.4, 2.4], [-4.6, 0.0], [-0.1, -0.1]]) * scale
    torch.testing.assert_close(adv, expected)


def test_a_row_with_no_real_token_is_a_group_member_with_outcome_0():
    # Rows 0 and 1 share prompt 0 and row 1 is empty: as in verl (which sums every row of a
    # prompt, an empty one to 0), row 1 is a member with outcome 0, so row 0 (outcome 3) is
    # not alone and no warning is raised. Until this was aligned with verl, empty rows were
    # left out and row 0 counted as a group of one (raw score 3 / (1 + 1e-6) in grpo).
    # grpo: mean 1.5, unbiased std sqrt(1.5^2 + 1.5^2) = sqrt(4.5) -> 1.5 / (sqrt(4.5) + eps);
    # without std 3 - 1.5 = 1.5; rloo: 3 - 0 (the other member) = 3. The empty row stays 0.
    mask = torch.tensor([[1, 1], [0, 0]])
    ids = torch.tensor([0, 0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scaled, _ = grpo(SOLO_REWARDS[:2], mask, group_ids=ids)
        centred, _ = grpo(SOLO_REWARDS[:2], mask, group_ids=ids, norm_adv_by_std_in_grpo=False)
        loo, _ = rloo(SOLO_REWARDS[:2], mask, group_ids=ids)
    want = 1.5 / (math.sqrt(4.5) + 1e-6)
    torch.testing.assert_close(scaled, torch.tensor([[want, want], [0.0, 0.0]]))
    torch.testing.assert_close(centred, torch.tensor([[1.5, 1.5], [0.0, 0.0]]))
    torch.testing.assert_close(loo, torch.tensor([[3.0, 3.0], [0.0, 0.0]]))


@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_group_estimators_do_not_warn_without_groups_of_one(name):
    # Groups {0, 2} and {1, 3}; an all-empty group (rows 4, 5 of prompt 9) is not a group
    # of one either.
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [0, 1], [0, 0], [0, 0]])
    ids = torch.tensor([0, 1, 0, 1, 9, 9])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ADVANTAGE_ESTIMATORS[name](torch.ones(6, 2), mask, group_ids=ids)


def test_singleton_warning_is_shown_once_per_calling_line_and_points_at_the_caller():
    # Under Python's default filter a warning with the same text from the same line is
    # shown once: a training loop calling compute_advantages every step warns once.
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):
            compute_advantages("grpo", SOLO_REWARDS, SOLO_MASK, group_ids=SOLO_IDS)
    assert len(caught) == 1
    assert issubclass(caught[0].category, SingletonGroupWarning)
    assert caught[0].filename.endswith("advantages.py")  # the compute_advantages line
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        rloo(SOLO_REWARDS, SOLO_MASK, group_ids=SOLO_IDS)
    assert caught[0].filename == __file__


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("name", ["grpo", "rloo", "reinforce_plus_plus_baseline"])
def test_group_estimators_match_python_loop(name, seed):
    gen = torch.Generator().manual_seed(200 + seed)
    mask = random_ragged_mask(10, 5, gen)
    rewards = torch.randn(10, 5, generator=gen)
    group_ids = torch.randint(0, 4, (10,), generator=gen)
    adv, _ = ADVANTAGE_ESTIMATORS[name](rewards, mask, group_ids=group_ids)
    torch.testing.assert_close(adv, ref_group_advantages(name, rewards, mask, group_ids))


def test_empty_rows_are_group_members_with_outcome_0():
    # Row 2 is empty (its 100 lies outside the mask): a member of group 0 with outcome 0, as
    # in verl. Outcomes 1, 3, 0 -> mean 4/3 -> A = -1/3, 5/3 and 0 on row 2 (masked). (This
    # test asserted the opposite, mean 2 over rows 0 and 1, before the parity fix: verl's
    # group statistics count every row of a prompt.)
    rewards = torch.tensor([[1.0], [3.0], [100.0]])
    mask = torch.tensor([[1], [1], [0]])
    adv, _ = grpo(rewards, mask, group_ids=torch.tensor([0, 0, 0]), norm_adv_by_std_in_grpo=False)
    torch.testing.assert_close(adv, torch.tensor([[-1.0 / 3.0], [5.0 / 3.0], [0.0]]))


def test_compute_advantages_dispatch():
    mask = GROUP_MASK
    values = torch.ones(6, 3)
    gae = compute_advantages("gae", GROUP_REWARDS, mask, values=values, gamma=0.9, lam=0.5)
    torch.testing.assert_close(gae[0], compute_gae(GROUP_REWARDS, values, mask, 0.9, 0.5)[0])
    g = compute_advantages(
        "grpo", GROUP_REWARDS, mask, group_ids=GROUP_IDS, norm_adv_by_std_in_grpo=False
    )
    assert _row_values(g[0]) == pytest.approx([-2.0, -1.0, 0.0, 1.0, 2.0, 7.0])
    # gamma is forwarded to reinforce_plus_plus; values are ignored by critic-free ones.
    rpp = compute_advantages("reinforce_plus_plus", GROUP_REWARDS, mask, values=values, gamma=0.5)
    torch.testing.assert_close(rpp[0], reinforce_plus_plus(GROUP_REWARDS, mask, gamma=0.5)[0])
    assert not torch.equal(rpp[0], reinforce_plus_plus(GROUP_REWARDS, mask, gamma=1.0)[0])


def test_compute_advantages_errors():
    with pytest.raises(ValueError, match="unknown advantage estimator 'ppo'") as err:
        compute_advantages("ppo", GROUP_REWARDS, GROUP_MASK)
    for name in ADVANTAGE_ESTIMATORS:
        assert name in str(err.value)
    with pytest.raises(ValueError, match="'gae' needs values"):
        compute_advantages("gae", GROUP_REWARDS, GROUP_MASK)
    for name in ("grpo", "rloo", "reinforce_plus_plus_baseline"):
        with pytest.raises(ValueError, match=f"{name}: needs group_ids"):
            compute_advantages(name, GROUP_REWARDS, GROUP_MASK)
    with pytest.raises(ValueError, match=r"unknown options \['norm_by_std'\]"):
        compute_advantages("rloo", GROUP_REWARDS, GROUP_MASK, group_ids=GROUP_IDS, norm_by_std=1)
    with pytest.raises(ValueError, match=r"group_ids \[5\] vs token_rewards \[6, 3\]"):
        grpo(GROUP_REWARDS, GROUP_MASK, group_ids=GROUP_IDS[:5])
    with pytest.raises(ValueError, match=r"token_rewards \[6, 3\] vs values \[6, 2\]"):
        compute_gae(GROUP_REWARDS, torch.ones(6, 2), GROUP_MASK)
    with pytest.raises(ValueError, match=r"token_rewards \[6, 3\] vs response_mask \[6, 2\]"):
        compute_gae(GROUP_REWARDS, torch.ones(6, 3), GROUP_MASK[:, :2])


def test_estimators_do_not_modify_inputs_or_track_grad():
    rewards = GROUP_REWARDS.clone().requires_grad_(True)
    values = torch.ones(6, 3, requires_grad=True)
    # Every extra input, for the estimators that read them (the others ignore them).
    extra = {
        "reward_baselines": torch.full((6,), 0.5),
        "old_logprobs": torch.full((6, 3), -0.5),
        "sum_pi_squared": torch.full((6, 3), 0.4),
        "is_weights": torch.full((6, 3), 1.2),
        "score_components": torch.ones(6, 2),
        "teacher_logprobs": torch.full((6, 3), -0.25),
    }
    extra = {k: v.requires_grad_(True) for k, v in extra.items()}
    before = {k: v.detach().clone() for k, v in extra.items()}
    ids = torch.tensor([10, 11, 10, 11, 10, 11])  # no group of one: grpo_passk needs two
    for name in ADVANTAGE_ESTIMATORS:
        adv, ret = compute_advantages(
            name, rewards, GROUP_MASK, values=values, group_ids=ids, **extra
        )
        assert not adv.requires_grad and not ret.requires_grad
    assert torch.equal(rewards.detach(), GROUP_REWARDS)
    assert torch.equal(values.detach(), torch.ones(6, 3))
    for k, v in extra.items():
        assert torch.equal(v.detach(), before[k]), k


# --------------------------------------------------------------------------- the registry


def test_gae_is_registered_with_its_options_and_whitens_when_asked():
    # The literal of test_gae_default_gamma_lam_literal, A = [0.45125, 0.475, 0.5] (gamma 1,
    # lam 0.95), whitened: mean 0.4754167, unbiased variance 0.00059427 (squared deviations
    # 0.00058403 + 0.00000017 + 0.00060434, over 2), so A_w = (A - 0.4754167) *
    # rsqrt(0.00059427 + 1e-8) = [-0.99134, -0.01709, 1.00843].
    est = ADVANTAGE_ESTIMATORS["gae"]
    assert est.critic and est.options == ("lam", "whiten_advantages", "whiten_shift_mean")
    assert all(not e.critic for n, e in ADVANTAGE_ESTIMATORS.items() if n != "gae")
    assert ADVANTAGE_ESTIMATORS["grpo"].options == ("norm_adv_by_std_in_grpo",)
    rewards, values, mask = (
        torch.tensor([[0.0, 0.0, 1.0]]),
        torch.full((1, 3), 0.5),
        torch.ones(1, 3),
    )
    plain = compute_advantages("gae", rewards, mask, values=values, lam=0.95)
    torch.testing.assert_close(plain[0], torch.tensor([[0.45125, 0.475, 0.5]]))
    white = compute_advantages(
        "gae", rewards, mask, values=values, lam=0.95, whiten_advantages=True
    )
    want = torch.tensor([[-0.99134, -0.01709, 1.00843]])
    torch.testing.assert_close(white[0], want, atol=1e-4, rtol=0)
    torch.testing.assert_close(white[1], plain[1])  # the critic's targets are never whitened
    # scale only: the mean 0.4754167 added back, [-0.51592, 0.45833, 1.48385]
    scaled = compute_advantages(
        "gae", rewards, mask, values=values, lam=0.95, whiten_advantages=True,
        whiten_shift_mean=False,
    )  # fmt: skip
    torch.testing.assert_close(scaled[0], want + 0.4754167, atol=1e-4, rtol=0)


def test_an_estimator_option_goes_to_its_estimator_only():
    # grpo's option changes grpo (group {0, 1}: outcomes 1 and 3 -> mean 2, std sqrt(2)) and
    # gae's lam is no option of grpo.
    rewards, mask = torch.tensor([[1.0], [3.0]]), torch.ones(2, 1)
    ids = torch.tensor([0, 0])
    scaled = compute_advantages("grpo", rewards, mask, group_ids=ids)[0]
    torch.testing.assert_close(scaled, torch.tensor([[-1.0], [1.0]]) / (2**0.5 + GRPO_EPS))
    centred = compute_advantages(
        "grpo", rewards, mask, group_ids=ids, norm_adv_by_std_in_grpo=False
    )
    torch.testing.assert_close(centred[0], torch.tensor([[-1.0], [1.0]]))
    with pytest.raises(ValueError, match=r"'grpo' got unknown options \['lam'\]"):
        compute_advantages("grpo", rewards, mask, group_ids=ids, lam=0.9)


def test_a_registered_estimator_is_dispatched_by_name():
    @register_advantage("test_constant", options=("scale",))
    def constant(token_rewards, response_mask, scale: float = 1.0):
        out = torch.full_like(token_rewards, scale) * response_mask
        return out, out

    try:
        adv, _ = compute_advantages("test_constant", torch.zeros(1, 2), torch.ones(1, 2), scale=3.0)
        torch.testing.assert_close(adv, torch.full((1, 2), 3.0))
    finally:
        del ADVANTAGE_ESTIMATORS["test_constant"]
