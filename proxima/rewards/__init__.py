"""Reward sources. Every source is a callable

    source(prompts: list[str], responses: list[str], columns: dict[str, list],
           sequences: LongTensor [B, L], attention_mask: LongTensor [B, L]) -> FloatTensor [B]

returning float32 scores on the CPU: a Python function (:class:`FunctionReward`), a
reward model (:class:`ModelReward`), or several of them weighted (:class:`WeightedReward`).
"""

from proxima.rewards.function import FunctionReward, RewardError, load_reward_function
from proxima.rewards.model import ModelReward, same_vocabulary
from proxima.rewards.weighted import WeightedPart, WeightedReward

__all__ = [
    "FunctionReward",
    "ModelReward",
    "RewardError",
    "load_reward_function",
    "same_vocabulary",
    "WeightedPart",
    "WeightedReward",
]
