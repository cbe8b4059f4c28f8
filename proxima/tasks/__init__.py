"""Built-in tasks: each writes its prompt files, builds and warm-starts its tiny model, and
points the config at them, so `proxima train` runs end to end with nothing downloaded."""

from __future__ import annotations

from pathlib import Path

from proxima.config import Config, ConfigError


def prepare_task(cfg: Config, run_dir: Path) -> dict:
    """Prepare cfg.task.name in run_dir/task; fills the model/data/reward paths of cfg."""
    from proxima.tasks import arithmetic

    tasks = {"arithmetic": arithmetic.prepare}
    if cfg.task.name not in tasks:
        raise ConfigError(
            f"Unknown `task.name` {cfg.task.name!r}. Built-in tasks: {', '.join(tasks)}."
        )
    return tasks[cfg.task.name](cfg, run_dir / "task")
