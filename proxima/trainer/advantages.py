"""Phases 4 and 5 on the whole global batch: token rewards, then advantages and returns.

With several processes each rank scored its own share; `BatchView.gather` puts the
per-sequence quantities of the whole batch on every rank (rows in rank order, so one process
and N processes see the same batch), and `estimate_advantages` computes from them,
identically on every rank (verl's flow): GAE, whitening, score normalisation, group
baselines and the KL controller's measurement all see global quantities. `Estimates.rows`
hands each rank its own rows back for the update.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from proxima.algos import (
    ADVANTAGE_ESTIMATORS,
    compute_advantages,
    shape_rewards,
    teacher_advantages,
)
from proxima.config import AlgorithmConfig
from proxima.trainer.dist import Dist
from proxima.types import Experience


@dataclass(frozen=True, kw_only=True)
class BatchView:
    """The per-sequence quantities of the whole global batch that phases 4 and 5 read."""

    scores: torch.Tensor  # [B]
    stopped: torch.Tensor  # [B] bool
    kl: torch.Tensor  # [B, R]
    response_mask: torch.Tensor  # [B, R]
    values: torch.Tensor | None  # [B, R]
    group_ids: torch.Tensor  # [B], unique across ranks
    turn_rewards: torch.Tensor | None = None  # [B, R] multi-turn episodes (rollout.env)
    # the estimators' extra inputs gathered, by their `algos.EXTRA_INPUTS` name (shapes
    # there): those asked for that the experience holds (score_components: only with
    # reward.sources)
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        return self.scores.shape[0]

    @property
    def score_components(self) -> torch.Tensor | None:
        """[B, K] the raw score of each of reward.sources, or None for a single source."""
        return self.inputs.get("score_components")

    @classmethod
    def gather(
        cls, exp: Experience, dist: Dist, groups_per_rank: int, inputs: tuple[str, ...] = ()
    ) -> BatchView:
        """The whole batch on every rank; of the extra inputs (`Experience` fields named as
        in `algos.EXTRA_INPUTS`) only those named in `inputs` that the experience holds."""

        def g(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else dist.gather_rows(t)

        return cls(
            scores=g(exp.scores),
            stopped=g(exp.stopped),
            kl=g(exp.kl),
            response_mask=g(exp.response_mask),
            values=g(exp.values),
            group_ids=g(exp.group_ids + dist.rank * groups_per_rank),
            turn_rewards=g(exp.turn_rewards),
            inputs={
                name: g(getattr(exp, name)) for name in inputs if getattr(exp, name) is not None
            },
        )


@dataclass(frozen=True, kw_only=True)
class Estimates:
    """What phases 4-5 computed for the whole batch ([B, R] each) and the shaping stats
    (kl, reward, no_stop_fraction: see `algos.shape_rewards`)."""

    token_rewards: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    stats: dict[str, float]

    def rows(self, exp: Experience, dist: Dist) -> Experience:
        """`exp` (this rank's rows) with its token rewards, advantages and returns."""
        b, r = exp.batch_size, exp.response_mask.shape[1]
        rows = slice(dist.rank * b, (dist.rank + 1) * b)
        return replace(
            exp,
            token_rewards=self.token_rewards[rows, :r],
            advantages=self.advantages[rows, :r],
            returns=self.returns[rows, :r],
        )


# Options of an estimator that the reward sources supply when the config leaves them unset:
# gdpo's weights of its reward components are the sources' own (`reward.sources`).
FROM_SOURCES = {
    "gdpo_reward_weights": lambda reward: [p.weight for p in getattr(reward, "parts", [])],
}


def with_source_options(algorithm: AlgorithmConfig, reward) -> AlgorithmConfig:
    """`algorithm` with each unset option of its estimator that the reward source `reward`
    supplies (`FROM_SOURCES`) filled in."""
    options = ADVANTAGE_ESTIMATORS[algorithm.adv_estimator].options
    filled = {
        k: FROM_SOURCES[k](reward)
        for k in options
        if k in FROM_SOURCES and not getattr(algorithm, k)
    }
    return replace(algorithm, **filled) if filled else algorithm


def estimate_advantages(
    batch: BatchView,
    algorithm: AlgorithmConfig,
    *,
    kl_coef: float,
    no_stop_penalty: float,
    score_mean: float = 0.0,
    score_std: float = 1.0,
) -> Estimates:
    """Phase 4, `algos.shape_rewards`: -kl_coef x KL on every token, the standardised,
    penalised, clipped score at the last (and, in multi-turn episodes, each turn's reward
    at its last action token); phase 5, `algos.compute_advantages` with the
    estimator `algorithm.adv_estimator` and its own options, read from the config fields
    its registry entry names. With a teacher's log-probs in the batch (on-policy
    distillation) and an estimator that does not read them itself, the teacher's term is
    added to its advantages, after its own normalisation (`algos.teacher_advantages`:
    A = A_task + distill_coef x (teacher_lp - old_lp), as Tinker adds it); the returns a
    critic learns from stay the task's."""
    token_rewards, stats = shape_rewards(
        batch.scores,
        batch.stopped,
        batch.kl,
        batch.response_mask,
        kl_coef=kl_coef,
        clip_reward_value=algorithm.clip_reward_value or None,
        no_stop_penalty=no_stop_penalty,
        score_mean=score_mean,
        score_std=score_std,
        turn_rewards=batch.turn_rewards,
    )
    name = algorithm.adv_estimator
    estimator = ADVANTAGE_ESTIMATORS[name]
    options = {k: getattr(algorithm, k) for k in estimator.options}
    inputs = {k: batch.inputs.get(k) for k in estimator.inputs}
    advantages, returns = compute_advantages(
        name,
        token_rewards,
        batch.response_mask,
        values=batch.values,
        gamma=algorithm.gamma,
        group_ids=batch.group_ids,
        **inputs,
        **options,
    )
    teacher = batch.inputs.get("teacher_logprobs")
    if teacher is not None and "teacher_logprobs" not in estimator.inputs:
        advantages = advantages + teacher_advantages(
            teacher,
            batch.inputs["old_logprobs"],
            batch.response_mask,
            algorithm.distill_coef,
            algorithm.distill_clip,
        )
    stats = {k: float(v) for k, v in stats.items()}
    return Estimates(
        token_rewards=token_rewards, advantages=advantages, returns=returns, stats=stats
    )
