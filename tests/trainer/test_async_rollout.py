"""One-step asynchronous rollouts (`rollout.asynchronous`): every batch but the first is
sampled from the weights one version behind the ones it trains (the staleness accounting is
exact, critic warm-up included), the old log-probs are the trainer's own at its current
weights, the engine's feed the truncated importance weights (on by default), the batch
sampled ahead travels in the trainer's state, and the config refuses what cannot work."""

from __future__ import annotations

import pytest
import torch

from proxima.algos import truncated_is_weights
from proxima.config import ConfigError, load_config
from proxima.rng import seed_everything
from proxima.rollout.collect import rollout_from_state, rollout_state
from proxima.rollout.engines import engine_class
from proxima.rollout.experience import sequence_logprobs
from proxima.rollout.plan import plan_scoring
from proxima.rollout.types import Generation
from tests.rollout.scripted import spec
from tests.trainer.nano import REWARD, nano_files, nano_trainer

HF = engine_class("hf")

ASYNC = "rollout.asynchronous=true"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return nano_files(tmp_path_factory.mktemp("async"))


def _spy_update(trainer) -> list:
    """Record the Experience of every update (before it changes the weights), with the
    actor's own log-probs of it at that moment."""
    seen, update = [], trainer.update

    def spy(exp):
        mine = sequence_logprobs(trainer.roles.actor, _as_gen(exp), 0.7, 4)
        seen.append((exp, mine))
        return update(exp)

    trainer.update = spy
    return seen


def _as_gen(exp) -> Generation:
    return Generation(exp.input_ids, exp.attention_mask, exp.response_mask, exp.stopped)


def test_staleness_is_exactly_one_version_after_the_first_batch(files):
    trainer = nano_trainer(files, ASYNC)
    rows = []
    for k in range(3):
        metrics, ro = trainer.step()
        rows.append((metrics, ro))
        # the batch of the next iteration was sampled now, before this update: version k
        assert trainer.sampler.pending is not None
        assert trainer.sampler.pending[0].versions.tolist() == [k] * 8
        assert trainer.policy_version == k + 1
    # iteration 0 trains what it sampled (version 0); iteration k > 0 the batch sampled
    # during k - 1 from version k - 1, trained at version k
    for k, (metrics, ro) in enumerate(rows):
        assert ro.versions.tolist() == [max(k - 1, 0)] * 8, k
        # tokens generated this iteration: the batch sampled ahead (and, first, its own)
        made = trainer.sampler.pending[0] if k == 2 else rows[k + 1][1]
        tokens = float(made.gen.response_mask.sum())
        tokens += float(ro.gen.response_mask.sum()) if k == 0 else 0.0
        speed = tokens / metrics["time/generate"]
        assert metrics["tokens_per_s"] == pytest.approx(speed, rel=1e-12)
        assert metrics["rollout/staleness_mean"] == (0.0 if k == 0 else 1.0)
        assert metrics["rollout/staleness_max"] == (0.0 if k == 0 else 1.0)


def test_the_pending_batch_is_the_next_iterations_batch(files):
    trainer = nano_trainer(files, ASYNC)
    trainer.step()
    ahead = trainer.sampler.pending[0]
    _, ro = trainer.step()
    assert ro is ahead  # iteration 1 trains exactly what iteration 0 sampled ahead


def test_critic_warmup_leaves_the_policy_version_and_the_staleness_at_zero(files):
    # iteration 0 only warms the critic up: the policy stays version 0, so the batch that
    # iteration 1 trains (sampled during 0) is not stale; iteration 1 updates the actor, so
    # the batch of iteration 2 (sampled during 1, from version 0) is one version behind
    trainer = nano_trainer(files, ASYNC, "critic.warmup_iterations=1")
    got = [trainer.step()[0] for _ in range(3)]
    assert [m["rollout/staleness_max"] for m in got] == [0.0, 0.0, 1.0]
    assert trainer.policy_version == 2


