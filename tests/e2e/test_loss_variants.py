"""Every policy loss (`actor.policy_loss.loss_mode`) and every advantage estimator of the
registries trains end to end for 3 iterations on the nano model: finite metrics, the
actor's weights move, and the config validates with the loss's own options."""

from __future__ import annotations

import math

import pytest
from safetensors.torch import load_file

from proxima.algos import ADVANTAGE_ESTIMATORS, POLICY_LOSSES
from proxima.cli import main
from proxima.config import load_config
from proxima.logging import read_metrics

pytestmark = pytest.mark.slow

# options a loss cannot run without (dro has no usable default for its beta)
REQUIRED = {"dro": ("actor.policy_loss.dro_beta=0.1",)}


def _train(fast_overrides, make_model, tmp_path, *extra: str) -> list[dict]:
    model = make_model()
    out = tmp_path / "run"
    assert main(["train", *fast_overrides(model, out, 3, *extra)]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, bad
    before = load_file(model / "model.safetensors")
    after = load_file(out / "actor" / "model.safetensors")
    assert any(not after[k].equal(before[k]) for k in before), "the actor did not move"
    return rows


GROUPS = ("rollout.n=4", "actor.ppo_mini_batch_size=16", "critic.ppo_mini_batch_size=16")


@pytest.mark.parametrize("mode", sorted(POLICY_LOSSES))
def test_each_policy_loss_trains(fast_overrides, make_model, tmp_path, mode):
    extra = (f"actor.policy_loss.loss_mode={mode}", *REQUIRED.get(mode, ()))
    assert load_config(None, ["task.name=arithmetic", *extra]).actor.policy_loss.loss_mode == mode
    rows = _train(
        fast_overrides, make_model, tmp_path, "algorithm.adv_estimator=grpo", *GROUPS, *extra
    )
    assert "actor/pg_loss" in rows[-1]


@pytest.mark.parametrize("name", sorted(n for n, e in ADVANTAGE_ESTIMATORS.items() if not e.critic))
def test_each_critic_free_estimator_trains(fast_overrides, make_model, tmp_path, name):
    # distill learns from a teacher: another nano model on the same tokenizer
    teacher = (f"model.teacher_path={make_model(seed=1)}",) if name == "distill" else ()
    estimator = f"algorithm.adv_estimator={name}"
    rows = _train(fast_overrides, make_model, tmp_path, estimator, *GROUPS, *teacher)
    assert "actor/pg_loss" in rows[-1]
    assert not (tmp_path / "run" / "critic").exists()
