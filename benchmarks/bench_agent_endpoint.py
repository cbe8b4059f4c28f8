"""The calculator task played two ways on the same seeds: by proxima's environment class
(`proxima train tools`, `rollout.env`) and by an agent program on the official `openai`
client through proxima's OpenAI-compatible endpoint (`proxima train
examples/agent/calculator.yaml`, `rollout.agent`): held-out greedy accuracy before and
after, and what the endpoint costs per episode and per model call.

    .venv/bin/python benchmarks/bench_agent_endpoint.py [--seeds 0 1 2] [--iterations 60]

Per run: `time/generate` (the episodes of an iteration: generation, the environment or the
agent's loop and HTTP calls) summed over the iterations, the episodes and the model calls
(`env/turns` per episode: an agent's calls) summed likewise; the overhead is the agent's
seconds per call minus the environment's, and per episode likewise. The two configurations
alternate, seed by seed; the table shows each run and the medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WAYS = {"env": ["tools"], "agent": [str(ROOT / "examples" / "agent" / "calculator.yaml")]}


def _run(way: str, seed: int, iterations: int, folder: Path) -> dict:
    out = folder / f"{way}-{seed}"
    cmd = [sys.executable, "-m", "proxima", "train", *WAYS[way], f"trainer.seed={seed}"]
    cmd += [f"trainer.iterations={iterations}", "eval.every=0", "trainer.save_every=0"]
    cmd += [f"trainer.output_dir={out}"]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/update" in r]
    summary = json.loads((out / "summary.json").read_text())
    episodes = summary["config"]["data"]["train_batch_size"] * summary["config"]["rollout"]["n"]
    seconds = sum(r["time/generate"] for r in rows)
    calls = sum(r["env/turns"] * episodes for r in rows)
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    return {
        "before %": 100 * summary["eval_before"]["accuracy"],
        "after %": 100 * summary["eval_after"]["accuracy"],
        "generate s/iteration": seconds / len(rows),
        "calls/episode": calls / (episodes * len(rows)),
        "ms/episode": 1000 * seconds / (episodes * len(rows)),
        "ms/call": 1000 * seconds / calls,
        "wall s": summary["wall_seconds"],
        "sample": samples[-1],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--iterations", type=int, default=60)
    p.add_argument("--smoke", action="store_true", help="one seed, the task shrunk to seconds")
    args = p.parse_args()
    if args.smoke:
        from benchmarks.common.runs import SMOKE_TASK

        args.seeds, args.iterations = [0], 1
        for way in WAYS:
            WAYS[way] = [*WAYS[way], *SMOKE_TASK]
    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for way in WAYS:
                got = _run(way, seed, args.iterations, Path(tmp))
                runs[way].append(got)
                shown = {k: v for k, v in got.items() if k != "sample"}
                print(f"seed {seed} {way}: {json.dumps(shown)}", file=sys.stderr, flush=True)
    keys = [k for k in runs["env"][0] if k != "sample"]
    print("| | seed | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 2) + "|")
    for way, rs in runs.items():
        for seed, r in zip(args.seeds, rs, strict=True):
            print(f"| {way} | {seed} | " + " | ".join(f"{r[k]:.4g}" for k in keys) + " |")
    med = {w: {k: statistics.median(r[k] for r in rs) for k in keys} for w, rs in runs.items()}
    for unit in ("ms/episode", "ms/call"):
        print(f"endpoint overhead, {unit}: {med['agent'][unit] - med['env'][unit]:.2f} "
              f"(agent {med['agent'][unit]:.2f}, env {med['env'][unit]:.2f}, medians)")  # fmt: skip
    print(json.dumps({"args": vars(args), "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
