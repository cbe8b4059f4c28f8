"""Phase 3: the scoring passes, without gradients -> a complete `Experience`.

Old log-probs (an actor pass, logits / temperature; or the engine's own), reference
log-probs, values and the per-token KL estimate of each generated sequence, computed in
micro-batches as the run's `ScoringPlan` (`rollout.plan`) says, the teacher's log-probs of
the sampled tokens (on-policy distillation; at the sampling temperature, as the
reference's and the old ones, so the three compare the same distributions), and the
rollout correction's weights (importance weights, rejection).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from proxima.algos import (
    RolloutCorrection,
    kl_full,
    kl_penalty,
    logprobs_from_logits,
    sum_pi_squared,
)
from proxima.config import AlgorithmConfig, RolloutConfig
from proxima.models.critic import Critic
from proxima.models.forward import (
    response_logits,
    response_logits_values,
    response_logprobs,
    response_values,
    unpack,
)
from proxima.rollout.plan import ScoringPlan
from proxima.rollout.types import Generation
from proxima.types import (
    SORTED,
    Experience,
    prompt_sorted_groups,
    right_shifts,
    roll_rows,
    shared_padding,
    token_budget_groups,
)


@dataclass(frozen=True)
class Chunks:
    """How a scoring pass splits the batch: `size` consecutive rows in the batch's layout,
    or (`max_tokens` > 0) groups of rows by a token budget (`types.token_budget_groups`;
    `max_tokens` = SORTED: `size` rows to a group, sorted by length), each right-aligned
    and trimmed of the padding its rows share (as the update's micro-batches); `packed`
    (`model.packing`): each chunk's sequences through packed rows (`models.packing`; the
    budget's groups counted in packed rows). The result is the same every way."""

    size: int
    max_tokens: int = 0
    packed: bool = False

    @classmethod
    def of(cls, rollout: RolloutConfig, packed: bool = False) -> Chunks:
        return cls(rollout.micro_batch_size, rollout.max_tokens_per_micro, packed)


PassFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _chunks(chunks: Chunks | int) -> Chunks:
    return Chunks(chunks) if isinstance(chunks, int) else chunks


@torch.no_grad()
def _in_chunks(fn: PassFn, gen: Generation, chunks: Chunks | int) -> torch.Tensor:
    """fn(input_ids, attention_mask, response_ids) -> [b, ..., r] (r = response_ids' width)
    over the batch in `chunks` (an int: that many rows at a time), put together as
    [B, ..., R] (zero past a group's width)."""
    chunks = _chunks(chunks)
    if chunks.packed:
        return _in_packed_chunks(fn, gen, chunks)
    ids, attn, response = gen.input_ids, gen.attention_mask, gen.response_ids
    n, r = response.shape
    if not chunks.max_tokens:
        parts = [
            fn(ids[i : i + chunks.size], attn[i : i + chunks.size], response[i : i + chunks.size])
            for i in range(0, n, chunks.size)
        ]
        return torch.cat(parts, dim=0)
    p, out = ids.shape[1] - r, None
    for group in token_budget_groups(attn, chunks.max_tokens, rows=chunks.size):
        rows = torch.tensor(group, device=ids.device)
        shift = right_shifts(attn[rows])  # right-aligned as the update's micro-batches
        g_ids, g_attn = roll_rows(ids[rows], shift), roll_rows(attn[rows], shift)
        start, lo, hi = shared_padding(g_attn, roll_rows(gen.response_mask[rows], shift))
        part = fn(g_ids[:, start : p + hi], g_attn[:, start : p + hi], g_ids[:, p + lo : p + hi])
        if out is None:
            out = part.new_zeros((n, *part.shape[1:-1], r))
        aligned = part.new_zeros((len(group), *part.shape[1:-1], r))
        aligned[..., lo:hi] = part
        out[rows] = roll_rows(aligned, -shift)  # back to each row's own columns
    return out


def _in_packed_chunks(fn: PassFn, gen: Generation, chunks: Chunks) -> torch.Tensor:
    """`_in_chunks` through packed rows: the padding is never computed, so each chunk's
    rows go in their own columns; groups by the budget count packed rows."""
    ids, attn, response = gen.input_ids, gen.attention_mask, gen.response_ids
    n, size = ids.shape[0], chunks.size
    if chunks.max_tokens == SORTED:  # a prompt's samples together: laid once
        groups = prompt_sorted_groups(ids, attn, ids.shape[1] - response.shape[1], size)
    elif chunks.max_tokens:
        groups = token_budget_groups(attn, chunks.max_tokens, packed=True, rows=size)
    else:
        groups = [list(range(i, min(i + size, n))) for i in range(0, n, size)]
    out = None
    for group in groups:
        rows = torch.tensor(group, device=ids.device)
        part = fn(ids[rows], attn[rows], response[rows])
        out = part.new_zeros((n, *part.shape[1:])) if out is None else out
        out[rows] = part
    return out


def _attended(attention_mask: torch.Tensor, response: torch.Tensor) -> torch.Tensor:
    """[B, R] bool: the response positions the mask attends to, the only ones the scoring
    passes project to the vocabulary (`models.forward`'s `keep`)."""
    return attention_mask[:, -response.shape[1] :].bool()


@torch.no_grad()
def sequence_logprobs(
    model: torch.nn.Module, gen: Generation, temperature: float, chunks: Chunks | int
) -> torch.Tensor:
    """[B, R] log-probs of the response tokens under `model`, zero where masked."""

    packed = _chunks(chunks).packed

    def one(ids, attn, response) -> torch.Tensor:
        return response_logprobs(model, ids, attn, response, temperature, packed)

    return _in_chunks(one, gen, chunks) * gen.response_mask


@torch.no_grad()
def sequence_logprobs_sum_pi_squared(
    model: torch.nn.Module, gen: Generation, temperature: float, chunks: Chunks | int
) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, R] log-probs of the response tokens and [B, R] sum over the vocabulary of pi^2 at
    each of them (pi = softmax(logits / temperature)), from one pass; zero where masked."""

    packed = _chunks(chunks).packed

    def one(ids, attn, response) -> torch.Tensor:
        keep = _attended(attn, response)
        logits = response_logits(model, ids, attn, response.shape[1], temperature, keep, packed)
        lp = logprobs_from_logits(logits, response[keep])
        return torch.stack([unpack(lp, keep), unpack(sum_pi_squared(logits), keep)], dim=1)

    both = _in_chunks(one, gen, chunks)  # [B, 2, R]
    return both[:, 0] * gen.response_mask, both[:, 1] * gen.response_mask


@torch.no_grad()
def sequence_logprobs_values(
    model: torch.nn.Module, gen: Generation, temperature: float, chunks: Chunks | int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The scoring pass of an actor that carries the critic: [B, R] log-probs and values
    from one pass, zero where masked."""

    packed = _chunks(chunks).packed

    def one(ids, attn, response) -> torch.Tensor:
        keep = _attended(attn, response)
        r = response.shape[1]
        logits, values = response_logits_values(
            model, ids, attn, r, temperature, keep=keep, packed=packed
        )
        lp = logprobs_from_logits(logits, response[keep])
        return torch.stack([unpack(lp, keep), values], dim=1)

    both = _in_chunks(one, gen, chunks)  # [B, 2, R]
    return both[:, 0] * gen.response_mask, both[:, 1] * gen.response_mask


