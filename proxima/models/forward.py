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
from proxima.models.unwrap import base_model


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that start at 0 on the first real token of each row.

    attention_mask: [B, L] of 0/1. Returns [B, L] long; pads get 0 (they are masked anyway),
    so a left-padded row sees the same positions as the unpadded sequence.
    """
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def _accepts_logits_to_keep(model: torch.nn.Module) -> bool:
    cached = getattr(model, "_proxima_logits_to_keep", None)
    if cached is None:
        # the wrappers (DDP, peft, the LoRA reference view, the actor with a value head) pass
        # **kwargs on to the HF model they wrap: its signature decides
        cached = "logits_to_keep" in inspect.signature(base_model(model).forward).parameters
        model._proxima_logits_to_keep = cached
    return cached


def _response_forward(model, input_ids, attention_mask, response_length: int, **extra):
    """The forward pass every response-aligned read shares: positions from the mask, no KV
    cache, and only the last R + 1 positions projected to the vocabulary when the model
    supports `logits_to_keep` (saves the [B, P, V] prompt logits)."""
    if _accepts_logits_to_keep(model):
        extra["logits_to_keep"] = response_length + 1
    return model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
        **extra,
    )


def _scaled(logits: torch.Tensor, response_length: int, temperature: float) -> torch.Tensor:
    logits = logits[:, -response_length - 1 : -1]
    # divide by the sampling temperature (lm-human-preferences policy.py; "The N Implementation
    # Details of RLHF with PPO"), else the KL rises faster than it should
    return logits / temperature if temperature != 1.0 else logits


def response_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    temperature: float = 1.0,
) -> torch.Tensor:
    """Logits that predict the response tokens, divided by the sampling temperature.

    input_ids, attention_mask: [B, P + R]; returns [B, R, V]. Position P + t - 1 predicts
    response token t.
    """
    out = _response_forward(model, input_ids, attention_mask, response_length)
    return _scaled(out.logits, response_length, temperature)


def response_logits_values(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    temperature: float = 1.0,
    values_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass of the actor with a value head (`models.critic.PolicyValue`): the
    `response_logits` [B, R, V] and the values [B, R] of the same states, read where
    `response_values` reads a critic's (position P + t - 1 for response token t).
    `values_only`: the policy without gradient (only the value head learns)."""
    span = slice(-response_length - 1, -1)
    out = _response_forward(
        model, input_ids, attention_mask, response_length, value_span=span, values_only=values_only
    )
    return _scaled(out.logits, response_length, temperature), out.vpreds


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
