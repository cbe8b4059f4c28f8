"""critic.shared_backbone: one network with a policy head and a value head (PPO's shared
parameterisation). The value head reads the LM head's input; the values come with the
actor's scoring pass, or from the generation itself when the old log-probs do; one forward /
backward per micro-batch trains both losses. Nano models, a few seconds in all."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from proxima.config import ConfigError
from proxima.models import init_model, load_causal_lm
from proxima.models.critic import PolicyValue, ValueHead, lm_head, new_value_head, value_of
from proxima.models.forward import (
    position_ids_from_mask,
    response_logits,
    response_logits_values,
)
from proxima.rollout.engines import engine_spec
from proxima.rollout.experience import build_experience, sequence_logprobs
from proxima.rollout.hf_engine import HFEngine
from proxima.rollout.plan import plan_scoring
from proxima.rollout.types import Sampling
from proxima.trainer.ppo import PPOTrainer
from proxima.trainer.update import PolicyObjective
from tests.trainer.nano import nano_files, nano_trainer

HF, VLLM = engine_spec("hf"), engine_spec("vllm")

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    return nano_files(tmp_path_factory.mktemp("shared"))


def make_trainer(files, *extra: str) -> PPOTrainer:
    return nano_trainer(
        files, "critic.optim.lr=3e-3", "critic.shared_backbone=true", "critic.vf_coef=0.7", *extra
    )


def count_calls(module: torch.nn.Module) -> list:
    calls: list = []
    module.register_forward_hook(lambda *a: calls.append(1))
    return calls


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen2", "gpt_neox"])
def test_values_read_the_lm_heads_input(tmp_path, arch):
    """The value head reads the final (normalised) hidden state the logits come from, at
    the positions a value model's values are read (P + t - 1 for response token t)."""
    model = load_causal_lm(init_model(tmp_path / arch, arch, "nano", alphabet="abcdefghij", seed=1))
    both = PolicyValue(model, new_value_head(model, seed=3))
    torch.manual_seed(0)
    ids = torch.randint(3, 8, (3, 9))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # left padding
    r = 4
    logits, values = response_logits_values(both, ids, mask, r, temperature=0.5)
    torch.testing.assert_close(logits, response_logits(model, ids, mask, r, 0.5))
    base = model.base_model(
        input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)
    )
    hidden = base.last_hidden_state[:, -r - 1 : -1]
    assert hidden.shape == (3, r, lm_head(model).weight.shape[1])
    torch.testing.assert_close(lm_head(model)(hidden) / 0.5, logits)
    torch.testing.assert_close(values, value_of(both.value_head, hidden))


