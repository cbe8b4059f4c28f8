"""A whole PPO run from a complete config, as one recipe (torchtune's recipe shape):
`setup()` checks every input and builds the trainer, `train()` runs the iterations between
the evaluations, `finish()` keeps the result and writes the summary. (A built-in task is
prepared before this, by `proxima.recipes.train`.)

Everything a user can get wrong (config, model folders, vocabularies, the critic's options,
the scoring plan, data, reward source, the checkpoint to resume) is checked before a model
loads, and the models are loaded before the run folder is created: a failed start leaves
nothing behind. A run stopped by SIGINT / SIGTERM ends with a checkpoint and
`summary["stopped"]`; a diverged one with `summary["diverged"]` and its last good
checkpoint as the result; one whose iteration raised (a reward function, a full disk) with
a checkpoint of its last completed iteration, `summary["failed"]`, and `RunFailed` naming
the error and the resume command.
"""

from __future__ import annotations

import json
import shutil
import signal
import sys
import time
from pathlib import Path

from proxima.checkpoint import (
    CheckpointWriteError,
    check_resume,
    checkpoint_iteration,
    copy_models,
    list_checkpoints,
    load_checkpoint,
    model_folders,
    remove_orphans,
    save_periodic,
)
from proxima.config import Config, ConfigError, batch_plan, check_sources
from proxima.config.roles import role_plan
from proxima.config.run import run_plan
from proxima.data.mixing import MixedPromptLoader, all_items
from proxima.files import FULL_DISK_HINT, describe_write_error, write_error, write_whole
from proxima.launch import signum_of
from proxima.logging import (
    RunLogger,
    format_line,
    plot_metrics,
    plot_pass_at_k,
    progress,
    write_atomic,
)
from proxima.recipes.common import (
    check_shared_run_dir,
    new_run_dir,
    remove_orphans_near,
    start_dist,
)
from proxima.recipes.failure import SAVING, Failure, failure_message
from proxima.rng import preserve_rng, seed_everything
from proxima.rollout.engines import check_engine
from proxima.trackers import check_trackers, open_trackers, selected
from proxima.trainer.checks import check_checkpoint
from proxima.trainer.device import resolve_device
from proxima.trainer.dist import Dist
from proxima.trainer.drift import DriftMonitor
from proxima.trainer.evaluate import describe, evaluate_modes
from proxima.trainer.health import (
    HealthMonitor,
    NonFiniteOutputsError,
    RunFailed,
    failed_shares,
    non_finite_divergence,
)
from proxima.trainer.host_memory import peak_bytes
from proxima.trainer.memory import check_memory, disk_problem, plan_memory
from proxima.trainer.optim import NonFiniteWeightsError
from proxima.trainer.ppo import PPOTrainer
from proxima.trainer.progress import PhaseWatch, SaveSchedule
from proxima.trainer.roles import load_roles
from proxima.trainer.setup import prepare_inputs
from proxima.trainer.signals import StopSignals, should_stop

# phases of a failure that leave the iteration complete (nothing to undo)
LINE_KEYS = {  # metric -> short label of the one-line summary per iteration
    "score": "score",
    "env/return": "return",
    "env/turns": "turns",
    "kl": "kl",
    "kl_coef": "beta",
    "teacher/reverse_kl": "t_kl",
    "response_length": "len",
    "actor/clipfrac": "clipfrac",
    "actor/entropy": "entropy",
    "critic/vf_loss": "vf_loss",
    "critic/explained_variance": "ev",
    "eval/accuracy": "eval_acc",
    "tokens_per_s": "tok/s",
    "rollout/logprob_diff_mean": "lp_diff",
}
PLOT_KEYS = [
    "score",
    "env/return",
    "env/turns",
    "eval/accuracy",
    "eval/mean_reward",
    "eval/pass@1",
    "kl",
    "teacher/reverse_kl",
    (
        "drift (0-1)",
        ["drift/repetition", "drift/dominated", "drift/empty", "drift/distinct_2"],
    ),
    "drift/ref_logprob",
    "response_length",
    "actor/entropy",
    "actor/clipfrac",
    "actor/approx_kl",
    "critic/vf_loss",
    (
        "explained variance",
        [
            "critic/explained_variance",
            "critic/explained_variance_first",
            "critic/explained_variance_group",
        ],
    ),
    "kl_coef",
    "actor/grad_norm",
    "rollout/logprob_diff_mean",
    "rollout/logprob_diff_max",
]


