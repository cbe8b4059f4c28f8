"""Multi-turn episodes through phases 3-6: a scripted episode's token rewards, GAE advantages
and returns and a critic-free estimator's advantages, worked out by hand (observation
positions are transparent: gamma and lambda step from action token to action token); the
losses and their gradients ignore observation positions; on a real tiny model the hf
engine's log-probs (and a value head's values from generation) at action tokens equal the
trainer's recomputed ones; a trainer iteration with an environment reports its metrics."""

from __future__ import annotations

import pytest
import torch

from proxima.config import (
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    EnvConfig,
    RolloutConfig,
)
from proxima.data import PromptItem
from proxima.models import build_char_tokenizer, build_tiny_model
from proxima.models.critic import PolicyValue, ValueHead, new_value_head
from proxima.models.forward import response_logits_values
from proxima.rollout.collect import generate_rollout
from proxima.rollout.experience import sequence_logprobs
from proxima.trainer.advantages import BatchView, estimate_advantages
from proxima.trainer.update import PolicyObjective
from proxima.types import Experience
from tests.rollout.scripted import ALPHABET, EOS, ScriptedEngine, spec

A, B, C, X, Y = 4, 5, 6, 7, 8
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def episode():
    """Row 0: a c | x y | b EOS, row 1: a a a | x y | EOS (| = turn boundaries; x y the
    observation), turn rewards 0.5 then 1.0 (tests/rollout/test_episodes.py checks it)."""
    tok = build_char_tokenizer(ALPHABET)
    cfg = RolloutConfig(
        env=EnvConfig(spec("TwoTurns"), max_turn_tokens=3, max_episode_tokens=12, turn_stop=["c"])
    )
    engine = ScriptedEngine([[[A, C], [A, A, A]], [[B, EOS], [EOS]]])
    items = [PromptItem("ab", [A, B]) for _ in range(2)]
    return generate_rollout(engine, tok, items, cfg, CPU, n=1, logprobs=True)


def _batch(ro, values) -> BatchView:
    g = ro.gen
    return BatchView(
        scores=torch.tensor([2.0, 0.0]),  # the reward source's score of each episode
        stopped=g.stopped,
        # nonzero on the observation positions too: they must be ignored
        kl=torch.tensor([[0.2, 0.1, 7, 7, 0.3, 0.5], [0, 0, 0, 5, 5, 0]]),
        response_mask=g.response_mask,
        values=values,
        group_ids=torch.tensor([0, 0]),
        turn_rewards=g.turn_rewards,
    )


def test_gae_across_turns_by_hand(episode):
    """kl_coef 0.1, gamma 0.5, lam 0.9. Row 0's action tokens t = 0, 1, 4, 5: token rewards
    -0.02, 0.5 - 0.01, -0.03, 1.0 + 2.0 - 0.05 (turn rewards at t = 1 and 5, score at 5);
    values 0.1, 0.2, 0.3, 0.4 (9 on the observation: ignored). Backwards:
      t5: delta = 2.95 - 0.4 = 2.55                      A = 2.55
      t4: delta = -0.03 + 0.5 * 0.4 - 0.3 = -0.13        A = -0.13 + 0.45 * 2.55 = 1.0175
      t1: delta = 0.49 + 0.5 * 0.3 - 0.2 = 0.44          A = 0.44 + 0.45 * 1.0175 = 0.897875
      t0: delta = -0.02 + 0.5 * 0.2 - 0.1 = -0.02        A = -0.02 + 0.45 * 0.897875
                                                           = 0.38404375
    Row 1 (t = 0, 1, 2, 5; rewards 0, 0, 0.5, 1.0; values 0.5 each):
      t5: 1 - 0.5 = 0.5; t2: 0.5 + 0.25 - 0.5 = 0.25, A = 0.25 + 0.45 * 0.5 = 0.475;
      t1: -0.25 + 0.45 * 0.475 = -0.03625; t0: -0.25 + 0.45 * -0.03625 = -0.2663125.
    Were the observation positions steps, gamma and lambda would apply twice more."""
    values = torch.tensor([[0.1, 0.2, 9, 9, 0.3, 0.4], [0.5, 0.5, 0.5, 9, 9, 0.5]])
    alg = AlgorithmConfig(gamma=0.5, lam=0.9, whiten_advantages=False)
    est = estimate_advantages(_batch(episode, values), alg, kl_coef=0.1, no_stop_penalty=0.0)
    want_r = [[-0.02, 0.49, 0, 0, -0.03, 2.95], [0, 0, 0.5, 0, 0, 1.0]]
    want_a = [[0.38404375, 0.897875, 0, 0, 1.0175, 2.55], [-0.2663125, -0.03625, 0.475, 0, 0, 0.5]]
    want_ret = [[0.48404375, 1.097875, 0, 0, 1.3175, 2.95], [0.2336875, 0.46375, 0.975, 0, 0, 1.0]]
    torch.testing.assert_close(est.token_rewards, torch.tensor(want_r))
    torch.testing.assert_close(est.advantages, torch.tensor(want_a))
    torch.testing.assert_close(est.returns, torch.tensor(want_ret))
    # the reward stat counts the turn rewards: row sums 3.39 and 1.5
    assert est.stats["reward"] == pytest.approx((3.39 + 1.5) / 2)


