"""algorithm.normalize_scores: running standardisation of scores before the reward clip."""

import torch

from proxima.algos import FixedKLController, RunningMoments
from proxima.config import Config
from proxima.trainer.ppo import PPOTrainer
from proxima.types import Experience


def _bare_trainer(normalize: bool) -> PPOTrainer:
    """Only what compute_token_rewards reads (no models needed)."""
    t = PPOTrainer.__new__(PPOTrainer)
    t.cfg = Config()
    t.cfg.algorithm.normalize_scores = normalize
    t.cfg.algorithm.clip_reward_value = 5.0
    t.kl_ctl = FixedKLController(0.0)
    t.score_moments = RunningMoments()
    return t


def _exp(scores: list[float]) -> Experience:
    b = len(scores)
    return Experience(
        input_ids=torch.zeros(b, 3, dtype=torch.long),
        attention_mask=torch.ones(b, 3, dtype=torch.long),
        response_mask=torch.ones(b, 2, dtype=torch.long),
        old_logprobs=torch.zeros(b, 2),
        scores=torch.tensor(scores),
    )


def test_scores_standardised_by_running_moments():
    t = _bare_trainer(True)
    exp = _exp([1.0, 3.0])
    t.compute_token_rewards(exp)
    # moments of {1, 3}: mean 2, unbiased std sqrt(2); scores land on the last token
    s = 2**0.5
    assert torch.allclose(exp.token_rewards, torch.tensor([[0.0, -1 / s], [0.0, 1 / s]]))
    exp2 = _exp([5.0, 7.0])
    t.compute_token_rewards(exp2)
    # moments of {1, 3, 5, 7}: mean 4, unbiased var 20/3
    std = (20 / 3) ** 0.5
    assert torch.allclose(exp2.token_rewards[:, -1], torch.tensor([1 / std, 3 / std]))


def test_off_leaves_scores_raw_but_clipped():
    t = _bare_trainer(False)
    exp = _exp([1.0, 9.0])
    t.compute_token_rewards(exp)
    assert exp.token_rewards[:, -1].tolist() == [1.0, 5.0]
    assert t.score_moments.count == 0
