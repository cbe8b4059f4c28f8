"""The model math of a PPO iteration: FLOPs per phase and, per decode step, what it must
read and compute (the bounds bench_utilisation.py sets each phase against)."""

from __future__ import annotations

from benchmarks.common.workloads import Workload


def forward_flops(w: Workload, length: int, logits: int, context: int = 0) -> float:
    """Multiply-adds x 2 of a forward of `length` tokens through the workload's model after
    `context` tokens whose keys and values it reuses: the linear layers for every new token,
    causal attention (scores and weighted values of each new token over its context), and
    the LM head for `logits` positions (0: a value or score head)."""
    kv = (w.kv_heads or w.heads) * w.head_dim
    linear = 2 * (2 * w.hidden * w.hidden + 2 * w.hidden * kv + 3 * w.hidden * w.intermediate)
    # 4 h per (query, key) pair: query i of the new tokens sees context + i keys
    attention = 2 * w.hidden * length * (length + 1 + 2 * context)
    return w.layers * (linear * length + attention) + 2 * w.hidden * w.vocab * logits


def model_flops(w: Workload, lengths: dict, epochs: int, shared: bool) -> dict:
    """The model math each phase needs for these sequences (whatever a system computes beyond
    it, such as TRL's LM head over the prompt positions, is not counted):
    - score: the reference's forward (log-probs at the response positions), the reward
      model's, and the critic's (none with a shared backbone: the values come from the actor),
      each prompt once for the samples that share it (`prompt_key`) and each response after it;
    - train, per epoch: the actor's forward + backward (3x a forward) and the critic's (none
      with a shared backbone), each sequence in full: shuffled mini-batches part a prompt's
      samples, so a prompt is counted with each of them;
    - prefill: each prompt's forward up to its first sampled token, once for its samples;
    - decode: per decode step, [bytes, FLOPs]: what it must read at least (every weight, fp32,
      once, and each unfinished sequence's keys and values) and compute (one token of each
      unfinished sequence, attending to its context, through the LM head)."""
    pairs = list(zip(lengths["prompt"], lengths["response"], strict=True))
    kv = (w.kv_heads or w.heads) * w.head_dim
    layer = 2 * w.hidden * w.hidden + 2 * w.hidden * kv + 3 * w.hidden * w.intermediate
    weights = 4 * (w.layers * (layer + 2 * w.hidden) + w.hidden + w.vocab * w.hidden)
    with_head = sum(forward_flops(w, p + r, r) for p, r in pairs)
    backbone = sum(forward_flops(w, p + r, 0) for p, r in pairs)
    prompts = dict(zip(lengths["prompt_key"], lengths["prompt"], strict=True))
    once = sum(forward_flops(w, p, 0) for p in prompts.values())
    responses = sum(forward_flops(w, r, 0, context=p) for p, r in pairs)
    head = 2 * w.hidden * w.vocab * sum(r for _, r in pairs)
    score_models = 2 if shared else 3  # reference and reward model, and the critic
    critic = 0.0 if shared else backbone
    decode = []
    for step in range(1, lengths["width"]):  # the first token comes from the prefill
        ctx = [p + step for p, r in pairs if r > step]  # each unfinished row's context
        if ctx:
            flops = len(ctx) * (2 * w.layers * layer + 2 * w.hidden * w.vocab)
            flops += 4 * w.hidden * w.layers * sum(ctx)
            decode.append([weights + 4 * 2 * w.layers * kv * sum(ctx), flops])
    return {
        "score": score_models * (once + responses) + head,
        "train": epochs * 3 * (with_head + critic),
        "prefill": sum(forward_flops(w, p, 1) for p in prompts.values()),
        "decode": decode,
    }
