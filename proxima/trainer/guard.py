"""Run guards: nothing lost on Ctrl-C, divergence caught, slow phases shown.

- `StopSignals`: the first SIGINT or SIGTERM (what a cluster scheduler sends before it kills
  a job) asks the loop to stop once the current iteration is done; the loop then writes a
  checkpoint and the summary. A second signal aborts at once (KeyboardInterrupt).
- `HealthMonitor`: each iteration's metrics are checked for a collapse (entropy near 0, a KL
  runaway, the response length collapsing); `guard.patience` consecutive unhealthy
  iterations stop the run with a `Divergence` naming the metric, the iteration and the
  likely fix. Weights or outputs that are not finite stop it at once.
- `SaveSchedule`: when a periodic checkpoint is due (every N iterations and/or minutes).
- `PhaseWatch`: the phase running now, in the progress bar, and a line when one is slow.

- `RunFailed`: an error that struck mid-run, raised once the run has kept what it could
  (a checkpoint of the last completed iteration, the summary, the resume command).

The loop (recipes/ppo.py) asks `should_stop`, which reads only the stop signal and the
metrics; the metrics are the same on every rank, so a multi-process run can agree on it.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass

from proxima.config import Config, TrainerConfig
from proxima.launch import Interrupted
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


# --------------------------------------------------------------------------- signals


class StopSignals:
    """Context manager: SIGINT / SIGTERM set `received` (the first one); a second raises
    KeyboardInterrupt. Handlers are installed only in the main thread and restored on exit."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received else ""

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def agreed(self, dist) -> StopSignals:
        """The signal as every rank of a torchrun job sees it: a signal on any rank stops
        them all, at the same iteration (a collective: every rank calls it at the same
        point of the loop)."""
        if dist.active:
            seen = [s for s in dist.all_gather_object(self.received) if s is not None]
            if self.received is None and seen:
                self.received = seen[0]
        return self

    def _handle(self, signum: int, frame: object) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            raise Interrupted(f"second {name}: aborted at once", signum)
        self.received = signum
        # os.write, not print: the signal may arrive while the main thread is printing
        os.write(
            2,
            f"\n{name} received: finishing this iteration, then writing a checkpoint and the "
            "summary (send it again to abort at once)\n".encode(),
        )


# --------------------------------------------------------------------------- divergence


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


def should_stop(signals: StopSignals, divergence: Divergence | None) -> str | None:
    """Why the loop stops before trainer.iterations: "signal", "diverged" or None. Decided
    only from the signal and from metrics, which are identical on every rank."""
    if divergence is not None:
        return "diverged"
    if signals.received:
        return "signal"
    return None


# --------------------------------------------------------------------------- checkpoints


class SaveSchedule:
    """A periodic checkpoint is due every `save_every` iterations, and once
    `save_every_minutes` have passed since the last one; always at the last iteration."""

    def __init__(self, t: TrainerConfig, clock=time.monotonic) -> None:
        self.t, self.clock = t, clock
        self.last = clock()

    def due(self, iteration: int) -> bool:
        t = self.t
        if iteration >= t.iterations or (t.save_every and iteration % t.save_every == 0):
            return True
        return bool(t.save_every_minutes) and self.clock() - self.last >= 60 * t.save_every_minutes

    def saved(self) -> None:
        self.last = self.clock()


# --------------------------------------------------------------------------- phases

SLOW_PHASE_S = 30.0


class PhaseWatch:
    """Listener of the trainer's PhaseTimer: the running phase in the progress bar's postfix,
    and a line when a phase runs longer than `slow_s` (from a timer thread, so a phase that
    hangs, e.g. a slow reward function, is named while it runs). `iteration()` is the
    iteration being run, for that line."""

    def __init__(self, bar, iteration=lambda: 1, slow_s: float = SLOW_PHASE_S) -> None:
        self.bar, self.iteration, self.slow_s = bar, iteration, slow_s
        self._timer: threading.Timer | None = None

    def start(self, name: str) -> None:
        self.bar.set_postfix_str(f"{name}...", refresh=True)
        self._timer = threading.Timer(self.slow_s, self._slow, args=(name, self.iteration()))
        self._timer.daemon = True
        self._timer.start()

    def _slow(self, name: str, iteration: int) -> None:
        self.bar.write(
            f"iteration {iteration}: phase `{name}` has been running for more than "
            f"{self.slow_s:g} s (its time is logged as time/{name})"
        )

    def end(self, name: str, seconds: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.bar.set_postfix_str(f"{name} {seconds:.1f}s", refresh=False)

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
