"""`proxima train` with a `PythonEnv` whose every turn's code tries to kill the trainer (its
pid and its parent): the run goes on to its end and writes its checkpoint, and each turn's
record names the failure. Where no namespace can be made the code would succeed: skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from proxima.sandbox import isolation_in_use

pytestmark = pytest.mark.slow

ENV = '''
import os
from proxima.sandbox import PythonEnv

class KillerEnv(PythonEnv):
    """Whatever the model says, its turn runs code that kills the process stepping it."""

    def step(self, action):
        pid = os.getpid()
        code = f"import os\\nos.kill(os.getppid(), 9)\\nos.kill({pid}, 9)\\n"
        return super().step("```python\\n" + code + "```")
'''


def test_train_survives_code_that_kills_it(tmp_path, make_model, fast_overrides):
    if isolation_in_use().name == "none":
        pytest.skip("no namespace here: the code would kill the trainer (the warning says so)")
    (tmp_path / "killer_env.py").write_text(ENV)
    init, run = make_model("llama"), tmp_path / "run"
    env_args = (
        f"rollout.env={tmp_path / 'killer_env.py'}:KillerEnv",
        "rollout.env.max_turns=2",
        "rollout.env.max_turn_tokens=3",
        "rollout.env.max_episode_tokens=40",
        "rollout.env.timeout_s=30",
    )
    root = str(Path(__file__).resolve().parents[2])
    done = subprocess.run(
        [sys.executable, "-m", "proxima", "train", *fast_overrides(init, run, 1, *env_args)],
        env={**os.environ, "PYTHONPATH": root},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert (run / "actor").is_dir()
    sample = json.loads((run / "samples.jsonl").read_text().splitlines()[0])
    sandbox = sample["episode"]["turns"][0]["info"]["sandbox"]
    assert sandbox["outcome"] == "error"
    assert sandbox["isolation"] == isolation_in_use().name
