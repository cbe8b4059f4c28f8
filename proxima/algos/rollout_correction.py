"""When the rollout engine is not the trainer: how far its log-probs are from the trainer's,
and the truncated importance weights that correct for it.

A rollout engine (vLLM) samples token a_t from its own distribution mu (its numerics, its
top-k / top-p renormalisation), while PPO's ratio uses the trainer's pi_old computed on the
same weights. The gap is measured every iteration (`logprob_diff`, verl's
`training/rollout_probs_diff_*`, verl PR 2953; TRL issue 6789) and can be corrected with
truncated importance sampling (TIS; Yao et al. 2025, "Your Efficient RL Framework Secretly
Brings You Off-Policy RL Training", https://fengyao.notion.site/off-policy-rl; verl's
`rollout_is`): the policy-gradient term of token t is weighted by
w_t = min(pi_old(a_t) / mu(a_t), cap), treated as a constant.
"""

from __future__ import annotations

import torch

from ._checks import check_same_shape, select
from .masked import masked_mean

LOG_RATIO_BOUND = 20.0  # exp(20) ~ 5e8: far beyond any cap, finite in float32
IS_LEVELS = ("token", "sequence")


def logprob_diff(
    rollout_logprobs: torch.Tensor, old_logprobs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """|rollout_logprobs - old_logprobs| over real response tokens, all [B, T].

    Returns detached 0-dim ``mean`` and ``max`` (0 when the mask is empty).
    """
    check_same_shape(
        "logprob_diff",
        rollout_logprobs=rollout_logprobs,
        old_logprobs=old_logprobs,
        response_mask=response_mask,
    )
    diff = select((rollout_logprobs - old_logprobs).abs(), response_mask).detach().float()
    top = diff.amax() if diff.numel() else diff.new_zeros(())
    return {"mean": masked_mean(diff, response_mask), "max": top}


def truncated_is_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    cap: float = 2.0,
    level: str = "token",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance weights min(pi_old / mu, cap), detached, 0 on padding.

    old_logprobs (trainer, pi_old), rollout_logprobs (engine, mu), response_mask: [B, T].
    level ``token``: w_t = min(exp(old_t - rollout_t), cap) for each token; ``sequence``:
    one weight per row, min(exp(sum_t (old_t - rollout_t)), cap), on each of its tokens.
    Log-ratios are clamped to [-20, 20] before exp. Returns (weights [B, T] float32, stats)
    with 0-dim detached ``is_weight_mean`` (after truncation, over real tokens) and
    ``is_truncated_frac`` (share of real tokens whose weight hit the cap).
    """
    check_same_shape(
        "truncated_is_weights",
        old_logprobs=old_logprobs,
        rollout_logprobs=rollout_logprobs,
        response_mask=response_mask,
    )
    if not cap >= 1:
        raise ValueError(
            f"truncated_is_weights: cap must be >= 1 (weights above it are truncated), got "
            f"{cap}; verl's default is 2.0"
        )
    if level not in IS_LEVELS:
        raise ValueError(f"truncated_is_weights: level must be one of {IS_LEVELS}, got {level!r}")
    log_ratio = select(
        old_logprobs.detach().float() - rollout_logprobs.detach().float(), response_mask
    )
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)
    raw = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    weights = select(raw.clamp(max=cap), response_mask)
    stats = {
        "is_weight_mean": masked_mean(weights, response_mask),
        "is_truncated_frac": masked_mean((raw >= cap).float(), response_mask),
    }
    return weights, stats
