"""Built-in tasks: each writes its prompt files, builds and warm-starts its tiny model, and
returns a config that names them, so `proxima train` runs end to end with nothing
downloaded. Tasks sit above the trainer: they use it, it never imports them.

A shipped recipe (`proxima train chat`, `dapo`, ...) is a task and its settings. Given the
user's own prompts (`data.train_path`) the task steps aside: it writes nothing and
replaces nothing, and the recipe's settings train the user's model on the user's data
against the user's reward (`check_task` says what is missing, `own_data_config` fills in
what the task can lend, the chat task's model). Without them, a task makes its own inputs,
and refuses (`check_task`, before any work) a path of the user's it would otherwise
replace."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from proxima.checkpoint import saved_config
from proxima.config import Config, ConfigError

# A task fills these itself; a resumed task run takes them from its checkpoint instead of
# preparing the task (and its SFT) again, so the reference stays the original initial actor.
TASK_PATHS = ("model.actor_path", "data.train_path", "data.eval_path")


@dataclass(frozen=True)
class Task:
    prepare: Callable[[Config, Path], tuple[Config, dict]]
    # the model a run on the user's own data trains when it names none; None: the task's
    # model fits only its own data (a tiny model with the task's characters)
    default_model: Callable[[], str] | None = None
    # the keys it reads from the config beside its own data (it uses them as given)
    takes: tuple[str, ...] = ()
    # a recipe's setting that reads the task's own data: with the user's, it must be theirs
    own: dict[str, str] | None = None


def _tasks() -> dict[str, Task]:
    from proxima.tasks import arithmetic, instructions, tools

    return {
        "arithmetic": Task(arithmetic.prepare),
        "tools": Task(tools.prepare, own={"rollout.env.cls": tools.ENV}),
        "instructions": Task(
            instructions.prepare, instructions.default_model, takes=("model.actor_path",)
        ),
    }


@dataclass(frozen=True)
class PreferenceTask:
    """A built-in task of `proxima pipeline` (`pipeline.task`): `prepare` writes its prompts
    (held-out prompts, demonstrations) and returns the config that names them, its gold
    scorer and its model; `default_model`, the model it lends to the user's own prompts when
    model.actor_path is empty (None: the pipeline builds a tiny model for them)."""

    prepare: Callable[[Config, Path], tuple[Config, dict]]
    default_model: Callable[[], str] | None = None


def preference_task(name: str) -> PreferenceTask:
    """The built-in task of `proxima pipeline` named `name` (config.choices.PIPELINE_TASKS)."""
    from proxima.tasks import chat_preferences, instructions, preferences

    tasks = {
        "preferences": PreferenceTask(preferences.prepare),
        "chat": PreferenceTask(
            chat_preferences.prepare, partial(instructions.default_model, "pipeline.task=chat")
        ),
    }
    if name not in tasks:
        raise ConfigError(f"Unknown `pipeline.task` {name!r}. Built-in: {', '.join(tasks)}.")
    return tasks[name]


# the tasks whose preparation warm-starts their model by SFT on task.n_sft demonstrations
SFT_TASKS = ("arithmetic", "tools")


def uses_own_data(cfg: Config) -> bool:
    """The run names its own prompts: its task (if any) prepares nothing."""
    return bool(cfg.task.name and cfg.data.train_path and not cfg.trainer.resume_from)


def check_task(cfg: Config) -> None:
    """Before any work: the task exists, its warm start has a batch of demonstrations, and
    every path the user gave it is one it uses."""
    t = cfg.task
    if not t.name:
        return
    if t.name not in _tasks():
        raise ConfigError(f"Unknown `task.name` {t.name!r}. Built-in tasks: {', '.join(_tasks())}.")
    if (
        t.name in SFT_TASKS
        and t.sft_steps
        and t.n_sft < t.sft_batch_size
        and not uses_own_data(cfg)
    ):
        raise ConfigError(
            f"`task.n_sft`={t.n_sft} demonstrations are fewer than one batch of the task's "
            f"SFT warm start (`task.sft_batch_size`={t.sft_batch_size}); raise task.n_sft, "
            "lower task.sft_batch_size, or set task.sft_steps=0 to skip the warm start."
        )
    if cfg.trainer.resume_from:  # the checkpoint names the paths (`resumed_task_config`)
        return
    if uses_own_data(cfg):
        _check_own_data(cfg, _tasks()[cfg.task.name])
    else:
        _check_task_inputs(cfg, _tasks()[cfg.task.name])


def _check_own_data(cfg: Config, task: Task) -> None:
    """A recipe on the user's data: a model (or one the task lends), a reward, and none of
    the recipe's settings that read the task's data."""
    name = cfg.task.name
    aside = f"with your `data.train_path` the recipe's task {name!r} writes and builds nothing"
    if not cfg.model.actor_path and task.default_model is None:
        raise ConfigError(
            f"`model.actor_path` is empty: {aside} (its tiny model knows only the task's "
            "characters); set model.actor_path to your model's folder."
        )
    rewarded = cfg.reward.function or cfg.reward.model_path or cfg.reward.sources
    if not rewarded and not (cfg.rollout.env.cls or cfg.rollout.agent.fn):
        raise ConfigError(
            f"No reward for your `data.train_path`: {aside}, and its reward reads the task's "
            "own columns; set reward.function=file.py:fn (or reward.model_path, "
            "reward.sources) to score your prompts."
        )
    for key, value in (task.own or {}).items():
        if _get(cfg, key) == value:
            raise ConfigError(
                f"`{key}`={value} belongs to task {name!r} and reads its rows, not those of "
                f"your `data.train_path`: set {key} to your own."
            )


def _check_task_inputs(cfg: Config, task: Task) -> None:
    """A task that makes its inputs: a path of the user's it does not take is refused."""
    name = cfg.task.name
    if cfg.data.eval_path:
        raise ConfigError(
            f"`data.eval_path` is set, but task {name!r} writes its own held-out prompts "
            "(split from its training prompts): give your `data.train_path` as well to train "
            "on your data (the task then writes nothing), or drop data.eval_path."
        )
    if cfg.model.actor_path and "model.actor_path" not in task.takes:
        raise ConfigError(
            f"`model.actor_path` is set, but task {name!r} trains the tiny model it builds "
            "and warm-starts on its own data: give your `data.train_path` and a reward as "
            "well to train your model with this recipe's settings, or drop model.actor_path."
        )


def _get(cfg: Config, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def own_data_config(cfg: Config) -> tuple[Config, dict]:
    """A run on the user's own data: `cfg` with what its task lends (a model when none is
    named), and what the task did, for summary.json (nothing written)."""
    task = _tasks()[cfg.task.name]
    info = {"name": cfg.task.name, "prepared": False, "data": "data.train_path"}
    if cfg.model.actor_path or task.default_model is None:
        return cfg, info
    model = task.default_model()
    return cfg.replace({"model.actor_path": model}), {**info, "model": model}


def prepare_task(cfg: Config, run_dir: Path) -> tuple[Config, dict]:
    """Prepare cfg.task.name in run_dir/task; returns the config that names its model, data
    and reward, and what the preparation did (for summary.json)."""
    check_task(cfg)
    return _tasks()[cfg.task.name].prepare(cfg, Path(run_dir) / "task")


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