def test_critic_free_outcome_is_the_episode_return(episode):
    """rloo: outcomes 3.39 (row 0: 0.5 + 1.0 + 2.0 - 0.11 KL) and 1.5 (row 1); A = n / (n - 1)
    (outcome - group mean) = 2 (3.39 - 2.445) = 1.89 and -1.89 on the action tokens."""
    alg = AlgorithmConfig(adv_estimator="rloo")
    est = estimate_advantages(_batch(episode, None), alg, kl_coef=0.1, no_stop_penalty=0.0)
    mask = episode.gen.response_mask.float()
    torch.testing.assert_close(est.advantages, torch.tensor([[1.89], [-1.89]]) * mask)


def _experience(gen, logprobs) -> Experience:
    return Experience(
        input_ids=gen.input_ids,
        attention_mask=gen.attention_mask,
        response_mask=gen.response_mask,
        old_logprobs=logprobs.detach(),
        ref_logprobs=logprobs.detach() - 0.3,
        values=torch.full(gen.response_mask.shape, 0.2),
        advantages=torch.tensor(
            [[1.0, -2.0, 3.0, 0.5, 1.5, -1.0], [0.5, 1.0, -1.5, 2.0, 1.0, 2.0]]
        ),
        returns=torch.full(gen.response_mask.shape, 0.7),
    )


def test_loss_and_gradient_ignore_observations(episode):
    """The actor's loss (clipped surrogate, entropy bonus, KL loss) and the value loss of a
    shared critic: the gradient at observation positions is exactly 0, and logits / values
    changed there change neither the loss nor the gradient elsewhere."""
    gen = episode.gen
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 10)
    lp = torch.log_softmax(logits, -1).gather(-1, gen.response_ids.unsqueeze(-1))[..., 0]
    mb = _experience(gen, lp + 0.05)
    actor = ActorConfig(entropy_coef=0.01, use_kl_loss=True, kl_loss_coef=0.1)
    objective = PolicyObjective(actor, temperature=1.0)
    critic = ValueHead(CriticConfig(), torch.nn.Linear(2, 1))
    obs = (gen.response_mask == 0).unsqueeze(-1)

    def loss_and_grads(logits, values):
        logits = logits.clone().requires_grad_(True)
        values = values.clone().requires_grad_(True)
        packed = logits[mb.response_mask.bool()]  # the policy reads its positions only
        loss = objective.policy_terms(packed, mb)[0] + critic.value_terms(values, mb)[0]
        return (loss, *torch.autograd.grad(loss, (logits, values)))

    values = torch.rand(2, 6)
    loss, g_logits, g_values = loss_and_grads(logits, values)
    assert float(g_logits[obs.expand_as(g_logits)].abs().max()) == 0.0
    assert float(g_values[obs[..., 0]].abs().max()) == 0.0
    assert float(g_logits.abs().max()) > 0 and float(g_values.abs().max()) > 0
    changed = loss_and_grads(
        logits + 5.0 * torch.randn_like(logits) * obs, values + 3 * obs[..., 0]
    )
    torch.testing.assert_close(changed[0], loss, rtol=0, atol=1e-6)
    torch.testing.assert_close(changed[1], g_logits, rtol=0, atol=1e-7)
    torch.testing.assert_close(changed[2], g_values, rtol=0, atol=1e-7)


