"""A whole PPO run from a complete config: set-up, evaluation before, the iterations,
evaluation after, outputs. (A built-in task is prepared above this, in proxima.recipes.)"""

from __future__ import annotations

import json
import re
import sys
import time
from pathlib import Path

import torch

from proxima import env
from proxima.checkpoint import (
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
from proxima.logging import RunLogger, format_line, plot_metrics, progress
from proxima.rng import preserve_rng, seed_everything
from proxima.rollout.engines import check_engine
from proxima.trainer.dist import Dist
from proxima.trainer.dist import init as init_dist
from proxima.trainer.evaluate import evaluate
from proxima.trainer.guard import (
    Divergence,
    HealthMonitor,
    NonFiniteOutputsError,
    PhaseWatch,
    SaveSchedule,
    StopSignals,
    non_finite_divergence,
    should_stop,
)
from proxima.trainer.optim import NonFiniteWeightsError
from proxima.trainer.ppo import PPOTrainer
from proxima.trainer.setup import load_roles, prepare_inputs, resolve_device

LINE_KEYS = {  # metric -> short label of the one-line summary per iteration
    "score": "score",
    "kl": "kl",
    "kl_coef": "beta",
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
    "eval/accuracy",
    "eval/mean_reward",
    "kl",
    "response_length",
    "actor/entropy",
    "actor/clipfrac",
    "actor/approx_kl",
    "critic/vf_loss",
    "critic/explained_variance",
    "kl_coef",
    "actor/grad_norm",
    "rollout/logprob_diff_mean",
    "rollout/logprob_diff_max",
]


def new_run_dir(path: str | Path) -> Path:
    """`path`, or `path-2`, `path-3`, ... if it already holds a run: nothing is overwritten.
    A folder that cannot be created is a ConfigError naming trainer.output_dir."""
    base = Path(path)
    candidate, k = base, 1
    try:
        while candidate.exists() and (not candidate.is_dir() or any(candidate.iterdir())):
            k += 1
            candidate = base.with_name(f"{base.name}-{k}")
        candidate.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(
            f"`trainer.output_dir`={path}: cannot create the run folder {candidate} "
            f"({err.strerror or err}). Point trainer.output_dir at a folder you can write to."
        ) from None
    return candidate


def remove_orphans_near(output_dir: str | Path) -> None:
    """Temporary checkpoint folders left by killed writes in the runs at `output_dir`
    (`output_dir`, `output_dir-2`, ...), removed when the next run starts."""
    base = Path(output_dir)
    if not base.parent.is_dir():
        return
    pattern = re.compile(re.escape(base.name) + r"(-\d+)?")
    for run in base.parent.iterdir():
        if pattern.fullmatch(run.name) and run.is_dir():
            for orphan in remove_orphans(run / "checkpoints"):
                print(f"removed {orphan}: an unfinished checkpoint of a killed run")


def _eval(trainer: PPOTrainer, items, cfg: Config, tag: str) -> dict:
    """Greedy evaluation (and sampled, when configured) on the held-out prompts."""
    roles = trainer.roles
    with trainer.precision(generation=True):
        runs = {
            greedy: evaluate(
                trainer.synced_engine(),
                roles.tokenizer,
                items,
                roles.reward,
                cfg.rollout,
                trainer.device,
                greedy=greedy,
                batch_size=cfg.eval.batch_size,
                dist=trainer.dist,
            )
            for greedy in ((True, False) if cfg.eval.sampled else (True,))
        }
    res = runs[True]
    if False in runs:
        res["sampled"] = {k: v for k, v in runs[False].items() if k != "samples"}
    acc = f", accuracy {res['accuracy']:.1%}" if "accuracy" in res else ""
    _say(
        trainer,
        f"[eval {tag}] greedy mean reward {res['mean_reward']:.4f}{acc} on {res['n']} prompts",
    )
    return res


def _say(trainer: PPOTrainer, text: str) -> None:
    """Print on the main process only (one console for the whole job)."""
    if trainer.dist.is_main:
        print(text)


def start_dist(cfg: Config) -> tuple[Dist, torch.device]:
    """The process group (under torchrun) and this process's device; threads."""
    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)
    _, _, local = env.world()
    device = resolve_device(cfg.model.device, local)
    t = cfg.trainer
    return init_dist(t.strategy, t.dist_backend, t.dist_timeout_s, device), device


