"""Phase 6: PPO epochs over shuffled mini-batches, one optimizer step per mini-batch.

An objective gives a micro-batch's loss and stats from one forward pass of the trained
module: `PolicyObjective` for the actor (the configured policy loss, the entropy bonus, the
KL loss and, when the actor carries the critic, + vf_coef x the value loss), and the critic's
own for a value model (`models.critic.ValueObjective`): the critic object builds the
objectives it trains in (`Critic.objectives`). `run_epochs` runs one trained role's epochs
with one.

Micro-batches accumulate gradients with weights chosen so that a mini-batch's gradient is
the same whatever the micro-batch size and the number of processes (`micro_weight`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, fields, replace

import torch

from proxima.algos import (
    POLICY_LOSSES,
    PolicyLossOptions,
    aggregate_loss,
    kl_full,
    kl_penalty,
    logprobs_and_entropy,
    masked_mean,
)
from proxima.config import ActorConfig
from proxima.data import PromptLoader, collate_sft
from proxima.models.critic import Critic
from proxima.models.forward import response_logits, response_logits_values, unpack
from proxima.trainer.dist import Dist, grad_sync
from proxima.trainer.optim import TrainedRole
from proxima.types import SORTED, Experience, prompt_sorted_groups, token_budget_groups

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


def token_micro_batches(
    mini: Experience,
    budget: int,
    keep_response_width: bool = False,
    packed: bool = False,
    rows: int = 0,
) -> list[Experience]:
    """This process's share of a mini-batch as micro-batches formed by a token budget
    (`types.token_budget_groups`), each with its rows right-aligned and trimmed of the
    padding they then share (`Experience.right_aligned`, `Experience.trimmed`): a
    micro-batch computes its longest row's width, not the longest prompt plus the longest
    response. The loss weights (`micro_weight`) make the gradient that of the whole
    mini-batch, as with fixed micro-batches. `packed`: the objective's passes take
    packed rows (`model.packing`), and the budget counts them. `budget` = SORTED: `rows`
    rows to a micro-batch, sorted by length; packed, a prompt's samples kept together in
    the batch's layout, so that the pass lays the prompt once (`prompt_sorted_groups`)."""
    if packed and budget == SORTED:
        ids, attn = mini.input_ids, mini.attention_mask
        groups = prompt_sorted_groups(ids, attn, mini.prompt_length, rows)
        return [mini.select(g).trimmed(keep_response_width) for g in groups]
    groups = token_budget_groups(mini.attention_mask, budget, packed, rows)
    return [mini.select(g).right_aligned().trimmed(keep_response_width) for g in groups]


def _even_out(micros: list[Experience], count: int) -> list[Experience]:
    """`micros` split further (the largest first) into `count` micro-batches, so that
    every process runs as many forward passes (FSDP2 gathers the weights in each)."""
    micros = list(micros)
    while len(micros) < count:
        i = max(range(len(micros)), key=lambda j: micros[j].batch_size)
        big = micros.pop(i)
        if big.batch_size < 2:  # cannot split a row: count rows instead
            micros.insert(i, big)
            break
        half = big.batch_size // 2
        micros[i:i] = [big.select(list(range(half))), big.select(list(range(half, big.batch_size)))]
    return micros


def mini_batches(
    exp: Experience, size: int, shuffle: bool, generator: torch.Generator
) -> Iterator[Experience]:
    """One epoch: every row once, in mini-batches of `size` (shuffled by `generator`)."""
    n = exp.batch_size
    order = torch.randperm(n, generator=generator) if shuffle else torch.arange(n)
    for i in range(0, n, size):
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


# --------------------------------------------------------------------------- objectives


def policy_loss_options(cfg: ActorConfig) -> PolicyLossOptions:
    """The policy losses' options from the actor's section: `actor.clip_ratio_low` /
    `_high` (0: `actor.clip_ratio`), `actor.clip_ratio_c` (0: no dual clip) and every
    `actor.policy_loss.*` option under its own name."""
    section = {f.name: getattr(cfg.policy_loss, f.name) for f in fields(cfg.policy_loss)}
    del section["loss_mode"]
    return PolicyLossOptions(
        clip_ratio_low=cfg.clip_ratio_low or cfg.clip_ratio,
        clip_ratio_high=cfg.clip_ratio_high or cfg.clip_ratio,
        clip_ratio_c=cfg.clip_ratio_c or None,
        **section,
    )