@torch.no_grad()
def sequence_kl_full(
    actor: torch.nn.Module,
    reference: torch.nn.Module,
    gen: Generation,
    temperature: float,
    chunks: Chunks | int,
) -> torch.Tensor:
    """[B, R] exact KL(actor || reference) over the vocabulary at each response token."""

    packed = _chunks(chunks).packed

    def one(ids, attn, response) -> torch.Tensor:
        r, keep = response.shape[1], _attended(attn, response)
        return unpack(
            kl_full(
                response_logits(actor, ids, attn, r, temperature, keep, packed),
                response_logits(reference, ids, attn, r, temperature, keep, packed),
            ),
            keep,
        )

    return _in_chunks(one, gen, chunks) * gen.response_mask


@torch.no_grad()
def sequence_values(critic: torch.nn.Module, gen: Generation, chunks: Chunks | int) -> torch.Tensor:
    """[B, R] critic values of the response states, zero where masked."""

    packed = _chunks(chunks).packed

    def one(ids, attn, response) -> torch.Tensor:
        return response_values(critic, ids, attn, response.shape[1], packed)

    return _in_chunks(one, gen, chunks) * gen.response_mask


def _old_logprobs(gen, plan: ScoringPlan, actor, rollout: RolloutConfig, chunks: Chunks):
    """(old log-probs, values that came with them or None), as the plan says."""
    temperature = rollout.temperature
    if plan.old_from_engine:
        if gen.logprobs is None:
            raise ValueError("the plan takes the engine's log-probs but the engine gave none")
        values = gen.values.float() * gen.response_mask if plan.values == "generation" else None
        if plan.values == "generation" and gen.values is None:
            raise ValueError("the plan takes the values from the generation, which gave none")
        return gen.logprobs.float() * gen.response_mask, values
    if plan.values == "actor":
        return sequence_logprobs_values(actor, gen, temperature, chunks)
    return sequence_logprobs(actor, gen, temperature, chunks), None