class PPORecipe:
    """One PPO run. Under torchrun every rank runs it; rank 0 alone writes files and prints
    (the seed is offset by rank: each rank samples its own responses).

    `run_dir`: the run folder when it exists already (a built-in task prepared in it);
    `summary`: what the summary starts from (the task's preparation)."""

    def __init__(
        self,
        cfg: Config,
        dist: Dist | None = None,
        run_dir: Path | None = None,
        summary: dict | None = None,
        made_run_dir: bool = False,
    ) -> None:
        self.cfg, self.dist, self.run_dir = cfg, dist, run_dir
        self.summary = dict(summary or {})
        self.start = time.perf_counter()
        # this command created the run folder (here, or `run_dir` for a built-in task's
        # preparation): a run that trained nothing removes it
        self.made_run_dir = made_run_dir
        self.failure: Failure | None = None  # the first error: what, at which iteration, where
        self.drift = DriftMonitor(cfg)  # warnings of degenerate answers, in the summary
        self.unwritten: list[str] = []  # what a failed run could not write, said at the end
        self.summary_written = False

    def run(self) -> dict:
        """setup, train, finish; returns the summary (also written to summary.json)."""
        try:
            self.setup()
        except BaseException:  # a signal or an error before the first iteration
            if self.made_run_dir and self.dist is not None and self.dist.is_main:
                shutil.rmtree(self.run_dir, ignore_errors=True)  # a failed start leaves nothing
            raise
        try:
            with StopSignals() as signals:
                reason = self.train(signals)
            return self.finish(reason, signals)
        except BaseException:
            self.logger.close("failed")  # the trackers' runs too (finish said how it ended)
            raise
        finally:
            self.logger.close()
            self.trainer.close()

    # ------------------------------------------------------------------ setup

    def setup(self) -> None:
        cfg = self.cfg
        check_sources(cfg)
        check_engine(cfg)  # rollout.name=vllm: installed, and able to run this model
        check_trackers(cfg)  # trainer.loggers: packages installed, an MLflow server answers
        self.resume = check_resume(cfg)  # checked before anything is written
        if self.resume is not None:
            check_checkpoint(self.resume)
        if self.dist is None:
            self.dist, device = start_dist(cfg)
        else:
            device = resolve_device(cfg.model.device, self.dist.local_rank)
        seed_everything(cfg.trainer.seed + self.dist.rank)
        inputs = prepare_inputs(cfg)  # folders, vocabularies, plan, data, reward
        self.eval_items = inputs.eval_items
        self.memory = self._plan_memory(inputs, device)  # a run that cannot fit stops here
        where = self.run_dir or cfg.trainer.output_dir
        full = disk_problem(cfg, where) if self.dist.is_main else None
        if full:  # a warning: what is free may change before the end
            self._say(f"warning: {full}")
        roles = load_roles(cfg, device, inputs.tokenizer, inputs.reward_fn)
        if cfg.model.packing is None:  # unset: what the models take (`check_packing`)
            cfg = self.cfg = cfg.replace({"model.packing": roles.packed})
        offload = self.memory.offload if self.memory is not None else None  # auto resolved
        self.trainer = PPOTrainer(
            cfg,
            roles,
            inputs.prompts,
            device,
            inputs.sft,
            self.dist,
            plan=inputs.plan,
            offload=offload,
        )
        if self.resume is not None:
            load_checkpoint(self.resume, self.trainer)
            self.summary["resumed_from"] = str(self.resume)
        self._open_run_dir()
        self._start_logging(roles)

    def _start_logging(self, roles) -> None:
        """The plans on the console, the trackers and the run's logger."""
        cfg = self.cfg
        memory = f"\n{self.memory.describe()}" if self.memory is not None else ""
        loader = self.trainer.loader
        mix = loader.expected_counts() if isinstance(loader, MixedPromptLoader) else None
        self._say(
            f"{batch_plan(cfg, self.dist.world_size, mix)}\n{role_plan(cfg).describe()}\n"
            f"{run_plan(cfg).describe()}"
            f"{memory}\nroles:\n{roles.report()}\n"
            f"{self.trainer.plan.describe()}"
        )
        if self.resume is not None:
            self._say(f"resumed from {self.resume} at iteration {self.trainer.iteration}")
        self.first_iteration = self.trainer.iteration
        main, names = self.dist.is_main, selected(cfg)
        resumed_run = None
        if self.resume is not None and self.resume.parent.name == "checkpoints":
            resumed_run = self.resume.parent.parent
        trackers = open_trackers(cfg, self.run_dir, resumed_run) if main else []
        self.logger = RunLogger(
            self.run_dir, tensorboard="tensorboard" in names, enabled=main, trackers=trackers
        )
        self.logger.log_config(cfg.to_dict())

    def _plan_memory(self, inputs, device):
        """The memory plan (`trainer.memory.plan_memory`) from the config, the models'
        config.json and the longest prompt; a run it says cannot fit stops before any
        model loads (trainer.memory_check)."""
        mode = self.cfg.trainer.memory_check
        if mode == "off":
            return None
        items = [*all_items(inputs.prompts), *inputs.eval_items]
        longest = max((len(item.ids) for item in items), default=None)
        world = self.dist.world_size
        plan = plan_memory(self.cfg, device, world, prompt_length=longest, scoring=inputs.plan)
        warning = check_memory(plan, mode)
        if warning:
            self._say(f"warning: {warning}")
        return plan

    def _open_run_dir(self) -> None:
        """The run folder (a new one unless given), its config.json; leftovers of killed
        checkpoint writes next to it removed."""
        cfg, main = self.cfg, self.dist.is_main
        if main:
            remove_orphans_near(cfg.trainer.output_dir)
            if self.resume is not None:
                remove_orphans(self.resume.parent)
        if self.run_dir is None:
            run_dir = new_run_dir(cfg.trainer.output_dir) if main else None
            self.run_dir = self.dist.broadcast_object(run_dir)
            self.made_run_dir = True
            try:
                check_shared_run_dir(self.run_dir, self.dist)  # several nodes share it
            except ConfigError:
                if main:  # a failed start leaves nothing behind
                    shutil.rmtree(self.run_dir, ignore_errors=True)
                raise
            self._say(f"run folder: {self.run_dir}")
        self.summary = {
            "run_dir": str(self.run_dir),
            "world_size": self.dist.world_size,
            **self.summary,
        }
        if main:
            self._write_start_files()

    def _write_start_files(self) -> None:
        """config.json and memory_plan.json, each whole (`write_atomic`); a run folder this
        recipe made that cannot hold them is removed: nothing was trained."""
        files = {"config.json": json.dumps(self.cfg.to_dict(), indent=2)}
        if self.memory is not None:
            files["memory_plan.json"] = json.dumps(self.memory.to_dict(), indent=2)
        try:
            for name, text in files.items():
                write_atomic(self.run_dir / name, text)
        except OSError as err:
            if self.made_run_dir:
                shutil.rmtree(self.run_dir, ignore_errors=True)
            what = "is removed" if self.made_run_dir else "keeps what it held"
            raise OSError(
                f"{err.strerror or err}; {FULL_DISK_HINT}. Nothing was trained: the run "
                f"folder {self.run_dir} {what}. Free space under `trainer.output_dir` or "
                "point it at another disk."
            ) from err

    # ------------------------------------------------------------------ train

    def train(self, signals: StopSignals) -> str | None:
        """Evaluation before, then the iterations until trainer.iterations, a stop signal, a
        divergence (`guard.should_stop`) or an error; returns why it stopped early, or None."""
        trainer, dist = self.trainer, self.dist
        total = self.cfg.trainer.iterations
        self.divergence = None
        if self.eval_items and not self._evaluate_first():
            return "failed"
        monitor, schedule = HealthMonitor(self.cfg), SaveSchedule(self.cfg.trainer)
        bar = progress(total=total, desc="ppo", disable=not dist.is_main or None)
        bar.update(trainer.iteration)
        trainer.timer.listener = watch = PhaseWatch(bar, lambda: trainer.iteration + 1)
        try:
            while trainer.iteration < total:
                reason = should_stop(signals.agreed(dist), self.divergence)
                reason = reason or self._iterate(monitor, schedule, bar)
                if reason is not None:
                    return reason
            return "diverged" if self.divergence is not None else None
        finally:
            watch.close()
            trainer.timer.listener = None
            bar.close()

    def _evaluate_first(self) -> bool:
        """The evaluation before the iterations (where a resumed run resumes: not "before"
        training); False when it failed."""
        trainer = self.trainer
        key, tag = ("eval_before", "before")
        if self.resume is not None:
            key, tag = ("eval_at_resume", f"at resume, iteration {trainer.iteration}")
        try:
            with preserve_rng():  # so a resumed run, which evaluates first too, replays exactly
                self.summary[key] = self.evaluate(tag)
        except Exception as err:  # noqa: BLE001 - kept, reported, raised as RunFailed
            self.failure = Failure(err, trainer.iteration, "evaluation before training")
            return False
        self.logger.log(trainer.iteration, _eval_metrics(self.summary[key]))
        return True

    def _iterate(self, monitor: HealthMonitor, schedule: SaveSchedule, bar) -> str | None:
        """One iteration and what follows it (a periodic evaluation, the logs, the health
        check, a checkpoint when due; periodic checkpoints only after healthy iterations);
        returns why the run must stop now, or None."""
        cfg, trainer = self.cfg, self.trainer
        try:
            metrics, ro = trainer.step()
        except (NonFiniteWeightsError, NonFiniteOutputsError) as err:
            self.divergence = non_finite_divergence(err, cfg, trainer.iteration + 1)
            return "diverged"
        except Exception as err:  # noqa: BLE001 - kept, reported, raised as RunFailed
            self.failure = Failure(err, trainer.iteration + 1, trainer.timer.current)
            return "failed"
        it, phase = trainer.iteration, "evaluation"
        try:
            if self.eval_items and cfg.eval.every and it % cfg.eval.every == 0:
                if it < cfg.trainer.iterations:
                    metrics.update(_eval_metrics(self.evaluate(f"it {it}")))
            phase = "logging"
            self._log(it, metrics, ro, bar)
            self.divergence = monitor.observe(it, metrics)  # the same on every rank
            for warning in self.drift.observe(it, metrics):  # once per kind
                if self.dist.is_main:
                    bar.write(f"warning: {warning.message}", file=sys.stderr)
            due = self.dist.any(
                it == cfg.trainer.iterations or (monitor.healthy and schedule.due(it))
            )
            if self.divergence is None and due:
                phase = "checkpoint"
                self._checkpoint()
                schedule.saved()
        except Exception as err:  # noqa: BLE001 - iteration `it` is complete: kept
            self.failure = Failure(err, it, phase)
            return "failed"
        return None

    def _log(self, it: int, metrics: dict, ro, bar) -> None:
        self.logger.log(it, metrics)
        k = self.cfg.trainer.log_samples
        extra = {}
        if ro.score_components is not None:  # each of reward.sources' raw score
            names = self.trainer.roles.reward.names
            parts = ro.score_components[:k]
            extra = {f"reward/{n}": parts[:, i].tolist() for i, n in enumerate(names)}
        if ro.episodes is not None:  # multi-turn: each turn's action, observation, reward
            extra["episode"] = ro.episodes[:k]
        self.logger.log_samples(
            it, ro.prompts[:k], ro.responses[:k], ro.scores[:k].tolist(), extra=extra
        )
        bar.update(1)
        if self.dist.is_main:
            bar.write(format_line(it, self.cfg.trainer.iterations, metrics, LINE_KEYS))
            for line in self._failure_lines(it, metrics, ro):
                bar.write(line, file=sys.stderr)

    def _failure_lines(self, it: int, metrics: dict, ro) -> list[str]:
        """A warning for each kind of work that mostly failed in iteration `it` (episodes
        ending on environment errors, samples scored a reward source's fallback), with the
        first error seen; the health check stops the run when all of it fails for
        guard.patience iterations in a row."""
        out = []
        for what, share in failed_shares(metrics).items():
            if share < 0.5:
                continue
            if what == "env":
                errors = [t["error"] for e in ro.episodes or [] for t in e["turns"] if "error" in t]
                first, work = (errors[:1] or ["?"])[0], "episodes ended on an environment failure"
            else:
                name = what.removeprefix("reward/")
                parts = self.trainer.roles.reward.parts
                source = next(p.source for p in parts if p.name == name)
                first = getattr(source, "last_error", None) or "?"
                work = f"samples were scored {what}'s fallback"
            out.append(f"warning: iteration {it}: {share:.0%} of the {work}; first: {first}")
        return out

    def evaluate(self, tag: str) -> dict:
        """Greedy evaluation (and sampled, when configured) on the held-out prompts."""
        trainer = self.trainer
        roles = trainer.roles
        trainer.prepare("evaluate")  # model.offload: the reward models on the device
        with trainer.precision(generation=True):
            runs = evaluate_modes(
                trainer.synced_engine(),
                roles.tokenizer,
                self.eval_items,
                roles.reward,
                self.cfg,
                trainer.device,
                dist=self.dist,
            )
        self._say("\n".join(f"[eval {tag}] {line}" for line in describe(runs)))
        res = runs["greedy"]
        if "sampled" in runs:
            res["sampled"] = {k: v for k, v in runs["sampled"].items() if k != "samples"}
        if "pass@k" in runs:
            res["pass@k"] = runs["pass@k"]
        return res

    def _checkpoint(self) -> None:
        extra = {"run_dir": str(self.run_dir)}
        save_periodic(self.trainer, self.run_dir, self.cfg.trainer.keep_checkpoints, extra)

    # ------------------------------------------------------------------ finish

    def finish(self, reason: str | None, signals: StopSignals) -> dict:
        """What the end of the run leaves: a checkpoint when stopped or failed, the
        evaluation after, the result models, summary.json, curves.png and the last lines on
        the console. A failed run (also one whose result could not be written) then raises
        `RunFailed`."""
        trainer, summary = self.trainer, self.summary
        if reason == "signal":
            reason = self._checkpoint_on_signal(signals)
        if reason == "diverged":
            summary["diverged"] = self.divergence.to_dict()
        elif reason == "failed":
            summary["failed"] = self._keep_after_failure()
        elif reason is None and self.eval_items:
            self._evaluate_after(signals)
        if not self._keep_result() and "failed" not in summary:
            summary["failed"] = self._keep_after_failure()
        summary["drift_warnings"] = [w.to_dict() for w in self.drift.warnings]
        summary.update(
            config=self.cfg.to_dict(),
            iterations=trainer.iteration,
            wall_seconds=time.perf_counter() - self.start,
            phase_seconds=dict(trainer.timer.total),
            memory=self._memory_measured(),
        )
        if self.dist.is_main:
            self._write_outputs()
        self.dist.barrier()  # no rank leaves before the files are written
        if "failed" in summary:
            trained = trainer.iteration > self.first_iteration
            litter = self.made_run_dir and not trained and summary["failed"]["checkpoint"] is None
            if litter and self.dist.is_main:  # a run that trained nothing leaves no folder
                self.logger.close()
                shutil.rmtree(self.run_dir, ignore_errors=True)
            raise RunFailed(self._failure_message(removed=litter), summary) from self.failure.error
        return summary

    def _memory_measured(self) -> dict:
        """The measured peak beside the memory plan's (GiB, this process): the peak resident
        set on a CPU, the memory torch allocated on a GPU."""
        device = self.trainer.device
        out = {
            "device": device.type,
            "peak_gib": round(peak_bytes(device) / 2**30, 3),
            "measured": "allocated by torch" if device.type == "cuda" else "resident (VmHWM)",
        }
        if self.memory is not None:
            out["planned_peak_gib"] = round(self.memory.peak / 2**30, 3)
        return out

    def _checkpoint_on_signal(self, signals: StopSignals) -> str:
        """A checkpoint of the iteration a stop signal ended (unless one exists) and
        summary["stopped"]; "failed" when the checkpoint cannot be written."""
        trainer = self.trainer
        if not (self.run_dir / "checkpoints" / f"iter_{trainer.iteration}").is_dir():
            try:
                self._checkpoint()
            except CheckpointWriteError as err:
                self.failure = Failure(err, trainer.iteration, "checkpoint")
                return "failed"
        self._stopped(signals.name, int(signals.received))
        return "signal"

    def _stopped(self, name: str, signum: int) -> None:
        self.summary["stopped"] = {
            "signal": name,
            "iteration": self.trainer.iteration,
            "exit_status": 128 + signum,
        }

    def _write_outputs(self) -> None:
        """summary.json, curves.png and the last lines; a write that fails (a full disk) is
        said, not raised: the console still tells what happened."""
        try:
            write_atomic(self.run_dir / "summary.json", json.dumps(self.summary, indent=2))
            self.summary_written = True
            metrics = self.run_dir / "metrics.jsonl"
            if metrics.is_file() and metrics.stat().st_size:
                plot_metrics(metrics, self.run_dir / "curves.png", self._plot_keys())
            curves = {
                tag: self.summary[key]["pass@k"]
                for key, tag in (("eval_before", "before"), ("eval_after", "after"))
                if "pass@k" in self.summary.get(key, {})
            }
            if any(k.startswith("pass@") for run in curves.values() for k in run):
                plot_pass_at_k(curves, self.run_dir / "pass_at_k.png")
        except OSError as err:
            what = "curves.png" if self.summary_written else "summary.json"
            self.unwritten.append(f"{what} ({describe_write_error(err)})")
            if self.failure is None:
                self._say(f"warning: could not write {self.unwritten[-1]}")
        images = [self.run_dir / "curves.png", self.run_dir / "pass_at_k.png"]
        self.logger.finish(self.summary, images)  # to the trackers (trainer.loggers)
        if self.failure is None:
            _report(self.summary, self.run_dir)

    def _plot_keys(self) -> list:
        """PLOT_KEYS, with each of reward.sources' raw score in one panel beside the score
        (a weight-0 judge beside the reward it watches)."""
        names = getattr(self.trainer.roles.reward, "names", [])
        if len(names) < 2:
            return PLOT_KEYS
        return [PLOT_KEYS[0], ("reward sources", [f"reward/{n}" for n in names]), *PLOT_KEYS[1:]]

    def _keep_after_failure(self) -> dict:
        """After an iteration raised: the trainer back at its last completed iteration and
        a checkpoint of it (unless one exists, or the weights had already changed: then the
        newest checkpoint there is)."""
        err, iteration, phase = self.failure
        trainer = self.trainer
        undone = self.failure.complete or trainer.undo_iteration()
        progressed = trainer.iteration > self.first_iteration
        kept = self.resume
        if undone and progressed and phase not in ("checkpoint", SAVING):
            try:
                if not (self.run_dir / "checkpoints" / f"iter_{trainer.iteration}").is_dir():
                    self._checkpoint()
            except CheckpointWriteError as write_err:
                self.unwritten.append(f"a checkpoint: {write_err}")
        found = list_checkpoints(self.run_dir / "checkpoints")
        kept = found[-1] if found else kept
        self.kept_models = undone and progressed and phase != SAVING
        return {
            "iteration": iteration,
            "phase": phase,
            "error": f"{type(err).__name__}: {err}",
            "checkpoint": str(kept) if kept is not None else None,
        }

    def _failure_message(self, removed: bool) -> str:
        return failure_message(
            self.summary["failed"],
            self.run_dir,
            unwritten=self.unwritten,
            summary_written=self.summary_written,
            kept_models=self.kept_models,
            removed=removed,
            trained=self.trainer.iteration - self.first_iteration,
            iteration=self.trainer.iteration,
        )

    def _evaluate_after(self, signals: StopSignals) -> None:
        """The evaluation after the last iteration; a stop signal during the last iteration
        or during the evaluation skips it: the run is complete, and exits with the signal's
        status (128 + its number) as a stopped run does."""
        agreed = signals.agreed(self.dist)
        if agreed.received:  # a signal during the last iteration
            self._say(f"evaluation after training skipped ({signals.name}); the run is complete")
            self._stopped(signals.name, int(agreed.received))
            return
        try:
            self.summary["eval_after"] = self.evaluate("after")
            self.logger.log(self.trainer.iteration, _eval_metrics(self.summary["eval_after"]))
        except KeyboardInterrupt as err:  # the run is complete: keep it, skip the evaluation
            signum = signum_of(err)
            self._say("evaluation after training interrupted and skipped; the run is kept")
            self._stopped(signal.Signals(signum).name, int(signum))

    def _keep_result(self) -> bool:
        """The run's result in the run folder (actor/, the critic's), each folder whole or
        the one before it kept (`files.write_whole`): the trained models, or after a
        divergence the last good checkpoint's (the diverged weights are not kept), or after a
        failure the models of the last completed iteration (or none). False when they could
        not be written (a full disk): then the checkpoint is the result."""
        diverged, failed = self.summary.get("diverged"), self.summary.get("failed")
        try:
            if failed is None and diverged is None:
                self._save_models()  # the value model too: kept, not thrown away
            elif failed is not None and self.kept_models:
                self._save_models()
            elif diverged is not None and self.dist.is_main:
                good = [
                    c
                    for c in [self.resume, *list_checkpoints(self.run_dir / "checkpoints")]
                    if c is not None and checkpoint_iteration(c) <= diverged["last_good_iteration"]
                ]
                diverged["result"] = str(good[-1]) if good else None
                if good:
                    copy_models(good[-1], self.run_dir)
        except Exception as err:
            cause = write_error(err)
            if cause is None:
                raise
            self.kept_models = False
            what = f"the models in {self.run_dir} ({describe_write_error(cause)})"
            if self.failure is not None:
                self.unwritten.append(what)
                return True
            self.failure = Failure(OSError(f"cannot write {what}"), self.trainer.iteration, SAVING)
            return False
        return True

    def _save_models(self) -> None:
        """The trained models into the run folder; every rank takes part (FSDP2 gathers the
        shards), the main one writes."""
        if self.dist.is_main:
            write_whole(self.run_dir, self.trainer.save_models)
        else:
            self.trainer.save_models(self.run_dir)

    def _say(self, text: str) -> None:
        """Print on the main process only (one console for the whole job)."""
        if self.dist.is_main:
            print(text)


