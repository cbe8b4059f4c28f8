"""Prompt and response lengths of a generation, as every system reports them for the FLOP
model (benchmarks/common/flops.py)."""

from __future__ import annotations


def lengths(attention_mask, response_mask, prompt_ids) -> dict:
    """Each sequence's prompt and response tokens (padding left out), which sequences share
    a prompt (`prompt_key`: equal for equal prompt tokens) and the decode steps.
    `prompt_ids` [B, P]: the prompts as the model saw them, padded where `attention_mask`'s
    first P columns are 0."""
    width = response_mask.shape[1]
    prompt_mask = attention_mask[:, : prompt_ids.shape[1]]
    return {
        "prompt": [int(x) for x in prompt_mask.sum(1)],
        "response": [int(x) for x in response_mask.sum(1)],
        "prompt_key": [
            hash(tuple(ids[m.bool()].tolist()))
            for ids, m in zip(prompt_ids, prompt_mask, strict=True)
        ],
        "width": int(width),
    }


def joined(parts: list[dict]) -> dict:
    """The lengths of several generate calls of one iteration."""
    return {
        **{k: [x for p in parts for x in p[k]] for k in ("prompt", "response", "prompt_key")},
        "width": max((p["width"] for p in parts), default=0),
    }


def tokens_before_eos(response, eos_id: int) -> int:
    """Response tokens up to and including the first EOS (all of them when none)."""
    import torch

    is_eos = (response == eos_id).long()
    before = torch.cumsum(is_eos, dim=1) - is_eos
    return int((before == 0).sum())
