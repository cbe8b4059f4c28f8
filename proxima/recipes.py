"""Whole runs from a loaded config, above the trainer: what `proxima train` does.

A built-in task (task.name) is prepared here, before the trainer starts, into a new config
that names its model, data and reward; the trainer only ever sees a config that is
complete and frozen.
"""

from __future__ import annotations

from proxima.config import Config
from proxima.rollout.engines import check_engine
from proxima.tasks import check_task, prepare_task, resumed_task_config
from proxima.trainer.run import new_run_dir, start_dist, train_ppo


def train(cfg: Config) -> dict:
    """Run PPO as configured (preparing a built-in task first); returns the run's summary,
    also written to <run folder>/summary.json. Under torchrun every rank calls it: the main
    rank prepares the task (its SFT warm start included) and the others receive its config."""
    check_task(cfg)
    check_engine(cfg)  # before a task's warm start: the engine must be installed
    dist, _ = start_dist(cfg)
    if not cfg.task.name:
        return train_ppo(cfg, dist=dist)
    if cfg.trainer.resume_from:  # the task is not prepared again: its checkpoint names it
        return train_ppo(resumed_task_config(cfg), dist=dist)
    prepared = None
    if dist.is_main:
        run_dir = new_run_dir(cfg.trainer.output_dir)
        print(f"run folder: {run_dir}")
        prepared = (run_dir, *prepare_task(cfg, run_dir))
    run_dir, cfg, info = dist.broadcast_object(prepared)
    return train_ppo(cfg, run_dir, summary={"task": info}, dist=dist)
