"""A reward that pays loops, no KL reference and a high learning rate: the answers degenerate
within 20 iterations of a nano model, and the run says so (a warning per kind on stderr,
summary.json's drift_warnings) while it goes on."""

from __future__ import annotations

import json

import pytest

from proxima.cli import main
from tests.trainer.nano import REWARD, nano_files

pytestmark = pytest.mark.slow


def test_a_run_that_learns_loops_warns_of_drift(tmp_path, capsys):
    f = nano_files(tmp_path)
    out = tmp_path / "run"
    args = [
        "task.name=",
        f"model.actor_path={f['model']}",
        "model.device=cpu",
        f"data.train_path={f['prompts']}",
        "data.train_batch_size=8",
        "rollout.n=4",
        f"reward.function={REWARD}:repeats_one_char",
        "rollout.max_response_length=6",
        "algorithm.adv_estimator=grpo",
        "algorithm.use_kl_in_reward=false",  # no reference: nothing holds the policy near
        "actor.ppo_mini_batch_size=32",
        "actor.ppo_micro_batch_size=32",
        "actor.optim.lr=1e-2",
        "actor.optim.warmup_steps=0",
        "trainer.iterations=20",
        f"trainer.output_dir={out}",
        "trainer.tensorboard=false",
        "trainer.threads=1",
        "guard.patience=0",
    ]
    assert main(["train", *args]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["score"] > 2 * rows[0]["score"]  # the reward rose ...
    assert rows[-1]["drift/repetition"] > 0.3 > rows[0]["drift/repetition"]  # ... by loops
    assert rows[-1]["drift/distinct_2"] < 0.5 * rows[0]["drift/distinct_2"]
    warnings = json.loads((out / "summary.json").read_text())["drift_warnings"]
    kinds = [w["kind"] for w in warnings]
    assert {"diversity", "repetition"} <= set(kinds) and len(kinds) == len(set(kinds))
    err = capsys.readouterr().err
    assert err.count("warning: drift at iteration") == len(kinds)
    assert "keep a KL reference (algorithm.use_kl_in_reward=true" in err
    assert "drift/ref_logprob" not in rows[-1]  # no reference, no reference likelihood
