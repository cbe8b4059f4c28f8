"""A run's health: divergence caught, errors that stop a run named.

- `HealthMonitor`: each iteration's metrics are checked for a collapse (entropy near 0, a KL
  runaway, the response length collapsing); `guard.patience` consecutive unhealthy
  iterations stop the run with a `Divergence` naming the metric, the iteration and the
  likely fix. Weights or outputs that are not finite stop it at once
  (`non_finite_divergence`). Answers that degenerate without diverging are
  `trainer.drift`'s: it warns, it never stops a run.
- `RunFailed`: an error that struck mid-run, raised once the run has kept what it could
  (a checkpoint of the last completed iteration, the summary, the resume command).

The metrics are the same on every rank, so a multi-process run agrees on a divergence.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxima.config import Config
from proxima.trainer.optim import NonFiniteWeightsError

EXIT_DIVERGED = 3  # `proxima train`'s exit status for a diverged run (2: a user error)


class RunFailed(RuntimeError):
    """A run stopped by an error in an iteration (or while writing a checkpoint), after it
    kept what it could; `summary` is the run's summary, also in summary.json under
    `failed`. The message says what failed, what is kept and how to resume."""

    def __init__(self, message: str, summary: dict) -> None:
        super().__init__(message)
        self.summary = summary


class NonFiniteOutputsError(RuntimeError):
    """A trained model's outputs (log-probs, values, sampling probabilities) are not finite:
    its weights diverged in the previous update."""

    def __init__(self, message: str, role: str = "actor") -> None:
        super().__init__(message)
        self.role = role


@dataclass
class Divergence:
    """Why the run stopped as diverged. `last_good` is the newest iteration whose weights are
    known good: a checkpoint iter_N with N <= last_good holds a healthy policy."""

    diagnosis: str
    iteration: int
    metric: str
    last_good: int

    def to_dict(self) -> dict:
        return {
            "diagnosis": self.diagnosis,
            "iteration": self.iteration,
            "metric": self.metric,
            "last_good_iteration": self.last_good,
        }


def _lr_fix(cfg: Config, role: str = "actor") -> str:
    return f"lower {role}.optim.lr (now {getattr(cfg, role).optim.lr:g})"


def non_finite_divergence(err: Exception, cfg: Config, iteration: int) -> Divergence:
    """A Divergence for non-finite weights (the update of `iteration` made them so: the
    policy before it was good) or non-finite outputs (seen at `iteration`: the previous
    update made them so)."""
    role = getattr(err, "role", "actor")
    weights = isinstance(err, NonFiniteWeightsError)
    clip = getattr(cfg, role).optim.grad_clip
    what = "weights became" if weights else "outputs are"
    diagnosis = (
        f"diverged at iteration {iteration}: the {role}'s {what} not finite (inf/nan): {err}. "
        f"Likely fix: {_lr_fix(cfg, role)}"
        + ("" if clip else f", and clip gradients ({role}.optim.grad_clip=1.0)")
        + "."
    )
    metric = f"{role}/weights" if weights else f"{role}/outputs"
    return Divergence(diagnosis, iteration, metric, iteration - 1 if weights else iteration - 2)


@dataclass
class Finding:
    metric: str
    text: str  # what was seen, with the threshold's key
    fix: str


class HealthMonitor:
    """Per-iteration collapse checks with the thresholds of `guard.*`; `observe` returns a
    Divergence after `guard.patience` consecutive unhealthy iterations."""

    def __init__(self, cfg: Config) -> None:
        self.cfg, self.g = cfg, cfg.guard
        self.base_length: float | None = None  # the first iteration's mean response length
        self.streak: list[tuple[int, list[Finding]]] = []
        self.healthy_score: float | None = None  # score of the last healthy iteration

    @property
    def healthy(self) -> bool:
        """The last observed iteration was healthy."""
        return not self.streak

    def findings(self, m: dict[str, float]) -> list[Finding]:
        g, cfg, out = self.g, self.cfg, []
        entropy = m.get("actor/entropy")
        if entropy is not None and entropy < g.min_entropy:
            fix = f"{_lr_fix(cfg)}, or add an entropy bonus (actor.entropy_coef)"
            out.append(
                Finding(
                    "actor/entropy",
                    f"actor/entropy {entropy:.3g} < guard.min_entropy={g.min_entropy:g} "
                    "(the policy collapsed onto single tokens)",
                    fix,
                )
            )
        length = m.get("response_length", 0.0)
        per_token = m.get("kl", 0.0) / max(length, 1.0)
        if g.max_kl_per_token and per_token > g.max_kl_per_token:
            kl_coef = cfg.algorithm.kl_ctrl.kl_coef
            rose = self.healthy_score is not None and m.get("score", 0.0) > self.healthy_score
            hack = (
                f", while the score rose from {self.healthy_score:.4g} to {m['score']:.4g} "
                "(the policy games the reward)"
                if rose
                else ""
            )
            out.append(
                Finding(
                    "kl",
                    f"KL to the reference {per_token:.3g} per token > "
                    f"guard.max_kl_per_token={g.max_kl_per_token:g}{hack}",
                    f"{_lr_fix(cfg)}, or raise algorithm.kl_ctrl.kl_coef (now {kl_coef:g}; or "
                    "algorithm.kl_ctrl.type=adaptive, actor.target_kl)",
                )
            )
        if (
            self.base_length
            and g.min_length_ratio
            and length < g.min_length_ratio * self.base_length
        ):
            out.append(
                Finding(
                    "response_length",
                    f"response_length {length:.3g} < guard.min_length_ratio={g.min_length_ratio:g}"
                    f" x the first iteration's {self.base_length:.3g}",
                    f"{_lr_fix(cfg)}; check the reward for a bias toward short responses "
                    "(or rollout.no_stop_penalty)",
                )
            )
        out += _skipped_steps(cfg, m)
        out += _all_failed(m)
        return out

    def observe(self, iteration: int, metrics: dict[str, float]) -> Divergence | None:
        if self.base_length is None:
            self.base_length = metrics.get("response_length")
        found = self.findings(metrics)
        if not found:
            self.streak.clear()
            self.healthy_score = metrics.get("score", self.healthy_score)
            return None
        self.streak.append((iteration, found))
        if not self.g.patience or len(self.streak) < self.g.patience:
            return None
        first = self.streak[0][0]
        seen = "; ".join(f.text for f in found)
        diagnosis = (
            f"diverged at iteration {iteration}: {seen}, for {len(self.streak)} consecutive "
            f"iterations (since iteration {first}; guard.patience={self.g.patience}). "
            f"Likely fix: {found[0].fix}."
        )
        # iteration `first` measured the policy after iteration first - 1: that one was bad
        return Divergence(diagnosis, iteration, found[0].metric, first - 2)


def failed_shares(m: dict[str, float]) -> dict[str, float]:
    """What failed in the iteration, as shares of its work: episodes that ended on an
    environment error or timeout (`env`), samples a reward source scored its fallback
    (`reward/<name>`)."""
    out = {}
    if "env/errors" in m:
        out["env"] = m["env/errors"] + m.get("env/timeouts", 0.0)
    for k, v in m.items():
        if k.endswith("/fallback_share"):
            out[k.removesuffix("/fallback_share")] = v
    return out


def _all_failed(m: dict[str, float]) -> list[Finding]:
    """Every episode ended on an environment failure, or every sample got a reward source's
    fallback: the iteration learned from no real outcome."""
    out = []
    for what, share in failed_shares(m).items():
        if share >= 1.0:
            env = what == "env"
            out.append(
                Finding(
                    "env/errors" if env else f"{what}/fallback_share",
                    "every episode ended on an environment error or timeout"
                    if env
                    else f"every sample was scored {what}'s fallback (the source failed)",
                    "fix the environment (samples.jsonl holds each turn's error)"
                    if env
                    else "fix the reward source (its error is printed above)",
                )
            )
    return out


def _skipped_steps(cfg: Config, m: dict[str, float]) -> list[Finding]:
    """A role whose every optimizer step of the iteration was skipped (its gradient was not
    finite, e.g. an inf value loss from a huge unclipped score): it learns nothing."""
    out = []
    for role in ("actor", "critic"):
        steps, skipped = m.get(f"{role}/optimizer_steps"), m.get(f"{role}/skipped_steps")
        if steps and skipped == steps:
            out.append(
                Finding(
                    f"{role}/skipped_steps",
                    f"every optimizer step of the {role} was skipped ({int(steps)} of "
                    f"{int(steps)}: its gradient was not finite)",
                    "clip or normalise the scores (algorithm.clip_reward_value, "
                    f"algorithm.normalize_scores), or {_lr_fix(cfg, role)}",
                )
            )
    return out
