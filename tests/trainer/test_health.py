"""The health checks that stop a diverged run, and the weight guard of the optimizer step."""

from __future__ import annotations

import pytest
import torch

from proxima.config import Config
from proxima.trainer.health import HealthMonitor, NonFiniteOutputsError, non_finite_divergence
from proxima.trainer.optim import NonFiniteWeightsError, TrainedRole, optimizer_step

HEALTHY = {"score": 0.2, "kl": 0.4, "response_length": 4.0, "actor/entropy": 2.0}


def _observe(monitor: HealthMonitor, rows: list[dict]):
    out = None
    for i, row in enumerate(rows, start=1):
        out = monitor.observe(i, {**HEALTHY, **row})
        if out is not None:
            return i, out
    return None, out


def test_entropy_collapse_stops_after_patience_consecutive_iterations():
    # iterations 1-2 healthy, 3-5 collapsed: the third bad one (5) stops the run. Iteration 3
    # measured the policy after iteration 2, so the last good weights are those of iteration 1
    monitor = HealthMonitor(Config())
    rows = [{}, {}, {"actor/entropy": 0.0}, {"actor/entropy": 1e-6}, {"actor/entropy": 0.0}]
    at, div = _observe(monitor, rows)
    assert at == 5 and div.metric == "actor/entropy" and div.last_good == 1
    assert div.diagnosis.startswith("diverged at iteration 5: actor/entropy 0 < guard.min_entropy")
    assert "for 3 consecutive iterations (since iteration 3; guard.patience=3)" in div.diagnosis
    assert "Likely fix: lower actor.optim.lr (now 5e-07)" in div.diagnosis


def test_a_healthy_iteration_resets_the_streak_and_patience_0_never_stops():
    rows = [{"actor/entropy": 0.0}, {"actor/entropy": 0.0}, {}] * 4  # never 3 in a row
    assert _observe(HealthMonitor(Config()), rows) == (None, None)
    never = HealthMonitor(Config().replace({"guard.patience": 0}))
    assert _observe(never, [{"actor/entropy": 0.0}] * 10) == (None, None)
    assert not never.healthy


def test_kl_runaway_while_the_score_rises_is_named_reward_hacking():
    # KL per token = kl / response_length: 24 / 4 = 6 > 5; the score rose from 0.2 to 0.9
    cfg = Config().replace({"guard.patience": 2, "algorithm.kl_ctrl.kl_coef": 0.05})
    rows = [{}, {"kl": 24.0, "score": 0.9}, {"kl": 24.0, "score": 0.9}]
    at, div = _observe(HealthMonitor(cfg), rows)
    assert at == 3 and div.metric == "kl" and div.last_good == 0
    assert "KL to the reference 6 per token > guard.max_kl_per_token=5" in div.diagnosis
    assert "while the score rose from 0.2 to 0.9 (the policy games the reward)" in div.diagnosis
    assert "raise algorithm.kl_ctrl.kl_coef (now 0.05" in div.diagnosis


def test_response_length_collapse_is_relative_to_the_first_iteration():
    # first iteration 4.0 tokens; 0.3 < 0.1 x 4.0 = 0.4 is a collapse, 0.5 is not
    cfg = Config().replace({"guard.patience": 1})
    assert _observe(HealthMonitor(cfg), [{}, {"response_length": 0.5}]) == (None, None)
    at, div = _observe(HealthMonitor(cfg), [{}, {"response_length": 0.3}])
    assert at == 2 and div.metric == "response_length"
    assert "response_length 0.3 < guard.min_length_ratio=0.1 x the first iteration's 4" in (
        div.diagnosis
    )


def test_non_finite_weights_and_outputs_name_the_role_and_the_fix():
    cfg = Config().replace({"critic.optim.lr": 2.0, "critic.optim.grad_clip": 0.0})
    err = NonFiniteWeightsError("parameter w is not finite")
    err.role = "critic"
    div = non_finite_divergence(err, cfg, iteration=7)
    assert div.last_good == 6 and div.metric == "critic/weights"  # update 7 broke them
    assert "the critic's weights became not finite (inf/nan)" in div.diagnosis
    assert "lower critic.optim.lr (now 2), and clip gradients" in div.diagnosis
    div = non_finite_divergence(NonFiniteOutputsError("sampling failed"), cfg, iteration=7)
    assert div.last_good == 5 and div.metric == "actor/outputs"  # update 6 broke them


def _pushed_to_overflow(layer: torch.nn.Linear) -> None:
    """Weights at 3.3e38 and a gradient of -1 on each: Adam's first step (betas 0.9, 0.95)
    adds lr / (1 - 0.9) x 0.1 (-1) / 1 x (-1) = lr; with lr = 3e37 that is 3.6e38, above
    float32's max 3.4e38: inf, although the gradient is finite."""
    with torch.no_grad():
        layer.weight.fill_(3.3e38)
        layer.bias.fill_(3.3e38)
    (-(layer.weight.sum() + layer.bias.sum())).backward()


def test_a_step_that_makes_weights_non_finite_raises():
    layer = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(layer.parameters(), lr=3e37, betas=(0.9, 0.95), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    _pushed_to_overflow(layer)
    with pytest.raises(NonFiniteWeightsError, match=r"parameter weight is not finite .* 3e\+37"):
        optimizer_step(layer, opt, sched, grad_clip=0.0)
    assert all(p.grad is None for p in layer.parameters())


def test_trained_role_names_itself_in_the_weight_error():
    cfg = Config().replace({"critic.optim.lr": 3e37, "critic.optim.grad_clip": 0.0}).critic
    role = TrainedRole("critic", torch.nn.Linear(2, 2), cfg, total_steps=1)
    _pushed_to_overflow(role.model)
    with pytest.raises(NonFiniteWeightsError) as err:
        role.step()
    assert err.value.role == "critic"