def test_generation_values_equal_the_scoring_pass(files):
    trainer = make_trainer(files)
    assert trainer.plan.old_from_engine and trainer.plan.values == "generation"
    assert isinstance(trainer.roles.critic, ValueHead) and "critic" not in trainer.trained
    torch.manual_seed(0)
    ro = trainer.on_policy.generate()
    gen = ro.gen
    mask = gen.response_mask.bool()
    assert gen.values is not None and mask.sum() > 10 and (gen.values[~mask] == 0).all()
    r = gen.response_mask.shape[1]
    with torch.no_grad():
        _, values = response_logits_values(
            trainer.roles.actor, gen.input_ids, gen.attention_mask, r
        )
        want = values * gen.response_mask
    assert float(want[mask].std()) > 1e-3  # values that differ between states
    torch.testing.assert_close(gen.values, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("mode", ["auto", "recompute"])
def test_scoring_passes_of_the_actor(files, mode):
    """Engine log-probs: no actor pass at all (the values came with the generation).
    Recompute: one pass per micro-batch gives both log-probs and values."""
    trainer = make_trainer(files, f"rollout.old_logprobs={mode}", "rollout.micro_batch_size=3")
    torch.manual_seed(1)
    ro = trainer.on_policy.generate()
    calls = count_calls(trainer.roles.actor.policy.model)  # the decoder: once per actor pass
    exp = build_experience(
        ro.gen,
        torch.zeros(len(ro.prompts)),
        ro.group_ids,
        trainer.plan,
        actor=trainer.roles.actor,
        reference=None,
        critic=trainer.roles.critic,
        rollout=trainer.cfg.rollout,
        algorithm=trainer.cfg.algorithm,
    )
    assert len(calls) == (0 if mode == "auto" else 3)  # 8 rows in micro-batches of 3
    assert exp.values is not None and exp.values.abs().sum() > 0
    want_old = sequence_logprobs(trainer.roles.actor.policy, ro.gen, 0.7, 8)
    torch.testing.assert_close(exp.old_logprobs, want_old, atol=1e-5, rtol=0)


def _experience(trainer: PPOTrainer):
    """One iteration's experience with advantages and returns (the update not run)."""
    captured = {}

    def keep(exp):
        captured["exp"] = exp
        return {}

    trainer.update = keep
    torch.manual_seed(2)
    trainer.step()
    return captured["exp"]


def test_one_loss_is_the_actor_loss_plus_vf_coef_times_the_value_loss(files):
    trainer = make_trainer(files)
    exp = _experience(trainer)
    actor, critic, cfg = trainer.roles.actor, trainer.roles.critic, trainer.cfg
    params = list(actor.parameters())  # the policy's, then the value head's

    def grads(loss):
        return torch.autograd.grad(loss, params, allow_unused=True)

    loss, stats = PolicyObjective(cfg.actor, 0.7, critic=critic)(actor, exp)
    got = grads(loss)
    a_loss, a_stats = PolicyObjective(cfg.actor, 0.7)(actor.policy, exp)
    r = exp.response_mask.shape[1]
    _, values = response_logits_values(actor, exp.input_ids, exp.attention_mask, r, 0.7)
    v_loss, _ = critic.value_terms(values, exp)
    torch.testing.assert_close(loss, a_loss + 0.7 * v_loss)
    assert stats["pg_loss"] == a_stats["pg_loss"]
    assert stats["critic/vf_loss"] == float(v_loss.detach())
    g_actor, g_value = grads(a_loss), grads(v_loss)
    for g, ga, gv, p in zip(got, g_actor, g_value, params, strict=True):
        want = (ga if ga is not None else 0) + 0.7 * (gv if gv is not None else 0)
        torch.testing.assert_close(g, want * torch.ones_like(p), atol=1e-7, rtol=1e-5)
    # the value loss trains the backbone too, not only its head
    layer = actor.policy.model.layers[0].mlp.up_proj.weight
    at = next(i for i, p in enumerate(params) if p is layer)
    assert float(g_value[at].abs().max()) > 0


def test_one_forward_and_one_optimizer_per_micro_batch(files):
    trainer = make_trainer(files, "actor.ppo_epochs=2")
    calls = count_calls(trainer.roles.actor.policy.model)
    update = trainer.update

    def counted(exp):  # the update's passes only (generation runs the actor too)
        calls.clear()
        return update(exp)

    trainer.update = counted
    head = trainer.roles.critic.head
    head_before = head.weight.detach().clone()
    torch.manual_seed(3)
    metrics, _ = trainer.step()
    assert len(calls) == 4  # 2 epochs x 2 micro-batches, no critic pass
    assert metrics["actor/optimizer_steps"] == 2
    assert "critic/vf_loss" in metrics and "critic/explained_variance" in metrics
    assert not torch.equal(head_before, head.weight)
    # the value head at critic.optim.lr, on its own (here the same) schedule
    groups = trainer.trained["actor"].optimizer.param_groups
    assert groups[1]["initial_lr"] == 3e-3 and groups[0]["initial_lr"] == 1e-3
    assert groups[1]["lr"] / groups[0]["lr"] == pytest.approx(3.0)
    assert metrics["critic/lr"] == groups[1]["lr"] and metrics["actor/lr"] == groups[0]["lr"]


def test_warmup_trains_only_the_value_head(files):
    trainer = make_trainer(files, "critic.warmup_iterations=1")
    policy, head = trainer.roles.actor.policy, trainer.roles.critic.head
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    head_before = head.weight.detach().clone()
    torch.manual_seed(4)
    metrics, _ = trainer.step()
    after = policy.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not torch.equal(head_before, head.weight)
    assert "critic/vf_loss" in metrics and "actor/pg_loss" not in metrics
    assert trainer.weight_version == 0  # the engine's weights did not change
    metrics, _ = trainer.step()
    assert "actor/pg_loss" in metrics and trainer.weight_version == 1


def test_a_zero_head_gives_zero_values_then_learns(files):
    """critic.head_init=zero: the first batch's values are all 0 (the advantages are the
    returns, whitened), and the head's first step moves it off zero."""
    trainer = make_trainer(files, "critic.head_init=zero")
    head = trainer.roles.critic.head
    assert torch.count_nonzero(head.weight) == 0 and torch.count_nonzero(head.bias) == 0
    torch.manual_seed(4)
    trainer.step()
    assert torch.count_nonzero(head.weight) > 0


def test_models_and_optimizer_state_round_trip(files, tmp_path):
    trainer = make_trainer(files)
    torch.manual_seed(5)
    trainer.step()
    trainer.save_models(tmp_path)
    assert (tmp_path / "value_head" / "model.safetensors").is_file()
    assert not (tmp_path / "critic").exists()
    state = trainer.state_dict()
    other = make_trainer(files)
    mine, theirs = trainer.roles.critic.head, other.roles.critic.head
    with torch.no_grad():
        theirs.weight.zero_()
    other.load_models(tmp_path)
    other.load_state_dict(state)
    torch.testing.assert_close(theirs.weight, mine.weight)
    torch.testing.assert_close(theirs.bias, mine.bias)
    # resumed: the next iteration is the same as the uninterrupted one's
    torch.manual_seed(6)
    want, _ = trainer.step()
    torch.manual_seed(6)
    got, _ = other.step()
    for key in ("score", "critic/vf_loss", "actor/pg_loss", "values_mean"):
        assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key


def test_a_checkpoint_without_a_value_head_is_refused(files, tmp_path):
    trainer = make_trainer(files)
    trainer.save_models(tmp_path)
    shutil.rmtree(tmp_path / "value_head")
    with pytest.raises(FileNotFoundError, match="shared_backbone"):
        trainer.load_models(tmp_path)


@pytest.mark.parametrize(
    "override, match",
    [
        ("algorithm.adv_estimator=grpo", "uses no critic"),
        ("model.critic_init=reward_model", "separate critic"),
        ("model.critic_path=/x", "separate critic"),
        ("critic.vf_coef=0", "vf_coef"),
        ("rollout.name=vllm rollout.old_logprobs=engine", "only the hf engine"),
    ],
)
def test_options_that_cannot_apply_are_refused(files, override, match):
    with pytest.raises(ConfigError, match=match):
        make_trainer(files, *override.split())


def test_only_an_actor_that_carries_the_critic_gives_values(files):
    trainer = make_trainer(files)
    ids, mask = torch.full((2, 3), 4), torch.ones(2, 3, dtype=torch.long)
    sampling = Sampling(max_new_tokens=2, stop_ids=(1,), values=True)
    assert HFEngine(trainer.roles.actor, 0, 8).generate(ids, mask, sampling).values is not None
    plain = HFEngine(trainer.roles.actor.policy, 0, 8)  # the policy alone: no value head
    with pytest.raises(ValueError, match="value head"):
        plain.generate(ids, mask, sampling)
    assert plain.generate(ids, mask, replace(sampling, values=False)).values is None


def test_the_plan_takes_the_values_with_the_old_logprobs(files):
    trainer = make_trainer(files)
    cfg = trainer.cfg
    assert plan_scoring(cfg, HF).values == "generation"
    assert plan_scoring(cfg, VLLM).values == "actor"  # vllm: an actor pass
    recompute = cfg.replace({"rollout.old_logprobs": "recompute"})
    assert plan_scoring(recompute, HF).values == "actor"
    assert plan_scoring(cfg.replace({"critic.shared_backbone": False}), HF).values == "critic"
    free = cfg.replace({"critic.shared_backbone": False, "algorithm.adv_estimator": "grpo"})
    assert plan_scoring(free, HF).values == ""


def test_new_value_head_is_seeded_and_leaves_the_global_rng(files):
    actor = load_causal_lm(files["model"])
    torch.manual_seed(9)
    state = torch.get_rng_state()
    a, b = new_value_head(actor, seed=1), new_value_head(actor, seed=1)
    assert torch.equal(torch.get_rng_state(), state)
    torch.testing.assert_close(a.weight, b.weight)
    assert not torch.equal(a.weight, new_value_head(actor, seed=2).weight)
    assert float(a.bias.detach().abs().max()) == 0


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["critic.ppo_epochs=2"], r"`critic.ppo_epochs`=2 would be ignored.*`actor.ppo_epochs`=1"),
        (["critic.shuffle=false"], r"`critic.shuffle`=False would be ignored"),
        (["critic.optim.grad_clip=0.5"], r"`critic.optim.grad_clip`=0.5 would be ignored"),
        (["model.critic_lora=false"], r"`model.critic_lora`=False configure a separate critic"),
    ],
)
def test_critic_keys_the_value_head_would_ignore_are_refused(files, overrides, match):
    with pytest.raises(ConfigError, match=match):
        make_trainer(files, *overrides)


