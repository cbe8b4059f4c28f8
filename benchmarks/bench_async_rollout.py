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
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve()
PHASES = ("time/generate", "time/reward", "time/score", "time/advantages", "time/update")


def reward(prompts: list[str], responses: list[str], **_: list) -> list[float]:
    """A score that varies (the share of digits), so the advantages are not all 0."""
    return [sum(c.isdigit() for c in r) / max(1, len(r)) for r in responses]


def _setup(folder: Path) -> tuple[Path, Path]:
    model = folder / "model"
    subprocess.run(
        [sys.executable, "-m", "proxima", "init-model", "--out", str(model), "--size", "tiny",
         "--alphabet", "0123456789+=", "--max-positions", "64"],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    rows = [{"prompt": f"{a}+{b}="} for a in range(8) for b in range(8)]
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, prompts


def _run(folder: Path, model: Path, prompts: Path, asynchronous: bool, args) -> dict:
    out = folder / "run"
    cmd = [
        sys.executable, "-m", "proxima", "train",
        f"model.actor_path={model}",
        f"data.train_path={prompts}",
        f"reward.function={HERE}:reward",
        "data.train_batch_size=16",
        "rollout.n=4",
        "rollout.max_response_length=32",
        "actor.ppo_mini_batch_size=64",
        "actor.ppo_micro_batch_size=64",
        "critic.ppo_mini_batch_size=64",
        "critic.ppo_micro_batch_size=64",
        "critic.warmup_iterations=0",
        f"rollout.asynchronous={str(asynchronous).lower()}",
        f"trainer.iterations={args.iterations}",
        f"trainer.threads={args.threads}",
        "trainer.save_every=0",
        "trainer.log_samples=0",
        "eval.every=0",
        f"trainer.output_dir={out}",
    ]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/update" in r][2:]
    subprocess.run(["rm", "-rf", str(out)], check=True)
    for r in rows:
        r["time/iteration"] = sum(r.get(k, 0.0) for k in PHASES)
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
    runs: dict[str, list[dict]] = {"sync": [], "async": []}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model, prompts = _setup(folder)
        for _ in range(args.repeats):
            for name in runs:
                runs[name].append(_run(folder, model, prompts, name == "async", args))
    med = {
        name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()
    }
    keys = ["time/iteration", *PHASES, "response_length", "staleness_mean"]
    print("| | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for name, m in med.items():
        print(f"| {name} | " + " | ".join(f"{m[k]:.4f}" for k in keys) + " |")
    ratio = med["async"]["time/iteration"] / med["sync"]["time/iteration"]
    print(f"async / sync, seconds per iteration: {ratio:.2f}x")
    print(json.dumps({"runs": runs, "median": med}, indent=2))


if __name__ == "__main__":
    main()
