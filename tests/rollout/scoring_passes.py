"""What the scoring-pass tests share: the ragged batch of `tests.distributed.common` as a
Generation, and the check that every scoring pass in one chunking equals another's."""

from __future__ import annotations

import torch

from proxima.models.critic import PolicyValue, new_value_head
from proxima.rollout.experience import (
    Chunks,
    sequence_kl_full,
    sequence_logprobs,
    sequence_logprobs_sum_pi_squared,
    sequence_logprobs_values,
    sequence_values,
)
from proxima.rollout.types import Generation
from tests.distributed.common import TEMPERATURE, global_batch, models


def ragged_generation(shared: bool = False):
    """(actor, value model, the ragged batch as a Generation); `shared`: rows in pairs of
    one prompt's samples (`global_batch`)."""
    actor, critic = models()
    exp = global_batch(actor, shared)
    gen = Generation(
        input_ids=exp.input_ids,
        attention_mask=exp.attention_mask,
        response_mask=exp.response_mask,
        stopped=exp.stopped,
    )
    return actor, critic, gen


def assert_close(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.shape == b.shape
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    assert bool((a[b == 0] == 0).all())  # masked places exactly zero in both


def assert_passes_equal(actor, ref, critic, gen: Generation, chunks: Chunks, want: Chunks):
    """Old log-probs, sum pi^2, the exact KL to `ref`, a value model's values and a value
    head's log-probs and values in `chunks` equal those in `want`."""
    shared = PolicyValue(actor, new_value_head(actor, seed=3))
    passes = [
        lambda c: [sequence_logprobs(actor, gen, TEMPERATURE, c)],
        lambda c: sequence_logprobs_sum_pi_squared(actor, gen, TEMPERATURE, c),
        lambda c: [sequence_kl_full(actor, ref, gen, TEMPERATURE, c)],
        lambda c: [sequence_values(critic, gen, c)],
        lambda c: sequence_logprobs_values(shared, gen, TEMPERATURE, c),
    ]
    for scored in passes:
        for a, b in zip(scored(chunks), scored(want), strict=True):
            assert_close(a, b)
