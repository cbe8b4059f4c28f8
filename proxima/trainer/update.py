"""Phase 2: PPO updates of actor and critic on shuffled mini-batches.

Micro-batches accumulate gradients with weights chosen so that a mini-batch's gradient is
the same whatever the micro-batch size (token-mean: each micro-batch's mean is weighted
by its share of the mini-batch's tokens; seq modes: by its share of sequences; token-sum:
each sum counts once).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext

import torch

from proxima.algos import (
    aggregate_loss,
    entropy_from_logits,
    kl_full,
    kl_penalty,
    logprobs_from_logits,
    masked_mean,
    policy_loss,
    value_loss,
)
from proxima.config import ActorConfig, CriticConfig
from proxima.models.forward import response_logits, response_logits_hidden, response_values
from proxima.models.value_head import value_of
from proxima.trainer.dist import Dist, grad_sync
from proxima.trainer.optim import TrainedRole
from proxima.types import Experience

FIRST_STATS = ("logratio_abs",)  # also reported for the first mini-batch alone


def micro_weight(
    micro: Experience,
    mini: Experience,
    mode: str,
    world: int = 1,
    mini_tokens: float | None = None,
) -> float:
    """Weight of a micro-batch's loss so that the accumulated gradient is the gradient of the
    whole global mini-batch's loss, whatever the micro-batch size and the number of
    processes (verl issues 906, 5641, 5798: this, got wrong).

    token-mean: the micro-batch's share of the global mini-batch's real tokens
    (`mini_tokens`: all processes together; default this process's mini-batch); seq modes:
    its share of the sequences; token-sum: each sum counts once. Times `world`, because
    DDP and FSDP2 average the gradients of the processes where the loss wants their sum.
    """
    if mode == "token-sum":
        return float(world)
    if mode == "token-mean":
        total = float(mini.response_mask.sum()) if mini_tokens is None else mini_tokens
        return world * float(micro.response_mask.sum()) / max(1.0, total)
    return micro.batch_size / mini.batch_size


def mini_batches(
    exp: Experience, size: int, epochs: int, shuffle: bool, generator: torch.Generator
) -> Iterator[Experience]:
    for _ in range(epochs):
        order = (
            torch.randperm(exp.batch_size, generator=generator)
            if shuffle
            else torch.arange(exp.batch_size)
        )
        for i in range(0, exp.batch_size, size):
            yield exp.select(order[i : i + size])


class StatsAccumulator:
    """Weighted means of stats over an iteration's micro-batches and optimizer steps, and
    over every process (`means(dist)`): the same numbers on every rank."""

    def __init__(self) -> None:
        self._sums: dict[str, float] = defaultdict(float)
        self._weights: dict[str, float] = defaultdict(float)

    def add(self, stats: dict[str, float], weight: float = 1.0) -> None:
        for k, v in stats.items():
            self._sums[k] += float(v) * weight
            self._weights[k] += weight

    def means(self, dist: Dist | None = None) -> dict[str, float]:
        keys = sorted(self._sums)
        both = torch.tensor(
            [[self._sums[k] for k in keys], [self._weights[k] for k in keys]], dtype=torch.float64
        )
        if dist is not None:
            both = dist.all_reduce_sum(both)
        return {k: float(both[0, i] / max(1e-12, float(both[1, i]))) for i, k in enumerate(keys)}


def _kl_to_reference(logits, logprobs, mb: Experience, kind: str, reference, temperature):
    """Per-token KL(actor || reference) [B, R] for the KL loss: a sampled estimator from the
    rollout's reference log-probs, or `full`, exact over the vocabulary (one more reference
    forward pass per micro-batch)."""
    if kind != "full":
        return kl_penalty(logprobs, mb.ref_logprobs, kind)
    with torch.no_grad():
        ref_logits = response_logits(
            reference, mb.input_ids, mb.attention_mask, mb.response_mask.shape[1], temperature
        )
    return kl_full(logits, ref_logits)


def actor_micro_loss(
    actor: torch.nn.Module,
    mb: Experience,
    cfg: ActorConfig,
    temperature: float,
    reference: torch.nn.Module | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate - entropy bonus (+ KL loss) of one micro-batch."""
    r = mb.response_mask.shape[1]
    logits = response_logits(actor, mb.input_ids, mb.attention_mask, r, temperature)
    return _policy_terms(logits, mb, cfg, temperature, reference)


