"""Every benchmark script runs: its `--smoke` mode (the same code path on the smallest sizes,
seconds, no figure checked) in a fresh process, as `python -m benchmarks.NAME --smoke` from
the repository root. A script that needs something absent (TRL, vLLM, the SmolLM2 wheel)
says so and leaves that part out. A refactor that breaks a script fails here."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# script -> the arguments of its smoke run
SMOKE = {
    "bench_agent_endpoint": ["--smoke"],
    "bench_async_overlap": ["latency", "--smoke"],
    "bench_cpu_levers": ["--smoke"],
    "bench_generation": ["--smoke"],
    "bench_learning": ["--smoke"],
    "bench_lora_push": ["--smoke"],
    "bench_memory_plan": ["--smoke"],
    "bench_multiturn": ["--smoke"],
    "bench_prefill_once": ["--smoke"],
    "bench_shared_prompts": ["--smoke"],
    "bench_rollout_engines": ["--smoke"],
    "bench_token_budget": ["--smoke"],
    "bench_tools": ["--smoke"],
    "bench_utilisation": ["--smoke"],
    "bench_vs_trl": ["--smoke"],
    "chat_sweep": ["--smoke"],
    "check_identical": ["--smoke"],
    "memory_phases": ["--smoke"],
    "pipeline_dpo_kl": ["--smoke"],
    "warm_start_answers": ["--smoke"],
}


def test_every_script_has_a_smoke_run():
    scripts = {p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem != "__init__"}
    assert scripts == set(SMOKE), "list a new script's smoke run in SMOKE"


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(SMOKE))
def test_smoke(script: str, tmp_path: Path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", f"benchmarks.{script}", *SMOKE[script]],
        cwd=ROOT,
        env={**env, "TMPDIR": str(tmp_path)},  # whatever a run leaves behind goes with tmp_path
        capture_output=True,
        text=True,
        timeout=600,
    )
    took = time.perf_counter() - start
    tail = (proc.stdout[-2000:] + "\n" + proc.stderr[-4000:]).strip()
    assert proc.returncode == 0, (
        f"{script} --smoke exited {proc.returncode} after {took:.0f} s:\n{tail}"
    )
