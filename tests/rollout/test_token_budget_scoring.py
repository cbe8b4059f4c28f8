"""The scoring passes by a token budget (`rollout.max_tokens_per_micro`,
`reward.max_tokens_per_micro`): rows grouped by length and trimmed of the padding they share
give the fixed micro-batches' log-probs, values, exact KL, sum pi^2 and reward scores."""

from __future__ import annotations

import torch

from proxima.models.critic import PolicyValue, new_value_head
from proxima.models.forward import reward_model_scores
from proxima.rewards.model import ModelReward
from proxima.rollout.experience import (
    Chunks,
    sequence_kl_full,
    sequence_logprobs,
    sequence_logprobs_sum_pi_squared,
    sequence_logprobs_values,
    sequence_values,
)
from proxima.rollout.types import Generation
from proxima.types import token_budget_groups
from tests.distributed.common import TEMPERATURE, global_batch, models

BUDGET = 18  # tokens: the groups [9, 8] [6, 6, 5] [4, 3, 2] of the ragged batch


def _gen():
    actor, critic = models()
    exp = global_batch(actor)
    gen = Generation(
        input_ids=exp.input_ids,
        attention_mask=exp.attention_mask,
        response_mask=exp.response_mask,
        stopped=exp.stopped,
    )
    return actor, critic, gen


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert bool((a[b == 0] == 0).all())  # masked places exactly zero in both


def test_groups_are_formed_by_the_budget_longest_first():
    _, _, gen = _gen()
    groups = token_budget_groups(gen.attention_mask, BUDGET)
    real = gen.attention_mask.sum(dim=1)
    assert [real[g].tolist() for g in groups] == [[9, 8], [6, 6, 5], [4, 3, 2]]
    assert sorted(i for g in groups for i in g) == list(range(8))


def test_every_scoring_pass_equals_fixed_micro_batches():
    actor, critic, gen = _gen()
    fixed, budget = Chunks(8), Chunks(8, BUDGET)
    ref, _ = models()
    with torch.no_grad():  # a reference that differs from the actor
        for p in ref.parameters():
            p.add_(0.01 * torch.randn_like(p))
    _close(
        sequence_logprobs(actor, gen, TEMPERATURE, budget),
        sequence_logprobs(actor, gen, TEMPERATURE, fixed),
    )
    for a, b in zip(
        sequence_logprobs_sum_pi_squared(actor, gen, TEMPERATURE, budget),
        sequence_logprobs_sum_pi_squared(actor, gen, TEMPERATURE, fixed),
        strict=True,
    ):
        _close(a, b)
    _close(
        sequence_kl_full(actor, ref, gen, TEMPERATURE, budget),
        sequence_kl_full(actor, ref, gen, TEMPERATURE, fixed),
    )
    _close(sequence_values(critic, gen, budget), sequence_values(critic, gen, fixed))
    shared = PolicyValue(actor, new_value_head(actor, seed=3))
    for a, b in zip(
        sequence_logprobs_values(shared, gen, TEMPERATURE, budget),
        sequence_logprobs_values(shared, gen, TEMPERATURE, fixed),
        strict=True,
    ):
        _close(a, b)
    # the groups change the batch's shapes, so the result is not trivially the same tensor
    assert sequence_logprobs(actor, gen, TEMPERATURE, budget).abs().sum() > 0


def test_reward_model_scores_by_token_budget_equal_fixed_batches():
    _, critic, gen = _gen()
    scores = {
        tokens: ModelReward(
            critic, None, None, reward_model_scores, batch_size=3, max_tokens=tokens
        )._score_in_chunks(gen.input_ids, gen.attention_mask)
        for tokens in (0, BUDGET)
    }
    torch.testing.assert_close(scores[BUDGET], scores[0], rtol=0, atol=1e-5)
    assert len(set(scores[0].tolist())) == 8  # eight different sequences, eight scores
