"""Multi-process tests: each launches `torchrun --standalone --nproc_per_node 2` on the CPU
(gloo) and compares with one process. About 10-15 s per launch on 2 cores."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def torchrun(args: list[str], timeout: float = 300, nproc: int = 2, check: bool = True):
    """`python -m torch.distributed.run --standalone --nproc_per_node N ARGS` from the project
    root, one thread per process; returns the CompletedProcess (output captured)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc_per_node={nproc}", *args]
    proc = subprocess.run(
        cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    if check and proc.returncode != 0:
        pytest.fail(
            f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc


from tests.e2e.conftest import fast_overrides, make_model, prompt_file, reward_spec  # noqa: E402, F401
