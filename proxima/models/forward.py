"""Every forward pass of the four roles: logits of response tokens (actor, reference),
values (critic), sequence scores (reward model), for rollout scoring and training alike.

Prompts are left-padded, so positions are counted from each row's first real token
(`position_ids_from_mask`); without that, padding would shift positions and change
log-probs and values (tested in tests/trainer/test_forward.py).
"""

from __future__ import annotations

import inspect

import torch
from transformers import PreTrainedModel

from proxima.algos import last_token_index
from proxima.models.loading import scalar_head
from proxima.models.value_head import HeadInput


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that start at 0 on the first real token of each row.

    attention_mask: [B, L] of 0/1. Returns [B, L] long; pads get 0 (they are masked anyway),
    so a left-padded row sees the same positions as the unpadded sequence.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    cached = getattr(model, "_proxima_logits_to_keep", None)
    if cached is None:
        # a peft model (and the LoRA reference view) passes **kwargs on to the HF model it
        # wraps: the wrapped model's signature decides
        inner = getattr(model, "module", model)  # inside a DistributedDataParallel wrapper
        inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner
        cached = "logits_to_keep" in inspect.signature(inner.forward).parameters
        model._proxima_logits_to_keep = cached
    return cached


def response_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Logits that predict the response tokens, divided by the sampling temperature.

    input_ids, attention_mask: [B, P + R]; returns [B, R, V]. Position P + t - 1 predicts
    response token t. Only the last R + 1 positions are projected to the vocabulary when the
    model supports `logits_to_keep` (saves the [B, P, V] prompt logits).
    """
    kwargs = {}
    if _accepts_logits_to_keep(model):
        kwargs["logits_to_keep"] = response_length + 1
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
        **kwargs,
    )
    logits = out.logits[:, -response_length - 1 : -1]
    # divide by the sampling temperature (lm-human-preferences policy.py; "The N Implementation
    # Details of RLHF with PPO"), else the KL rises faster than it should
    return logits / temperature if temperature != 1.0 else logits


def response_logits_hidden(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A shared-backbone actor-critic's one pass: `response_logits` [B, R, V] and the final
    hidden states [B, R, H] they came from (the LM head's input), at the positions
    `response_values` reads a critic's (P + t - 1 for response token t): a value head on
    them (`models.value_head.value_of`) gives the values."""
    with HeadInput(model) as seen:
        logits = response_logits(model, input_ids, attention_mask, response_length, temperature)
    return logits, seen.calls[-1][:, -response_length - 1 : -1]


def response_values(
    critic: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
) -> torch.Tensor:
    """Critic values V(s_t) aligned like `response_logits`: [B, R] float32.

    The value of response token t is read at position P + t - 1, the state before token t
    is emitted (the alignment of DeepSpeed-Chat's and TRL's critics).
    """
    out = critic(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
    )
    return out.logits[:, -response_length - 1 : -1, 0].float()


def reward_model_scores(
    model: PreTrainedModel, input_ids: torch.Tensor, attention_mask: torch.Tensor
) -> torch.Tensor:
    """Score of each sequence, read at its last real token (as DeepSpeed-Chat's reward model
    reads it at the last token of the sequence). Returns [B] float32.

    input_ids, attention_mask: [B, L]. The model's own pad-token pooling is bypassed: it
    breaks when pad == eos or with left padding. Gradients flow if the caller enables them
    (reward-model training reuses this).
    """
    out = model.base_model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    hidden = out.last_hidden_state  # [B, L, H]
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    last, _ = last_token_index(attention_mask)
    return scalar_head(model)(hidden[rows, last])[:, 0].float()
