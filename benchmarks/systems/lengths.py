"""Prompt and response lengths of a generation, as every system reports them for the FLOP
model (benchmarks/common/flops.py)."""

from __future__ import annotations


def lengths(attention_mask, response_mask) -> dict:
    """Each sequence's prompt and response tokens (padding left out) and the decode steps."""
    width = response_mask.shape[1]
    prompt = (
        attention_mask[:, : attention_mask.shape[1] - width].sum(1)
        if attention_mask.shape[1] > width
        else attention_mask.sum(1)
    )
    return {
        "prompt": [int(x) for x in prompt],
        "response": [int(x) for x in response_mask.sum(1)],
        "width": int(width),
    }


def joined(parts: list[dict]) -> dict:
    """The lengths of several generate calls of one iteration."""
    return {
        "prompt": [x for p in parts for x in p["prompt"]],
        "response": [x for p in parts for x in p["response"]],
        "width": max((p["width"] for p in parts), default=0),
    }


def tokens_before_eos(response, eos_id: int) -> int:
    """Response tokens up to and including the first EOS (all of them when none)."""
    import torch

    is_eos = (response == eos_id).long()
    before = torch.cumsum(is_eos, dim=1) - is_eos
    return int((before == 0).sum())