def _old_and_sum_pi_squared(gen, plan: ScoringPlan, actor, rollout: RolloutConfig, chunks: Chunks):
    """(old log-probs, values or None, sum pi^2 or None), as the plan says."""
    if plan.sum_pi_squared:  # the plan recomputes: no critic-free estimator has values
        old, spsq = sequence_logprobs_sum_pi_squared(actor, gen, rollout.temperature, chunks)
        return old, None, spsq
    return (*_old_logprobs(gen, plan, actor, rollout, chunks), None)


def rollout_correction(algorithm: AlgorithmConfig) -> RolloutCorrection:
    """The corrections `algorithm.rollout_correction` (truncated importance weights) and
    `algorithm.rollout_rejection` (rejection by the ratio pi_old / mu) ask for."""
    return RolloutCorrection(
        level=algorithm.rollout_correction,
        cap=algorithm.rollout_correction_cap,
        rejection=algorithm.rollout_rejection,
        upper=algorithm.rollout_rejection_threshold,
        lower=algorithm.rollout_rejection_threshold_lower,
    )


def build_experience(
    gen: Generation,
    scores: torch.Tensor,
    group_ids: torch.Tensor,
    plan: ScoringPlan,
    *,
    actor: torch.nn.Module,
    reference: torch.nn.Module | None,
    critic: Critic | None,
    rollout: RolloutConfig,
    algorithm: AlgorithmConfig,
    teacher: torch.nn.Module | None = None,
    packed: bool = False,
) -> Experience:
    """Run the scoring passes `plan` asks for and pack everything into one Experience.

    `reference` is None when no KL is used (the KL is then 0). The per-token KL(actor ||
    reference) is the plan's estimator: one of `algos.KL_ESTIMATORS` from the two log-probs,
    or `full`, exact over the vocabulary. The engine's own log-probs (`gen.logprobs`), when
    they are not the old log-probs, travel as `rollout_logprobs`, with the weights of
    `rollout_correction(algorithm)` (importance weights old / engine, rejection).
    `teacher`: on-policy distillation's teacher, whose log-probs of the sampled tokens
    travel as `teacher_logprobs`; None without one. `packed` (`model.packing`): every pass
    through packed rows (`Chunks`).
    """
    temperature, chunks = rollout.temperature, Chunks.of(rollout, packed)
    old, values, spsq = _old_and_sum_pi_squared(gen, plan, actor, rollout, chunks)
    ref = sequence_logprobs(reference, gen, temperature, chunks) if reference is not None else None
    teacher_lp = None
    if teacher is not None:
        teacher_lp = sequence_logprobs(teacher, gen, temperature, chunks)
    if plan.values == "critic":
        values = sequence_values(critic.model, gen, chunks)
    if reference is None:
        kl = torch.zeros_like(old)
    elif plan.kl == "full":
        kl = sequence_kl_full(actor, reference, gen, temperature, chunks)
    else:
        kl = kl_penalty(old, ref, plan.kl) * gen.response_mask
    engine_lp = None
    if not plan.old_from_engine and gen.logprobs is not None:
        engine_lp = gen.logprobs.to(old.device)
    is_weights = None
    if engine_lp is not None:
        is_weights, _ = rollout_correction(algorithm).weights(old, engine_lp, gen.response_mask)
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
        group_ids=group_ids.to(old.device),
        rollout_logprobs=engine_lp,
        is_weights=is_weights,
        sum_pi_squared=spsq,
        teacher_logprobs=teacher_lp,
        turn_rewards=None if gen.turn_rewards is None else gen.turn_rewards.to(old.device),
    )
