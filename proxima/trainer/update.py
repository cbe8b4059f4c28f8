"""Phase 2: PPO updates of actor and critic on shuffled mini-batches.

Micro-batches accumulate gradients with weights chosen so that a mini-batch's gradient is
the same whatever the micro-batch size (token-mean: each micro-batch's mean is weighted
by its share of the mini-batch's tokens; seq modes: by its share of sequences; token-sum:
each sum counts once).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator

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
from proxima.models.forward import response_logits, response_values
from proxima.trainer.optim import TrainedRole
from proxima.types import Experience


def micro_weight(micro: Experience, mini: Experience, mode: str) -> float:
    """Share of the mini-batch that a micro-batch's mean loss stands for (1 for token-sum:
    the sums of the micro-batches add up to the mini-batch's sum)."""
    if mode == "token-sum":
        return 1.0
    if mode == "token-mean":
        return float(micro.response_mask.sum()) / max(1.0, float(mini.response_mask.sum()))
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
    """Weighted means of stats over an iteration's micro-batches and optimizer steps."""

    def __init__(self) -> None:
        self._sums: dict[str, float] = defaultdict(float)
        self._weights: dict[str, float] = defaultdict(float)

    def add(self, stats: dict[str, float], weight: float = 1.0) -> None:
        for k, v in stats.items():
            self._sums[k] += float(v) * weight
            self._weights[k] += weight

    def means(self) -> dict[str, float]:
        return {k: self._sums[k] / max(1e-12, self._weights[k]) for k in self._sums}


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


def run_updates(
    role: TrainedRole,
    exp: Experience,
    *,
    micro_loss: Callable[[Experience], tuple[torch.Tensor, dict]],
    generator: torch.Generator,
    extra_loss: Callable[[], torch.Tensor | None] | None = None,
) -> dict[str, float]:
    """Epochs x shuffled mini-batches of `role` (sizes from its config section); each
    mini-batch one optimizer step."""
    sec = role.cfg
    acc = StatsAccumulator()
    role.model.train()
    skipped = 0
    batches = mini_batches(exp, sec.ppo_mini_batch_size, sec.ppo_epochs, sec.shuffle, generator)
    for mini in batches:
        for micro in mini.split(sec.ppo_micro_batch_size):
            loss, stats = micro_loss(micro)
            w = micro_weight(micro, mini, sec.loss_agg_mode)
            (loss * w).backward()
            acc.add(stats, w)
        if extra_loss is not None:
            extra = extra_loss()
            if extra is not None:
                extra.backward()
                acc.add({"ptx_loss": float(extra.detach())})
        norm, ok = role.step()
        skipped += not ok
        acc.add({"grad_norm": norm})
    out = acc.means()
    out["skipped_steps"] = float(skipped)
    return out
