"""What some estimators need beyond scores (`Estimator.needs`), produced by the trainer:
ReMax's greedy baseline, and the sum of pi^2 of the optimal token baseline."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from proxima.algos import EXTRA_INPUTS
from proxima.config import ConfigError, load_config
from proxima.models.forward import response_logits
from proxima.rollout.collect import Rollout, collect, sampled_inputs
from proxima.rollout.engines import engine_spec
from proxima.rollout.plan import plan_scoring
from proxima.trainer.advantages import BatchView
from proxima.trainer.dist import Dist
from proxima.types import Experience
from tests.trainer.nano import nano_files, nano_trainer

HF = engine_spec("hf")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return nano_files(tmp_path_factory.mktemp("needs"))


def test_the_extra_inputs_travel_by_their_name_alone():
    # an estimator's new input is a row of EXTRA_INPUTS and a field of the Experience (and of
    # the Rollout when sampling produces it): nothing between them names it
    assert set(EXTRA_INPUTS) <= {f.name for f in dataclasses.fields(Experience)}
    rows = {f.name for f in dataclasses.fields(Rollout)} & set(EXTRA_INPUTS)
    assert rows == {"reward_baselines", "score_components"}
    mask = torch.ones(2, 3)
    exp = Experience(
        input_ids=torch.zeros(2, 5, dtype=torch.long),
        attention_mask=torch.ones(2, 5),
        response_mask=mask,
        old_logprobs=-mask,
        scores=torch.zeros(2),
        stopped=torch.ones(2, dtype=torch.bool),
        kl=0 * mask,
        group_ids=torch.zeros(2, dtype=torch.long),
        is_weights=mask,
        score_components=torch.ones(2, 4),
    )
    view = BatchView.gather(exp, Dist(), 1, tuple(EXTRA_INPUTS))
    assert sorted(view.inputs) == ["is_weights", "old_logprobs", "score_components"]
    assert torch.equal(view.score_components, exp.score_components)
    assert BatchView.gather(exp, Dist(), 1, ("is_weights",)).inputs.keys() == {"is_weights"}
    ro = Rollout(
        gen=None,
        prompts=[],
        responses=[],
        columns={},
        group_ids=torch.zeros(0),
        reward_baselines=torch.zeros(2),
    )
    assert sampled_inputs(ro).keys() == {"reward_baselines"}


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
