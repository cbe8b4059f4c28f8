"""The cost of multi-turn episodes against single responses on the same token budget.

    .venv/bin/python -m benchmarks.bench_multiturn [--repeats 3] [--iterations 8] [--threads 2]
    .venv/bin/python -m benchmarks.bench_multiturn --smoke   # one short run of two of them

Every run trains the same tiny Llama (`init-model --size tiny`) with PPO and a critic on the
same 64 prompts (16 x 4 samples per iteration). Single-turn: one response of at most 48
tokens. Multi-turn (`rollout.env`): 4 actions of at most 12 tokens (48 in all), each answered
by a 4-token observation (`Echo` below: never done, reward 0), so an episode is at most 48
action tokens + 12 observation tokens; each episode's KV cache is kept between its turns
(`rollout.env.keep_kv_cache`), and a third run prefills each turn's whole context instead
(`multi-turn, whole prefills`: keep_kv_cache=false). The model is untrained, so some
responses end early at EOS (an episode's EOS ends only its turn): the cost is compared per
action token, the tokens the policy is trained on. Each configuration runs `--repeats`
times, alternating; per run the median over its iterations (the first two left out as
warm-up) of the seconds per iteration and per 1,000 action tokens, for each phase; the
table shows the median over runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
from functools import partial
from pathlib import Path

from benchmarks.common.runs import (
    PHASES,
    SEQUENCES,
    WARM_UP,
    alternate,
    print_table,
    train_rows,
)

HERE = Path(__file__).resolve()


class Echo:
    """Answers every action with `ok;` + a digit: never done, no reward."""

    def __init__(self, row: dict) -> None:
        self.turn = 0

    def step(self, action: str) -> tuple[str | None, float, bool]:
        self.turn += 1
        return f"ok;{self.turn % 10}", 0.0, False


MULTI_TURN = [
    f"rollout.env={HERE}:Echo",
    "rollout.env.max_turns=4",
    "rollout.env.max_turn_tokens=12",
    "rollout.env.max_episode_tokens=60",
    "rollout.max_response_length=60",
]


WHOLE_PREFILLS = "multi-turn, whole prefills"


def _run(args, folder: Path, model: Path, prompts: Path, name: str) -> dict[str, float]:
    extra = MULTI_TURN if name.startswith("multi-turn") else ["rollout.max_response_length=48"]
    extra += ["rollout.env.keep_kv_cache=false"] if name == WHOLE_PREFILLS else []
    rows = train_rows(folder, model, prompts, args, extra)
    for r in rows:
        r["action_tokens"] = r["response_length"] * SEQUENCES
    result = {}
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
    p.add_argument("--smoke", action="store_true", help="single- and multi-turn, one short run")
    args = p.parse_args()
    names = ["single-turn", "multi-turn", WHOLE_PREFILLS]
    if args.smoke:  # whole prefills differ from multi-turn by one override only
        args.repeats, args.iterations, args.threads = 1, WARM_UP + 1, 1
        names = names[:2]
    runs, med = alternate(names, args.repeats, "0123456789+=;okabcdef", 128, partial(_run, args))
    keys = ["action_tokens", "time/iteration", "time/iteration per 1k"]
    keys += [f"{k} per 1k" for k in PHASES]
    print_table(med, keys, 3)
    for name in names[1:]:
        for key in ("time/iteration", "time/generate"):
            ratio = med[name][f"{key} per 1k"] / med["single-turn"][f"{key} per 1k"]
            print(f"{name} / single-turn, {key} per 1,000 action tokens: {ratio:.2f}x")
    print(json.dumps({"runs": runs, "median": med}, indent=2))


if __name__ == "__main__":
    main()