def test_old_logprobs_are_the_trainers_and_the_correction_weights_the_gap(files):
    trainer = nano_trainer(files, ASYNC)
    assert trainer.cfg.algorithm.rollout_correction == "token"  # on by default
    assert trainer.plan.old_logprobs == "actor"
    seen = _spy_update(trainer)
    trainer.step()
    trainer.step()
    cap = trainer.cfg.algorithm.rollout_correction_cap
    for k, (exp, mine) in enumerate(seen):
        # PPO's old log-probs: the trainer's pass at its current (pre-update) weights
        assert torch.allclose(exp.old_logprobs, mine, atol=1e-6), k
        want, _ = truncated_is_weights(
            exp.old_logprobs, exp.rollout_logprobs, exp.response_mask, cap=cap, level="token"
        )
        assert torch.equal(exp.is_weights, want), k
    mask = seen[0][0].response_mask.bool()
    # iteration 0: sampled and trained at version 0 (float32 hf engine): weights ~ 1
    assert (seen[0][0].is_weights[mask] - 1).abs().max() < 1e-4
    # iteration 1: sampled at version 0, trained at version 1: the weights correct the gap
    mask = seen[1][0].response_mask.bool()
    gap = (seen[1][0].old_logprobs - seen[1][0].rollout_logprobs)[mask]
    assert gap.abs().max() > 1e-3
    assert (seen[1][0].is_weights[mask] - 1).abs().max() > 1e-3


def test_synchronous_runs_record_no_staleness_and_keep_nothing(files):
    trainer = nano_trainer(files)
    metrics, ro = trainer.step()
    assert trainer.sampler is trainer.on_policy  # no batch kept between iterations
    assert not any(k.startswith("rollout/staleness") for k in metrics)
    assert ro.versions.tolist() == [0] * 8
    assert trainer.state_dict()["sampler"] == {}  # nothing gathered either


def test_the_pending_batch_round_trips_through_the_state(files, tmp_path):
    trainer = nano_trainer(files, ASYNC)
    trainer.step()
    path = tmp_path / "state.pt"
    torch.save(trainer.state_dict(), path)
    state = torch.load(path, weights_only=True)
    assert len(state["sampler"]["pending"]) == 1  # one entry per rank
    mine = state["sampler"]["pending"][0]
    back = rollout_from_state(mine["rollout"], "cpu")
    ro = trainer.sampler.pending[0]
    assert back.prompts == ro.prompts and back.responses == ro.responses
    assert back.columns == ro.columns
    for name in ("input_ids", "attention_mask", "response_mask", "stopped", "logprobs"):
        assert torch.equal(getattr(back.gen, name), getattr(ro.gen, name)), name
    for name in ("group_ids", "scores", "versions"):
        assert torch.equal(getattr(back, name), getattr(ro, name)), name
    assert mine["stats"] == trainer.sampler.pending[1]
    assert rollout_state(back).keys() == mine["rollout"].keys()
    fresh = nano_trainer(files, ASYNC)
    fresh.load_state_dict(state)
    assert torch.equal(fresh.sampler.pending[0].gen.input_ids, ro.gen.input_ids)
    # another number of processes than the checkpoint's: its rows are not this rank's
    fresh.load_state_dict({**state, "sampler": {"pending": [mine, mine]}})
    assert fresh.sampler.pending is None  # the next iteration samples its own batch


