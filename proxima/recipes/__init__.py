"""Whole runs from a loaded config, above the trainer: what the commands do. `cli` parses and
dispatches to these; a library user calls them the same way.

- `train(cfg)`: `proxima train`, a built-in task prepared first when `task.name` says so
  (unless the config names its own `data.train_path`: then the task prepares nothing,
  `proxima.tasks`), then the PPO recipe (`recipes.ppo.PPORecipe`);
- `recipes.sft.sft`, `recipes.rm.reward_model`, `recipes.evaluation.evaluate_policy`: the
  `sft`, `rm` and `eval` commands.
"""

from __future__ import annotations

import shutil
import sys

from proxima.config import Config
from proxima.files import describe_write_error, write_error
from proxima.recipes.common import new_run_dir, start_dist
from proxima.recipes.ppo import PPORecipe
from proxima.tasks import (
    check_task,
    own_data_config,
    prepare_task,
    resumed_task_config,
    uses_own_data,
)
from proxima.trackers import check_trackers


def train(cfg: Config) -> dict:
    """Run PPO as configured (preparing a built-in task first); returns the run's summary,
    also written to <run folder>/summary.json. Under torchrun every rank calls it: the main
    rank prepares the task (its SFT warm start included) and the others receive its config."""
    check_task(cfg)
    check_trackers(cfg)  # before a task's warm start too
    dist, _ = start_dist(cfg)
    if not cfg.task.name:
        return PPORecipe(cfg, dist).run()
    if cfg.trainer.resume_from:  # the task is not prepared again: its checkpoint names it
        return PPORecipe(resumed_task_config(cfg), dist).run()
    if uses_own_data(cfg):  # the recipe's settings on the user's data: nothing prepared
        own = own_data_config(cfg) if dist.is_main else None  # a model import writes a cache
        cfg, info = dist.broadcast_object(own)
        if dist.is_main:
            print(f"task {cfg.task.name}: not prepared (data.train_path is the run's own)")
        return PPORecipe(cfg, dist, summary={"task": info}).run()
    prepared = None
    if dist.is_main:
        run_dir = new_run_dir(cfg.trainer.output_dir)
        print(f"run folder: {run_dir}")
        try:
            prepared = (run_dir, *prepare_task(cfg, run_dir))
        except (
            BaseException
        ) as err:  # an error or Ctrl-C in the warm start: no half-prepared folder
            shutil.rmtree(run_dir, ignore_errors=True)
            print(f"removed {run_dir}: the task's preparation did not finish", file=sys.stderr)
            cause = write_error(err)
            if cause is None:
                raise
            raise OSError(
                f"the task `{cfg.task.name}` could not write its data and model into "
                f"{run_dir / 'task'} ({describe_write_error(cause)}). Free space under "
                "`trainer.output_dir` or point it at another disk."
            ) from err
    run_dir, cfg, info = dist.broadcast_object(prepared)
    return PPORecipe(cfg, dist, run_dir, summary={"task": info}, made_run_dir=True).run()


__all__ = ["PPORecipe", "train"]
