"""A shipped recipe on the user's model, data and reward, end to end: the recipe's settings
train them, its task writes nothing (tests/test_recipes_and_tasks.py: every recipe)."""

from __future__ import annotations

import json

from proxima.cli import main


def test_the_dapo_recipe_trains_your_model_on_your_data(
    make_model, prompt_file, reward_spec, tmp_path
):
    out = tmp_path / "run"
    args = [
        "train",
        "dapo",
        f"model.actor_path={make_model()}",
        f"data.train_path={prompt_file}",
        f"data.eval_path={prompt_file}",
        f"reward.function={reward_spec('fn')}",
        "data.train_batch_size=4",
        "rollout.n=2",
        "actor.ppo_mini_batch_size=8",
        "actor.ppo_micro_batch_size=8",
        "eval.max_prompts=8",
        "trainer.iterations=1",
        f"trainer.output_dir={out}",
        "trainer.tensorboard=false",
        "trainer.threads=1",
    ]
    assert main(args) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["task"]["prepared"] is False
    assert not (out / "task").exists()  # nothing written for the task
    assert summary["config"]["data"]["train_path"] == str(prompt_file)
    assert summary["config"]["reward"]["function"] == reward_spec("fn")