def _policy_terms(
    logits: torch.Tensor,
    mb: Experience,
    cfg: ActorConfig,
    temperature: float,
    reference: torch.nn.Module | None,
) -> tuple[torch.Tensor, dict[str, float]]:
    logprobs = logprobs_from_logits(logits, mb.response_ids)
    loss, stats = policy_loss(
        logprobs,
        mb.old_logprobs,
        mb.advantages,
        mb.response_mask,
        clip_ratio=cfg.clip_ratio,
        clip_ratio_low=cfg.clip_ratio_low or None,
        clip_ratio_high=cfg.clip_ratio_high or None,
        clip_ratio_c=cfg.clip_ratio_c or None,
        agg=cfg.loss_agg_mode,
        is_weights=mb.is_weights,
    )
    stats = {k: float(v) for k, v in stats.items()}
    stats["pg_loss"] = float(loss.detach())
    # |log pi - log pi_old|: on the first mini-batch, before any step, this is the gap
    # between the old log-probs (recomputed, or the engine's) and the training forward
    gap = (logprobs.detach() - mb.old_logprobs).abs()
    stats["logratio_abs"] = float(masked_mean(gap, mb.response_mask))
    # the entropy is only built into the graph when it is part of the loss
    with torch.set_grad_enabled(bool(cfg.entropy_coef) and torch.is_grad_enabled()):
        entropy = entropy_from_logits(logits)
    stats["entropy"] = float(masked_mean(entropy.detach(), mb.response_mask))
    if cfg.entropy_coef:
        loss = loss - cfg.entropy_coef * aggregate_loss(
            entropy, mb.response_mask, cfg.loss_agg_mode
        )
    if cfg.use_kl_loss:
        kl_tok = _kl_to_reference(logits, logprobs, mb, cfg.kl_loss_type, reference, temperature)
        kl = aggregate_loss(kl_tok, mb.response_mask, cfg.loss_agg_mode)
        loss = loss + cfg.kl_loss_coef * kl
        stats["kl_loss"] = float(kl.detach())
    return loss, stats


