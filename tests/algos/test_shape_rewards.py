"""`shape_rewards`: standardise, no-stop penalty, clip, KL per token: literal values."""

import pytest
import torch

from proxima.algos import shape_rewards

SCORES = torch.tensor([2.0, -7.0, 1.0])
STOPPED = torch.tensor([True, False, True])
MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
# row 2 holds 9.0 on a masked position: it must reach neither the rewards nor the KL stat
KL = torch.tensor([[0.5, 0.1, 0.0], [0.2, 0.2, 0.2], [0.3, 9.0, 0.0]])


def test_order_standardise_penalty_clip_and_kl():
    rewards, stats = shape_rewards(
        SCORES,
        STOPPED,
        KL,
        MASK,
        kl_coef=0.1,
        clip_reward_value=4.5,
        no_stop_penalty=-1.0,
        score_mean=1.0,
        score_std=2.0,
    )
    # standardised: (2 - 1) / 2 = 0.5, (-7 - 1) / 2 = -4, (1 - 1) / 2 = 0
    # penalty on the row that never stopped: -4 - 1 = -5; clipped to [-4.5, 4.5]: -4.5
    # token rewards: -0.1 * KL on real tokens, the shaped score added at the last real one
    want = torch.tensor(
        [
            [-0.05, -0.01 + 0.5, 0.0],
            [-0.02, -0.02, -0.02 - 4.5],
            [-0.03, 0.0, 0.0],
        ]
    )
    torch.testing.assert_close(rewards, want)
    # KL summed per row over real tokens: 0.6, 0.6, 0.3 -> mean 0.5
    assert float(stats["kl"]) == pytest.approx(0.5)
    # reward sums: 0.44, -4.56, -0.03 -> mean -4.15 / 3
    assert float(stats["reward"]) == pytest.approx(-4.15 / 3)
    assert float(stats["no_stop_fraction"]) == pytest.approx(1 / 3)


def test_defaults_leave_the_score_raw():
    rewards, _ = shape_rewards(
        SCORES, STOPPED, torch.zeros(3, 3), MASK, kl_coef=0.1, clip_reward_value=None
    )
    # no standardisation, no penalty, no clip, no KL: the raw score at the last real token
    assert rewards.sum(-1).tolist() == [2.0, -7.0, 1.0]
    assert rewards[0, 1] == 2.0 and rewards[1, 2] == -7.0 and rewards[2, 0] == 1.0


def test_bad_arguments_name_the_cause():
    with pytest.raises(ValueError, match="stopped"):
        shape_rewards(SCORES, STOPPED[:2], KL, MASK, kl_coef=0.1, clip_reward_value=5.0)
    with pytest.raises(ValueError, match="score_std must be > 0"):
        shape_rewards(SCORES, STOPPED, KL, MASK, kl_coef=0.1, clip_reward_value=5.0, score_std=0.0)


def test_turn_rewards_are_added_unshaped_where_the_mask_is_real():
    """Multi-turn episodes: each turn's reward at its last action token, neither
    standardised nor clipped (the environment's own scale), masked positions dropped."""
    turns = torch.tensor([[0.0, 3.0, 0.0], [6.0, 0.0, 0.0], [0.0, 8.0, 0.0]])
    rewards, stats = shape_rewards(
        SCORES,
        STOPPED,
        KL,
        MASK,
        kl_coef=0.1,
        clip_reward_value=4.5,
        no_stop_penalty=-1.0,
        score_mean=1.0,
        score_std=2.0,
        turn_rewards=turns,
    )
    # the previous test's token rewards, plus 3.0 at row 0 t1 and 6.0 at row 1 t0 (6.0 is
    # above the clip: not clipped); row 2's 8.0 sits on a masked position and is dropped
    want = torch.tensor(
        [
            [-0.05, -0.01 + 0.5 + 3.0, 0.0],
            [-0.02 + 6.0, -0.02, -0.02 - 4.5],
            [-0.03, 0.0, 0.0],
        ]
    )
    torch.testing.assert_close(rewards, want)
    assert float(stats["kl"]) == pytest.approx(0.5)
