"""Learning benchmark: the default example over several seeds.

    python -m benchmarks.bench_learning [key=value ...] --seeds 1 2 3 [--out runs/bench_learning]
        [--config dapo]
    python -m benchmarks.bench_learning --smoke   # one seed, the example shrunk to seconds

Each seed runs the whole default example (data split, tiny model, SFT warm start, PPO,
held-out greedy accuracy before and after) and the script prints one row per seed and the
median gain. Extra `key=value` overrides apply to every seed (e.g. algorithm.adv_estimator=grpo);
put them before `--seeds`, which takes every number after it.
"""

from __future__ import annotations

import argparse
import json
import statistics

from benchmarks.common.runs import SMOKE_TASK, scratch_folder
from proxima.cli.args import builtin_config, default_config_path
from proxima.config import load_config
from proxima.recipes import train


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--out", default="runs/bench_learning")
    p.add_argument(
        "--config", default="", help="a YAML file or a shipped config name (default: the example)"
    )
    p.add_argument("overrides", nargs="*")
    p.add_argument("--smoke", action="store_true", help="one seed, the example shrunk")
    a = p.parse_args()
    if a.smoke:
        a.seeds, a.overrides = [1], [*SMOKE_TASK, *a.overrides]
        a.out = str(scratch_folder("proxima-bench-learning-smoke-"))
    rows = []
    for seed in a.seeds:
        cfg = load_config(
            builtin_config(a.config) if a.config else default_config_path(),
            [
                f"trainer.seed={seed}",
                f"trainer.output_dir={a.out}/seed{seed}",
                "trainer.tensorboard=false",
                *a.overrides,
            ],
        )
        s = train(cfg)
        rows.append(
            {
                "seed": seed,
                "before": s["eval_before"]["accuracy"],
                "after": s["eval_after"]["accuracy"],
                "sft_steps": s["task"]["sft_steps"],
                "sft_s": s["task"]["sft_seconds"],
                "wall_s": s["task"]["sft_seconds"] + s["wall_seconds"],
            }
        )
    print(
        "\n| seed | SFT steps | before | after | gain | SFT s | total s |"
        "\n|---|---|---|---|---|---|---|"
    )
    for r in rows:
        print(
            f"| {r['seed']} | {r['sft_steps']} | {r['before']:.1%} | {r['after']:.1%} | "
            f"{r['after'] - r['before']:+.1%} | {r['sft_s']:.0f} | {r['wall_s']:.0f} |"
        )
    gains = [r["after"] - r["before"] for r in rows]
    print(f"median gain {statistics.median(gains):+.1%} over seeds {a.seeds}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
