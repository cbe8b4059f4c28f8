"""A user's own environment through the CLI, nothing in proxima changed: a file with an `Env`
class named by `rollout.env`, `proxima train` (the environment gives every reward: no
reward.function), its episodes in samples.jsonl and the env metrics in metrics.jsonl,
evaluation of whole episodes (in the run and with `proxima eval`), and a resumed run that
equals the uninterrupted one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from proxima.cli import main
from proxima.logging import read_metrics

pytestmark = pytest.mark.slow

ENV = '''
class Env:
    """Turn 1: "=" and reward 0.1; turn 2: reward 1 for the right sum, done."""

    max_reward = 1.1

    def __init__(self, row):
        self.answer, self.turn = row["answer"], 0

    def step(self, action):
        self.turn += 1
        if self.turn == 1:
            return "=", 0.1, False
        return None, float(action.replace("</s>", "") == self.answer), True
'''
MULTI = (
    "reward.function=",
    "rollout.env.max_turns=2",
    "rollout.env.max_turn_tokens=3",
    "rollout.env.max_episode_tokens=10",
    "eval.max_prompts=8",
    "trainer.threads=1",
)


@pytest.fixture
def env_spec(tmp_path: Path) -> str:
    (tmp_path / "my_env.py").write_text(ENV)
    return f"rollout.env={tmp_path / 'my_env.py'}:Env"


def _steps(run: Path) -> dict[int, dict]:
    rows = read_metrics(run / "metrics.jsonl")
    skip = ("time/", "tokens_per_s")
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(skip)} for r in rows}


def test_own_environment_trains_and_evaluates(
    tmp_path, make_model, fast_overrides, env_spec, prompt_file
):
    init, run = make_model("llama"), tmp_path / "run"
    extra = (env_spec, *MULTI, f"data.eval_path={prompt_file}")
    assert main(["train", *fast_overrides(init, run, 2, *extra)]) == 0
    steps = _steps(run)
    assert steps[1]["env/turns"] == 2.0 and steps[1]["env/done"] == 1.0
    assert steps[1]["env/reward_per_turn"] >= 0.05 - 1e-9  # 0.1 for each first turn
    assert "eval/multi_turn" in steps[2] and steps[2]["eval/turns"] == 2.0
    sample = json.loads((run / "samples.jsonl").read_text().splitlines()[0])
    first = sample["episode"]["turns"][0]
    assert first["observation"] == "=" and first["reward"] == 0.1
    assert sample["episode"]["end"] == "done"
    out = tmp_path / "eval.json"
    args = ["eval", "--model", str(run / "actor"), "--data", str(prompt_file), env_spec]
    assert main([*args, *MULTI[1:4], "eval.max_prompts=8", f"eval.out={out}"]) == 0
    res = json.loads(out.read_text())["greedy"]
    assert res["turns"] == 2.0 and res["n"] == 8
    assert res["mean_reward"] == pytest.approx(0.1 + res["accuracy"])  # max_reward 1.1


def test_resume_equals_uninterrupted_run(tmp_path, make_model, fast_overrides, env_spec):
    """Episodes (their sampling, the environments' answers) replay after a resume: the same
    metrics for steps 3-4 and the same weights at the end."""
    init, run_a, run_b = make_model("llama"), tmp_path / "a", tmp_path / "b"
    extra = (env_spec, *MULTI, "trainer.save_every=2")
    assert main(["train", *fast_overrides(init, run_a, 4, *extra)]) == 0
    resume = f"trainer.resume_from={run_a / 'checkpoints' / 'iter_2'}"
    assert main(["train", *fast_overrides(init, run_b, 4, *extra, resume)]) == 0
    a, b = _steps(run_a), _steps(run_b)
    assert sorted(b) == [3, 4] and "env/turns" in a[3]
    for step in (3, 4):
        assert a[step] == b[step], step
    wa, wb = (load_file(r / "actor" / "model.safetensors") for r in (run_a, run_b))
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


BROKEN = """
class Env:
    def __init__(self, row):
        pass

    def step(self, action):
        raise KeyError("no tool named " + repr(action[:3]))
"""


def test_every_episode_failing_is_said_and_stops_the_run(
    tmp_path, make_model, fast_overrides, prompt_file, capsys
):
    """Not a silent exit 0: each iteration whose episodes mostly failed is warned about
    with the first error; all of them failing for guard.patience iterations stops the run
    as diverged."""
    (tmp_path / "broken.py").write_text(BROKEN)
    run = tmp_path / "run"
    extra = (f"rollout.env={tmp_path / 'broken.py'}:Env", *MULTI, "guard.patience=2")
    model = make_model("llama")
    assert main(["train", *fast_overrides(model, run, 5, *extra)]) == 3
    err = capsys.readouterr().err
    assert "warning: iteration 1: 100% of the episodes ended on an environment failure; " in err
    assert 'first: raised KeyError: "no tool named' in err
    assert "every episode ended on an environment error or timeout, for 2 consecutive" in err
    assert "fix the environment (samples.jsonl holds each turn's error)" in err
    assert sorted(_steps(run)) == [1, 2]
    # `proxima eval` says so too, instead of a bare accuracy of 0%
    args = ["eval", "--model", str(model), "--data", str(prompt_file), extra[0]]
    assert main([*args, *MULTI[1:4], "eval.max_prompts=4"]) == 0
    said = capsys.readouterr().out
    assert "greedy: warning: 100% of the episodes ended on an environment error or timeout " in said
    assert '(first: raised KeyError: "no tool named' in said