def test_critic_keys_equal_to_the_actors_are_accepted(files):
    """A config that sets the critic's steps like the actor's (the default example does)
    runs with the value head: the keys say nothing the head would ignore."""
    trainer = make_trainer(files, "critic.ppo_epochs=2", "actor.ppo_epochs=2")
    assert "critic" not in trainer.trained


def test_the_heads_optimizer_group_has_the_critics_settings(files):
    trainer = make_trainer(
        files,
        "critic.optim.betas=[0.8,0.9]",
        "critic.optim.eps=1e-6",
        "critic.optim.weight_decay=0.1",
        "critic.optim.warmup_steps=4",
    )
    role = trainer.trained["actor"]
    policy, head = role.optimizer.param_groups
    assert [name for name, _, _ in role.groups] == ["actor", "critic"]
    assert policy["betas"] == (0.9, 0.95) and policy["eps"] == 1e-8
    assert policy["weight_decay"] == 0.0
    assert head["betas"] == (0.8, 0.9) and head["eps"] == 1e-6 and head["weight_decay"] == 0.1
    assert head["params"] == list(trainer.roles.critic.head.parameters())
    # warm-up of its own: step 0 of 4 -> lr x 1/4, while the policy's group has none
    assert head["lr"] == pytest.approx(3e-3 / 4) and policy["lr"] == pytest.approx(1e-3)
    assert role.lrs() == {"actor": policy["lr"], "critic": head["lr"]}
