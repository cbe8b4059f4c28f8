"""A shipped recipe on the user's own model, data and reward: its task writes nothing and
replaces nothing; without the user's data, a task refuses a path it would not use, naming
the key, before any work. Command-line style: the config `proxima train <recipe> ...`
resolves, then what `recipes.train` does with it before anything is written."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxima.cli import main
from proxima.cli.args import builtin_config
from proxima.config import ConfigError, load_config
from proxima.tasks import check_task, own_data_config, uses_own_data
from proxima.tasks import instructions as instructions_task

RECIPES = ["arithmetic", "dapo", "chat", "chat_ppo", "tools"]


def _resolved(recipe: str, *overrides: str):
    """The config `proxima train <recipe> overrides...` runs: loaded, its task checked and,
    on the user's data, what the task lends filled in (`recipes.train`'s steps)."""
    cfg = load_config(builtin_config(recipe), list(overrides))
    check_task(cfg)
    return own_data_config(cfg)[0] if uses_own_data(cfg) else cfg


def _own(tmp_path: Path) -> list[str]:
    for name in ("mine.jsonl", "held.jsonl"):
        (tmp_path / name).write_text('{"prompt": "1+1="}\n')
    return [
        f"model.actor_path={tmp_path / 'M'}",
        f"data.train_path={tmp_path / 'mine.jsonl'}",
        f"data.eval_path={tmp_path / 'held.jsonl'}",
        "reward.function=mine.py:score",
    ]


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_recipe_with_your_model_data_and_reward_keeps_them(recipe, tmp_path):
    extra = ["rollout.env.cls=my_env.py:Env"] if recipe == "tools" else []
    cfg = _resolved(recipe, *_own(tmp_path), *extra)
    assert cfg.task.name  # the recipe's task, which steps aside
    assert cfg.model.actor_path == str(tmp_path / "M")
    assert cfg.data.train_path == str(tmp_path / "mine.jsonl")
    assert cfg.data.eval_path == str(tmp_path / "held.jsonl")
    assert cfg.reward.function == "mine.py:score"


def test_the_chat_recipe_lends_its_model_to_your_data(tmp_path, monkeypatch):
    monkeypatch.setattr(instructions_task, "default_model", lambda: "/cache/smollm2")
    own = [o for o in _own(tmp_path) if not o.startswith("model.actor_path=")]
    cfg = _resolved("chat", *own)
    assert cfg.model.actor_path == "/cache/smollm2"
    assert cfg.data.train_path == str(tmp_path / "mine.jsonl")
    assert cfg.reward.function == "mine.py:score"


@pytest.mark.parametrize("recipe", ["arithmetic", "dapo", "tools"])
def test_your_data_without_a_model_names_model_actor_path(recipe, tmp_path):
    own = [o for o in _own(tmp_path) if not o.startswith("model.actor_path=")]
    extra = ["rollout.env.cls=my_env.py:Env"] if recipe == "tools" else []
    with pytest.raises(ConfigError, match=r"^`model.actor_path` is empty"):
        _resolved(recipe, *own, *extra)


@pytest.mark.parametrize("recipe", ["arithmetic", "dapo", "chat"])
def test_your_data_without_a_reward_names_the_reward(recipe, tmp_path):
    own = [o for o in _own(tmp_path) if not o.startswith("reward.function=")]
    with pytest.raises(ConfigError, match=r"reward.function=file.py:fn"):
        _resolved(recipe, *own)


def test_your_data_with_the_calculator_environment_names_rollout_env_cls(tmp_path):
    with pytest.raises(ConfigError, match=r"^`rollout.env.cls`=proxima.tasks.tools:Calculator"):
        _resolved("tools", *_own(tmp_path))


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_held_out_file_without_your_data_is_refused(recipe, tmp_path):
    held = [o for o in _own(tmp_path) if o.startswith("data.eval_path=")]
    with pytest.raises(ConfigError, match=r"^`data.eval_path` is set"):
        _resolved(recipe, *held)


@pytest.mark.parametrize("recipe", ["arithmetic", "dapo", "tools"])
def test_a_model_the_task_would_replace_is_refused(recipe, tmp_path):
    with pytest.raises(ConfigError, match=r"^`model.actor_path` is set"):
        _resolved(recipe, f"model.actor_path={tmp_path / 'M'}")


def test_the_chat_task_trains_the_model_it_is_given(tmp_path):
    cfg = _resolved("chat", f"model.actor_path={tmp_path / 'M'}")
    assert not uses_own_data(cfg) and cfg.model.actor_path == str(tmp_path / "M")


def test_the_preference_task_trains_the_model_it_is_given(tmp_path):
    from proxima.tasks import preferences

    cfg = load_config(
        builtin_config("pipeline"), [f"model.actor_path={tmp_path / 'M'}"], command="pipeline"
    )
    cfg, _ = preferences.prepare(cfg, tmp_path / "task")
    assert cfg.model.actor_path == str(tmp_path / "M")
    assert cfg.pipeline.prompts == str(tmp_path / "task" / "prompts.jsonl")


def test_every_pipeline_task_is_built_in_and_an_unknown_one_is_refused():
    from proxima.config.choices import PIPELINE_TASKS
    from proxima.tasks import preference_task

    assert all(callable(preference_task(name).prepare) for name in PIPELINE_TASKS)
    assert preference_task("preferences").default_model is None  # a tiny model per task
    with pytest.raises(ConfigError, match=r"`pipeline.task` must be one of preferences, chat"):
        load_config(builtin_config("pipeline"), ["pipeline.task=poems"], command="pipeline")
    with pytest.raises(ConfigError, match=r"Unknown `pipeline.task` 'poems'"):
        preference_task("poems")


def test_the_real_model_pipeline_recipe_loads_as_shipped():
    """pipeline_chat.yaml: the chat task, no demonstrations, LoRA, the critic from the reward
    model and the KL reference on (its run: tests/e2e/test_pipeline.py, at tiny sizes)."""
    cfg = load_config(builtin_config("pipeline_chat"), [], command="pipeline")
    assert cfg.pipeline.task == "chat" and not cfg.pipeline.sft_data and not cfg.pipeline.prompts
    assert cfg.model.lora_rank == 16 and cfg.model.critic_lora and cfg.pipeline.critic_from_rm
    assert cfg.algorithm.adv_estimator == "gae" and cfg.algorithm.use_kl_in_reward is not False
    assert cfg.algorithm.kl_ctrl.kl_coef == 0.05 and not cfg.actor.use_kl_loss


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("pipeline.heldout=held.jsonl", "pipeline.heldout"),
        ("pipeline.sft_data=demos.jsonl", "pipeline.sft_data"),
        ("data.train_path=mine.jsonl", "data.train_path"),
        ("data.eval_path=held.jsonl", "data.eval_path"),
    ],
)
def test_the_pipeline_refuses_a_file_its_task_would_replace(override, key):
    with pytest.raises(ConfigError, match=rf"^`{key}`"):
        load_config(builtin_config("pipeline"), [override], command="pipeline")


def test_proxima_config_refuses_what_train_refuses(tmp_path, capsys):
    assert main(["config", "arithmetic", f"model.actor_path={tmp_path}"]) == 2
    assert "`model.actor_path` is set" in capsys.readouterr().err
