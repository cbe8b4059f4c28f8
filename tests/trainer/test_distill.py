"""On-policy distillation in the trainer: the config keys and their refusals, the teacher in
the role and scoring plans, its log-probs from phase 3, its term added to another
estimator's advantages (exact values by hand) or alone (`distill`), its metrics and its
place in the offload. Nano models, a few seconds in all."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from proxima.algos import reverse_kl_stats
from proxima.config import Config, ConfigError, load_config
from proxima.config.roles import policy_folder, role_plan
from proxima.config.validation import check_sources
from proxima.models import init_model
from proxima.models.forward import response_logprobs
from proxima.rollout.engines import engine_spec
from proxima.rollout.plan import plan_scoring
from proxima.trainer.advantages import BatchView, estimate_advantages
from tests.trainer.nano import nano_files, nano_trainer

pytestmark = pytest.mark.usefixtures("one_thread")

BASE = ["model.actor_path=m", "data.train_path=p.jsonl"]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """The nano student and its prompts, and a teacher: another nano model on the same
    tokenizer (another seed), so the two differ on every token."""
    root = tmp_path_factory.mktemp("distill")
    out = nano_files(root)
    alphabet = "0123456789+="
    out["teacher"] = init_model(
        root / "t", "llama", "nano", alphabet=alphabet, max_positions=32, seed=1
    )
    return out


def _config(*overrides: str) -> Config:
    return load_config(None, BASE + list(overrides))


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["algorithm.adv_estimator=distill"],
            "`algorithm.adv_estimator=distill` learns from a teacher's log-probs: set "
            "`model.teacher_path`",
        ),
        (
            ["model.teacher_path=t", "algorithm.distill_coef=0", "reward.function=f.py:fn"],
            "`algorithm.distill_coef`=0.0: the teacher's term would be zero",
        ),
        (
            ["model.teacher_path=t", "algorithm.distill_coef=-1", "reward.function=f.py:fn"],
            "would be reversed",
        ),
        (
            [
                "model.teacher_path=t",
                "algorithm.adv_estimator=distill",
                "algorithm.distill_clip=-1",
            ],
            "`algorithm.distill_clip` must be >= 0",
        ),
        (
            [
                "model.teacher_path=t",
                "algorithm.adv_estimator=distill",
                "algorithm.use_kl_in_reward=true",
            ],
            "which `adv_estimator=distill` does not read",
        ),
        (
            [
                "model.teacher_path=t",
                "algorithm.adv_estimator=distill",
                "algorithm.filter_groups=true",
                "rollout.n=2",
            ],
            "`algorithm.filter_groups` drops groups by their scores",
        ),
        (
            ["model.teacher_path=t", "algorithm.adv_estimator=distill", "data.eval_path=e.jsonl"],
            "`data.eval_path`: held-out prompts are scored by the reward source",
        ),
    ],
)
def test_bad_distillation_settings_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _config(*overrides)


def test_distillation_alone_needs_no_reward_and_no_kl():
    cfg = _config("model.teacher_path=t", "algorithm.adv_estimator=distill")
    assert not cfg.kl_in_reward and not cfg.uses_critic
    plan = role_plan(cfg)
    assert plan.has_teacher and plan.teacher_folder == "t" and not plan.has_reference
    assert plan.rewards == ()
    # a reward may still be given: scored and logged, and it judges data.eval_path
    logged = _config(
        "model.teacher_path=t",
        "algorithm.adv_estimator=distill",
        "reward.function=f.py:fn",
        "data.eval_path=e.jsonl",
    )
    assert "(scored and logged, not trained on" in role_plan(logged).describe()


def test_only_the_training_commands_take_a_teacher():
    cfg = Config().replace({"model.teacher_path": "t", "model.actor_path": "m"})
    cfg = cfg.replace({"data.sft_path": "s.jsonl", "sft.out": "o"})
    with pytest.raises(ConfigError, match="`proxima sft` has no teacher: unset it"):
        check_sources(cfg, "sft")
    check_sources(cfg, "config")  # `proxima config` shows it
    with pytest.raises(ConfigError, match="`data.train_path` is empty"):
        check_sources(cfg, "distill")
    with pytest.raises(ConfigError, match=r"`model.teacher_path` is empty.*\(--teacher\)"):
        check_sources(cfg.replace({"model.teacher_path": ""}), "distill")


def test_the_distill_command_starts_from_its_own_config():
    from proxima.cli import build_parser
    from proxima.cli.args import load

    argv = ["distill", "--teacher", "T", "--student", "S", "--data", "p.jsonl", "--coef", "2"]
    cfg = load(build_parser().parse_args([*argv, "rollout.n=2"]))
    assert (cfg.model.teacher_path, cfg.model.actor_path, cfg.data.train_path) == (
        "T",
        "S",
        "p.jsonl",
    )
    a = cfg.algorithm
    assert (a.adv_estimator, a.distill_coef, cfg.rollout.n) == ("distill", 2.0, 2)
    assert cfg.actor.optim.lr == 5e-5 and cfg.trainer.output_dir == "runs/distill"
    assert not cfg.kl_in_reward and not cfg.reward.function  # no reference, no reward
    with pytest.raises(ConfigError, match=r"set `model.teacher_path`.*proxima distill --teacher"):
        load(build_parser().parse_args(["distill", "--student", "S", "--data", "p.jsonl"]))


def test_the_role_plan_names_the_teacher_and_how_it_is_used():
    alone = role_plan(_config("model.teacher_path=t", "algorithm.adv_estimator=distill"))
    assert alone.describe().splitlines()[3:] == [
        "  teacher  : a frozen model, from model.teacher_path (t): 1 x (teacher - student "
        "log-prob) per token, the whole advantage",
        "  reward   : none (distill: the teacher's log-probs are the only signal)",
    ]
    beside = _config(
        "model.teacher_path=t",
        "algorithm.adv_estimator=grpo",
        "algorithm.distill_coef=0.25",
        "reward.function=f.py:fn",
        "rollout.n=2",
    )
    line = role_plan(beside).describe().splitlines()[3]
    assert line.endswith("0.25 x (teacher - student log-prob) per token, added to grpo's advantage")
    # without a teacher the plan prints no teacher line at all
    assert "teacher" not in role_plan(_config("reward.function=f.py:fn")).describe()


def test_a_run_folder_names_its_trained_actor(tmp_path):
    run = tmp_path / "run"
    (run / "actor").mkdir(parents=True)
    (run / "config.json").write_text("{}")  # a run folder's own config is proxima's
    (run / "summary.json").write_text("{}")
    assert policy_folder(str(run)) == str(run)  # no trained actor yet: itself
    (run / "actor" / "config.json").write_text("{}")
    assert policy_folder(str(run)) == str(run / "actor")
    assert policy_folder(str(run / "actor")) == str(run / "actor")
    cfg = _config(f"model.teacher_path={run}", "algorithm.adv_estimator=distill")
    assert role_plan(cfg).teacher_folder == str(run / "actor")


def test_the_scoring_plan_has_a_teacher_pass():
    cfg = _config("model.teacher_path=t", "algorithm.adv_estimator=distill")
    plan = plan_scoring(cfg, engine_spec("hf"))
    assert plan.teacher
    assert "  teacher      : a teacher pass (log-probs of the sampled tokens)" in plan.describe()
    assert not plan_scoring(_config("reward.function=f.py:fn"), engine_spec("hf")).teacher


# --------------------------------------------------------------------------- phases 4-5


def _batch(teacher_minus_old: list[list[float]]) -> BatchView:
    # 2 prompts x 2 samples; rows of 3, 1, 2 and 3 tokens
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1]])
    old = -torch.ones(4, 3)
    return BatchView(
        scores=torch.tensor([1.0, 0.0, 2.0, 3.0]),
        stopped=torch.ones(4, dtype=torch.bool),
        kl=torch.zeros(4, 3),
        response_mask=mask,
        values=None,
        group_ids=torch.tensor([0, 0, 1, 1]),
        inputs={
            "old_logprobs": old,
            "teacher_logprobs": old + torch.tensor(teacher_minus_old),
        },
    )


# teacher - old per token; the masked positions hold junk that must not reach the result
DIFF = [[0.5, -1.0, 0.0], [-0.25, 9.0, 9.0], [1.0, 0.5, 9.0], [0.0, 0.0, -2.0]]


def test_the_teacher_term_is_added_to_another_estimators_advantages():
    # Dr.GRPO (no std): outcome = score at the last token; group 0 (1, 0) -> mean 0.5 ->
    # +0.5, -0.5; group 1 (2, 3) -> mean 2.5 -> -0.5, +0.5; plus 0.5 x (teacher - old):
    # row 0: 0.5 + [0.25, -0.5, 0]   = [0.75, 0, 0.5]
    # row 1: -0.5 + [-0.125]         = [-0.625]
    # row 2: -0.5 + [0.5, 0.25]      = [0, -0.25]
    # row 3: 0.5 + [0, 0, -1]        = [0.5, 0.5, -0.5]
    algorithm = replace(
        Config().algorithm,
        adv_estimator="grpo",
        norm_adv_by_std_in_grpo=False,
        distill_coef=0.5,
    )
    est = estimate_advantages(_batch(DIFF), algorithm, kl_coef=0.0, no_stop_penalty=0.0)
    assert est.advantages.tolist() == [
        [0.75, 0.0, 0.5],
        [-0.625, 0.0, 0.0],
        [0.0, -0.25, 0.0],
        [0.5, 0.5, -0.5],
    ]
    # the returns stay the task's (grpo's are its advantages)
    assert est.returns.tolist() == [
        [0.5, 0.5, 0.5],
        [-0.5, 0.0, 0.0],
        [-0.5, -0.5, 0.0],
        [0.5, 0.5, 0.5],
    ]
    # clipped at 0.5 first: -1 -> -0.5 and -2 -> -0.5 (then x 0.5)
    clipped = estimate_advantages(
        _batch(DIFF), replace(algorithm, distill_clip=0.5), kl_coef=0.0, no_stop_penalty=0.0
    )
    assert clipped.advantages[0].tolist() == [0.75, 0.25, 0.5]
    assert clipped.advantages[3].tolist() == [0.5, 0.5, 0.25]


def test_distill_alone_counts_the_teacher_term_once_and_reads_no_score():
    algorithm = replace(Config().algorithm, adv_estimator="distill", distill_coef=0.5)
    est = estimate_advantages(_batch(DIFF), algorithm, kl_coef=0.0, no_stop_penalty=0.0)
    assert est.advantages.tolist() == [
        [0.25, -0.5, 0.0],
        [-0.125, 0.0, 0.0],
        [0.5, 0.25, 0.0],
        [0.0, 0.0, -1.0],
    ]
    assert torch.equal(est.returns, est.advantages)


# --------------------------------------------------------------------------- the trainer


def test_phase_3_scores_the_sampled_tokens_with_the_teacher(files):
    trainer = nano_trainer(
        files,
        f"model.teacher_path={files['teacher']}",
        "algorithm.adv_estimator=distill",
        "reward.function=",
    )
    assert trainer.plan.teacher and trainer.roles.teacher is not None
    assert not any(p.requires_grad for p in trainer.roles.teacher.parameters())
    assert "teacher  : 0.018 M params (float32)" in trainer.roles.report()
    assert trainer.batch_inputs[:2] == ("old_logprobs", "teacher_logprobs")
    ro, _ = trainer.sampler.sample()
    exp = trainer.make_experience(ro)
    gen, temperature = ro.gen, trainer.cfg.rollout.temperature
    with torch.no_grad():
        want = response_logprobs(
            trainer.roles.teacher, gen.input_ids, gen.attention_mask, gen.response_ids, temperature
        )
    torch.testing.assert_close(exp.teacher_logprobs, want * gen.response_mask)
    # another model: its log-probs are not the student's
    assert not torch.allclose(exp.teacher_logprobs, exp.old_logprobs)
    metrics, _ = trainer.step()
    # a single-sample estimate per token: its mean may fall either side of 0, its spread not
    assert math.isfinite(metrics["teacher/reverse_kl"]) and metrics["teacher/reverse_kl_std"] > 0
    assert "kl_coef" not in metrics and trainer.roles.reference is None


def test_the_metrics_are_the_reverse_kl_of_the_whole_batch(files):
    trainer = nano_trainer(
        files,
        f"model.teacher_path={files['teacher']}",
        "algorithm.adv_estimator=grpo",
        "rollout.n=2",
        "actor.ppo_mini_batch_size=16",
    )
    ro, _ = trainer.sampler.sample()
    exp = trainer.make_experience(ro)
    batch = BatchView.gather(exp, trainer.dist, len(ro.prompts) // 2, trainer.batch_inputs)
    est = trainer.estimate(batch)
    metrics = trainer.metrics(batch, est, exp, {})
    want = reverse_kl_stats(exp.teacher_logprobs, exp.old_logprobs, exp.response_mask)
    assert metrics["teacher/reverse_kl"] == pytest.approx(float(want["reverse_kl"]))
    assert metrics["teacher/reverse_kl_std"] == pytest.approx(float(want["reverse_kl_std"]))


def test_the_teacher_waits_on_the_cpu_outside_scoring(files):
    trainer = nano_trainer(
        files,
        f"model.teacher_path={files['teacher']}",
        "algorithm.adv_estimator=distill",
        "reward.function=",
        offload=True,
    )
    off = trainer.offload
    assert "teacher" in off.parts
    for phase, there in (("generate", False), ("score", True), ("update", False)):
        off.enter(phase)
        assert off.where()["teacher"] is there, phase
    trainer.step()  # the moves are exact: a whole iteration runs through them


def test_a_batch_sampled_ahead_is_scored_by_the_teacher_when_it_trains(files):
    # rollout.max_staleness: phase 3 (the teacher's pass with it) runs in the trainer on the
    # batch sampled ahead, against the old log-probs of the trainer's current weights
    trainer = nano_trainer(
        files,
        f"model.teacher_path={files['teacher']}",
        "algorithm.adv_estimator=distill",
        "reward.function=",
        "rollout.max_staleness=1",
        "rollout.workers=0",
    )
    assert trainer.plan.old_logprobs == "actor" and trainer.plan.teacher
    for _ in range(2):
        metrics, _ = trainer.step()
        assert metrics["teacher/reverse_kl_std"] > 0  # the teacher's term was there
