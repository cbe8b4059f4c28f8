"""Multi-turn keys (the `rollout.env` section): every mistake stops before a model loads, the
message naming the key and the fix; a key of the former flat layout is answered with its new
name."""

from __future__ import annotations

import pytest

from proxima.config import ConfigError, load_config
from proxima.rollout.environments import check_env
from tests.rollout.scripted import spec

BASE = ["model.actor_path=m", "data.train_path=p.jsonl"]
ENV = f"rollout.env={spec('TwoTurns')}"


def test_env_run_needs_no_reward_source_and_takes_one():
    cfg = load_config(None, [*BASE, ENV])
    assert cfg.rollout.env.cls.endswith(":TwoTurns") and not cfg.reward.function
    assert load_config(None, [*BASE, ENV, "reward.function=f.py:fn"]).reward.function
    with pytest.raises(ConfigError, match=r"Set exactly one of .*\(with rollout.env: at most one"):
        load_config(None, [*BASE, ENV, "reward.function=f.py:fn", "reward.model_path=rm"])
    with pytest.raises(ConfigError, match="Set exactly one of `reward.function`"):
        load_config(None, BASE)  # without an environment a reward source is required


@pytest.mark.parametrize(
    "override, message",
    [
        (
            "rollout.env.turn_stop=[']']",
            r"`rollout.env.turn_stop` is set but `rollout.env.cls` is empty",
        ),
        ("rollout.env.max_turns=2", r"`rollout.env.max_turns` is set but `rollout.env.cls` is"),
    ],
)
def test_env_keys_without_env(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*BASE, "reward.function=f.py:fn", override])


@pytest.mark.parametrize(
    "override, message",
    [
        ("rollout.env=my_env.py", r"`rollout.env.cls`='my_env.py' needs a ':' and a name"),
        ("rollout.env.max_turns=0", r"`rollout.env.max_turns` must be >= 1, got 0"),
        ("rollout.env.max_episode_tokens=0", r"`rollout.env.max_episode_tokens` must be >= 1"),
        ("rollout.env.workers=0", r"`rollout.env.workers` must be >= 1"),
        ("rollout.env.max_turn_tokens=-1", r"`rollout.env.max_turn_tokens` must be >= 0"),
        ("rollout.env.timeout_s=-1", r"`rollout.env.timeout_s` must be >= 0"),
        (
            "rollout.env.max_episode_tokens=1",
            r"`rollout.env.max_episode_tokens` \(1\) is below one action's most tokens",
        ),
        ("rollout.env.turn_stop=['']", r"`rollout.env.turn_stop` must be a list of non-empty"),
        ("rollout.env.observation_role=''", r"`rollout.env.observation_role` must name a chat"),
    ],
)
def test_env_limits(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [*BASE, ENV, override])


def test_the_section_and_its_shorthand():
    """`rollout.env=SPEC` is short for `rollout.env.cls=SPEC`, also with keys after it."""
    long = load_config(None, [*BASE, f"rollout.env.cls={spec('TwoTurns')}"])
    short = load_config(None, [*BASE, ENV, "rollout.env.max_turns=2"])
    assert long.rollout.env.cls == short.rollout.env.cls
    assert (long.rollout.env.max_turns, short.rollout.env.max_turns) == (4, 2)


@pytest.mark.parametrize(
    "old, new",
    [
        ("max_turns", "max_turns"),
        ("turn_stop", "turn_stop"),
        ("max_turn_tokens", "max_turn_tokens"),
        ("max_episode_tokens", "max_episode_tokens"),
        ("env_workers", "workers"),
        ("env_timeout_s", "timeout_s"),
        ("env_fallback_reward", "fallback_reward"),
        ("observation_role", "observation_role"),
    ],
)
def test_a_former_key_is_answered_with_its_new_name(old, new):
    with pytest.raises(ConfigError, match=f"`rollout.{old}` is now `rollout.env.{new}`"):
        load_config(None, [*BASE, ENV, f"rollout.{old}=1"])


def test_a_former_key_in_a_yaml_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(f"rollout:\n  env: {spec('TwoTurns')}\n  max_turns: 2\n")
    with pytest.raises(ConfigError, match=r"`rollout.max_turns` is now `rollout.env.max_turns`"):
        load_config(path, BASE)


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


def test_a_class_without_step_lists_the_methods_it_has(tmp_path):
    (tmp_path / "envs.py").write_text(
        "class NoStep:\n    def __init__(self, row): pass\n    def act(self, a): pass\n"
    )
    cfg = load_config(None, [*BASE, f"rollout.env={tmp_path / 'envs.py'}:NoStep"])
    with pytest.raises(
        ConfigError,
        match="'NoStep' is a class with the methods act; it must be a class with a method step",
    ):
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
    with pytest.raises(ConfigError, match=r"`rollout.env.cls`=.*gone.py:Env.*not found"):
        prepare_inputs(cfg)