@pytest.fixture(scope="module")
def tiny():
    tok = build_char_tokenizer("0123456789+=[]*")
    model = build_tiny_model("llama", tok, "nano", max_positions=64, seed=0)
    return tok, model


def _real_episodes(tok, model, **kw):
    cfg = RolloutConfig(
        env=EnvConfig(
            spec("Never"), max_turns=3, max_turn_tokens=4, max_episode_tokens=20, turn_stop=["]"]
        ),
        temperature=0.8,
    )
    items = [
        PromptItem(p, tok(p, add_special_tokens=False)["input_ids"]) for p in ["1+2=", "33*4="]
    ]
    torch.manual_seed(3)
    return generate_rollout(model, tok, items, cfg, CPU, n=2, logprobs=True, **kw)


def test_hf_engine_logprobs_equal_trainer_at_action_tokens(tiny):
    """float32: the engine's log-probs of each action token, sampled turn by turn from
    contexts that hold the observations, equal one trainer forward pass over the whole
    episode within 1e-5; every observation token ("z" is <unk> here) has mask 0."""
    tok, model = tiny
    ro = _real_episodes(tok, model)
    g = ro.gen
    assert int((g.response_mask == 0).sum()) > 0 and ro.episodes[0]["end"] == "max_turns"
    trainer = sequence_logprobs(model, g, 0.8, 8)
    torch.testing.assert_close(trainer, g.logprobs, rtol=0, atol=1e-5)
    obs_positions = (g.attention_mask[:, -g.response_mask.shape[1] :] == 1) & (g.response_mask == 0)
    assert (g.response_ids[obs_positions] == tok.unk_token_id).all()  # only observations
    assert int(obs_positions.sum()) == 2 * 4  # 2 observations of 1 token in each of 4 episodes


def test_generation_values_equal_actor_pass(tiny):
    """A value head on the actor: the values from the decode steps of every turn equal the
    actor's pass over the episode (critic.shared_backbone with the engine's log-probs)."""
    tok, model = tiny
    actor = PolicyValue(model, new_value_head(model, seed=1))
    ro = _real_episodes(tok, actor, values=True)
    g = ro.gen
    r = g.response_mask.shape[1]
    with torch.no_grad():
        _, values = response_logits_values(actor, g.input_ids, g.attention_mask, r, 0.8)
    torch.testing.assert_close(g.values, values * g.response_mask, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "extra",
    [
        (),
        ("critic.shared_backbone=true", "model.critic_init=actor"),
        ("model.lora_rank=4",),
        ("algorithm.adv_estimator=grpo", "rollout.n=2", "data.train_batch_size=4"),
    ],
    ids=["gae", "shared_backbone", "lora", "grpo"],
)
def test_trainer_iteration_with_env(tmp_path, extra):
    """One PPO iteration on episodes (GAE with a critic of its own or on the actor's
    backbone, LoRA, grpo): env metrics and the samples' episodes."""
    from tests.trainer.nano import nano_files, nano_trainer

    trainer = nano_trainer(
        nano_files(tmp_path),
        f"rollout.env={spec('Never')}",
        "rollout.env.max_turns=2",
        "rollout.env.max_turn_tokens=3",
        "rollout.env.max_episode_tokens=10",
        *extra,
    )
    metrics, ro = trainer.step()
    assert metrics["env/turns"] == 2.0 and metrics["env/truncated"] == 1.0
    assert metrics["env/reward_per_turn"] == 0.25
    assert metrics["env/errors"] == 0.0 and metrics["env/timeouts"] == 0.0
    assert metrics["env/return"] == pytest.approx(0.5 + float(ro.scores.mean()))
    assert len(ro.episodes) == 8 and len(ro.episodes[0]["turns"]) == 2
    assert metrics["actor/optimizer_steps"] >= 1
