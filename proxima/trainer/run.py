"""A whole PPO run from a complete config: set-up, evaluation before, the iterations,
evaluation after, outputs. (A built-in task is prepared above this, in proxima.recipes.)"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch

from proxima.checkpoint import check_resume, load_checkpoint, save_periodic
from proxima.config import Config, batch_plan, check_sources
from proxima.logging import RunLogger, format_line, plot_metrics, progress
from proxima.rng import preserve_rng, seed_everything
from proxima.rollout.engine import check_engine
from proxima.trainer.evaluate import evaluate
from proxima.trainer.ppo import PPOTrainer
from proxima.trainer.setup import load_prompts, load_roles, load_sft, resolve_device

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
    """`path`, or `path-2`, `path-3`, ... if it already holds a run: nothing is overwritten."""
    base = Path(path)
    candidate, k = base, 1
    while candidate.exists() and any(candidate.iterdir()):
        k += 1
        candidate = base.with_name(f"{base.name}-{k}")
    candidate.mkdir(parents=True, exist_ok=True)
    return candidate


def _eval(trainer: PPOTrainer, items, cfg: Config, tag: str) -> dict:
    """Greedy evaluation (and sampled, when configured) on the held-out prompts."""
    roles = trainer.roles
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
        )
        for greedy in ((True, False) if cfg.eval.sampled else (True,))
    }
    res = runs[True]
    if False in runs:
        res["sampled"] = {k: v for k, v in runs[False].items() if k != "samples"}
    acc = f", accuracy {res['accuracy']:.1%}" if "accuracy" in res else ""
    print(f"[eval {tag}] greedy mean reward {res['mean_reward']:.4f}{acc} on {res['n']} prompts")
    return res


def _load_data(cfg: Config, tokenizer) -> tuple:
    """Training prompts, held-out evaluation prompts (maybe none), ptx records (maybe none)."""
    prompts = load_prompts(cfg, cfg.data.train_path, tokenizer)
    eval_items = (
        list(load_prompts(cfg, cfg.data.eval_path, tokenizer)) if cfg.data.eval_path else []
    )
    eval_items = eval_items[: cfg.eval.max_prompts or None]
    sft = None
    if cfg.actor.ptx_coef:
        max_len = cfg.data.max_prompt_length + cfg.rollout.max_response_length
        sft = load_sft(cfg, cfg.data.sft_path, tokenizer, max_len)
    return prompts, eval_items, sft


def train_ppo(cfg: Config, run_dir: Path | None = None, summary: dict | None = None) -> dict:
    """Run PPO as configured into `run_dir` (default: a new folder at trainer.output_dir);
    returns (and writes) the run's summary, which starts from `summary`."""
    start = time.perf_counter()
    check_sources(cfg)
    check_engine(cfg)  # rollout.name=vllm: installed, and able to run this model
    resume = check_resume(cfg)  # checked before anything is written
    run_dir = run_dir or new_run_dir(cfg.trainer.output_dir)
    seed_everything(cfg.trainer.seed)
    if cfg.trainer.threads:
        torch.set_num_threads(cfg.trainer.threads)
    device = resolve_device(cfg.model.device)
    summary = {"run_dir": str(run_dir), **(summary or {})}
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
    print(batch_plan(cfg))
    roles = load_roles(cfg, device)
    print("roles:\n" + roles.report())
    prompts, eval_items, sft = _load_data(cfg, roles.tokenizer)
    trainer = PPOTrainer(cfg, roles, prompts, device, sft_data=sft)
    if resume is not None:
        load_checkpoint(resume, trainer)
        summary["resumed_from"] = str(resume)
        print(f"resumed from {resume} at iteration {trainer.iteration}")
    logger = RunLogger(run_dir, tensorboard=cfg.trainer.tensorboard)
    try:
        summary.update(_loop(trainer, cfg, logger, eval_items, run_dir))
    finally:
        logger.close()
    trainer.save_models(run_dir)  # the value model too: kept, not thrown away
    summary.update(
        config=cfg.to_dict(),
        iterations=trainer.iteration,
        wall_seconds=time.perf_counter() - start,
        phase_seconds=dict(trainer.timer.total),
    )
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_metrics(run_dir / "metrics.jsonl", run_dir / "curves.png", PLOT_KEYS)
    print(
        f"run folder: {run_dir} (summary.json, metrics.jsonl, samples.jsonl, curves.png, "
        "actor/, critic/)"
    )
    return summary


def _eval_metrics(res: dict) -> dict[str, float]:
    return {f"eval/{k}": v for k, v in res.items() if isinstance(v, float)}


def _loop(trainer: PPOTrainer, cfg: Config, logger: RunLogger, eval_items, run_dir: Path) -> dict:
    out: dict = {}
    if eval_items:
        with preserve_rng():  # so a resumed run, which evaluates first too, replays exactly
            out["eval_before"] = _eval(trainer, eval_items, cfg, "before")
        logger.log(trainer.iteration, _eval_metrics(out["eval_before"]))
    total = cfg.trainer.iterations
    bar = progress(total=total, desc="ppo")
    bar.update(trainer.iteration)
    while trainer.iteration < total:
        metrics, ro = trainer.step()
        it = trainer.iteration
        if eval_items and cfg.eval.every and it % cfg.eval.every == 0 and it < total:
            metrics.update(_eval_metrics(_eval(trainer, eval_items, cfg, f"it {it}")))
        logger.log(it, metrics)
        k = cfg.trainer.log_samples
        logger.log_samples(it, ro.prompts[:k], ro.responses[:k], ro.scores[:k].tolist())
        bar.update(1)
        bar.write(format_line(it, total, metrics, LINE_KEYS))
        if (cfg.trainer.save_every and it % cfg.trainer.save_every == 0) or it == total:
            save_periodic(trainer, run_dir, cfg.trainer.keep_checkpoints, {"run_dir": str(run_dir)})
    bar.close()
    if eval_items:
        out["eval_after"] = _eval(trainer, eval_items, cfg, "after")
        logger.log(trainer.iteration, _eval_metrics(out["eval_after"]))
    return out
