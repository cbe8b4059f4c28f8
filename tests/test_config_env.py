"""Multi-turn keys (`rollout.env` and its limits): every mistake stops before a model loads,
the message naming the key and the fix."""

from __future__ import annotations

import pytest

from proxima.config import ConfigError, load_config
from proxima.rollout.environments import check_env
from tests.rollout.scripted import spec

BASE = ["model.actor_path=m", "data.train_path=p.jsonl"]
ENV = f"rollout.env={spec('TwoTurns')}"


def test_env_run_needs_no_reward_source_and_takes_one():
    cfg = load_config(None, [*BASE, ENV])
    assert cfg.rollout.env.endswith(":TwoTurns") and not cfg.reward.function
    assert load_config(None, [*BASE, ENV, "reward.function=f.py:fn"]).reward.function
    with pytest.raises(ConfigError, match=r"Set exactly one of .*\(with rollout.env: at most one"):
        load_config(None, [*BASE, ENV, "reward.function=f.py:fn", "reward.model_path=rm"])
    with pytest.raises(ConfigError, match="Set exactly one of `reward.function`"):
        load_config(None, BASE)  # without an environment a reward source is required


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.turn_stop=[']']", r"`rollout.turn_stop` is set but `rollout.env` is empty"),
        ("rollout.max_turns=2", r"`rollout.max_turns` is set but `rollout.env` is empty"),
    ],
)
def test_env_keys_without_env(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*BASE, "reward.function=f.py:fn", override])


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.env=my_env.py", r"`rollout.env`='my_env.py' needs a ':' and a name"),
        ("rollout.max_turns=0", r"`rollout.max_turns` must be >= 1, got 0"),
        ("rollout.max_episode_tokens=0", r"`rollout.max_episode_tokens` must be >= 1"),
        ("rollout.env_workers=0", r"`rollout.env_workers` must be >= 1"),
        ("rollout.max_turn_tokens=-1", r"`rollout.max_turn_tokens` must be >= 0"),
        ("rollout.env_timeout_s=-1", r"`rollout.env_timeout_s` must be >= 0"),
        ("rollout.turn_stop=['']", r"`rollout.turn_stop` must be a list of non-empty strings"),
        ("rollout.observation_role=''", r"`rollout.observation_role` must name a chat role"),
    ],
)
def test_env_limits(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*BASE, ENV, override])


@pytest.mark.parametrize(
    "env, message",
    [
        ("missing_env.py:Env", r"file missing_env.py not found .* fix the path"),
        (spec("Nope"), r"has no attribute 'Nope'; classes found: \[.*'TwoTurns'"),
        (spec("ALPHABET"), r"'ALPHABET' is a str; it must be a class with a method step"),
        ("no_such_module_xyz:Env", r"importing module 'no_such_module_xyz' failed"),
    ],
)
def test_check_env_names_the_problem(env, message):
    cfg = load_config(None, [*BASE, f"rollout.env={env}"])
    with pytest.raises(ConfigError, match=message):
        check_env(cfg)


def test_check_env_before_models_load(tmp_path):
    """A PPO run with a missing environment file stops in `prepare_inputs`, before any
    model loads, naming the key."""
    from proxima.trainer.setup import prepare_inputs
    from tests.trainer.nano import nano_files

    files = nano_files(tmp_path)
    cfg = load_config(
        None,
        [
            f"model.actor_path={files['model']}",
            f"data.train_path={files['prompts']}",
            "data.train_batch_size=4",
            "actor.ppo_mini_batch_size=4",
            "actor.ppo_micro_batch_size=4",
            "critic.ppo_mini_batch_size=4",
            "critic.ppo_micro_batch_size=4",
            f"rollout.env={tmp_path / 'gone.py'}:Env",
        ],
    )
    with pytest.raises(ConfigError, match=r"`rollout.env`=.*gone.py:Env.*not found"):
        prepare_inputs(cfg)