@dataclass(frozen=True)
class PolicyObjective:
    """The actor's loss on a micro-batch: the policy loss `actor.policy_loss.loss_mode` with
    its options (vanilla: the clipped surrogate, dual clip) - entropy_coef x entropy
    (+ kl_loss_coef x KL to the reference);
    with a `critic` on the actor, + vf_coef x its value loss from the same pass (its stats
    named `critic/...`). `values_only` (the critic's warm-up): vf_coef x the value loss
    alone, the policy without gradient. `packed` (`model.packing`): its passes (and a value
    model's, `ValueModel.objectives`) take packed rows."""

    cfg: ActorConfig
    temperature: float
    reference: torch.nn.Module | None = None
    critic: Critic | None = None  # a value head trained in its steps (`ValueHead.objectives`)
    values_only: bool = False
    packed: bool = False

    def during_warmup(self) -> PolicyObjective | None:
        """The actor's objective while the critic warms up: the value loss alone when the
        actor carries the critic, else nothing (the actor waits)."""
        return replace(self, values_only=True) if self.critic is not None else None

    def __call__(self, model: torch.nn.Module, mb: Experience):
        r, temperature, packed = mb.response_mask.shape[1], self.temperature, self.packed
        keep = mb.response_mask.bool()  # the positions the loss counts: the head's only ones
        ids, attn = mb.input_ids, mb.attention_mask
        if self.critic is None:
            logits = response_logits(model, ids, attn, r, temperature, keep, packed)
            return self.policy_terms(logits, mb)
        logits, values = response_logits_values(
            model, ids, attn, r, temperature, self.values_only, keep, packed
        )
        vf, vf_stats = self.critic.value_terms(values, mb)
        stats = {f"critic/{k}": v for k, v in vf_stats.items()}
        coef = self.critic.cfg.vf_coef
        if self.values_only:
            return coef * vf, stats
        loss, actor_stats = self.policy_terms(logits, mb)
        return loss + coef * vf, {**actor_stats, **stats}

    def policy_terms(self, logits: torch.Tensor, mb: Experience):
        """The policy's loss and stats from the logits [N, V] of the N positions of
        `mb.response_mask` (`models.forward`'s flat logits of the kept positions)."""
        cfg = self.cfg
        keep = mb.response_mask.bool()
        # the entropy is only built into the graph when it is part of the loss
        logprobs, entropy = (
            unpack(x, keep)
            for x in logprobs_and_entropy(
                logits, mb.response_ids[keep], entropy_grad=bool(cfg.entropy_coef)
            )
        )
        loss, stats = POLICY_LOSSES[cfg.policy_loss.loss_mode](
            logprobs,
            mb.old_logprobs,
            mb.advantages,
            mb.response_mask,
            cfg.loss_agg_mode,
            policy_loss_options(cfg),
            mb.is_weights,
        )
        stats = {k: float(v) for k, v in stats.items()}
        stats["pg_loss"] = float(loss.detach())
        # |log pi - log pi_old|: on the first mini-batch, before any step, this is the gap
        # between the old log-probs (recomputed, or the engine's) and the training forward
        gap = (logprobs.detach() - mb.old_logprobs).abs()
        stats["logratio_abs"] = float(masked_mean(gap, mb.response_mask))
        stats["entropy"] = float(masked_mean(entropy.detach(), mb.response_mask))
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * aggregate_loss(
                entropy, mb.response_mask, cfg.loss_agg_mode
            )
        if cfg.use_kl_loss:
            kl = aggregate_loss(self._kl(logits, logprobs, mb), mb.response_mask, cfg.loss_agg_mode)
            loss = loss + cfg.kl_loss_coef * kl
            stats["kl_loss"] = float(kl.detach())
        return loss, stats

    def _kl(self, logits, logprobs, mb: Experience) -> torch.Tensor:
        """Per-token KL(actor || reference) [B, R] for the KL loss: a sampled estimator from
        the rollout's reference log-probs, or `full`, exact over the vocabulary (one more
        reference forward pass per micro-batch)."""
        if self.cfg.kl_loss_type != "full":
            return kl_penalty(logprobs, mb.ref_logprobs, self.cfg.kl_loss_type)
        r, keep = mb.response_mask.shape[1], mb.response_mask.bool()
        with torch.no_grad():
            ref_logits = response_logits(
                self.reference,
                mb.input_ids,
                mb.attention_mask,
                r,
                self.temperature,
                keep,
                self.packed,
            )
        return unpack(kl_full(logits, ref_logits), keep)


