"""On-policy distillation: a frozen teacher's log-probs of the tokens the student sampled,
as a dense per-token advantage.

The student samples; the teacher scores every sampled token; token t of a response gets the
advantage ``coef * (teacher_lp[t] - student_lp[t])``: minus the single-sample estimate of
the reverse KL, KL(student || teacher), at that token. Summed over a response, it is minus
the estimate of the sequence's reverse KL, so the policy gradient with these advantages
lowers the student's reverse KL to the teacher on its own samples (GKD, Agarwal et al.
2023, arXiv:2306.13649, its reverse-KL case, estimated on the sampled token). As in the
Tinker cookbook's on-policy distillation (``incorporate_kl_penalty``: advantage
``-kl_penalty_coef * (sampled_logprob - teacher_logprob)``, ``kl_discount_factor`` 0 by
default) each token is credited with its own term only, no discounted sum of the later
ones; verl's distillation with ``use_policy_gradient`` feeds the same ``-k1`` (clamped to
``[-loss_max_clamp, loss_max_clamp]``) to its policy loss as the advantage.

``student_lp`` is the old log-probs of the sampled tokens (the policy that sampled them, as
Tinker's sampled log-probs): the advantage is fixed for the update, and the policy loss
(its importance ratio and clipping) trains on it as on any other advantage.
``teacher_advantages`` is the term: the ``distill`` estimator of ``ADVANTAGE_ESTIMATORS``
(``algos.advantages``) is it alone (no token reward is read), and a trainer adds it to
another estimator's advantages (``A = A_task + coef * (teacher_lp - student_lp)``).
"""

from __future__ import annotations

import torch

from ._checks import check_same_shape, select
from .masked import masked_mean, masked_var


@torch.no_grad()
def teacher_advantages(
    teacher_logprobs: torch.Tensor,
    student_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    coef: float = 1.0,
    clip: float = 0.0,
) -> torch.Tensor:
    """[B, T] ``coef * (teacher_logprobs - student_logprobs)`` on real response tokens, 0
    elsewhere (float32, detached). ``clip`` > 0 first clamps each token's log-ratio to
    ``[-clip, clip]`` (verl's ``loss_max_clamp``): a token the teacher finds nearly
    impossible (log-prob -30) then weighs no more than ``clip``."""
    check_same_shape(
        "teacher_advantages",
        teacher_logprobs=teacher_logprobs,
        student_logprobs=student_logprobs,
        response_mask=response_mask,
    )
    if clip < 0:
        raise ValueError(f"teacher_advantages: clip must be >= 0 (0 = off), got {clip}")
    diff = teacher_logprobs.detach().float() - student_logprobs.detach().float()
    if clip > 0:
        diff = diff.clamp(-clip, clip)
    return select(coef * diff, response_mask)


@torch.no_grad()
def reverse_kl_stats(
    teacher_logprobs: torch.Tensor, student_logprobs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """The reverse KL to the teacher on the sampled tokens: ``reverse_kl``, the mean over
    real response tokens of ``student_lp - teacher_lp`` (each token's single-sample estimate
    of KL(student || teacher), Tinker's ``teacher_kl``), and ``reverse_kl_std``, its spread
    over those tokens (unbiased; 0 with fewer than two tokens). 0-dim float32 tensors."""
    check_same_shape(
        "reverse_kl_stats",
        teacher_logprobs=teacher_logprobs,
        student_logprobs=student_logprobs,
        response_mask=response_mask,
    )
    diff = student_logprobs.detach().float() - teacher_logprobs.detach().float()
    return {
        "reverse_kl": masked_mean(diff, response_mask),
        "reverse_kl_std": masked_var(diff, response_mask).sqrt(),
    }
