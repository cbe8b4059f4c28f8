"""The run plan: how a run samples and where it runs, decided once from the config and
printed; the checks that read it instead of the flags."""

from __future__ import annotations

import pytest

from proxima.cli import main
from proxima.config import load_config
from proxima.config.choices import ENGINES, ENGINES_SERVING_ACTOR
from proxima.config.run import run_plan
from proxima.rollout.engines import ENGINES as ENGINE_CLASSES
from proxima.rollout.engines import engine_spec

BASE = ["task.name=arithmetic"]


def _plan(*overrides: str):
    return run_plan(load_config(None, [*BASE, *overrides]))


def test_the_default_run_samples_on_policy_in_one_process():
    plan = _plan()
    assert (plan.episodes, plan.ahead, plan.workers, plan.world_size) == ("", 0, 0, 1)
    assert not plan.multi_turn and plan.serves_actor and plan.engine == "hf"
    assert "on-policy" in plan.describe() and "offload  : auto: the memory plan" in plan.describe()
    assert "offload  : none" in _plan("model.offload=none").describe()


def test_episodes_are_an_environment_or_an_agent():
    assert _plan("rollout.env.cls=proxima.tasks.tools:Calculator").episodes == "env"
    assert _plan("rollout.agent.fn=agent.py:play").episodes == "agent"
    assert _plan("rollout.agent.fn=agent.py:play").multi_turn


@pytest.mark.parametrize(
    ("overrides", "workers"),
    [
        ((), 0),  # nothing sampled ahead: no worker in use
        (("rollout.max_staleness=2",), 2),  # unset: one worker per batch the pipeline holds
        (("rollout.max_staleness=1", "rollout.workers=2"), 2),
        (("rollout.max_staleness=1", "rollout.workers=0"), 0),
    ],
)
def test_workers_are_in_use_only_when_sampling_ahead(overrides, workers):
    assert _plan(*overrides).workers == workers


def test_offload_auto_says_when_nothing_decides_it():
    plan = _plan("model.offload=auto", "trainer.memory_check=off")
    assert not plan.offload_acts
    assert "never acts here: trainer.memory_check=off" in plan.describe()
    assert _plan("model.offload=auto").offload_acts
    assert "no GPU memory" in _plan("model.offload=auto", "model.device=cpu").offload_blocked
    ahead = _plan("model.offload=auto", "rollout.max_staleness=1")
    assert ahead.offload_blocked.startswith("rollout.max_staleness > 0")


def test_the_reference_in_the_update_is_the_kl_loss():
    assert _plan("actor.use_kl_loss=true").reference_in_update
    assert not _plan("actor.use_kl_loss=false").reference_in_update


def test_the_engine_names_and_who_serves_the_actor_agree_with_the_engine_classes():
    assert tuple(ENGINE_CLASSES) == ENGINES
    for name in ENGINES:
        assert engine_spec(name).serves_actor == (name in ENGINES_SERVING_ACTOR)


def test_the_plan_is_built_once_per_config():
    cfg = load_config(None, BASE)
    assert run_plan(cfg) is run_plan(cfg)
    assert run_plan(cfg.replace({"rollout.max_staleness": 1})).ahead == 1


def test_proxima_config_prints_the_run_plan(capsys):
    assert main(["config", "rollout.max_staleness=1", "rollout.workers=1"]) == 0
    out = capsys.readouterr().out
    assert "run plan:" in out and "1 batch(es) ahead, in 1 worker process(es)" in out
