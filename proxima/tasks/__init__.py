"""Built-in tasks: each writes its prompt files, builds and warm-starts its tiny model, and
returns a config that names them, so `proxima train` runs end to end with nothing
downloaded. Tasks sit above the trainer: they use it, it never imports them."""

from __future__ import annotations

from pathlib import Path

from proxima.checkpoint import saved_config
from proxima.config import Config, ConfigError

# A task fills these itself; a resumed task run takes them from its checkpoint instead of
# preparing the task (and its SFT) again, so the reference stays the original initial actor.
TASK_PATHS = ("model.actor_path", "data.train_path", "data.eval_path")


def _tasks() -> dict:
    from proxima.tasks import arithmetic, instructions, tools

    return {
        "arithmetic": arithmetic.prepare,
        "tools": tools.prepare,
        "instructions": instructions.prepare,
    }


# the tasks whose preparation warm-starts their model by SFT on task.n_sft demonstrations
SFT_TASKS = ("arithmetic", "tools")


def check_task(cfg: Config) -> None:
    t = cfg.task
    if t.name and t.name not in _tasks():
        raise ConfigError(f"Unknown `task.name` {t.name!r}. Built-in tasks: {', '.join(_tasks())}.")
    if t.name in SFT_TASKS and t.sft_steps and t.n_sft < t.sft_batch_size:
        raise ConfigError(
            f"`task.n_sft`={t.n_sft} demonstrations are fewer than one batch of the task's "
            f"SFT warm start (`task.sft_batch_size`={t.sft_batch_size}); raise task.n_sft, "
            "lower task.sft_batch_size, or set task.sft_steps=0 to skip the warm start."
        )


def prepare_task(cfg: Config, run_dir: Path) -> tuple[Config, dict]:
    """Prepare cfg.task.name in run_dir/task; returns the config that names its model, data
    and reward, and what the preparation did (for summary.json)."""
    check_task(cfg)
    return _tasks()[cfg.task.name](cfg, Path(run_dir) / "task")


def resumed_task_config(cfg: Config) -> Config:
    """A task run resumed from a checkpoint: the task's paths (and its reward, unless this
    config names one) as the checkpoint's config resolved them."""
    saved = saved_config(cfg.trainer.resume_from)
    changes = {key: saved.get(key, "") for key in TASK_PATHS}
    if not (cfg.reward.function or cfg.reward.model_path or cfg.reward.sources):
        changes["reward.function"] = saved.get("reward.function", "")
        changes["reward.model_path"] = saved.get("reward.model_path", "")
        changes["reward.sources"] = saved.get("reward.sources", [])
    return cfg.replace(changes)
