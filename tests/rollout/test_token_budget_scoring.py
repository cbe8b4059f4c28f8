"""The scoring passes by a token budget (`rollout.max_tokens_per_micro`,
`reward.max_tokens_per_micro`): rows grouped by length and trimmed of the padding they share
give the fixed micro-batches' log-probs, values, exact KL, sum pi^2 and reward scores."""

from __future__ import annotations

import torch

from proxima.models.forward import reward_model_scores
from proxima.rewards.model import ModelReward
from proxima.rollout.experience import (
    Chunks,
    sequence_logprobs,
)
from proxima.types import SORTED, token_budget_groups
from tests.distributed.common import TEMPERATURE, models
from tests.rollout.scoring_passes import assert_passes_equal, ragged_generation

BUDGET = 18  # tokens: the groups [9, 8] [6, 6, 5] [4, 3, 2] of the ragged batch


def test_groups_are_formed_by_the_budget_longest_first():
    _, _, gen = ragged_generation()
    groups = token_budget_groups(gen.attention_mask, BUDGET)
    real = gen.attention_mask.sum(dim=1)
    assert [real[g].tolist() for g in groups] == [[9, 8], [6, 6, 5], [4, 3, 2]]
    assert sorted(i for g in groups for i in g) == list(range(8))


def test_every_scoring_pass_equals_fixed_micro_batches():
    actor, critic, gen = ragged_generation()
    fixed, budget = Chunks(8), Chunks(8, BUDGET)
    ref, _ = models()
    with torch.no_grad():  # a reference that differs from the actor
        for p in ref.parameters():
            p.add_(0.01 * torch.randn_like(p))
    assert_passes_equal(actor, ref, critic, gen, budget, fixed)
    assert_passes_equal(actor, ref, critic, gen, Chunks(3, SORTED), fixed)  # the default
    # the groups change the batch's shapes, so the result is not trivially the same tensor
    assert sequence_logprobs(actor, gen, TEMPERATURE, budget).abs().sum() > 0


def test_reward_model_scores_by_token_budget_equal_fixed_batches():
    _, critic, gen = ragged_generation()
    scores = {
        tokens: ModelReward(
            critic, None, None, reward_model_scores, batch_size=3, max_tokens=tokens
        )._score_in_chunks(gen.input_ids, gen.attention_mask)
        for tokens in (0, BUDGET, SORTED)
    }
    torch.testing.assert_close(scores[BUDGET], scores[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(scores[SORTED], scores[0], rtol=0, atol=1e-5)
    assert len(set(scores[0].tolist())) == 8  # eight different sequences, eight scores