def critic_micro_loss(
    critic: torch.nn.Module, mb: Experience, cfg: CriticConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    values = response_values(critic, mb.input_ids, mb.attention_mask, mb.response_mask.shape[1])
    return _value_terms(values, mb, cfg)


def _value_terms(
    values: torch.Tensor, mb: Experience, cfg: CriticConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    loss, stats = value_loss(
        values,
        mb.values,
        mb.returns,
        mb.response_mask,
        cliprange_value=cfg.cliprange_value or None,
        agg=cfg.loss_agg_mode,
    )
    stats = {k: float(v) for k, v in stats.items()}
    stats["vf_loss"] = float(loss.detach())
    return loss, stats


def shared_micro_loss(
    actor: torch.nn.Module,
    value_head: torch.nn.Module,
    mb: Experience,
    actor_cfg: ActorConfig,
    critic_cfg: CriticConfig,
    temperature: float,
    reference: torch.nn.Module | None = None,
    head_only: bool = False,
) -> tuple[torch.Tensor, dict[str, float]]:
    """A shared-backbone actor-critic's micro-batch: one forward pass, loss = the actor's
    loss (`actor_micro_loss`) + critic.vf_coef x the value loss (`critic_micro_loss`; seed
    001's c1). The value stats come back named `critic/...`. `head_only` (the critic's
    warm-up): vf_coef x the value loss of the value head alone, on the backbone's features
    without gradient (the actor does not change)."""
    r = mb.response_mask.shape[1]
    with torch.set_grad_enabled(torch.is_grad_enabled() and not head_only):
        logits, hidden = response_logits_hidden(
            actor, mb.input_ids, mb.attention_mask, r, temperature
        )
    vf, vf_stats = _value_terms(value_of(value_head, hidden), mb, critic_cfg)
    stats = {f"critic/{k}": v for k, v in vf_stats.items()}
    if head_only:
        return critic_cfg.vf_coef * vf, stats
    loss, actor_stats = _policy_terms(logits, mb, actor_cfg, temperature, reference)
    return loss + critic_cfg.vf_coef * vf, {**actor_stats, **stats}


def run_updates(
    role: TrainedRole,
    exp: Experience,
    *,
    micro_loss: Callable[[Experience], tuple[torch.Tensor, dict]],
    generator: torch.Generator,
    extra_loss: Callable[[], torch.Tensor] | None = None,
    target_kl: float = 0.0,
    dist: Dist | None = None,
    autocast: Callable[[], AbstractContextManager] = nullcontext,
) -> dict[str, float]:
    """Epochs x shuffled mini-batches of `role` (sizes from its config section: the mini-
    batch is global, this process takes its share); each mini-batch one optimizer step.
    Gradients are synchronised across processes on the last backward of a mini-batch only
    (`extra_loss`, the ptx term, when there is one).

    `target_kl` > 0: early stopping on the old-policy KL (PPO-KL): when the mean `approx_kl`
    of a finished epoch (over all processes) exceeds it, the remaining epochs are skipped
    (Stable-Baselines3's and OpenRLHF's target_kl; "The 37 Implementation Details of PPO",
    https://iclr-blog-track.github.io/2022/03/25/ppo-implementation-details/). The stats add
    `optimizer_steps` (steps taken), `first_<stat>` for the `FIRST_STATS` of the first
    mini-batch (before any step: the actor's `first_logratio_abs` must be ~0) and, with a
    target, `early_stopped` (1 when epochs were skipped).

    `autocast()` (mixed precision) wraps each forward pass and loss only: backward and the
    optimizer step run outside it, because autocast caches its low-precision copies of the
    weights while its context is open, and a step inside would leave them stale."""
    dist = dist or Dist()
    sec, world = role.cfg, dist.world_size
    acc, first = StatsAccumulator(), StatsAccumulator()
    role.model.train()
    skipped = steps = 0
    stopped = False
    size = sec.ppo_mini_batch_size // world
    for epoch in range(sec.ppo_epochs):
        epoch_kl = StatsAccumulator()  # this epoch's approx_kl, weighted as `acc`
        for mini in mini_batches(exp, size, 1, sec.shuffle, generator):
            tokens = float(dist.all_reduce_sum(mini.response_mask.sum()))
            micros = mini.split(sec.ppo_micro_batch_size)
            for i, micro in enumerate(micros):
                last = extra_loss is None and i == len(micros) - 1
                with autocast():
                    loss, stats = micro_loss(micro)
                w = micro_weight(micro, mini, sec.loss_agg_mode, world, tokens)
                with grad_sync(role.model, last):
                    (loss * w).backward()
                acc.add(stats, w)
                if steps == 0:
                    first.add({f"first_{k}": stats[k] for k in FIRST_STATS if k in stats}, w)
                epoch_kl.add({k: v for k, v in stats.items() if k == "approx_kl"}, w)
            if extra_loss is not None:
                with autocast():
                    extra = extra_loss()
                extra.backward()
                acc.add({"ptx_loss": float(extra.detach())})
            norm, ok = role.step()
            skipped += not ok
            steps += 1
            acc.add({"grad_norm": norm})
        kl = epoch_kl.means(dist).get("approx_kl", 0.0) if target_kl > 0 else 0.0
        if target_kl > 0 and epoch + 1 < sec.ppo_epochs and kl > target_kl:
            stopped = True
            break
    out = {**acc.means(dist), **first.means(dist)}
    out["skipped_steps"] = float(skipped)
    out["optimizer_steps"] = float(steps)
    if target_kl > 0:
        out["early_stopped"] = float(stopped)
    return out
