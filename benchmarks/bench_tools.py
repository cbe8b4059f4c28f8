"""The built-in multi-turn example (`proxima train tools`) per seed: greedy held-out
accuracy before and after PPO, the share of episodes that called the calculator (evaluation's
`multi_turn`), and the wall time of the whole run (task preparation with its SFT warm start
included). Seeds run one after another, each in a fresh process.

    python -m benchmarks.bench_tools --seeds 1 2 3 [--out runs/bench-tools] [key=value ...]
    python -m benchmarks.bench_tools --smoke   # one seed, the task shrunk to seconds
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common.runs import SMOKE_TASK, scratch_folder
from benchmarks.common.timing import repo_env


def run(seed: int, out: Path, extra: list[str]) -> dict:
    folder = out / f"seed{seed}"
    cmd = [sys.executable, "-m", "proxima", "train", "tools", f"trainer.seed={seed}"]
    cmd += [f"trainer.output_dir={folder}", *extra]
    if folder.exists():
        raise SystemExit(f"{folder} exists: pass a new --out")
    start = time.perf_counter()
    subprocess.run(cmd, check=True, env=repo_env(), stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    summary = json.loads((folder / "summary.json").read_text())
    before, after = summary["eval_before"], summary["eval_after"]
    return {
        "seed": seed,
        "accuracy_before": before["accuracy"],
        "accuracy_after": after["accuracy"],
        "tool_share_before": before["multi_turn"],
        "tool_share_after": after["multi_turn"],
        "sft_seconds": summary["task"]["sft_seconds"],
        "wall_seconds": wall,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--out", type=Path, default=Path("runs/bench-tools"))
    p.add_argument("overrides", nargs="*", help="section.key=value passed to every run")
    p.add_argument("--smoke", action="store_true", help="one seed, the task shrunk to seconds")
    args = p.parse_args()
    if args.smoke:
        args.seeds, args.overrides = [1], [*SMOKE_TASK, *args.overrides]
        args.out = scratch_folder("proxima-bench-tools-smoke-")
    rows = [run(s, args.out, args.overrides) for s in args.seeds]
    print("| seed | accuracy before | accuracy after | calls the tool, before | after | wall s |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['seed']} | {r['accuracy_before']:.1%} | {r['accuracy_after']:.1%} | "
            f"{r['tool_share_before']:.1%} | {r['tool_share_after']:.1%} | "
            f"{r['wall_seconds']:.0f} |"
        )
    print(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