def _eval_metrics(res: dict) -> dict[str, float]:
    """eval/<key> of the greedy evaluation, and eval/pass@k, eval/mean@n (eval.n > 1), also
    per data source as eval/<source>/<key> and eval/<source>/pass@k."""
    out = {f"eval/{k}": v for k, v in res.items() if isinstance(v, float)}
    for src, part in res.get("by_source", {}).items():
        out.update({f"eval/{src}/{k}": v for k, v in part.items() if isinstance(v, float)})
    k_runs = res.get("pass@k", {})
    out.update({f"eval/{k}": v for k, v in k_runs.items() if isinstance(v, float)})
    for src, part in k_runs.get("by_source", {}).items():
        out.update({f"eval/{src}/{k}": v for k, v in part.items() if isinstance(v, float)})
    return out


def _report(summary: dict, run_dir: Path) -> None:
    """The last lines of a run: where everything is, or why it stopped and how to go on."""
    stopped, diverged = summary.get("stopped"), summary.get("diverged")
    models = ", ".join(f"{n}/" for n in model_folders(run_dir))
    if diverged is not None:
        result = diverged["result"]
        kept = (
            f"the result ({models}) is the last good checkpoint {result}"
            if result
            else "no checkpoint was written before it, so no result is kept: the initial "
            "model is model.actor_path, unchanged"
        )
        print(f"error: {diverged['diagnosis']}\n{kept}; run folder: {run_dir}", file=sys.stderr)
    elif stopped is not None and stopped["iteration"] == summary["config"]["trainer"]["iterations"]:
        print(
            f"run folder: {run_dir} ({models}); every iteration was trained, the evaluation "
            f"after training skipped ({stopped['signal']})"
        )
    elif stopped is not None:
        print(
            f"stopped at iteration {stopped['iteration']} ({stopped['signal']}); resume with "
            f"`proxima train trainer.resume_from={run_dir}`"
        )
    else:
        print(
            f"run folder: {run_dir} (summary.json, metrics.jsonl, samples.jsonl, curves.png, "
            f"{models})"
        )
    mem = summary.get("memory", {})
    if mem.get("peak_gib"):
        planned = (
            f"; the memory plan predicted {mem['planned_peak_gib']:.2f}"
            if "planned_peak_gib" in mem
            else ""
        )
        print(
            f"peak memory: {mem['peak_gib']:.2f} GiB ({mem['device']}, {mem['measured']}{planned})"
        )
