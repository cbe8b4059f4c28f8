"""Every forward pass of the four roles: logits of response tokens (actor, reference),
values (critic), sequence scores (reward model), for rollout scoring and training alike.

Prompts are left-padded, so positions are counted from each row's first real token
(`position_ids_from_mask`); without that, padding would shift positions and change
log-probs and values (tested in tests/models/test_forward.py).

Given `keep` ([B, R] bool, the response positions that count), the LM head projects only
those positions to the vocabulary: the logits come back flat, [N, V] for the N kept
positions in row-major order (`logits[i]` is position `keep.nonzero()[i]`), and `unpack`
puts per-position results back in [B, R]. A batch's responses end at different lengths,
so many of its [B, R] positions can be padding, and the head and the log-softmax over a
vocabulary of 32k-150k tokens are the largest per-position cost of the actor's passes.

`packed=True` (`model.packing`): the batch's sequences go through the model end to end in
packed rows (`models.packing`), its padding never computed; the results come back in the
same places. Every pass that takes `packed` gives the padded pass's results (tested on
every tiny architecture, with LoRA and the value head); `packing_problem` tries a model
once before a run relies on it.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import contextmanager

import torch
from transformers import PreTrainedModel

from proxima.algos import last_token_index, logprobs_from_logits
from proxima.models.loading import scalar_head
from proxima.models.packing import (
    PackedRows,
    one_row_attention,
    pack,
    pack_shared,
    rows_cost,
    shared_mask_form,
    shares_prompts,
)
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


Select = Callable[[torch.Tensor], torch.Tensor]  # [rows, L, ...] per position -> [N, ...]


def _padded_select(keep: torch.Tensor, response_length: int) -> Select:
    """The `keep` positions' outputs of a padded batch: position P + t - 1 -> token t."""
    return lambda x: x[:, -response_length - 1 : -1][keep]


@contextmanager
def _head_only_at(model: torch.nn.Module, select: Select | None):
    """While open, `model`'s LM head gets only the hidden states `select` picks ([N, H]),
    so its forward returns [N, V] logits. Yields whether the head was found (if not, the
    caller selects the positions afterwards)."""
    head = None if select is None else base_model(model).get_output_embeddings()
    if head is None:
        yield False
        return

    def only(module, args):
        return (select(args[0]), *args[1:])

    handle = head.register_forward_pre_hook(only)
    try:
        yield True
    finally:
        handle.remove()


def _kept_logits(logits, hooked: bool, select: Select, n: int, temperature: float):
    """The forward's logits -> the [N, V] logits of the N kept positions."""
    if not hooked:
        return _scaled(select(logits), temperature)
    if logits.dim() != 2 or logits.shape[0] != n:
        raise RuntimeError(
            f"the model's forward changed the shape of its LM head's output (got "
            f"{list(logits.shape)}, expected [{n}, V]): it cannot project only the "
            "response positions; call it without `keep`"
        )
    return _scaled(logits, temperature)


def _packed_rows(
    model: torch.nn.Module, input_ids, attention_mask, response_length: int | None = None
) -> PackedRows:
    """The batch packed the way `model`'s attention implementation reads packed rows; with
    `response_length`, each prompt once for all its samples (`pack_shared`: the rows that
    share their columns before the responses) where the model takes the 4D mask that needs
    and it costs fewer multiply-adds than packing every row's prompt (`rows_cost`)."""
    inner = base_model(model)
    config = inner.config
    rows = pack(input_ids, attention_mask, one_row_attention(config))
    if response_length is None or not shares_prompts(model):
        return rows
    form = shared_mask_form(config, next(inner.parameters()).dtype)
    split = input_ids.shape[1] - response_length
    shared = pack_shared(input_ids, attention_mask, split, form)
    if shared is None or rows_cost(shared, config) >= rows_cost(rows, config):
        return rows
    return shared


def _packed_keep(keep: torch.Tensor | None) -> torch.Tensor:
    if keep is None:
        raise ValueError("packed rows give the kept positions' logits only: pass `keep`")
    return keep


def response_logits(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    temperature: float = 1.0,
    keep: torch.Tensor | None = None,
    packed: bool = False,
) -> torch.Tensor:
    """Logits that predict the response tokens, divided by the sampling temperature.

    input_ids, attention_mask: [B, P + R]; returns [B, R, V]. Position P + t - 1 predicts
    response token t. With `keep` ([B, R] bool): those positions only, flat, [N, V].
    `packed`: through packed rows (needs `keep`).
    """
    if packed:
        rows = _packed_rows(model, input_ids, attention_mask, response_length)
        places = rows.predicting(_packed_keep(keep))
        select = lambda x: rows.take(x, places)
        with _head_only_at(model, select) as hooked:
            out = model(**rows.inputs())
        return _kept_logits(out.logits, hooked, select, len(places), temperature)
    if keep is None:
        out = _response_forward(model, input_ids, attention_mask, response_length)
        return _scaled(out.logits[:, -response_length - 1 : -1], temperature)
    select = _padded_select(keep, response_length)
    with _head_only_at(model, select) as hooked:
        out = _response_forward(model, input_ids, attention_mask, response_length)
    return _kept_logits(out.logits, hooked, select, int(keep.sum()), temperature)


