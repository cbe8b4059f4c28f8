"""Every forward pass of the four roles: logits of response tokens (actor, reference),
values (critic), sequence scores (reward model), for rollout scoring and training alike.

Prompts are left-padded, so positions are counted from each row's first real token
(`position_ids_from_mask`); without that, padding would shift positions and change
log-probs and values (tested in tests/models/test_forward.py).

Given `keep` ([B, R] bool, the response positions that count), the LM head projects only
those positions to the vocabulary: the logits come back packed, [N, V] for the N kept
positions in row-major order (`logits[i]` is position `keep.nonzero()[i]`), and `unpack`
puts per-position results back in [B, R]. A batch's responses end at different lengths,
so many of its [B, R] positions can be padding, and the head and the log-softmax over a
vocabulary of 32k-150k tokens are the largest per-position cost of the actor's passes.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch
from transformers import PreTrainedModel

from proxima.algos import last_token_index, logprobs_from_logits
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


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    # divide by the sampling temperature (lm-human-preferences policy.py; "The N Implementation
    # Details of RLHF with PPO"), else the KL rises faster than it should
    return logits / temperature if temperature != 1.0 else logits


@contextmanager
def _head_only_at(model: torch.nn.Module, keep: torch.Tensor | None, response_length: int):
    """While open, `model`'s LM head gets only the hidden states of the `keep` positions
    among the R response positions ([N, H]), so its forward returns [N, V] logits. Yields
    whether the head was found (if not, the caller selects the positions afterwards)."""
    head = None if keep is None else base_model(model).get_output_embeddings()
    if head is None:
        yield False
        return

    def pack(module, args):
        hidden = args[0][:, -response_length - 1 : -1]  # position P + t - 1 -> token t
        return (hidden[keep], *args[1:])

    handle = head.register_forward_pre_hook(pack)
    try:
        yield True
    finally:
        handle.remove()


def _response_logits(logits, packed: bool, keep, response_length: int, temperature: float):
    """The forward's logits -> `response_logits`' ([B, R, V], or [N, V] given `keep`)."""
    if keep is None or not packed:
        logits = logits[:, -response_length - 1 : -1]
        return _scaled(logits if keep is None else logits[keep], temperature)
    n = int(keep.sum())
    if logits.dim() != 2 or logits.shape[0] != n:
        raise RuntimeError(
            f"the model's forward changed the shape of its LM head's output (got "
            f"{list(logits.shape)}, expected [{n}, V]): it cannot project only the "
            "response positions; call it without `keep`"
        )
    return _scaled(logits, temperature)


def response_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    temperature: float = 1.0,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits that predict the response tokens, divided by the sampling temperature.

    input_ids, attention_mask: [B, P + R]; returns [B, R, V]. Position P + t - 1 predicts
    response token t. With `keep` ([B, R] bool): those positions only, packed, [N, V].
    """
    with _head_only_at(model, keep, response_length) as packed:
        out = _response_forward(model, input_ids, attention_mask, response_length)
    return _response_logits(out.logits, packed, keep, response_length, temperature)


def response_logits_values(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    temperature: float = 1.0,
    values_only: bool = False,
    keep: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass of the actor with a value head (`models.critic.PolicyValue`): the
    `response_logits` ([B, R, V], or [N, V] given `keep`) and the values [B, R] of the same
    states, read where `response_values` reads a critic's (position P + t - 1 for response
    token t). `values_only`: the policy without gradient (only the value head learns)."""
    span = slice(-response_length - 1, -1)
    with _head_only_at(model, keep, response_length) as packed:
        out = _response_forward(
            model,
            input_ids,
            attention_mask,
            response_length,
            value_span=span,
            values_only=values_only,
        )
    logits = _response_logits(out.logits, packed, keep, response_length, temperature)
    return logits, out.vpreds


def unpack(packed: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """[N, ...] values of the `keep` positions -> [B, R, ...], zero elsewhere (the gradient
    flows back to `packed`)."""
    return packed.new_zeros((*keep.shape, *packed.shape[1:])).index_put((keep,), packed)


def response_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_ids: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """[B, R] float32 log-probs of `response_ids` under `model` at the sampling temperature,
    computed only at the response positions the mask attends to, zero at the others."""
    r = response_ids.shape[1]
    keep = attention_mask[:, -r:].bool()
    logits = response_logits(model, input_ids, attention_mask, r, temperature, keep)
    return unpack(logprobs_from_logits(logits, response_ids[keep]), keep)


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
