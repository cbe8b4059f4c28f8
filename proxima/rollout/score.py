"""Phase 1b: scoring passes without gradients -> Experience.

Old log-probs (actor, logits / temperature; or the engine's own, `engine_logprobs_exact`),
reference log-probs, critic values and the per-token KL estimate of each generated sequence,
computed in micro-batches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from proxima.algos import kl_full, kl_penalty, logprobs_from_logits
from proxima.models.forward import response_logits, response_logits_hidden, response_values
from proxima.models.value_head import value_of
from proxima.rollout.generate import Generation
from proxima.types import Experience

# generation_config fields that do not change the distribution tokens are sampled from
_NEUTRAL_GENERATION_FIELDS = {
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "decoder_start_token_id",
    "max_length",
    "max_new_tokens",
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "use_cache",
    "transformers_version",
    "_from_model_config",
}


def engine_logprobs_exact(cfg, actor: torch.nn.Module, engine: str = "hf") -> str:
    """Why the engine's log-probs of the sampled tokens are NOT the trainer's old log-probs
    (log-softmax of the actor's logits / temperature, float32), or "" when they are the same
    quantity: the `hf` engine serves the actor itself, in float32 without autocast, samples
    with no truncation (top_k=0, top_p=1) and the actor's generation_config adds no logits
    processor (e.g. suppress_tokens, repetition_penalty). Then they differ only by the
    KV-cached decode's float rounding (~1e-7), and the scoring forward pass can be skipped.
    `engine`: the name of the engine that samples."""
    r = cfg.rollout
    if engine != "hf":
        return f"the {engine} engine has its own kernels"
    if cfg.model.dtype != "float32" or cfg.model.mixed_precision != "no":
        return "not float32 (the KV-cached decode rounds differently from the forward pass)"
    if r.top_k or r.top_p < 1.0:
        return "top_k / top_p renormalise the sampled distribution"
    if cfg.algorithm.rollout_correction:
        return "algorithm.rollout_correction compares the two"
    inner = getattr(actor, "module", actor)  # DDP
    config = getattr(inner, "generation_config", None)
    extra = sorted(set(config.to_diff_dict()) - _NEUTRAL_GENERATION_FIELDS) if config else []
    if extra:
        return f"the actor's generation_config sets {', '.join(extra)}"
    return ""


@torch.no_grad()
def _in_chunks(fn: Callable[[slice], torch.Tensor], n: int, size: int) -> torch.Tensor:
    return torch.cat([fn(slice(i, i + size)) for i in range(0, n, size)], dim=0)


@torch.no_grad()
def sequence_logprobs(
    model: torch.nn.Module, gen: Generation, temperature: float, micro_batch_size: int
) -> torch.Tensor:
    """[B, R] log-probs of the response tokens under `model`, zero where masked."""
    r = gen.response_mask.shape[1]

    def one(s: slice) -> torch.Tensor:
        logits = response_logits(model, gen.input_ids[s], gen.attention_mask[s], r, temperature)
        return logprobs_from_logits(logits, gen.response_ids[s])

    return _in_chunks(one, gen.input_ids.shape[0], micro_batch_size) * gen.response_mask


@torch.no_grad()
def sequence_logprobs_values(
    model: torch.nn.Module,
    value_head: torch.nn.Module,
    gen: Generation,
    temperature: float,
    micro_batch_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A shared-backbone actor-critic's scoring: [B, R] log-probs and values from one pass,
    zero where masked."""
    r = gen.response_mask.shape[1]

    def one(s: slice) -> torch.Tensor:
        logits, hidden = response_logits_hidden(
            model, gen.input_ids[s], gen.attention_mask[s], r, temperature
        )
        logprobs = logprobs_from_logits(logits, gen.response_ids[s])
        return torch.stack([logprobs, value_of(value_head, hidden)], dim=1)

    both = _in_chunks(one, gen.input_ids.shape[0], micro_batch_size)  # [B, 2, R]
    return both[:, 0] * gen.response_mask, both[:, 1] * gen.response_mask


@torch.no_grad()
def sequence_kl_full(
    actor: torch.nn.Module,
    reference: torch.nn.Module,
    gen: Generation,
    temperature: float,
    micro_batch_size: int,
) -> torch.Tensor:
    """[B, R] exact KL(actor || reference) over the vocabulary at each response token."""
    r = gen.response_mask.shape[1]

    def one(s: slice) -> torch.Tensor:
        ids, attn = gen.input_ids[s], gen.attention_mask[s]
        return kl_full(
            response_logits(actor, ids, attn, r, temperature),
            response_logits(reference, ids, attn, r, temperature),
        )

    return _in_chunks(one, gen.input_ids.shape[0], micro_batch_size) * gen.response_mask


@torch.no_grad()
def sequence_values(
    critic: torch.nn.Module, gen: Generation, micro_batch_size: int
) -> torch.Tensor:
    """[B, R] critic values of the response states, zero where masked."""
    r = gen.response_mask.shape[1]

    def one(s: slice) -> torch.Tensor:
        return response_values(critic, gen.input_ids[s], gen.attention_mask[s], r)

    return _in_chunks(one, gen.input_ids.shape[0], micro_batch_size) * gen.response_mask


def build_experience(
    gen: Generation,
    *,
    actor: torch.nn.Module,
    reference: torch.nn.Module | None,
    critic: torch.nn.Module | None,
    scores: torch.Tensor,
    temperature: float,
    micro_batch_size: int,
    group_ids: torch.Tensor,
    kl_estimator: str = "k1",
    old_from_engine: bool = False,
    value_head: torch.nn.Module | None = None,
) -> Experience:
    """Run the scoring passes and pack everything into one Experience.

    `reference` may be None when no KL is used (saves a forward pass; the KL is then 0);
    `critic` is None for critic-free estimators. `kl_estimator` names how the per-token
    KL(actor || reference) is estimated: one of `algos.KL_ESTIMATORS` from the two
    log-probs, or `full`, exact over the vocabulary (one more pair of forward passes).
    The engine's own log-probs (`gen.logprobs`), when present, travel as `rollout_logprobs`;
    with `old_from_engine` they are the old log-probs instead (no actor forward pass).
    `value_head` (a shared-backbone critic on the actor, instead of `critic`): the values come
    from the actor's pass that gives the old log-probs, or with `old_from_engine` from the
    generation (`gen.values`): then no actor pass runs at all.
    """
    values = None
    if old_from_engine:
        if gen.logprobs is None:
            raise ValueError("old_from_engine needs the engine's log-probs (logprobs=True)")
        old = gen.logprobs.float() * gen.response_mask
        if value_head is not None:
            if gen.values is None:
                raise ValueError("old_from_engine with a value_head needs gen.values")
            values = gen.values.float() * gen.response_mask
    elif value_head is not None:
        old, values = sequence_logprobs_values(
            actor, value_head, gen, temperature, micro_batch_size
        )
    else:
        old = sequence_logprobs(actor, gen, temperature, micro_batch_size)
    ref = sequence_logprobs(reference, gen, temperature, micro_batch_size) if reference else None
    if critic is not None:
        values = sequence_values(critic, gen, micro_batch_size)
    if reference is None:
        kl = torch.zeros_like(old)
    elif kl_estimator == "full":
        kl = sequence_kl_full(actor, reference, gen, temperature, micro_batch_size)
    else:
        kl = kl_penalty(old, ref, kl_estimator) * gen.response_mask
    engine_lp = None if old_from_engine or gen.logprobs is None else gen.logprobs.to(old.device)
    return Experience(
        input_ids=gen.input_ids,
        attention_mask=gen.attention_mask,
        response_mask=gen.response_mask,
        old_logprobs=old,
        ref_logprobs=ref,
        values=values,
        scores=scores.to(old.device, torch.float32),
        stopped=gen.stopped.to(old.device),
        kl=kl,
        group_ids=group_ids,
        rollout_logprobs=engine_lp,
    )