class PtxLoss:
    """ptx_coef x next-token cross-entropy on one SFT micro-batch per optimizer step
    (InstructGPT's PPO-ptx, arXiv:2203.02155 eq. 2), through the trained module (DDP /
    FSDP2 synchronise its gradients). `loader` is the trainer's (its position is state)."""

    def __init__(self, loader: PromptLoader, pad_token_id: int, coef: float, device) -> None:
        self.loader, self.pad_token_id, self.coef, self.device = loader, pad_token_id, coef, device

    def __call__(self, model: torch.nn.Module) -> torch.Tensor:
        batch = collate_sft(next(self.loader), self.pad_token_id)
        out = model(**{k: v.to(self.device) for k, v in batch.items()})
        return self.coef * out.loss


# --------------------------------------------------------------------------- the epochs


def _backward(
    role: TrainedRole, mini: Experience, objective, dist: Dist, precision, sync: bool
) -> list[tuple[dict[str, float], float]]:
    """Forward and backward of every micro-batch of the mini-batch `mini`, each loss weighted
    by `micro_weight`; the last backward synchronises the gradients across processes when
    `sync`. Returns each micro-batch's stats with its weight."""
    sec, world = role.cfg, dist.world_size
    tokens = float(dist.all_reduce_sum(mini.response_mask.sum()))
    if sec.ppo_max_tokens_per_micro:
        keep_width = sec.loss_agg_mode == "seq-mean-token-sum-norm"
        packed = getattr(objective, "packed", False)  # the objective's passes decide it
        micros = token_micro_batches(
            mini, sec.ppo_max_tokens_per_micro, keep_width, packed, sec.ppo_micro_batch_size
        )
        if dist.active:  # the same number of micro-batches on every process
            micros = _even_out(micros, max(dist.all_gather_object(len(micros))))
    else:
        micros = mini.split(sec.ppo_micro_batch_size)
    out = []
    for i, micro in enumerate(micros):
        with precision():
            loss, stats = objective(role.model, micro)
        w = micro_weight(micro, mini, sec.loss_agg_mode, world, tokens)
        with grad_sync(role.model, sync and i == len(micros) - 1):
            (loss * w).backward()
        out.append((stats, w))
    return out


def run_epochs(
    role: TrainedRole,
    exp: Experience,
    objective: Callable[[torch.nn.Module, Experience], tuple[torch.Tensor, dict]],
    *,
    generator: torch.Generator,
    dist: Dist | None = None,
    precision: Callable[[], AbstractContextManager] = nullcontext,
    extra_loss: Callable[[torch.nn.Module], torch.Tensor] | None = None,
    target_kl: float = 0.0,
) -> dict[str, float]:
    """Epochs x shuffled mini-batches of `role` with `objective` (sizes from its config
    section: the mini-batch is global, this process takes its share); each mini-batch one
    optimizer step. Gradients are synchronised across processes on the last backward of a
    mini-batch only (`extra_loss`'s, the ptx term, when there is one).

    `target_kl` > 0: early stopping on the old-policy KL (PPO-KL): when the mean `approx_kl`
    of a finished epoch (over all processes) exceeds it, the remaining epochs are skipped
    (Stable-Baselines3's and OpenRLHF's target_kl; "The 37 Implementation Details of PPO",
    https://iclr-blog-track.github.io/2022/03/25/ppo-implementation-details/). The stats add
    `optimizer_steps` (steps taken), `first_<stat>` for the `FIRST_STATS` of the first
    mini-batch (before any step: the actor's `first_logratio_abs` must be ~0) and, with a
    target, `early_stopped` (1 when epochs were skipped).

    `precision()` (mixed precision) wraps each forward pass and loss only: backward and the
    optimizer step run outside it, because autocast caches its low-precision copies of the
    weights while its context is open, and a step inside would leave them stale."""
    dist = dist or Dist()
    sec = role.cfg
    acc, first = StatsAccumulator(), StatsAccumulator()
    role.model.train()
    skipped = steps = 0
    stopped = False
    size = sec.ppo_mini_batch_size // dist.world_size
    for epoch in range(sec.ppo_epochs):
        epoch_kl = StatsAccumulator()  # this epoch's approx_kl, weighted as `acc`
        for mini in mini_batches(exp, size, sec.shuffle, generator):
            for stats, w in _backward(role, mini, objective, dist, precision, extra_loss is None):
                acc.add(stats, w)
                if steps == 0:
                    first.add({f"first_{k}": stats[k] for k in FIRST_STATS if k in stats}, w)
                epoch_kl.add({k: v for k, v in stats.items() if k == "approx_kl"}, w)
            if extra_loss is not None:
                with precision():
                    extra = extra_loss(role.model)
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
