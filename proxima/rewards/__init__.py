"""Reward sources. Every source is a callable

    source(prompts: list[str], responses: list[str], columns: dict[str, list],
           sequences: LongTensor [B, L], attention_mask: LongTensor [B, L]) -> FloatTensor [B]

returning float32 scores on the CPU: a Python function (:class:`FunctionReward`, sync or
async, whole-batch or guarded one sample per call), a reward model (:class:`ModelReward`),
or a reward server over HTTP (:class:`RemoteReward`; `proxima serve-reward` serves a
function: :mod:`proxima.rewards.server`), or several of them weighted
(:class:`WeightedReward`).
"""

from proxima.rewards.function import FunctionReward, RewardError, load_reward_function
from proxima.rewards.model import ModelReward, same_vocabulary
from proxima.rewards.none import NoScore
from proxima.rewards.remote import RemoteReward
from proxima.rewards.weighted import WeightedPart, WeightedReward

__all__ = [
    "FunctionReward",
    "ModelReward",
    "NoScore",
    "RemoteReward",
    "RewardError",
    "load_reward_function",
    "same_vocabulary",
    "WeightedPart",
    "WeightedReward",
]
