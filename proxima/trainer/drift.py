"""Drift: what shows degenerate answers beside the reward, every iteration, and a warning
when it collapses.

`batch_drift` computes the `drift/*` metrics (`algos.drift`) on the batch the trainer
already has: the sampled token ids and the response mask of the whole batch (every rank's
rows gathered, so N processes give one process's values), the decoded texts (a multi-turn
episode's text holds its observations too; its token n-grams do not), and the
reference's log-probs of phase 3 when the run has a reference (no extra forward pass;
without one there is no `drift/ref_logprob`). The entropy is the update's `actor/entropy`.

`DriftMonitor` compares each iteration with the run's start (the mean of its first
`START_ITERATIONS` iterations) and returns a `DriftWarning` once per kind when a metric
stays past its `guard.drift_*` threshold for `PERSIST` iterations in a row: what
collapsed, the figures, and the likely fix. It warns; it never stops the run (the
`HealthMonitor` of `trainer.health` stops diverged ones). A resumed run measures its start
afresh.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from proxima.algos import distinct_n, dominated, loglik_per_token, repetition, wordless
from proxima.config import Config
from proxima.config.roles import role_plan
from proxima.trainer.dist import Dist
from proxima.types import Experience

START_ITERATIONS = 3  # the start: the mean of the run's first iterations (one is noisy)
PERSIST = 3  # iterations in a row past a threshold before a warning (one batch is noisy)


def drift_metrics(
    ids: torch.Tensor,
    mask: torch.Tensor,
    dominated_rows: torch.Tensor,
    wordless_rows: torch.Tensor,
    ref_logprobs: torch.Tensor | None = None,
) -> dict[str, float]:
    """The drift/* metrics of a whole batch: token ids and mask [B, R], two [B] bool
    (`algos.dominated` and `algos.wordless` of each response's text), the reference's
    log-probs [B, R] or None."""

    def share(rows: torch.Tensor) -> float:
        return float(rows.float().mean()) if len(rows) else 0.0

    m = {
        "drift/repetition": float(repetition(ids, mask)),
        "drift/dominated": share(dominated_rows),
        "drift/empty": share(wordless_rows),
        "drift/distinct_1": float(distinct_n(ids, mask, 1)),
        "drift/distinct_2": float(distinct_n(ids, mask, 2)),
    }
    if ref_logprobs is not None:
        m["drift/ref_logprob"] = float(loglik_per_token(ref_logprobs, mask))
    return m


def batch_drift(
    mask: torch.Tensor, local: Experience, texts: list[str], dist: Dist
) -> dict[str, float]:
    """`drift_metrics` of the whole batch: `mask` [B, R] the gathered response mask as
    sampled (truncated responses in: they are often the loops), `local` this rank's rows
    and `texts` their decoded responses, gathered here."""
    g = dist.gather_rows
    ids = g(local.response_ids)
    rows = g(dominated(texts).to(torch.float32)).bool()
    empty = g(wordless(texts).to(torch.float32)).bool()
    ref = g(local.ref_logprobs) if local.ref_logprobs is not None else None
    return drift_metrics(ids, mask, rows, empty, ref)


@dataclass(frozen=True)
class DriftCheck:
    kind: str
    metric: str
    key: str  # its threshold, guard.<key>
    falls: bool  # a collapse is a fall (else a rise)
    ratio: bool  # the threshold is a fraction of the start (else a difference)
    what: str  # what a collapse means, for the message


CHECKS = (
    DriftCheck(
        "diversity", "drift/distinct_2", "drift_min_distinct_ratio", True, True,
        "the answers lost their variety",
    ),
    DriftCheck(
        "repetition", "drift/repetition", "drift_max_repetition_rise", False, False,
        "the answers repeat themselves",
    ),
    DriftCheck(
        "dominated", "drift/dominated", "drift_max_dominated_rise", False, False,
        "more answers are one word said over and over",
    ),
    DriftCheck(
        "empty", "drift/empty", "drift_max_empty_rise", False, False,
        "more answers say nothing (no word at all)",
    ),
    DriftCheck(
        "entropy", "actor/entropy", "drift_min_entropy_ratio", True, True,
        "the policy's entropy collapsed",
    ),
    DriftCheck(
        "reference", "drift/ref_logprob", "drift_max_ref_logprob_drop", True, False,
        "the reference finds the answers far less likely",
    ),
)  # fmt: skip


@dataclass
class DriftWarning:
    kind: str
    iteration: int
    metric: str
    start: float
    value: float
    limit: float
    threshold: str  # guard.<key>=<value>
    message: str

    def to_dict(self) -> dict:
        return asdict(self)


def _limit(check: DriftCheck, start: float, threshold: float) -> float:
    if check.ratio:
        return start * threshold
    return start - threshold if check.falls else start + threshold


def drift_fix(cfg: Config, kind: str) -> str:
    """The likely fix, by what the run has: a KL term to keep, or one to strengthen."""
    lr = f"lower actor.optim.lr (now {cfg.actor.optim.lr:g})"
    if not role_plan(cfg).has_reference:
        fix = (
            "keep a KL reference (algorithm.use_kl_in_reward=true, or actor.use_kl_loss=true), "
            f"or {lr}"
        )
    else:
        coefs = []
        if cfg.kl_in_reward:
            coefs.append(f"algorithm.kl_ctrl.kl_coef (now {cfg.algorithm.kl_ctrl.kl_coef:g})")
        if cfg.actor.use_kl_loss:
            coefs.append(f"actor.kl_loss_coef (now {cfg.actor.kl_loss_coef:g})")
        fix = f"raise the KL coefficient, {' or '.join(coefs)}, or {lr}"
    if kind == "entropy":
        fix += ", or add an entropy bonus (actor.entropy_coef)"
    return fix + "; and check what the reward pays for: samples.jsonl shows the answers"


@dataclass
class DriftMonitor:
    """Per-iteration drift checks against the run's start (`guard.drift_*`); `observe`
    returns the warnings that fire at this iteration, each kind at most once a run."""

    cfg: Config
    first: dict[str, list[float]] = field(default_factory=dict)
    streak: dict[str, int] = field(default_factory=dict)
    warnings: list[DriftWarning] = field(default_factory=list)

    def observe(self, iteration: int, metrics: dict[str, float]) -> list[DriftWarning]:
        fired = []
        warned = {w.kind for w in self.warnings}
        for check in CHECKS:
            threshold = getattr(self.cfg.guard, check.key)
            value = metrics.get(check.metric)
            if value is None or not threshold or check.kind in warned:
                continue
            first = self.first.setdefault(check.metric, [])
            if len(first) < START_ITERATIONS:
                first.append(float(value))
                continue
            start = sum(first) / len(first)
            limit = _limit(check, start, threshold)
            past = value < limit if check.falls else value > limit
            self.streak[check.kind] = self.streak.get(check.kind, 0) + 1 if past else 0
            if self.streak[check.kind] >= PERSIST:
                fired.append(self._warning(check, iteration, start, float(value), limit))
        self.warnings += fired
        return fired

    def _warning(
        self, check: DriftCheck, iteration: int, start: float, value: float, limit: float
    ) -> DriftWarning:
        threshold = f"guard.{check.key}={getattr(self.cfg.guard, check.key):g}"
        side = "below" if check.falls else "above"
        message = (
            f"drift at iteration {iteration}: {check.what}: {check.metric} {value:.4g} is "
            f"{side} {limit:.4g} (its start {start:.4g}, the mean of the first "
            f"{START_ITERATIONS} iterations; {threshold}) for {PERSIST} iterations in a "
            f"row. Likely fix: {drift_fix(self.cfg, check.kind)}."
        )
        return DriftWarning(
            check.kind, iteration, check.metric, start, value, limit, threshold, message
        )
