"""The benchmarks' FLOP model (benchmarks/common/flops.py), against sums done by hand."""

from __future__ import annotations

from benchmarks.common.flops import forward_flops, model_flops
from benchmarks.common.workloads import Workload

# hidden 4, one layer, one head, intermediate 8, a vocabulary of 10: a token's linear layers
# are 2 x (2 x 16 + 2 x 16 + 3 x 32) = 320 FLOPs, a (query, key) pair 4 x 4 = 16
W = Workload("hand", 4, 1, 1, 8, 3, 2, 0.0, 0.0, vocab=10)


def test_a_forward_counts_linear_layers_causal_pairs_and_the_head():
    # 3 tokens: 3 x 320 + 6 causal pairs x 16 + 2 logits x 2 x 4 x 10
    assert forward_flops(W, 3, 2) == 960 + 96 + 160
    # 2 tokens after 3 cached ones: their 4 + 5 keys
    assert forward_flops(W, 2, 0, context=3) == 640 + 9 * 16
    # a prompt then its response costs what the whole sequence does
    assert forward_flops(W, 3, 0) + forward_flops(W, 2, 0, context=3) == forward_flops(W, 5, 0)


def test_scoring_and_prefill_count_a_shared_prompt_once_training_counts_it_per_sample():
    lengths = {"prompt": [3, 3, 2], "response": [2, 1, 2], "width": 2}
    shared = model_flops(W, {**lengths, "prompt_key": [7, 7, 9]}, 1, shared=False)
    apart = model_flops(W, {**lengths, "prompt_key": [7, 8, 9]}, 1, shared=False)
    # prompts 3 and 2 once (1056 + 688), responses after them (784 + 384 + 752), through the
    # reference, the reward model and the critic, and 5 response logits (400)
    assert shared["score"] == 3 * (1744 + 1920) + 400
    # every prompt apart: each sequence in full, 1840 + 1440 + 1440 a model
    assert apart["score"] == 3 * (2800 + 1920) + 400 == 3 * 4720 + 400
    # training: the actor with its logits (4720 + 400) and the critic, x 3 for the backward
    assert shared["train"] == apart["train"] == 3 * (5120 + 4720)
    # a shared backbone: no critic pass in either phase
    one = model_flops(W, {**lengths, "prompt_key": [7, 7, 9]}, 2, shared=True)
    assert one["score"] == 2 * (1744 + 1920) + 400 and one["train"] == 2 * 3 * 5120
    # the prefill up to the first sampled token (one logit each), a shared prompt once
    assert shared["prefill"] == (1056 + 80) + (688 + 80)
    assert apart["prefill"] == 2 * (1056 + 80) + (688 + 80)
