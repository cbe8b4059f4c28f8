"""Rollout: response mask after stop tokens; generation chunks; left-padding invariance."""

import torch

from proxima.rollout.hf_engine import response_mask_after_stop


def test_mask_keeps_tokens_through_first_stop():
    # rows: stop at t=1; no stop; stop at t=0 then junk; two stop ids, second one first
    ids = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 9, 9, 9], [5, 3, 2, 0]])
    mask, stopped = response_mask_after_stop(ids, [2, 3])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]]
    assert stopped.tolist() == [True, False, True, True]


def test_mask_when_pad_equals_eos():
    # pad id == eos id == 2: everything after the first 2 is padding and masked
    ids = torch.tensor([[4, 4, 2, 2, 2]])
    mask, stopped = response_mask_after_stop(ids, [2])
    assert mask.tolist() == [[1, 1, 1, 0, 0]] and stopped.tolist() == [True]
