"""On-policy distillation's advantage (`algos.distill`): literal values worked out by hand in
the comments, and the same numbers as the formula as Tinker's cookbook and verl write it."""

import math

import pytest
import torch

from proxima.algos import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    distill,
    kl_penalty,
    reverse_kl_stats,
    teacher_advantages,
)

# two responses, the second one token shorter; every value a power of two (exact in float32)
TEACHER = torch.tensor([[-0.5, -1.0, -2.0], [-0.25, -3.0, float("nan")]])
STUDENT = torch.tensor([[-1.0, -1.0, -0.5], [-0.75, -1.0, -9.0]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])


def test_the_advantage_is_the_teacher_minus_the_student_log_prob_per_token():
    # teacher - student: [-0.5+1, -1+1, -2+0.5] = [0.5, 0, -1.5]; [-0.25+0.75, -3+1] =
    # [0.5, -2]; the masked token (a NaN from the teacher) is 0
    got = teacher_advantages(TEACHER, STUDENT, MASK)
    assert got.tolist() == [[0.5, 0.0, -1.5], [0.5, -2.0, 0.0]]
    # coef 0.5 halves each: [0.25, 0, -0.75], [0.25, -1]
    assert teacher_advantages(TEACHER, STUDENT, MASK, coef=0.5).tolist() == [
        [0.25, 0.0, -0.75],
        [0.25, -1.0, 0.0],
    ]
    # clip 1: -1.5 and -2 clamp to -1 (0.5 and 0 are inside [-1, 1])
    assert teacher_advantages(TEACHER, STUDENT, MASK, clip=1.0).tolist() == [
        [0.5, 0.0, -1.0],
        [0.5, -1.0, 0.0],
    ]
    # clip before coef: 2 x clamp(-1.5, -1, 1) = -2, not clamp(2 x -1.5)
    assert teacher_advantages(TEACHER, STUDENT, MASK, coef=2.0, clip=1.0)[0, 2].item() == -2.0


def test_the_distill_estimator_reads_no_token_reward_and_returns_its_advantage():
    est = ADVANTAGE_ESTIMATORS["distill"]
    assert est.needs == ("old_logprobs", "teacher_logprobs")
    assert est.options == ("distill_coef", "distill_clip") and not est.critic
    # a score at the last token and a KL penalty on every token change nothing
    rewards = torch.tensor([[-0.1, -0.1, 3.0], [-0.1, 7.0, 0.0]])
    adv, ret = compute_advantages(
        "distill",
        rewards,
        MASK,
        old_logprobs=STUDENT,
        teacher_logprobs=TEACHER,
        distill_coef=0.5,
        distill_clip=0.0,
    )
    assert adv.tolist() == [[0.25, 0.0, -0.75], [0.25, -1.0, 0.0]]
    assert torch.equal(ret, adv)
    with pytest.raises(ValueError, match="estimator 'distill' needs teacher_logprobs"):
        compute_advantages("distill", rewards, MASK, old_logprobs=STUDENT)
    with pytest.raises(ValueError, match="distill: needs old_logprobs"):
        distill(rewards, MASK, teacher_logprobs=TEACHER)
    with pytest.raises(ValueError, match=r"teacher_logprobs \[2, 3\] vs student_logprobs \[2, 2\]"):
        teacher_advantages(TEACHER, STUDENT[:, :2], MASK)
    with pytest.raises(ValueError, match="clip must be >= 0"):
        teacher_advantages(TEACHER, STUDENT, MASK, clip=-1.0)


def test_reverse_kl_is_the_mean_of_student_minus_teacher_and_its_spread():
    # student - teacher on the 5 real tokens: -0.5, 0, 1.5, -0.5, 2 -> mean 2.5 / 5 = 0.5;
    # deviations -1, -0.5, 1, -1, 1.5 -> squares 1 + 0.25 + 1 + 1 + 2.25 = 5.5 -> unbiased
    # variance 5.5 / 4 = 1.375
    stats = reverse_kl_stats(TEACHER, STUDENT, MASK)
    assert stats["reverse_kl"].item() == 0.5
    assert stats["reverse_kl_std"].item() == pytest.approx(math.sqrt(1.375), rel=1e-6)
    one = reverse_kl_stats(TEACHER, STUDENT, torch.tensor([[0, 0, 1], [0, 0, 0]]))
    assert one["reverse_kl"].item() == 1.5 and one["reverse_kl_std"].item() == 0.0


def _random(seed: int):
    gen = torch.Generator().manual_seed(seed)
    teacher = -3 * torch.rand(4, 7, generator=gen)
    student = -3 * torch.rand(4, 7, generator=gen)
    mask = (torch.rand(4, 7, generator=gen) < 0.8).long()
    return teacher, student, mask


@pytest.mark.parametrize("seed", range(5))
def test_matches_the_tinker_cookbook_formula(seed):
    # tinker_cookbook/distillation/train_on_policy.py, incorporate_kl_penalty, with its
    # default kl_discount_factor 0: reverse_kl = (sampled_logprobs - teacher_logprobs) * mask,
    # kl_advantages = -kl_penalty_coef * mask * reverse_kl, added to the task's advantages
    teacher, sampled, mask = _random(seed)
    kl_penalty_coef = 0.7
    reverse_kl = (sampled - teacher) * mask.float()
    tinker = -kl_penalty_coef * mask.float() * reverse_kl
    got = teacher_advantages(teacher, sampled, mask, coef=kl_penalty_coef)
    torch.testing.assert_close(got, tinker, rtol=0, atol=1e-6)
    # and its logged teacher_kl: sum(reverse_kl) / sum(mask)
    teacher_kl = reverse_kl.sum() / mask.sum()
    assert reverse_kl_stats(teacher, sampled, mask)["reverse_kl"].item() == pytest.approx(
        teacher_kl.item(), abs=1e-6
    )


@pytest.mark.parametrize("seed", range(5))
def test_matches_verl_policy_gradient_distillation(seed):
    # verl's distillation loss with use_policy_gradient=True and loss_mode k1: the per-token
    # loss kl_penalty(student, teacher, "k1") = student - teacher, clamped to
    # [-loss_max_clamp, loss_max_clamp], and the policy loss gets advantages = -loss
    teacher, student, mask = _random(seed)
    loss_max_clamp = 1.0
    losses = kl_penalty(student, teacher, "k1").clamp(min=-loss_max_clamp, max=loss_max_clamp)
    verl = -losses * mask
    adv, _ = compute_advantages(
        "distill",
        torch.zeros_like(student),
        mask,
        old_logprobs=student,
        teacher_logprobs=teacher,
        distill_coef=1.0,
        distill_clip=loss_max_clamp,
    )
    torch.testing.assert_close(adv, verl, rtol=0, atol=1e-6)
