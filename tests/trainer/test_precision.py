"""Where PPO's old log-probs come from (rollout.old_logprobs) and bfloat16 mixed precision
(model.mixed_precision): the engine's log-probs replace the scoring forward pass only where
they are the same quantity, and mixed precision computes in bfloat16 while the trained
weights and their optimizer state stay float32. Nano models, a few seconds in all."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from proxima.config import ConfigError, load_config
from proxima.models import load_causal_lm
from proxima.rollout.engines import engine_spec
from proxima.rollout.experience import build_experience
from proxima.rollout.plan import plan_scoring
from proxima.trainer.ppo import PPOTrainer
from proxima.trainer.update import PolicyObjective
from tests.trainer.nano import REWARD, nano_files, nano_trainer

HF, VLLM = engine_spec("hf"), engine_spec("vllm")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    return nano_files(tmp_path_factory.mktemp("precision"))


def make_trainer(files, *extra: str) -> PPOTrainer:
    return nano_trainer(files, *extra)


def _experience(trainer: PPOTrainer, ro, old_from_engine: bool):
    r = trainer.roles
    plan = replace(trainer.plan, old_logprobs="engine" if old_from_engine else "actor")
    return build_experience(
        ro.gen,
        torch.zeros(len(ro.prompts)),
        ro.group_ids,
        plan,
        actor=r.actor,
        reference=r.reference,
        critic=r.critic,
        rollout=replace(trainer.cfg.rollout, micro_batch_size=3),
        algorithm=trainer.cfg.algorithm,
    )


def test_auto_takes_the_engines_logprobs_in_float32_and_skips_the_actor_pass(files):
    trainer = make_trainer(files)
    assert trainer.plan.old_from_engine and trainer.plan.why.startswith("auto: exact")
    torch.manual_seed(0)
    ro = trainer.on_policy.generate()
    calls = []
    hook = trainer.roles.actor.register_forward_hook(lambda *a: calls.append(1))
    reused = _experience(trainer, ro, old_from_engine=True)
    assert calls == []  # no actor forward pass
    recomputed = _experience(trainer, ro, old_from_engine=False)
    hook.remove()
    assert calls  # the recompute path does run the actor
    mask = ro.gen.response_mask.bool()
    assert mask.sum() > 10
    # the same quantity: only the KV-cached decode's rounding differs
    torch.testing.assert_close(reused.old_logprobs, recomputed.old_logprobs, atol=1e-5, rtol=0)
    assert (reused.old_logprobs[~mask] == 0).all()
    # the KL penalty follows the old log-probs it was given
    torch.testing.assert_close(reused.kl, recomputed.kl, atol=1e-5, rtol=0)
    # the trust metric compares engine and trainer: meaningless once they are the same
    assert reused.rollout_logprobs is None and recomputed.rollout_logprobs is not None


@pytest.mark.parametrize("mode", ["auto", "recompute"])
def test_first_minibatch_logratio_is_zero_before_any_step(files, mode):
    trainer = make_trainer(files, f"rollout.old_logprobs={mode}")
    torch.manual_seed(1)
    metrics, _ = trainer.step()
    assert 0 <= metrics["actor/first_logratio_abs"] < 1e-5
    # after the first optimizer step (lr 1e-3) the mean over all mini-batches moves away
    assert metrics["actor/logratio_abs"] >= metrics["actor/first_logratio_abs"]


def test_engine_logprobs_under_other_weights_show_in_the_first_logratio(files):
    """A stale or mismatched behaviour policy is visible: the engine samples from weights
    the trainer no longer has."""
    trainer = make_trainer(files, "rollout.old_logprobs=engine")
    torch.manual_seed(2)
    ro = trainer.on_policy.generate()
    with torch.no_grad():  # the actor changes after the rollout, before the update
        for p in trainer.roles.actor.parameters():
            p.add_(0.05 * torch.randn_like(p))
    exp = _experience(trainer, ro, old_from_engine=True)
    exp = replace(exp, advantages=torch.zeros_like(exp.old_logprobs))
    _, stats = PolicyObjective(trainer.cfg.actor, 0.7)(trainer.roles.actor, exp)
    assert stats["logratio_abs"] > 1e-3


@pytest.mark.parametrize(
    ("override", "reason"),
    [
        ("rollout.top_k=5", "top_k"),
        ("rollout.top_p=0.9", "top_p"),
        ("model.mixed_precision=bf16", "float32"),
        ("algorithm.rollout_correction=token", "rollout_correction"),
        ("algorithm.rollout_rejection=token", "rollout_rejection"),
    ],
)
def test_auto_recomputes_where_the_engine_samples_another_distribution(files, override, reason):
    trainer = make_trainer(files, override)
    assert not trainer.plan.old_from_engine
    assert reason in trainer.plan.why and reason in trainer.plan.describe()


def test_auto_recomputes_when_the_generation_config_changes_the_sampler(files):
    trainer = make_trainer(files)
    config = load_causal_lm(files["model"]).generation_config
    assert HF.logprobs_differ(trainer.cfg, config) == ""
    assert plan_scoring(trainer.cfg, HF, config).old_from_engine
    config.suppress_tokens = [2]
    assert "suppress_tokens" in HF.logprobs_differ(trainer.cfg, config)
    assert not plan_scoring(trainer.cfg, HF, config).old_from_engine


def test_bf16_mixed_precision_computes_in_bf16_with_float32_master_weights(files):
    fp32 = make_trainer(files, "rollout.old_logprobs=recompute")
    mixed = make_trainer(files, "model.mixed_precision=bf16")
    assert not mixed.plan.old_from_engine  # auto: bf16 decode and forward pass round differently
    assert next(mixed.roles.reference.parameters()).dtype == torch.bfloat16
    torch.manual_seed(3)
    ro = fp32.on_policy.generate()
    with mixed.precision():
        low = _experience(mixed, ro, old_from_engine=False)
    high = _experience(fp32, ro, old_from_engine=False)
    assert low.old_logprobs.dtype == torch.float32
    assert not torch.equal(low.old_logprobs, high.old_logprobs)  # autocast did compute in bf16
    torch.testing.assert_close(low.old_logprobs, high.old_logprobs, atol=0.1, rtol=0)
    torch.testing.assert_close(low.values, high.values, atol=0.1, rtol=0)

    actor = mixed.trained["actor"]
    before = {n: p.detach().clone() for n, p in actor.model.named_parameters()}
    for _ in range(2):
        metrics, _ = mixed.step()
    assert all(torch.isfinite(torch.tensor(v)) for v in metrics.values())
    for name, p in actor.model.named_parameters():
        assert p.dtype == torch.float32, name
        for state in actor.optimizer.state[p].values():
            assert not torch.is_floating_point(state) or state.dtype == torch.float32
    moved = sum(not torch.equal(before[n], p) for n, p in actor.model.named_parameters())
    assert moved == len(before)  # lr 1e-3 in float32: every tensor changes


def test_precision_options_are_checked(files):
    with pytest.raises(ConfigError, match="model.dtype=float32"):
        load_config(None, ["model.mixed_precision=bf16", "model.dtype=bfloat16"])
    with pytest.raises(ConfigError, match="rollout_correction"):
        make_trainer(files, "rollout.old_logprobs=engine", "algorithm.rollout_correction=token")
    with pytest.raises(ConfigError, match="rollout_rejection` .which weigh by the ratio"):
        make_trainer(files, "rollout.old_logprobs=engine", "algorithm.rollout_rejection=sequence")
    with pytest.raises(ConfigError, match="rollout.old_logprobs"):
        load_config(None, ["rollout.old_logprobs=cached"])


def test_bf16_updates_see_the_weights_of_the_previous_optimizer_step(files):
    """autocast caches its bfloat16 copies of the weights while its context is open; a
    forward pass after an optimizer step in the same context would use the old weights.
    The second mini-batch's forward must equal a fresh autocast forward of the weights after
    the first step."""
    trainer = make_trainer(
        files,
        "model.mixed_precision=bf16",
        "critic.ppo_mini_batch_size=4",
        "critic.ppo_micro_batch_size=4",
    )
    critic = trainer.trained["critic"]
    calls, snapshots = [], []
    critic.model.register_forward_hook(
        lambda m, args, kwargs, out: calls.append((kwargs, out.logits.detach().clone())),
        with_kwargs=True,
    )
    critic.optimizer.register_step_post_hook(
        lambda *a: snapshots.append({k: v.clone() for k, v in critic.model.state_dict().items()})
    )
    torch.manual_seed(4)
    trainer.step()
    assert len(calls) == 3  # scoring, mini-batch 1, mini-batch 2 (after the first step)
    kwargs, seen = calls[2]
    fresh = load_critic_like(critic.model, snapshots[0])
    with trainer.precision(), torch.no_grad():
        expected = fresh(**kwargs).logits
    torch.testing.assert_close(seen, expected, atol=0, rtol=0)


def load_critic_like(model: torch.nn.Module, state: dict) -> torch.nn.Module:
    clone = copy.deepcopy(model)
    clone.load_state_dict(state)
    return clone


def test_auto_recomputes_for_another_engine(files):
    trainer = make_trainer(files)
    assert "vllm engine" in VLLM.logprobs_differ(trainer.cfg)
    assert plan_scoring(trainer.cfg, VLLM).old_logprobs == "actor"


@pytest.mark.parametrize("autocast", [False, True])
def test_generation_runs_under_autocast_only_when_asked(files, autocast):
    """model.mixed_precision=bf16: the scoring forward passes always run under bfloat16
    autocast, generation only with rollout.autocast=true (else in float32, as TRL samples)."""
    trainer = make_trainer(files, "model.mixed_precision=bf16", f"rollout.autocast={autocast}")
    seen = []
    trainer.roles.actor.register_forward_pre_hook(
        lambda *_: seen.append(torch.is_autocast_enabled("cpu"))
    )
    with trainer.precision(generation=True):  # as the sampler wraps phase 1
        ro = trainer.on_policy.generate()
    assert seen and set(seen) == {autocast}
    seen.clear()
    with trainer.precision():
        _experience(trainer, ro, old_from_engine=False)
    assert seen and set(seen) == {True}


def test_generation_autocast_is_refused_where_it_would_change_nothing(files):
    base = [f"model.actor_path={files['model']}", f"data.train_path={files['prompts']}"]
    base += [f"reward.function={REWARD}:fn", "rollout.autocast=true"]
    with pytest.raises(ConfigError, match="model.mixed_precision=no"):
        load_config(None, base)
    with pytest.raises(ConfigError, match="rollout.name=vllm"):
        load_config(None, [*base, "model.mixed_precision=bf16", "rollout.name=vllm"])
    assert load_config(None, [*base, "model.mixed_precision=bf16"]).rollout.autocast
