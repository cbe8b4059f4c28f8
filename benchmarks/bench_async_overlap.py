"""Asynchronous rollouts (`rollout.max_staleness=k` with `rollout.workers` worker processes)
against the synchronous loop: samples per second and learning, in the two regimes where the
overlap and its absence show.

    .venv/bin/python -m benchmarks.bench_async_overlap latency [--iterations 20] [--seeds 0 1 2]
    .venv/bin/python -m benchmarks.bench_async_overlap compute [--iterations 200] [--seeds 0]
    python3 -m benchmarks.bench_async_overlap latency --set model.device=cuda   # on a GPU
    .venv/bin/python -m benchmarks.bench_async_overlap latency --smoke   # sync and k=1, shrunk

- `latency`: `proxima train tools` (multi-turn episodes with a calculator), each calculator
  call 50-200 ms late and a reward server (`proxima serve-reward`, started here) that
  answers after 0.2 s (`benchmarks/common/latency_task.py`). Synchronous on 2 threads against
  k = 1, 2, 4 with k workers (one thread each, the trainer one), and k = 2 with nothing
  else set (the workers it defaults to): the CPU idles while the tools and the server
  wait, so the workers' batches overlap each other and the update.
- `compute`: the default example (`proxima train`), nothing to wait for: synchronous on both
  cores (`trainer.threads=2`) against one worker on one core and the trainer on the other
  (k = 1), and k = 4 with one worker.

Per run: seconds per iteration are the trainer's phases summed (`time/*` of metrics.jsonl:
for the asynchronous runs `time/generate` is the wait for a worker's batch), their median
over the iterations after the first k + 1 (the pipeline filling); samples per second =
samples per iteration / that median; learning = the held-out greedy accuracy after training
(summary.json). Configurations alternate, seed by seed; the table shows medians over seeds.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common.runs import SMOKE_TASK, run_quietly
from benchmarks.common.timing import repo_env

HERE = Path(__file__).resolve().parent
# loaded by file path, by `proxima train` and `proxima serve-reward` alike
LATENCY_TASK = HERE / "common" / "latency_task.py"
# 16 episodes an iteration, every one of them waiting at once (a smoke run's batch)
SMOKE_BATCH = [
    "data.train_batch_size=4",
    "rollout.n=4",
    "actor.ppo_mini_batch_size=16",
    "actor.ppo_micro_batch_size=16",
    "critic.ppo_mini_batch_size=16",
    "critic.ppo_micro_batch_size=16",
    "rollout.env.workers=16",
]
PHASES = ("generate", "reward", "score", "advantages", "update", "sync")

# name -> overrides; the synchronous run has both cores, an asynchronous one splits them
SYNC = ["trainer.threads=2"]
ASYNC = ["trainer.threads=1", "rollout.worker_threads=1"]
CONFIGS = {
    "latency": {
        "sync": SYNC,
        "k=1, 1 worker": [*ASYNC, "rollout.max_staleness=1", "rollout.workers=1"],
        "k=2, 2 workers": [*ASYNC, "rollout.max_staleness=2", "rollout.workers=2"],
        "k=4, 4 workers": [*ASYNC, "rollout.max_staleness=4", "rollout.workers=4"],
        "k=2, defaults": ["rollout.max_staleness=2"],  # the workers and threads it picks
    },
    "compute": {
        "sync": SYNC,
        "k=1, 1 worker": [*ASYNC, "rollout.max_staleness=1", "rollout.workers=1"],
        "k=4, 1 worker": [*ASYNC, "rollout.max_staleness=4", "rollout.workers=1"],
    },
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_judge() -> tuple[subprocess.Popen, str]:
    """`proxima serve-reward` of latency_task.judge on a free port, once it answers."""
    port = _free_port()
    cmd = [sys.executable, "-m", "proxima", "serve-reward", f"{LATENCY_TASK}:judge"]
    server = subprocess.Popen(
        [*cmd, "--port", str(port)], env=repo_env(), stdout=subprocess.DEVNULL
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):  # a minute: the server imports torch first
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return server, url
        except OSError:
            time.sleep(0.1)
    server.kill()
    raise RuntimeError(f"the reward server did not start on {url}")


def _run(regime: str, overrides: list[str], seed: int, folder: Path, url: str | None) -> dict:
    out = folder / "run"
    cmd = [sys.executable, "-m", "proxima", "train"]
    if regime == "latency":
        cmd += [
            "tools",
            f"rollout.env.cls={LATENCY_TASK}:SlowCalculator",
            "rollout.env.workers=64",
            f"reward.sources=[{{name: judge, url: '{url}'}}]",
        ]
    cmd += [
        *overrides,
        *ARGS.set,
        f"trainer.seed={seed}",
        f"trainer.iterations={ARGS.iterations}",
        "eval.every=0",
        "trainer.save_every=0",
        "trainer.log_samples=0",
        f"trainer.output_dir={out}",
    ]
    rows, summary = run_quietly(cmd, out)
    k = next((int(o.split("=")[1]) for o in overrides if "max_staleness" in o), 0)
    steady = rows[k + 1 :]
    per_it = statistics.median(sum(r.get(f"time/{p}", 0.0) for p in PHASES) for r in steady)
    samples = summary["config"]["data"]["train_batch_size"] * summary["config"]["rollout"]["n"]
    return {
        "s/iteration": per_it,
        "samples/s": samples / per_it,
        "wait s": statistics.median(r["time/generate"] for r in steady),
        "update s": statistics.median(r["time/update"] for r in steady),
        "worker generate s": statistics.median(r.get("time/worker_generate", 0.0) for r in steady),
        "before %": 100 * summary["eval_before"]["accuracy"],
        "after %": 100 * summary["eval_after"]["accuracy"],
        "staleness": statistics.mean(r.get("rollout/staleness_mean", 0.0) for r in steady),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("regime", choices=sorted(CONFIGS))
    p.add_argument("--iterations", type=int, default=20)
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--configs", nargs="+", help="names of the configurations (default: all)")
    p.add_argument(
        "--set",
        nargs="*",
        default=[],
        help="overrides for every run, e.g. model.device=cuda (on a GPU the workers share it)",
    )
    p.add_argument(
        "--smoke", action="store_true", help="sync and k=1 on the task shrunk to 3 iterations"
    )
    global ARGS
    ARGS = p.parse_args()
    if ARGS.smoke:  # k=1 fills its pipeline in 2 iterations: the 3rd is its steady state
        ARGS.seeds, ARGS.configs = [0], ["sync", "k=1, 1 worker"]
        ARGS.iterations, ARGS.set = 3, [*SMOKE_TASK, *SMOKE_BATCH, *ARGS.set]
    configs = {n: o for n, o in CONFIGS[ARGS.regime].items() if n in (ARGS.configs or [n])}
    server, url = _serve_judge() if ARGS.regime == "latency" else (None, None)
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for seed in ARGS.seeds:
                for name, overrides in configs.items():
                    got = _run(ARGS.regime, overrides, seed, Path(tmp), url)
                    runs[name].append(got)
                    print(f"seed {seed} {name}: {json.dumps(got)}", file=sys.stderr, flush=True)
    finally:
        if server is not None:
            server.kill()
    keys = list(next(iter(runs.values()))[0])
    med = {n: {k: statistics.median(r[k] for r in rs) for k in keys} for n, rs in runs.items()}
    base = med["sync"]["samples/s"] if "sync" in med else float("nan")
    print("| | " + " | ".join(keys) + " | speed-up |")
    print("|---" * (len(keys) + 2) + "|")
    for name, m in med.items():
        cells = " | ".join(f"{m[k]:.3g}" for k in keys)
        print(f"| {name} | {cells} | {m['samples/s'] / base:.2f}x |")
    print(json.dumps({"args": vars(ARGS), "runs": runs}, indent=1))


ARGS: argparse.Namespace

if __name__ == "__main__":
    main()
