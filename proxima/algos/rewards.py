"""Token rewards: a KL penalty on every response token plus the clipped score at the last one.

As in DeepSpeed-Chat's ``compute_rewards``
(https://github.com/microsoft/DeepSpeedExamples/blob/master/applications/DeepSpeed-Chat/dschat/rlhf/ppo_trainer.py):
r_t = -beta * KL_t on response tokens, and at the final token r_T += clip(R(x, y), -c, c).
"""

from __future__ import annotations

import torch

from ._checks import check_same_shape, select


def last_token_index(response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Index of the last real token of each row and whether the row has any real token.

    response_mask [B, T] -> (index [B] long, has_tokens [B] bool); index is 0 for empty rows.
    """
    real = (response_mask != 0).long()
    width = real.shape[-1]
    if width == 0:
        return real.sum(-1), real.sum(-1) > 0
    # argmax returns the first maximum, so on the reversed row it finds the last real token.
    from_end = real.flip(-1).argmax(dim=-1)
    has_tokens = real.sum(dim=-1) > 0
    index = torch.where(has_tokens, width - 1 - from_end, torch.zeros_like(from_end))
    return index, has_tokens


def token_rewards(
    scores: torch.Tensor,
    kl: torch.Tensor,
    response_mask: torch.Tensor,
    kl_coef: float,
    clip_reward_value: float | None,
) -> torch.Tensor:
    """Per-token rewards [B, T] (float32).

    Args:
        scores: [B] sequence scores (reward model or reward function).
        kl: [B, T] per-token KL estimate (e.g. ``kl_penalty(old_logprobs, ref_logprobs)``).
        response_mask: [B, T], nonzero on real response tokens.
        kl_coef: beta, the KL penalty coefficient (DeepSpeed-Chat default 0.1).
        clip_reward_value: c, scores are clipped to [-c, c] (DeepSpeed-Chat: 5); None disables.

    Every real token gets -kl_coef * kl; the last real token of each row (the last position
    where the mask is nonzero, so holes do not matter) also gets the clipped score. Rows with
    an empty mask get nothing. Zero wherever the mask is 0.
    """
    check_same_shape("token_rewards", kl=kl, response_mask=response_mask)
    if scores.shape != kl.shape[:1]:
        raise ValueError(
            f"token_rewards: shape mismatch: scores {list(scores.shape)} vs kl "
            f"{list(kl.shape)}; scores must be one value per row, shape [B]"
        )
    if clip_reward_value is not None and not clip_reward_value > 0:
        raise ValueError(
            f"token_rewards: clip_reward_value must be > 0, got {clip_reward_value}; "
            "use e.g. 5.0, or None to disable score clipping"
        )
    rewards = select(-kl_coef * kl.float(), response_mask)
    score = scores.float()
    if clip_reward_value is not None:
        score = score.clamp(-clip_reward_value, clip_reward_value)
    if rewards.shape[-1] == 0:  # no response tokens at all: nowhere to put a score
        return rewards
    index, has_tokens = last_token_index(response_mask)
    score = torch.where(has_tokens, score, torch.zeros_like(score))
    return rewards.scatter_add(-1, index.unsqueeze(-1), score.unsqueeze(-1))


def shape_rewards(
    scores: torch.Tensor,
    stopped: torch.Tensor,
    kl: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    kl_coef: float,
    clip_reward_value: float | None,
    no_stop_penalty: float = 0.0,
    score_mean: float = 0.0,
    score_std: float = 1.0,
    turn_rewards: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Everything between the reward source's raw scores and the token rewards, in order:

    1. standardise: s = (score - score_mean) / score_std (OpenRLHF's ``normalize_reward``;
       the defaults 0 and 1 leave the score as it is);
    2. s += no_stop_penalty for responses that never produced a stop token (TRL's
       ``missing_eos_penalty``), in the units of the standardised score;
    3. token rewards: -kl_coef * kl on every response token, clip(s, -c, c) added at the
       last one (`token_rewards`);
    4. multi-turn episodes: `turn_rewards` added as they are (each turn's reward sits at its
       last action token; neither standardised nor clipped: the environment's own scale).
       An estimator that scores a sequence by its outcome (the critic-free ones) then sees
       sum of turn rewards + shaped score - KL; GAE credits each turn's reward to the
       tokens before it.

    Args:
        scores: [B] raw scores; stopped: [B] bool, the response ended with a stop token;
        kl: [B, T] per-token KL estimate; response_mask: [B, T]; turn_rewards: [B, T] or
        None (only read where the mask is nonzero).
    Returns:
        (token rewards [B, T] float32, stats) with detached 0-d tensors: ``kl`` (KL summed
        over each response, mean over rows: the KL an adaptive controller steers),
        ``reward`` (token rewards summed over each response, mean over rows) and
        ``no_stop_fraction``.
    """
    if scores.shape != stopped.shape:
        raise ValueError(
            f"shape_rewards: shape mismatch: scores {list(scores.shape)} vs stopped "
            f"{list(stopped.shape)}; both are one value per row, shape [B]"
        )
    if not score_std > 0:
        raise ValueError(f"shape_rewards: score_std must be > 0, got {score_std}")
    no_stop = (~stopped.bool()).float()
    score = (scores.float() - score_mean) / score_std + no_stop_penalty * no_stop
    rewards = token_rewards(score, kl, response_mask, kl_coef, clip_reward_value)
    if turn_rewards is not None:
        check_same_shape("shape_rewards", turn_rewards=turn_rewards, response_mask=response_mask)
        rewards = rewards + select(turn_rewards.float(), response_mask)
    kl_real = select(kl.float(), response_mask)
    stats = {
        "kl": kl_real.sum(-1).mean().detach(),
        "reward": rewards.sum(-1).mean().detach(),
        "no_stop_fraction": no_stop.mean(),
    }
    return rewards, stats


def overlong_penalty(
    lengths: torch.Tensor, max_length: int, buffer_length: int, penalty_factor: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13).

    A response of L tokens (its stop token included) out of at most ``max_length`` gets
    ``min(0, -(L - (max_length - buffer_length)) / buffer_length * penalty_factor)``: 0 up to
    ``max_length - buffer_length`` tokens, then falling linearly to ``-penalty_factor`` at
    ``max_length`` (verl's DAPO reward manager, ``overlong_buffer``: len, penalty_factor).

    lengths [B] (any number type) -> [B] float32 penalties, added to the raw scores.
    """
    if not 0 < buffer_length <= max_length:
        raise ValueError(
            f"overlong_penalty: buffer_length must be in [1, max_length={max_length}], got "
            f"{buffer_length}; e.g. a quarter of the response length"
        )
    expected = max_length - buffer_length
    exceed = lengths.float() - expected
    return (-exceed / buffer_length * penalty_factor).clamp(max=0.0)
