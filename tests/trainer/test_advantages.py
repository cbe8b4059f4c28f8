"""Phases 4-5 as one pure function on the whole batch, and the iteration metrics built from
it: the explained variance over the batch, the KL coefficient only where it applies, the
engine-trust warning. Nano models, a few seconds in all."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from proxima.algos import compute_gae, explained_variance, masked_whiten, shape_rewards
from proxima.config import Config
from proxima.rollout.contract import LogprobMismatchWarning
from proxima.trainer.advantages import BatchView, estimate_advantages
from tests.trainer.nano import nano_files, nano_trainer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    return nano_files(tmp_path_factory.mktemp("advantages"))


def _batch() -> BatchView:
    # 2 prompts x 2 samples; row 1 stops after one token, row 3 never stops
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]])
    return BatchView(
        scores=torch.tensor([1.0, 0.0, 0.5, 7.0]),
        stopped=torch.tensor([True, True, True, False]),
        kl=torch.tensor([[0.1, 0.2, 0.3], [0.4, 0.0, 0.0], [0.0, 0.1, 0.0], [0.2, 0.2, 0.2]]),
        response_mask=mask,
        values=torch.tensor([[0.5, 0.4, 0.3], [0.2, 0.0, 0.0], [0.1, 0.1, 0.0], [1.0, 1.0, 1.0]]),
        group_ids=torch.tensor([0, 0, 1, 1]),
    )


def test_estimate_is_shape_rewards_then_the_estimator_and_leaves_its_input_alone():
    batch = _batch()
    before = {k: v.clone() for k, v in vars(batch).items() if isinstance(v, torch.Tensor)}
    algorithm = Config().algorithm  # gae, gamma 1, lam 0.95, whitened, clip 5
    est = estimate_advantages(batch, algorithm, kl_coef=0.1, no_stop_penalty=-1.0)
    rewards, stats = shape_rewards(
        batch.scores,
        batch.stopped,
        batch.kl,
        batch.response_mask,
        kl_coef=0.1,
        clip_reward_value=5.0,
        no_stop_penalty=-1.0,
    )
    adv, ret = compute_gae(rewards, batch.values, batch.response_mask, 1.0, 0.95)
    torch.testing.assert_close(est.token_rewards, rewards)
    torch.testing.assert_close(est.advantages, masked_whiten(adv, batch.response_mask))
    torch.testing.assert_close(est.returns, ret)
    assert est.stats == {k: float(v) for k, v in stats.items()}
    # the last row's score is 7 - 1 (no stop) = 6, clipped to 5, at its last token
    assert float(est.token_rewards[3, 2]) == pytest.approx(5.0 - 0.1 * 0.2)
    assert all(torch.equal(before[k], v) for k, v in vars(batch).items() if k in before)


def test_the_estimators_own_options_come_from_its_config_fields():
    batch = _batch()
    grpo = replace(Config().algorithm, adv_estimator="grpo", norm_adv_by_std_in_grpo=False)
    est = estimate_advantages(batch, grpo, kl_coef=0.0, no_stop_penalty=0.0)
    # groups {0, 1} (outcomes 1, 0) and {2, 3} (0.5, 5 clipped): mean-centred, not scaled
    want = torch.tensor([0.5, -0.5, -2.25, 2.25]).unsqueeze(1) * batch.response_mask
    torch.testing.assert_close(est.advantages, want)
    # whiten_advantages and lam are gae's: ignored by grpo, not an error
    assert estimate_advantages(batch, replace(grpo, lam=0.1), kl_coef=0.0, no_stop_penalty=0.0)


def test_explained_variance_is_over_the_whole_batch_with_a_floor(files):
    trainer = nano_trainer(files)
    torch.manual_seed(0)
    metrics, _ = trainer.step()
    ev = metrics["critic/explained_variance"]
    captured = {}
    real = trainer.metrics

    def keep(batch, est, local, stats):
        captured.update(batch=batch, est=est)
        return real(batch, est, local, stats)

    trainer.metrics = keep
    torch.manual_seed(1)
    metrics, _ = trainer.step()
    batch, est = captured["batch"], captured["est"]
    want = explained_variance(batch.values, est.returns, batch.response_mask, min_var=1e-8)
    assert metrics["critic/explained_variance"] == pytest.approx(float(want))
    assert -1e3 < ev <= 1.0  # never the -1e14 of near-constant returns in a micro-batch


def test_kl_coef_is_logged_only_when_the_kl_is_in_the_reward(files):
    in_reward, _ = nano_trainer(files).step()
    assert in_reward["kl_coef"] == pytest.approx(0.1)
    loss_only, _ = nano_trainer(files, "actor.use_kl_loss=true").step()
    assert "kl_coef" not in loss_only and "actor/kl_loss" in loss_only


def test_the_mismatch_warning_counts_iterations_from_one_and_fits_the_engine(files):
    trainer = nano_trainer(
        files, "rollout.old_logprobs=recompute", "rollout.logprob_diff_warn=1e-12"
    )
    torch.manual_seed(2)
    with pytest.warns(LogprobMismatchWarning) as caught:
        trainer.step()
    text = str(caught[0].message)
    assert "at iteration 1:" in text and "the hf engine's" in text
    assert "rollout.vllm.dtype" not in text  # a vLLM option, not the hf engine's
