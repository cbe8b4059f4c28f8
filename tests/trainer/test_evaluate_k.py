"""Evaluation with k samples per prompt (`eval.n`): unbiased pass@k for every k <= n, mean@n,
per data source; in `proxima eval`, in a run's metrics and its pass_at_k.png."""

from __future__ import annotations

import json

import pytest
import torch

from proxima.cli import main
from proxima.logging import read_metrics
from proxima.trainer.datasets import load_prompts
from proxima.trainer.evaluate import describe, evaluate_k
from proxima.trainer.roles import build_reward
from tests.trainer.nano import REWARD, nano_files, nano_trainer


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("passk")
    f = nano_files(root)
    rows = [
        {"prompt": f"{a}+{b}=", "data_source": "ones" if a == 1 else "rest"}
        for a in range(10)
        for b in range(2)
    ]
    f["sources"] = root / "sources.jsonl"
    f["sources"].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


def test_one_correct_of_n_gives_pass_at_k_k_over_n(files):
    trainer = nano_trainer(files, f"reward.function={REWARD}:first_sample_correct")
    cfg, tok = trainer.cfg, trainer.roles.tokenizer
    items = list(load_prompts(cfg, files["sources"], tok))
    reward = build_reward(cfg, tok, torch.device("cpu"))
    res = evaluate_k(
        trainer.roles.actor,
        tok,
        items,
        reward,
        cfg.rollout,
        torch.device("cpu"),
        n=4,
        batch_size=8,
    )
    # exactly one of the 4 samples of every prompt is correct: pass@k = k / 4 (a bootstrap
    # with replacement would give 1 - (3/4)^k instead)
    assert res["n"] == 4
    for k in (1, 2, 3, 4):
        assert res[f"pass@{k}"] == pytest.approx(k / 4)
    assert res["mean@4"] == pytest.approx(0.25)
    assert sorted(res["by_source"]) == ["ones", "rest"]
    assert res["by_source"]["ones"]["pass@2"] == pytest.approx(0.5)
    line = describe({"pass@k": res})
    assert line[0].startswith("pass@k: pass@1 0.2500, pass@2 0.5000")
    assert any("[ones]" in x for x in line)


def test_a_run_logs_pass_at_k_and_plots_it(files, tmp_path):
    out = tmp_path / "run"
    args = [
        "train",
        "task.name=",
        f"model.actor_path={files['model']}",
        "model.device=cpu",
        f"data.train_path={files['prompts']}",
        f"data.eval_path={files['sources']}",
        "data.train_batch_size=4",
        f"reward.function={REWARD}:first_sample_correct",
        "rollout.n=2",
        "rollout.max_response_length=4",
        "actor.ppo_mini_batch_size=8",
        "actor.ppo_micro_batch_size=8",
        "critic.ppo_mini_batch_size=8",
        "critic.ppo_micro_batch_size=8",
        "critic.warmup_iterations=0",
        "eval.n=4",
        "trainer.iterations=1",
        f"trainer.output_dir={out}",
        "trainer.tensorboard=false",
    ]
    assert main(args) == 0
    rows = read_metrics(out / "metrics.jsonl")
    last = [r for r in rows if "eval/pass@4" in r][-1]
    assert last["eval/pass@4"] == 1.0 and last["eval/pass@1"] == pytest.approx(0.25)
    assert last["eval/ones/pass@2"] == pytest.approx(0.5)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["eval_after"]["pass@k"]["pass@3"] == pytest.approx(0.75)
    assert (out / "pass_at_k.png").stat().st_size > 0


def test_proxima_eval_reports_pass_at_k(files, tmp_path, capsys):
    out = tmp_path / "eval.json"
    args = [
        "eval",
        f"model.actor_path={files['model']}",
        "model.device=cpu",
        f"data.eval_path={files['sources']}",
        f"reward.function={REWARD}:first_sample_correct",
        "rollout.max_response_length=4",
        "eval.n=2",
        f"eval.out={out}",
    ]
    assert main(args) == 0
    assert "pass@k: pass@1 0.5000, pass@2 1.0000, mean@2 0.5000" in capsys.readouterr().out
    assert json.loads(out.read_text())["pass@k"]["pass@2"] == 1.0


def test_greedy_evaluation_per_source(files):
    """Greedy accuracy over all prompts and per `data_source`: a reward of 1 on the prompts
    "1+b=" only gives ones 100% (2 prompts) and rest 0% (18), 10% overall."""
    from proxima.trainer.evaluate import evaluate

    trainer = nano_trainer(files, f"reward.function={REWARD}:first_sample_correct")
    cfg, tok = trainer.cfg, trainer.roles.tokenizer
    items = list(load_prompts(cfg, files["sources"], tok))

    def ones(prompts, responses, columns, ids, mask):
        return torch.tensor([float(p.startswith("1+")) for p in prompts])

    res = evaluate(trainer.roles.actor, tok, items, ones, cfg.rollout, torch.device("cpu"))
    assert res["accuracy"] == pytest.approx(0.1) and res["n"] == 20
    assert {k: (v["accuracy"], v["n"]) for k, v in res["by_source"].items()} == {
        "ones": (1.0, 2),
        "rest": (0.0, 18),
    }
    assert "greedy [ones]: mean reward 1.0000, accuracy 100.00% on 2" in describe({"greedy": res})
