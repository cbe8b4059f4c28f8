"""Micro-batches by a token budget (`ppo_max_tokens_per_micro`, verl's dynamic batch size):
rows sorted by length, packed under the budget, the padding they share trimmed; the
gradients are those of fixed micro-batches for actor, critic and shared backbone in every
loss aggregation mode (2 processes: tests/distributed/test_parity.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from proxima.trainer.dist import Dist
from proxima.trainer.update import token_micro_batches
from proxima.types import SORTED
from tests.distributed.common import (
    MODES,
    PROMPT_LENS,
    RESPONSE_LENS,
    global_batch,
    mini_batch_grads,
    models,
)


def test_rows_are_packed_longest_first_under_the_budget_and_trimmed():
    exp = global_batch(models()[0])
    lengths = [p + r for p, r in zip(PROMPT_LENS, RESPONSE_LENS, strict=True)]
    # (prompt, response) by row: (3,5) (2,4) (4,5) (1,3) (2,1) (3,2) (1,1) (4,2); longest
    # first: 9 (4,5), 8 (3,5), 6 (2,4), 6 (4,2), 5 (3,2), 4 (1,3), 3 (2,1), 2 (1,1).
    # Budget 18 in rows x the group's longest row (rows right-aligned): [9, 8] = 2 x 9, a
    # third would make 27; [6, 6, 5] = 3 x 6, a fourth would make 24; [4, 3, 2] = 3 x 4.
    # (Left-padded prompts and right-padded responses would need rows x (longest prompt +
    # longest response): [6, 6] alone would be 2 x (4 + 4) = 16.)
    micros = token_micro_batches(exp, 18)
    got = [m.attention_mask.sum(1).tolist() for m in micros]
    assert got == [[9, 8], [6, 6, 5], [4, 3, 2]]
    for m in micros:
        # right-aligned and trimmed: every row ends in the last column, the longest row
        # fills the width, and the response columns start where the longest response does
        assert bool(m.attention_mask[:, -1].all())
        assert m.input_ids.shape[1] == int(m.attention_mask.sum(1).max())
        assert bool(m.response_mask[:, 0].any())
        assert m.batch_size * m.input_ids.shape[1] <= 18
    # a row's response tokens keep their order, right-aligned: row (4,2) of [6, 6, 5]
    six = micros[1]
    row = int((six.response_mask.sum(1) == 2).nonzero()[0])
    assert six.response_mask[row].tolist() == [0, 0, 1, 1]
    original = int(
        ((exp.response_mask.sum(1) == 2) & (exp.attention_mask.sum(1) == 6)).nonzero()[0]
    )
    assert six.response_ids[row, 2:].tolist() == exp.response_ids[original, :2].tolist()
    assert six.old_logprobs[row, 2:].tolist() == exp.old_logprobs[original, :2].tolist()
    assert sum(m.batch_size for m in micros) == exp.batch_size
    assert max(lengths) == 9


def test_a_row_longer_than_the_budget_goes_alone():
    exp = global_batch(models()[0])
    assert [m.batch_size for m in token_micro_batches(exp, 1)] == [1] * exp.batch_size


def test_seq_mean_token_sum_norm_keeps_the_response_width():
    exp = global_batch(models()[0])
    for m in token_micro_batches(exp, 18, keep_response_width=True):
        assert m.response_mask.shape[1] == exp.response_mask.shape[1]


def test_sorted_micro_batches_keep_the_rows_and_trim_the_padding():
    """SORTED (the default): ppo_micro_batch_size rows to a micro-batch, longest first,
    each right-aligned and trimmed: never more rows or columns than a fixed micro-batch."""
    exp = global_batch(models()[0])
    micros = token_micro_batches(exp, SORTED, rows=3)
    real = [m.attention_mask.sum(1).tolist() for m in micros]
    assert real == [[9, 8, 6], [6, 5, 4], [3, 2]]
    assert [m.input_ids.shape[1] for m in micros] == [9, 6, 3]  # each its longest row
    # fixed micro-batches of 3 compute 8 rows x the batch's width 9: 72 positions, here 51
    assert sum(m.input_ids.numel() for m in micros) == 51 < exp.input_ids.numel() == 72
    with pytest.raises(ValueError, match="rows >= 1"):
        token_micro_batches(exp, SORTED)


@pytest.mark.parametrize("role", ["actor", "critic", "shared"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("budget", [18, SORTED])
def test_the_gradients_are_those_of_fixed_micro_batches(role, mode, budget):
    grads = []
    for tokens in (0, budget):
        actor, critic = models()
        exp = global_batch(actor)
        model = critic if role == "critic" else actor
        grads.append(mini_batch_grads(model, role, mode, exp, Dist(), 1, micro_tokens=tokens))
    want, got = grads
    assert want.keys() == got.keys() and any(g.abs().sum() > 0 for g in want.values())
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-5, msg=name)


def test_each_rank_runs_as_many_micro_batches():
    """With a budget of 12 the long half of the batch (rank 0 of 2) makes 3 micro-batches and
    the short half 2; `_even_out` splits the short half's largest so that both run 3
    forward passes (FSDP2 gathers the weights in each); grads: tests/distributed."""
    from proxima.trainer.update import _even_out

    exp = global_batch(models()[0])
    long, short = exp.select([0, 1, 2, 3]), exp.select([4, 5, 6, 7])
    a, b = token_micro_batches(long, 12), token_micro_batches(short, 12)
    assert (len(a), len(b)) == (3, 2)
    evened = _even_out(b, 3)
    assert [m.batch_size for m in evened] == [1, 1, 2]
    rows = sorted(int(n) for m in evened for n in m.attention_mask.sum(1))
    assert rows == sorted(int(n) for n in short.attention_mask.sum(1))  # every row once


def test_a_micro_batch_with_no_real_response_token_still_backwards():
    """Responses left out of the loss (rollout.mask_truncated) can fill a whole micro-batch:
    it keeps one response column, its loss is 0 and the gradient that of the others."""
    actor, _ = models()
    exp = global_batch(actor)
    masked = exp.response_mask.clone()
    masked[[0, 2]] = 0  # the two longest rows: the first micro-batch of a budget of 18
    exp = dataclasses.replace(exp, response_mask=masked)
    grads = [
        mini_batch_grads(models()[0], "actor", "token-mean", exp, Dist(), 1, micro_tokens=t)
        for t in (0, 18)
    ]
    assert token_micro_batches(exp, 18)[0].response_mask.shape[1] == 1
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5)
