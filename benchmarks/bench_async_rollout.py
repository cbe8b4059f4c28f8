"""One-step asynchronous rollouts (`rollout.asynchronous=true`) against the synchronous loop:
seconds per iteration and per phase, on the same model, prompts and seed.

    taskset -c 1 .venv/bin/python benchmarks/bench_async_rollout.py [--repeats 3]
        [--iterations 10] [--threads 1]

Both runs train a tiny Llama (`init-model --size tiny`) with PPO and a critic on 64 prompts
(16 x 4 samples per iteration, responses of at most 32 tokens, a reward that varies). The
asynchronous loop samples the next batch during each iteration before the update, one after
the other: it does the same generation work per iteration, plus the actor's scoring pass
that the synchronous loop skips here (`rollout.old_logprobs=auto` takes the hf engine's
float32 log-probs; with stale weights they are no longer the old policy's), plus the
rollout correction's weights. Each configuration runs `--repeats` times, alternating; per
run the median over its iterations (the first two left out as warm-up) of each phase and of
their sum; the table shows the median over runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
from functools import partial
from pathlib import Path

from phase_runs import PHASES, alternate, print_table, train_rows


def _run(args, folder: Path, model: Path, prompts: Path, name: str) -> dict:
    extra = [
        "rollout.max_response_length=32",
        "critic.warmup_iterations=0",
        f"rollout.asynchronous={str(name == 'async').lower()}",
        "eval.every=0",
    ]
    rows = train_rows(folder, model, prompts, args, extra)
    result = {k: statistics.median(r[k] for r in rows) for k in (*PHASES, "time/iteration")}
    result["response_length"] = statistics.median(r["response_length"] for r in rows)
    result["staleness_mean"] = statistics.mean(r.get("rollout/staleness_mean", 0.0) for r in rows)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--iterations", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    runs, med = alternate(["sync", "async"], args.repeats, "0123456789+=", 64, partial(_run, args))
    print_table(med, ["time/iteration", *PHASES, "response_length", "staleness_mean"], 4)
    ratio = med["async"]["time/iteration"] / med["sync"]["time/iteration"]
    print(f"async / sync, seconds per iteration: {ratio:.2f}x")
    print(json.dumps({"runs": runs, "median": med}, indent=2))


if __name__ == "__main__":
    main()
