"""The role plan (`config.roles`): which reference, critic and reward sources each
combination of keys gives, written out in full; built once per config; printed."""

from __future__ import annotations

import pytest

from proxima.config import ConfigError, RewardSource, load_config
from proxima.config.roles import RolePlan, plan_roles, role_plan

BASE = ["model.actor_path=m", "data.train_path=p.jsonl", "reward.function=f.py:fn"]
FN = (RewardSource("function", "function", "f.py:fn"),)
NO_KL = ["algorithm.use_kl_in_reward=false"]
COPY = {"reference": "folder", "reference_folder": "m", "reference_key": "model.actor_path"}
FROM_ACTOR = {
    "critic": "model",
    "critic_folder": "m",
    "critic_key": "model.actor_path",
    "critic_init": "actor",
}


def plan(*overrides: str) -> RolePlan:
    return role_plan(load_config(None, BASE + list(overrides)))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        # the defaults: KL in the reward against a frozen copy of the actor, GAE's value model
        ([], RolePlan("m", estimator="gae", rewards=FN, **COPY, **FROM_ACTOR)),
        # KL in the actor loss only: the same reference
        (
            ["actor.use_kl_loss=true"],
            RolePlan("m", estimator="gae", rewards=FN, **COPY, **FROM_ACTOR),
        ),
        # no KL anywhere: no reference
        (NO_KL, RolePlan("m", "none", estimator="gae", rewards=FN, **FROM_ACTOR)),
        # LoRA: the actor with its adapters off, the value model with adapters of its own
        (
            ["model.lora_rank=8"],
            RolePlan(
                "m",
                "adapters off",
                estimator="gae",
                rewards=FN,
                **{**FROM_ACTOR, "critic_lora": True},
            ),
        ),
        # LoRA and another reference folder: that folder
        (
            ["model.lora_rank=8", "model.reference_path=ref", "model.critic_lora=false"],
            RolePlan(
                "m",
                "folder",
                "ref",
                "model.reference_path",
                estimator="gae",
                rewards=FN,
                **FROM_ACTOR,
            ),
        ),
        # LoRA without KL: no reference at all
        (
            ["model.lora_rank=8", *NO_KL],
            RolePlan("m", "none", estimator="gae", rewards=FN, **FROM_ACTOR, critic_lora=True),
        ),
        # a value head on the actor
        (
            ["critic.shared_backbone=true", "critic.vf_coef=0.25"],
            RolePlan("m", critic="head", vf_coef=0.25, estimator="gae", rewards=FN, **COPY),
        ),
        # a critic-free estimator: no critic
        (
            ["algorithm.adv_estimator=grpo", "rollout.n=4"],
            RolePlan("m", critic="none", estimator="grpo", rewards=FN, **COPY),
        ),
        # a value model from a folder of its own
        (
            ["model.critic_path=c", "model.critic_init=critic", *NO_KL],
            RolePlan(
                "m",
                "none",
                critic="model",
                critic_folder="c",
                critic_key="model.critic_path",
                critic_init="critic",
                estimator="gae",
                rewards=FN,
            ),
        ),
    ],
)
def test_each_combination_gives_its_plan(overrides, expected):
    assert plan(*overrides) == expected


def test_a_value_model_from_the_first_reward_model_of_the_sources():
    sources = "[{name: a, function: f.py:g, weight: 0.5}, {name: b, model_path: rm}]"
    got = plan("reward.function=", f"reward.sources={sources}", "model.critic_init=reward_model")
    assert got == RolePlan(
        "m",
        estimator="gae",
        critic="model",
        critic_folder="rm",
        critic_key="model.critic_init=reward_model",
        critic_init="reward_model",
        rewards=(
            RewardSource("a", "function", "f.py:g", weight=0.5),
            RewardSource("b", "model_path", "rm"),
        ),
        **COPY,
    )
    assert got.reward_model_folders == ("rm",)
    assert got.critic_reads_other_folder and not got.reference_reads_other_folder


def test_a_value_model_from_a_reward_model_the_run_lacks_is_refused():
    cfg = load_config(None, BASE).replace({"model.critic_init": "reward_model"})
    with pytest.raises(ConfigError, match="model.critic_init=reward_model. needs"):
        role_plan(cfg)


def test_no_reward_source_when_the_environment_gives_every_reward():
    cfg = load_config(None, BASE).replace({"reward.function": ""})
    assert role_plan(cfg).rewards == ()
    assert (
        role_plan(cfg)
        .describe()
        .endswith("reward   : none (the environment or agent gives every reward)")
    )


def test_built_once_per_config_and_never_among_its_fields():
    cfg = load_config(None, BASE)
    first = role_plan(cfg)
    assert role_plan(cfg) is first
    assert cfg == load_config(None, BASE) and "_role_plan" not in cfg.to_dict()
    other = cfg.replace({"critic.shared_backbone": True})
    assert role_plan(other).critic == "head" and role_plan(cfg).critic == "model"
    assert plan_roles(cfg) == first


def test_the_printed_plan():
    assert plan().describe() == (
        "role plan:\n"
        "  reference: a frozen copy of the starting actor, from model.actor_path (m)\n"
        "  critic   : a value model of its own: the actor's backbone and a new value head, "
        "from model.actor_path (m)\n"
        "  reward   : the function f.py:fn"
    )
    sources = "[{name: a, function: f.py:g, weight: 0.5}, {name: b, url: 'http://h:1'}]"
    lora = plan(
        "model.lora_rank=8",
        "critic.shared_backbone=true",
        "model.critic_init=actor",
        "reward.function=",
        f"reward.sources={sources}",
    )
    assert lora.describe() == (
        "role plan:\n"
        "  reference: the actor with its LoRA adapters off (no weights of its own)\n"
        "  critic   : a value head on the actor's backbone, trained in the actor's steps "
        "(loss + 0.5 x value loss)\n"
        "  reward   : a = 0.5 x the function f.py:g; b = 1 x the server http://h:1"
    )
    assert plan(
        "model.reference_path=r", "algorithm.adv_estimator=grpo", "rollout.n=2"
    ).describe() == (
        "role plan:\n"
        "  reference: a frozen model, from model.reference_path (r)\n"
        "  critic   : none (grpo trains no critic)\n"
        "  reward   : the function f.py:fn"
    )


def test_proxima_config_prints_it_after_the_batch_plan(capsys, tmp_path, monkeypatch):
    from proxima.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["config", "task.name=", *BASE, "critic.shared_backbone=true"]) == 0
    out = capsys.readouterr().out
    batch, roles = out.index("batch plan:"), out.index("role plan:")
    assert batch < roles
    assert "  critic   : a value head on the actor's backbone" in out[roles:]