def train_ppo(
    cfg: Config, run_dir: Path | None = None, summary: dict | None = None, dist: Dist | None = None
) -> dict:
    """Run PPO as configured into `run_dir` (default: a new folder at trainer.output_dir);
    returns (and writes) the run's summary, which starts from `summary`. Under torchrun every
    rank calls it; rank 0 alone writes files and prints (the seed is offset by rank: each
    rank samples its own responses).

    Everything a user can get wrong (config, model folders, data, reward source, the
    checkpoint to resume) is checked before the run folder is created or a model is loaded.
    A run stopped by SIGINT / SIGTERM ends with a checkpoint and `summary["stopped"]`; a
    diverged one with `summary["diverged"]` and the last good checkpoint as its result."""
    start = time.perf_counter()
    check_sources(cfg)
    check_engine(cfg)  # rollout.name=vllm: installed, and able to run this model
    resume = check_resume(cfg)  # checked before anything is written
    if dist is None:
        dist, device = start_dist(cfg)
    else:
        device = resolve_device(cfg.model.device, dist.local_rank)
    seed_everything(cfg.trainer.seed + dist.rank)
    inputs = prepare_inputs(cfg)  # folders, tokenizer, data, reward: before any model loads
    main = dist.is_main
    if main:
        remove_orphans_near(cfg.trainer.output_dir)
        if resume is not None:
            remove_orphans(resume.parent)
    if run_dir is None:
        run_dir = new_run_dir(cfg.trainer.output_dir) if main else None
        run_dir = dist.broadcast_object(run_dir)
        if main:
            print(f"run folder: {run_dir}")
    summary = {"run_dir": str(run_dir), "world_size": dist.world_size, **(summary or {})}
    if main:
        (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
        print(batch_plan(cfg, dist.world_size))
    roles = load_roles(cfg, device, inputs.tokenizer, inputs.reward_fn)
    if main:
        print("roles:\n" + roles.report())
    trainer = PPOTrainer(cfg, roles, inputs.prompts, device, sft_data=inputs.sft, dist=dist)
    if main:
        print(trainer.plan.describe())
    if resume is not None:
        load_checkpoint(resume, trainer)
        summary["resumed_from"] = str(resume)
        _say(trainer, f"resumed from {resume} at iteration {trainer.iteration}")
    logger = RunLogger(run_dir, tensorboard=cfg.trainer.tensorboard, enabled=main)
    try:
        summary.update(_loop(trainer, cfg, logger, inputs.eval_items, run_dir))
    finally:
        logger.close()
    _keep_result(trainer, run_dir, summary, resume)
    summary.update(
        config=cfg.to_dict(),
        iterations=trainer.iteration,
        wall_seconds=time.perf_counter() - start,
        phase_seconds=dict(trainer.timer.total),
    )
    if main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        _plot(run_dir)
        _report(summary, run_dir)
    dist.barrier()  # no rank leaves before the files are written
    return summary


def _keep_result(trainer: PPOTrainer, run_dir: Path, summary: dict, resume: Path | None) -> None:
    """The run's result in run_dir/actor/ (and critic/ or value_head/): the trained models,
    or after a divergence the last good checkpoint's (the diverged weights are not kept)."""
    diverged = summary.get("diverged")
    if diverged is None:
        trainer.save_models(run_dir)  # the value model too: kept, not thrown away
        return
    if not trainer.dist.is_main:
        return
    good = [
        c
        for c in [resume, *list_checkpoints(run_dir / "checkpoints")]
        if c is not None and checkpoint_iteration(c) <= diverged["last_good_iteration"]
    ]
    if good:
        copy_models(good[-1], run_dir)
        diverged["result"] = str(good[-1])
    else:
        diverged["result"] = None


def _plot(run_dir: Path) -> None:
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        plot_metrics(metrics, run_dir / "curves.png", PLOT_KEYS)


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


def _eval_metrics(res: dict) -> dict[str, float]:
    return {f"eval/{k}": v for k, v in res.items() if isinstance(v, float)}


def _iterate(
    trainer: PPOTrainer,
    cfg: Config,
    logger: RunLogger,
    eval_items,
    run_dir: Path,
    bar,
    signals: StopSignals,
) -> Divergence | None:
    """The iterations, until trainer.iterations or `should_stop` (a signal, a divergence).
    Periodic checkpoints are written only after healthy iterations."""
    total = cfg.trainer.iterations
    monitor, schedule = HealthMonitor(cfg), SaveSchedule(cfg.trainer)
    divergence = None
    while trainer.iteration < total and not should_stop(signals.agreed(trainer.dist), divergence):
        try:
            metrics, ro = trainer.step()
        except (NonFiniteWeightsError, NonFiniteOutputsError) as err:
            return non_finite_divergence(err, cfg, trainer.iteration + 1)
        it = trainer.iteration
        if eval_items and cfg.eval.every and it % cfg.eval.every == 0 and it < total:
            metrics.update(_eval_metrics(_eval(trainer, eval_items, cfg, f"it {it}")))
        logger.log(it, metrics)
        k = cfg.trainer.log_samples
        logger.log_samples(it, ro.prompts[:k], ro.responses[:k], ro.scores[:k].tolist())
        bar.update(1)
        if trainer.dist.is_main:
            bar.write(format_line(it, total, metrics, LINE_KEYS))
        divergence = monitor.observe(it, metrics)  # metrics are the same on every rank
        due = trainer.dist.any(it == total or (monitor.healthy and schedule.due(it)))
        if divergence is None and due:
            save_periodic(trainer, run_dir, cfg.trainer.keep_checkpoints, {"run_dir": str(run_dir)})
            schedule.saved()
    return divergence


def _train(trainer: PPOTrainer, cfg: Config, logger: RunLogger, eval_items, run_dir: Path):
    """Evaluation before, then the iterations, with SIGINT / SIGTERM turned into a stop
    request; returns (why it stopped early or None, the divergence, the signal's number)."""
    out: dict = {}
    with StopSignals() as signals:
        if eval_items:
            with preserve_rng():  # so a resumed run, which evaluates first too, replays exactly
                out["eval_before"] = _eval(trainer, eval_items, cfg, "before")
            logger.log(trainer.iteration, _eval_metrics(out["eval_before"]))
        bar = progress(
            total=cfg.trainer.iterations, desc="ppo", disable=not trainer.dist.is_main or None
        )
        bar.update(trainer.iteration)
        trainer.timer.listener = watch = PhaseWatch(bar, lambda: trainer.iteration + 1)
        try:
            divergence = _iterate(trainer, cfg, logger, eval_items, run_dir, bar, signals)
        finally:
            watch.close()
            trainer.timer.listener = None
            bar.close()
    finished = trainer.iteration >= cfg.trainer.iterations and divergence is None
    reason = None if finished else should_stop(signals.agreed(trainer.dist), divergence)
    return out, reason, divergence, signals


def _loop(trainer: PPOTrainer, cfg: Config, logger: RunLogger, eval_items, run_dir: Path) -> dict:
    out, reason, divergence, signals = _train(trainer, cfg, logger, eval_items, run_dir)
    if reason == "diverged":
        out["diverged"] = divergence.to_dict()
    elif reason == "signal":
        if not (run_dir / "checkpoints" / f"iter_{trainer.iteration}").is_dir():
            save_periodic(trainer, run_dir, cfg.trainer.keep_checkpoints, {"run_dir": str(run_dir)})
        out["stopped"] = {"signal": signals.name, "iteration": trainer.iteration}
        out["stopped"]["exit_status"] = 128 + int(signals.received)
    elif eval_items and signals.agreed(trainer.dist).received:  # during the last iteration
        _say(trainer, f"evaluation after training skipped ({signals.name}); the run is complete")
    elif eval_items:
        try:
            out["eval_after"] = _eval(trainer, eval_items, cfg, "after")
            logger.log(trainer.iteration, _eval_metrics(out["eval_after"]))
        except KeyboardInterrupt:  # the run is complete: keep it, skip the evaluation
            _say(trainer, "evaluation after training interrupted and skipped; the run is kept")
    return out