def test_config_defaults_and_refusals(files):
    base = [
        f"model.actor_path={files['model']}",
        f"data.train_path={files['prompts']}",
        f"reward.function={REWARD}:fn",
    ]
    assert load_config(None, base).algorithm.rollout_correction == ""
    assert load_config(None, [*base, ASYNC]).algorithm.rollout_correction == "token"
    # a correction the user set, off included, stays as set
    off = load_config(None, [*base, ASYNC, "algorithm.rollout_correction="])
    assert off.algorithm.rollout_correction == ""
    seq = load_config(None, [*base, ASYNC, "algorithm.rollout_correction=sequence"])
    assert seq.algorithm.rollout_correction == "sequence"
    # a rejection alone leaves the importance weights on: verl combines the two
    rs = load_config(None, [*base, ASYNC, "algorithm.rollout_rejection=token"]).algorithm
    assert (rs.rollout_correction, rs.rollout_rejection) == ("token", "token")
    # auto recomputes even where the engine's log-probs would otherwise be exact
    plan = plan_scoring(off, HF)
    assert plan.old_logprobs == "actor" and "asynchronous" in plan.why
    assert plan_scoring(load_config(None, base), HF).old_logprobs == "engine"
    for cfg in (off, seq):  # named for the stale weights, whatever the correction
        with pytest.raises(ConfigError, match="rollout.old_logprobs=engine.*asynchronous"):
            plan_scoring(cfg.replace({"rollout.old_logprobs": "engine"}), HF)
    with pytest.raises(ConfigError, match="Did you mean `rollout.asynchronous`"):
        load_config(None, [*base, "rollout.async=true"])


def _comparable(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if not k.startswith(("time/", "tokens_per_s"))}


def test_a_failed_iteration_keeps_the_pending_batch_and_replays_exactly(files):
    seed_everything(0)
    a = nano_trainer(files, ASYNC)
    want = [_comparable(a.step()[0]) for _ in range(2)]
    seed_everything(0)
    b = nano_trainer(files, ASYNC)
    assert _comparable(b.step()[0]) == want[0]
    pending, update = b.sampler.pending, b.update

    def fail(exp):
        raise RuntimeError("boom")

    b.update = fail
    with pytest.raises(RuntimeError, match="boom"):
        b.step()
    assert b.undo_iteration()
    assert b.sampler.pending is pending  # the batch sampled during iteration 0 is still next
    b.update = update
    assert _comparable(b.step()[0]) == want[1]


def test_dynamic_sampling_keeps_each_samples_version(files):
    # DAPO's rounds are cut and concatenated by group: the versions travel with the rows
    trainer = nano_trainer(
        files,
        ASYNC,
        f"reward.function={REWARD}:even_first_digit_varies",
        "algorithm.adv_estimator=grpo",
        "rollout.n=2",
        "algorithm.filter_groups=true",
    )
    got = [trainer.step() for _ in range(2)]
    assert got[0][1].versions.tolist() == [0] * 16
    assert got[1][1].versions.tolist() == [0] * 16
    assert [m["rollout/staleness_max"] for m, _ in got] == [0.0, 1.0]
    assert trainer.sampler.pending[0].versions.tolist() == [1] * 16


def test_a_critic_on_the_actor_takes_its_values_from_the_trainers_pass(files):
    trainer = nano_trainer(files, ASYNC, "critic.shared_backbone=true")
    assert (trainer.plan.old_logprobs, trainer.plan.values) == ("actor", "actor")
    got = [trainer.step()[0] for _ in range(2)]
    assert got[1]["rollout/staleness_mean"] == 1.0
    assert all(torch.isfinite(torch.tensor(m["critic/explained_variance"])) for m in got)


def test_multi_turn_episodes_and_lora_ride_in_the_pending_batch(files, tmp_path):
    # an episode's record (turns, end, return) is plain data: it survives weights_only
    trainer = nano_trainer(
        files,
        ASYNC,
        f"rollout.env={spec('Never')}",
        "rollout.env.max_turns=2",
        "rollout.env.max_turn_tokens=3",
        "rollout.env.max_episode_tokens=10",
        "model.lora_rank=4",
    )
    got = [trainer.step() for _ in range(2)]
    assert [m["rollout/staleness_max"] for m, _ in got] == [0.0, 1.0]
    assert got[1][0]["env/turns"] == 2.0
    torch.save(trainer.state_dict(), tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)
    back = rollout_from_state(state["sampler"]["pending"][0]["rollout"], "cpu")
    assert back.episodes == trainer.sampler.pending[0].episodes and len(back.episodes) == 8
    assert torch.equal(back.gen.turn_rewards, trainer.sampler.pending[0].gen.turn_rewards)
