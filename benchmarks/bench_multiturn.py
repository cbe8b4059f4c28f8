"""The cost of multi-turn episodes against single responses on the same token budget.

    .venv/bin/python benchmarks/bench_multiturn.py [--repeats 3] [--iterations 8] [--threads 2]

Both runs train the same tiny Llama (`init-model --size tiny`) with PPO and a critic on the
same 64 prompts (16 x 4 samples per iteration). Single-turn: one response of at most 48
tokens. Multi-turn (`rollout.env`): 4 actions of at most 12 tokens (48 in all), each answered
by a 4-token observation (`Echo` below: never done, reward 0), so an episode is at most 48
action tokens + 12 observation tokens; the engine re-reads the whole context at each turn
(no cache reuse across turns). The model is untrained, so some responses end early at EOS
(an episode's EOS ends only its turn): the cost is compared per action token, the tokens the
policy is trained on. Each configuration runs `--repeats` times, alternating; per run the
median over its iterations (the first two left out as warm-up) of the seconds per iteration
and per 1,000 action tokens, for each phase; the table shows the median over runs.
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


class Echo:
    """Answers every action with `ok;` + a digit: never done, no reward."""

    def __init__(self, row: dict) -> None:
        self.turn = 0

    def step(self, action: str) -> tuple[str | None, float, bool]:
        self.turn += 1
        return f"ok;{self.turn % 10}", 0.0, False


def reward(prompts: list[str], responses: list[str], **_: list) -> list[float]:
    """A score that varies (the share of digits), so the advantages are not all 0."""
    return [sum(c.isdigit() for c in r) / max(1, len(r)) for r in responses]


def _setup(folder: Path) -> tuple[Path, Path]:
    model = folder / "model"
    alphabet = "0123456789+=;okabcdef"
    subprocess.run(
        [sys.executable, "-m", "proxima", "init-model", "--out", str(model), "--size", "tiny",
         "--alphabet", alphabet, "--max-positions", "128"],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    rows = [{"prompt": f"{a}+{b}="} for a in range(8) for b in range(8)]
    prompts = folder / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return model, prompts


def _run(folder: Path, model: Path, prompts: Path, multi: bool, args) -> dict[str, float]:
    out = folder / "run"
    common = [
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
    ]
    if multi:
        common += [
            f"rollout.env={HERE}:Echo",
            "rollout.max_turns=4",
            "rollout.max_turn_tokens=12",
            "rollout.max_episode_tokens=60",
            "rollout.max_response_length=60",
        ]
    else:
        common += ["rollout.max_response_length=48"]
    cmd = [sys.executable, "-m", "proxima", "train", *common]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "time/update" in r][2:]
    subprocess.run(["rm", "-rf", str(out)], check=True)
    result = {}
    for r in rows:
        r["time/iteration"] = sum(r.get(k, 0.0) for k in PHASES)
        r["action_tokens"] = r["response_length"] * 64
    for key in (*PHASES, "time/iteration"):
        result[key] = statistics.median(r[key] for r in rows)
        result[key + " per 1k"] = statistics.median(
            1000 * r[key] / r["action_tokens"] for r in rows
        )
    result["action_tokens"] = statistics.median(r["action_tokens"] for r in rows)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--iterations", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    runs: dict[str, list[dict]] = {"single-turn": [], "multi-turn": []}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        model, prompts = _setup(folder)
        for _ in range(args.repeats):
            for name in runs:
                runs[name].append(_run(folder, model, prompts, name == "multi-turn", args))
    med = {
        name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()
    }
    keys = ["action_tokens", "time/iteration", "time/iteration per 1k"]
    keys += [f"{k} per 1k" for k in PHASES]
    print("| | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for name, m in med.items():
        print(f"| {name} | " + " | ".join(f"{m[k]:.3f}" for k in keys) + " |")
    ratio = med["multi-turn"]["time/iteration per 1k"] / med["single-turn"]["time/iteration per 1k"]
    print(f"multi-turn / single-turn, seconds per 1,000 action tokens: {ratio:.2f}x")
    print(json.dumps({"runs": runs, "median": med}, indent=2))


if __name__ == "__main__":
    main()
