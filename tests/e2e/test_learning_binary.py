"""PPO learns a 0/1 task: copy the prompt's first character (rewards_fixture.copies_first_char)
from a randomly initialised tiny Llama, with the default example's PPO settings (critic, GAE
with lambda 1, whitened advantages, kl 0.01, critic warm-up) scaled down to 16 prompts x 4
samples, and an actor learning rate of 1e-3 instead of 1e-4 (a random policy, not an SFT one).

Measured with exactly this configuration (mean training score of the first 3 -> the last 3
of 80 iterations; 15-20 s each on 1 thread of a loaded 2-core machine):
  seed 0: 0.042 -> 0.484 (+0.44); seed 1: 0.078 -> 0.484 (+0.41); seed 2: 0.083 -> 0.474
(+0.39); seed 3: 0.083 -> 0.495 (+0.41). With 30 iterations the gain was +0.05 to +0.12
(too close to the noise of a 0/1 score over 64 samples). The test runs seed 0 and asserts
+0.25: a regression that roughly halves the gain fails it."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from proxima.cli.args import default_config_path
from proxima.config import load_config
from proxima.recipes import train

pytestmark = pytest.mark.slow

ITERATIONS = 80
MARGIN = 0.25


def run(tmp_path, init, prompt_file, reward, seed: int) -> list[float]:
    cfg = load_config(
        default_config_path(),
        [
            "task.name=",
            f"model.actor_path={init}",
            "model.device=cpu",
            f"data.train_path={prompt_file}",
            "data.eval_path=",
            f"reward.function={reward}",
            "data.train_batch_size=16",
            "rollout.n=4",
            "actor.optim.lr=1e-3",
            "actor.ppo_mini_batch_size=32",
            "actor.ppo_micro_batch_size=32",
            "critic.ppo_mini_batch_size=32",
            "critic.ppo_micro_batch_size=32",
            "eval.every=0",
            f"trainer.iterations={ITERATIONS}",
            f"trainer.seed={seed}",
            f"trainer.output_dir={tmp_path / f'run{seed}'}",
            "trainer.tensorboard=false",
            "trainer.threads=1",
        ],
    )
    summary = train(cfg)
    lines = (Path(summary["run_dir"]) / "metrics.jsonl").read_text().splitlines()
    return [json.loads(x)["score"] for x in lines if "score" in json.loads(x)]


def test_ppo_learns_a_binary_task(tmp_path, make_model, prompt_file, reward_spec):
    init = make_model("llama", size="tiny", seed=0)
    scores = run(tmp_path, init, prompt_file, reward_spec("copies_first_char"), seed=0)
    assert len(scores) == ITERATIONS and all(math.isfinite(s) for s in scores)
    first, last = sum(scores[:3]) / 3, sum(scores[-3:]) / 3
    assert first < 0.3, f"a random policy should rarely copy the digit, got {first:.3f}"
    assert last - first >= MARGIN, f"mean score {first:.3f} -> {last:.3f}: {scores}"
