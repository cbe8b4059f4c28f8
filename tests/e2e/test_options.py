"""Every documented algorithm option runs end to end through the trainer (the estimators
and policy losses: test_loss_variants.py): KL as a loss, the adaptive controller, the ptx
loss, a reward model (critic initialised from it, as OpenRLHF advises), the other KL
estimators, the DAPO recipe's keys.
Each run must train (weights move), log finite metrics and report the option's own metrics."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from proxima.cli import main
from proxima.logging import read_metrics
from proxima.models import build_tiny_reward_model, load_tokenizer

pytestmark = pytest.mark.slow


def _run(fast_overrides, make_model, tmp_path: Path, *extra: str, name: str = "run") -> list[dict]:
    """Two iterations of `extra` in tmp_path/name; `make_model` a fixture or a built folder."""
    out = tmp_path / name
    model = make_model() if callable(make_model) else make_model
    assert main(["train", *fast_overrides(model, out, 2, *extra)]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        bad = {k: v for k, v in row.items() if isinstance(v, float) and not math.isfinite(v)}
        assert not bad, bad
    return rows


def test_kl_loss_and_adaptive_controller(fast_overrides, make_model, tmp_path):
    rows = _run(
        fast_overrides,
        make_model,
        tmp_path,
        "actor.use_kl_loss=true",
        "actor.kl_loss_type=k3",
        "algorithm.use_kl_in_reward=true",
        "algorithm.kl_ctrl.type=adaptive",
        "algorithm.kl_ctrl.target_kl=0.001",
        "algorithm.kl_ctrl.horizon=100",
        "algorithm.kl_penalty=k2",
        "actor.entropy_coef=0.01",
    )
    assert "actor/kl_loss" in rows[-1]
    # iteration 1 measures KL 0 (actor == reference): below target, the coefficient shrinks
    assert rows[1]["kl_coef"] < rows[0]["kl_coef"] == 0.05


def test_ptx_loss(fast_overrides, make_model, tmp_path, sft_file):
    """The ptx loss enters the actor's update: the same seed with and without it samples the
    same first batch, but the updates differ from the first one on."""
    sft, model = f"data.sft_path={sft_file}", make_model()
    rows = _run(fast_overrides, model, tmp_path, "actor.ptx_coef=0.5", sft, name="ptx")
    plain = _run(fast_overrides, model, tmp_path, "actor.ptx_coef=0", sft, name="plain")
    assert rows[-1]["actor/ptx_loss"] > 0 and "actor/ptx_loss" not in plain[-1]
    assert rows[0]["score"] == plain[0]["score"]  # the same batch before any update
    assert rows[0]["actor/grad_norm"] != plain[0]["actor/grad_norm"]  # another gradient


def test_reward_model_source_and_critic_from_it(fast_overrides, make_model, tmp_path):
    model = make_model()
    tok = load_tokenizer(model)
    rm_dir = tmp_path / "rm"
    build_tiny_reward_model("llama", tok, size="nano", seed=1).save_pretrained(rm_dir)
    tok.save_pretrained(rm_dir)
    out = tmp_path / "run"
    args = [a for a in fast_overrides(model, out, 2) if not a.startswith("reward.function=")]
    args += [f"reward.model_path={rm_dir}", "model.critic_init=reward_model"]
    assert main(["train", *args]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert all(math.isfinite(r["score"]) for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["model"]["critic_init"] == "reward_model"


def test_full_kl_in_reward_and_as_loss(fast_overrides, make_model, tmp_path):
    rows = _run(
        fast_overrides,
        make_model,
        tmp_path,
        "algorithm.kl_penalty=full",
        "actor.use_kl_loss=true",
        "actor.kl_loss_type=full",
    )
    # iteration 1: the actor is still the reference, the exact KL is 0 (up to rounding)
    assert abs(rows[0]["kl"]) < 1e-5
    assert rows[1]["kl"] > 0 and rows[1]["actor/kl_loss"] > 0


def test_normalized_scores_keep_the_raw_score_logged(fast_overrides, make_model, tmp_path):
    rows = _run(
        fast_overrides,
        make_model,
        tmp_path,
        "algorithm.normalize_scores=true",
        "algorithm.kl_ctrl.kl_coef=0",
    )
    for row in rows:
        # the logged score is the raw one (fractions of "7": in [0, 1]); the reward that is
        # optimised is the standardised score (mean 0 over what was seen so far)
        assert 0.0 <= row["score"] <= 1.0
    assert abs(rows[0]["reward"]) < 1e-5  # first batch standardised by its own moments


def test_kl_loss_alone_leaves_the_reward_without_kl(fast_overrides, make_model, tmp_path):
    # actor.use_kl_loss with algorithm.use_kl_in_reward unset puts the KL in the loss only
    # (as verl's docs say of use_kl_loss): the shaped reward is the raw score (in [0, 1],
    # never clipped by 5) although the measured KL is no longer 0 in iteration 2
    rows = _run(fast_overrides, make_model, tmp_path, "actor.use_kl_loss=true")
    assert rows[1]["kl"] != 0.0 and rows[1]["actor/kl_loss"] > 0
    for row in rows:
        assert row["reward"] == pytest.approx(row["score"], abs=1e-6)


def test_target_kl_early_stops_the_actor_epochs(fast_overrides, make_model, tmp_path):
    # one mini-batch per epoch: epoch 1 starts at the rollout policy (approx_kl exactly 0),
    # epoch 2 measures the moved policy (> 1e-9), so epoch 3 of 3 is skipped: 2 steps
    rows = _run(fast_overrides, make_model, tmp_path, "actor.ppo_epochs=3", "actor.target_kl=1e-9")
    for row in rows:
        assert row["actor/early_stopped"] == 1.0 and row["actor/optimizer_steps"] == 2.0
        assert row["critic/optimizer_steps"] == 1.0  # the critic never stops early


def test_a_run_with_checkpointing_trains_as_one_without(tmp_path, make_model, fast_overrides):
    """Gradient checkpointing recomputes the forward in the backward pass: the same losses
    and gradients as a run that keeps the activations."""
    init = make_model("llama")
    rows = {}
    for on in ("true", "false"):
        argv = fast_overrides(init, tmp_path / on, 2, f"model.gradient_checkpointing={on}")
        assert main(["train", *argv]) == 0
        rows[on] = read_metrics(tmp_path / on / "metrics.jsonl")
    assert [r["step"] for r in rows["true"] if "actor/pg_loss" in r] == [1, 2]
    for key in ("actor/pg_loss", "actor/grad_norm", "critic/vf_loss", "critic/grad_norm"):
        got = [r[key] for r in rows["true"]]
        assert got == pytest.approx([r[key] for r in rows["false"]], rel=1e-5), key


def test_dapo_recipe_options_train(fast_overrides, make_model, tmp_path):
    """The DAPO recipe's keys together (the shipped dapo.yaml's algorithm, on the nano
    model): clip-higher, dynamic sampling, token-mean, overlong shaping, truncated masked."""
    rows = _run(
        fast_overrides,
        make_model,
        tmp_path,
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=false",
        "algorithm.filter_groups=true",
        "algorithm.max_gen_batches=2",
        "reward.overlong_buffer_len=2",
        "rollout.mask_truncated=true",
        "rollout.n=4",
        "actor.clip_ratio_high=0.28",
        "actor.ppo_mini_batch_size=16",
        "critic.ppo_mini_batch_size=16",
    )
    last = rows[-1]
    assert 1 <= last["dapo/gen_batches"] <= 2
    assert last["dapo/groups_kept"] + last["dapo/groups_filled"] == 4
    assert last["dapo/groups_generated"] == 4 * last["dapo/gen_batches"]
    assert "overlong_penalty_mean" in last


def test_token_budget_micro_batches_train(fast_overrides, make_model, tmp_path):
    rows = _run(
        fast_overrides,
        make_model,
        tmp_path,
        "actor.ppo_max_tokens_per_micro=24",
        "critic.ppo_max_tokens_per_micro=24",
        "rollout.max_tokens_per_micro=24",
        "rollout.old_logprobs=recompute",  # the actor's scoring pass runs by the budget too
    )
    assert rows[-1]["actor/optimizer_steps"] == 1 and "critic/vf_loss" in rows[-1]
