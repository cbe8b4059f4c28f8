"""PPO math as pure functions: tensors in, tensors out (shapes in each docstring).

Per-token tensors are [B, T], aligned on response tokens; ``response_mask`` is nonzero on
real response tokens. Nothing here imports the rest of proxima.
"""

from .advantages import (
    ADVANTAGE_ESTIMATORS,
    Estimator,
    SingletonGroupWarning,
    compute_advantages,
    compute_gae,
    discounted_returns,
    gae,
    grpo,
    register_advantage,
    reinforce_plus_plus,
    reinforce_plus_plus_baseline,
    rloo,
)
from .kl import KL_ESTIMATORS, AdaptiveKLController, FixedKLController, kl_full, kl_penalty
from .losses import (
    POLICY_LOSSES,
    EmptyMaskWarning,
    PolicyLoss,
    entropy_from_logits,
    explained_variance,
    logprobs_from_logits,
    policy_loss,
    register_policy_loss,
    sum_pi_squared,
    value_loss,
)
from .masked import (
    AGG_MODES,
    RunningMoments,
    aggregate_loss,
    masked_mean,
    masked_sum,
    masked_var,
    masked_whiten,
)
from .metrics import mean_at_k, pass_at_k, pass_at_k_table
from .rewards import last_token_index, overlong_penalty, shape_rewards, token_rewards
from .rollout_correction import IS_LEVELS, logprob_diff, truncated_is_weights

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "POLICY_LOSSES",
    "Estimator",
    "PolicyLoss",
    "gae",
    "register_advantage",
    "register_policy_loss",
    "AGG_MODES",
    "IS_LEVELS",
    "KL_ESTIMATORS",
    "AdaptiveKLController",
    "EmptyMaskWarning",
    "FixedKLController",
    "RunningMoments",
    "SingletonGroupWarning",
    "aggregate_loss",
    "compute_advantages",
    "compute_gae",
    "discounted_returns",
    "entropy_from_logits",
    "explained_variance",
    "grpo",
    "kl_full",
    "kl_penalty",
    "last_token_index",
    "logprob_diff",
    "logprobs_from_logits",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "mean_at_k",
    "overlong_penalty",
    "pass_at_k",
    "pass_at_k_table",
    "policy_loss",
    "reinforce_plus_plus",
    "reinforce_plus_plus_baseline",
    "rloo",
    "shape_rewards",
    "sum_pi_squared",
    "token_rewards",
    "truncated_is_weights",
    "value_loss",
]
