"""`proxima train` runs as A/B benchmarks (bench_multiturn.py): a tiny Llama and 64 prompts
built once, runs of 64 sequences per iteration whose per-iteration phase seconds are read
back (the first two iterations left out as warm-up), the configurations run alternately, and
a table of the medians over runs. Also the overrides that shrink a built-in example's task to
seconds for a smoke run."""

from __future__ import annotations

import atexit
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from benchmarks.common.timing import repo_env

HERE = Path(__file__).resolve()
PHASES = ("time/generate", "time/reward", "time/score", "time/advantages", "time/update")
SEQUENCES = 64  # 16 prompts x 4 samples per iteration
WARM_UP = 2  # iterations left out of every run's figures
# a built-in example (the default one, `tools`, `dapo`) shrunk to seconds: a handful of
# problems, a few warm-start steps, one iteration; for smoke runs, whose figures mean nothing
SMOKE_TASK = [
    "task.n_train=64",
    "task.n_eval=8",
    "task.n_sft=64",
    "task.sft_steps=2",
    "trainer.iterations=1",
    "trainer.threads=1",
    "eval.every=0",
]


def reward(prompts: list[str], responses: list[str], **_: list) -> list[float]:
    """A score that varies (the share of digits), so the advantages are not all 0."""
    return [sum(c.isdigit() for c in r) / max(1, len(r)) for r in responses]


def setup(folder: Path, alphabet: str, max_positions: int) -> tuple[Path, Path]:
    """A tiny Llama over `alphabet` and 64 prompts "a+b=" in `folder`."""
    model = folder / "model"
    subprocess.run(
        [sys.executable, "-m", "proxima", "init-model", "--out", str(model), "--size", "tiny",
         "--alphabet", alphabet, "--max-positions", str(max_positions)],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    rows = [{"prompt": f"{a}+{b}="} for a in range(8) for b in range(8)]
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, prompts


def scratch_folder(prefix: str) -> Path:
    """A temporary folder removed when this process exits: where a smoke run writes."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def run_quietly(cmd: list[str], out: Path) -> tuple[list[dict], dict]:
    """Run `proxima train` (`cmd`, writing into `out`), output discarded; its iterations'
    metrics rows (those with an update: not the evaluations') and its summary.json, then
    `out` removed."""
    subprocess.run(
        cmd, check=True, env=repo_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((out / "summary.json").read_text())
    shutil.rmtree(out)
    return [r for r in rows if "time/update" in r], summary


def train_rows(folder: Path, model: Path, prompts: Path, args, extra: list[str]) -> list[dict]:
    """The metrics rows of one PPO run with a critic (`extra`: its own overrides) after its
    first WARM_UP iterations, each with `time/iteration`, the sum of its phases."""
    out = folder / "run"
    cmd = [
        sys.executable, "-m", "proxima", "train",
        f"model.actor_path={model}",
        f"data.train_path={prompts}",
        f"reward.function={HERE}:reward",
        "data.train_batch_size=16",
        "rollout.n=4",
        "actor.ppo_mini_batch_size=64",
        "actor.ppo_micro_batch_size=64",
        "critic.ppo_mini_batch_size=64",
        "critic.ppo_micro_batch_size=64",
        f"trainer.iterations={args.iterations}",
        f"trainer.threads={args.threads}",
        "trainer.save_every=0",
        "trainer.log_samples=0",
        f"trainer.output_dir={out}",
        *extra,
    ]  # fmt: skip
    rows, _ = run_quietly(cmd, out)
    rows = rows[WARM_UP:]
    for r in rows:
        r["time/iteration"] = sum(r.get(k, 0.0) for k in PHASES)
    return rows


def alternate(
    names: list[str], repeats: int, alphabet: str, max_positions: int, run: Callable
) -> tuple[dict[str, list[dict]], dict[str, dict[str, float]]]:
    """`run(folder, model, prompts, name)` -> a result dict, for every name, `repeats` times
    in turn on one model; returns ({name: the results}, {name: their medians})."""
    runs: dict[str, list[dict]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model, prompts = setup(folder, alphabet, max_positions)
        for _ in range(repeats):
            for name in names:
                runs[name].append(run(folder, model, prompts, name))
    med = {n: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for n, rs in runs.items()}
    return runs, med


def print_table(med: dict[str, dict[str, float]], keys: list[str], digits: int) -> None:
    print("| | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for name, m in med.items():
        print(f"| {name} | " + " | ".join(f"{m[k]:.{digits}f}" for k in keys) + " |")