def response_logits_values(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    temperature: float = 1.0,
    values_only: bool = False,
    keep: torch.Tensor | None = None,
    packed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass of the actor with a value head (`models.critic.PolicyValue`): the
    `response_logits` ([B, R, V], or [N, V] given `keep`) and the values [B, R] of the same
    states, read where `response_values` reads a critic's (position P + t - 1 for response
    token t). `values_only`: the policy without gradient (only the value head learns).
    `packed`: through packed rows (needs `keep`; the values outside `keep` are then 0)."""
    if packed:
        keep = _packed_keep(keep)
        rows = _packed_rows(model, input_ids, attention_mask, response_length)
        places = rows.predicting(keep)
        select = lambda x: rows.take(x, places)
        with _head_only_at(model, select) as hooked:
            out = model(**rows.inputs(), value_span=places, values_only=values_only)
        logits = _kept_logits(out.logits, hooked, select, len(places), temperature)
        return logits, unpack(out.vpreds, keep)
    select = None if keep is None else _padded_select(keep, response_length)
    with _head_only_at(model, select) as hooked:
        out = _response_forward(
            model,
            input_ids,
            attention_mask,
            response_length,
            value_span=slice(-response_length - 1, -1),
            values_only=values_only,
        )
    if keep is None:
        return _scaled(out.logits[:, -response_length - 1 : -1], temperature), out.vpreds
    return _kept_logits(out.logits, hooked, select, int(keep.sum()), temperature), out.vpreds


def unpack(flat: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """[N, ...] values of the `keep` positions -> [B, R, ...], zero elsewhere (the gradient
    flows back to `flat`)."""
    return flat.new_zeros((*keep.shape, *flat.shape[1:])).index_put((keep,), flat)


def response_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_ids: torch.Tensor,
    temperature: float = 1.0,
    packed: bool = False,
) -> torch.Tensor:
    """[B, R] float32 log-probs of `response_ids` under `model` at the sampling temperature,
    computed only at the response positions the mask attends to, zero at the others."""
    r = response_ids.shape[1]
    keep = attention_mask[:, -r:].bool()
    logits = response_logits(model, input_ids, attention_mask, r, temperature, keep, packed)
    return unpack(logprobs_from_logits(logits, response_ids[keep]), keep)


def response_values(
    critic: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_length: int,
    packed: bool = False,
) -> torch.Tensor:
    """Critic values V(s_t) aligned like `response_logits`: [B, R] float32.

    The value of response token t is read at position P + t - 1, the state before token t
    is emitted (the alignment of DeepSpeed-Chat's and TRL's critics). `packed`: through
    packed rows; the values of positions whose state the mask leaves out are then 0.
    """
    if packed:
        rows = _packed_rows(critic, input_ids, attention_mask, response_length)
        # every position whose state is a real token (a right-aligned micro-batch's short
        # rows start inside the response columns)
        keep = rows.where[:, -response_length - 1 : -1] >= 0
        out = critic(**rows.inputs())
        return unpack(rows.take(out.logits[..., 0], rows.predicting(keep)).float(), keep)
    out = critic(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
    )
    return out.logits[:, -response_length - 1 : -1, 0].float()


def reward_model_scores(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    packed: bool = False,
    prompt_length: int | None = None,
) -> torch.Tensor:
    """Score of each sequence, read at its last real token (as DeepSpeed-Chat's reward model
    reads it at the last token of the sequence). Returns [B] float32.

    input_ids, attention_mask: [B, L]. The model's own pad-token pooling is bypassed: it
    breaks when pad == eos or with left padding. Gradients flow if the caller enables them
    (reward-model training reuses this). `packed`: through packed rows; with
    `prompt_length`, the rows the same in their first `prompt_length` columns (a prompt's
    samples) lay them once.
    """
    if packed:
        response = None if prompt_length is None else input_ids.shape[1] - prompt_length
        rows = _packed_rows(model, input_ids, attention_mask, response)
        hidden = model.base_model(**rows.inputs()).last_hidden_state  # [K, W, H]
        return scalar_head(model)(rows.take(hidden, rows.last_tokens()))[:, 0].float()
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
