"""algorithm.normalize_scores: running standardisation of scores before the reward clip,
as phase 4 applies it (RunningMoments of the raw scores, then `shape_rewards`)."""

import torch

from proxima.algos import RunningMoments, shape_rewards


def _shape(scores: list[float], moments: RunningMoments | None) -> torch.Tensor:
    """Token rewards [B, 2] of scores on 2-token responses, no KL, clip 5."""
    s = torch.tensor(scores)
    mean, std = 0.0, 1.0
    if moments is not None:
        moments.update(s)
        mean, std = moments.mean, moments.std
    rewards, _ = shape_rewards(
        s,
        torch.ones(len(scores), dtype=torch.bool),
        torch.zeros(len(scores), 2),
        torch.ones(len(scores), 2, dtype=torch.long),
        kl_coef=0.0,
        clip_reward_value=5.0,
        score_mean=mean,
        score_std=std,
    )
    return rewards


def test_scores_standardised_by_running_moments():
    moments = RunningMoments()
    rewards = _shape([1.0, 3.0], moments)
    # moments of {1, 3}: mean 2, unbiased std sqrt(2); scores land on the last token
    s = 2**0.5
    assert torch.allclose(rewards, torch.tensor([[0.0, -1 / s], [0.0, 1 / s]]))
    rewards2 = _shape([5.0, 7.0], moments)
    # moments of {1, 3, 5, 7}: mean 4, unbiased var 20/3
    std = (20 / 3) ** 0.5
    assert torch.allclose(rewards2[:, -1], torch.tensor([1 / std, 3 / std]))


def test_off_leaves_scores_raw_but_clipped():
    rewards = _shape([1.0, 9.0], None)
    assert rewards[:, -1].tolist() == [1.0, 5.0]


def test_a_first_batch_of_equal_scores_standardises_to_zero():
    # every sparse reward 0 in the first batch (std 0): the standardised scores are 0
    moments = RunningMoments()
    assert _shape([0.0, 0.0, 0.0], moments).tolist() == [[0.0, 0.0]] * 3
    rewards = _shape([1.0], moments)  # 0, 0, 0, 1: mean 1/4, unbiased std 1/2
    assert torch.allclose(rewards[:, -1], torch.tensor([1.5]))
