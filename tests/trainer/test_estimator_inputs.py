"""What some estimators need beyond scores (`Estimator.needs`), produced by the trainer:
ReMax's greedy baseline, and the sum of pi^2 of the optimal token baseline."""

from __future__ import annotations

import pytest
import torch

from proxima.config import ConfigError, load_config
from proxima.models.forward import response_logits
from proxima.rollout.collect import collect
from proxima.rollout.engines import engine_class
from proxima.rollout.plan import plan_scoring
from tests.trainer.nano import nano_files, nano_trainer

HF = engine_class("hf")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return nano_files(tmp_path_factory.mktemp("needs"))


def test_remax_baseline_is_the_score_of_a_greedy_response(files):
    trainer = nano_trainer(files, "algorithm.adv_estimator=remax", "rollout.n=2")
    ro, _ = trainer.sampler.sample()
    prompts = ro.prompts[::2]
    items = [it for it in trainer.loader.dataset if it.text in prompts]
    items.sort(key=lambda it: prompts.index(it.text))
    greedy = collect(
        trainer.roles.actor,
        trainer.roles.tokenizer,
        items,
        trainer.roles.reward,
        trainer.cfg.rollout,
        trainer.device,
        greedy=True,
        n=1,
    )
    assert torch.equal(ro.reward_baselines, greedy.scores.repeat_interleave(2))
    exp = trainer.make_experience(ro)
    assert torch.equal(exp.reward_baselines, ro.reward_baselines)


def test_optimal_token_baseline_gets_sum_pi_squared_from_the_actor(files):
    trainer = nano_trainer(files, "algorithm.adv_estimator=optimal_token_baseline", "rollout.n=2")
    assert trainer.plan.sum_pi_squared and trainer.plan.old_logprobs == "actor"
    assert "sum pi^2" in trainer.plan.describe()
    ro, _ = trainer.sampler.sample()
    exp = trainer.make_experience(ro)
    r = exp.response_mask.shape[1]
    with torch.no_grad():
        logits = response_logits(trainer.roles.actor, exp.input_ids, exp.attention_mask, r, 0.7)
    expected = torch.softmax(logits.float(), -1).square().sum(-1) * exp.response_mask
    torch.testing.assert_close(exp.sum_pi_squared, expected)


def test_optimal_token_baseline_refuses_the_engines_logprobs(files):
    cfg = load_config(
        None,
        [
            "task.name=arithmetic",
            "algorithm.adv_estimator=optimal_token_baseline",
            "rollout.old_logprobs=engine",
        ],
    )
    with pytest.raises(ConfigError, match="sum of pi\\^2"):
        plan_scoring(cfg, HF)
