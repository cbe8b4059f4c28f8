"""The model math of a PPO iteration: FLOPs per phase and, per decode step, what it must
read and compute (the bounds bench_utilisation.py sets each phase against)."""

from __future__ import annotations

from benchmarks.common.workloads import Workload


def forward_flops(w: Workload, length: int, logits: int) -> float:
    """Multiply-adds x 2 of one sequence's forward through the workload's model: the linear
    layers for every token, causal attention (scores and weighted values over each token's
    context), and the LM head for `logits` positions (0: a value or score head)."""
    kv = (w.kv_heads or w.heads) * w.head_dim
    linear = 2 * (2 * w.hidden * w.hidden + 2 * w.hidden * kv + 3 * w.hidden * w.intermediate)
    attention = 2 * w.hidden * length * (length + 1)  # 4 h per (query, key) pair, causal
    return w.layers * (linear * length + attention) + 2 * w.hidden * w.vocab * logits


def model_flops(w: Workload, lengths: dict, epochs: int, shared: bool) -> dict:
    """The model math each phase needs for these sequences (whatever a system computes beyond
    it, such as TRL's LM head over the prompt positions, is not counted):
    - score: the reference's forward (log-probs at the response positions), the reward
      model's, and the critic's (none with a shared backbone: the values come from the actor);
    - train, per epoch: the actor's forward + backward (3x a forward) and the critic's (none
      with a shared backbone);
    - prefill: each prompt's forward up to its first sampled token;
    - decode: per decode step, [bytes, FLOPs]: what it must read at least (every weight, fp32,
      once, and each unfinished sequence's keys and values) and compute (one token of each
      unfinished sequence, attending to its context, through the LM head)."""
    pairs = list(zip(lengths["prompt"], lengths["response"], strict=True))
    kv = (w.kv_heads or w.heads) * w.head_dim
    layer = 2 * w.hidden * w.hidden + 2 * w.hidden * kv + 3 * w.hidden * w.intermediate
    weights = 4 * (w.layers * (layer + 2 * w.hidden) + w.hidden + w.vocab * w.hidden)
    with_head = sum(forward_flops(w, p + r, r) for p, r in pairs)
    backbone = sum(forward_flops(w, p + r, 0) for p, r in pairs)
    critic = 0.0 if shared else backbone
    decode = []
    for step in range(1, lengths["width"]):  # the first token comes from the prefill
        ctx = [p + step for p, r in pairs if r > step]  # each unfinished row's context
        if ctx:
            flops = len(ctx) * (2 * w.layers * layer + 2 * w.hidden * w.vocab)
            flops += 4 * w.hidden * w.layers * sum(ctx)
            decode.append([weights + 4 * 2 * w.layers * kv * sum(ctx), flops])
    return {
        "score": with_head + backbone + critic,
        "train": epochs * 3 * (with_head + critic),
        "prefill": sum(forward_flops(w, p, 1) for p, _ in pairs),
        "decode": decode,
    }
