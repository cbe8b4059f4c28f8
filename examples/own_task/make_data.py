"""Data of two small text tasks for the "Train on your own task" recipe
(docs/getting-started.md).

    python examples/own_task/make_data.py --task sort --out data/sort [--seed 0]

sort:    "dbca>" -> "abcd"  (sort 4 letters of a-h)
reverse: "dbca<" -> "acbd"  (reverse 4 letters of a-h)

Writes disjoint sft.jsonl (300 prompt/response demonstrations), train.jsonl (2,000 prompts
with their answer column, for PPO) and eval.jsonl (256 held-out prompts with answers).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from pathlib import Path

LETTERS = "abcdefgh"
SIZES = {"eval": 256, "sft": 300, "train": 2000}


def solve(task: str, word: str) -> str:
    return "".join(sorted(word)) if task == "sort" else word[::-1]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--task", choices=["sort", "reverse"], required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    mark = ">" if a.task == "sort" else "<"
    words = ["".join(w) for w in itertools.product(LETTERS, repeat=4)]  # 4,096 problems
    random.Random(a.seed).shuffle(words)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    at = 0
    for name, n in SIZES.items():
        rows = []
        for w in words[at : at + n]:
            prompt, answer = w + mark, solve(a.task, w)
            rows.append(
                {"prompt": prompt, "response": answer}
                if name == "sft"
                else {"prompt": prompt, "answer": answer}
            )
        at += n
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {', '.join(f'{n} {k}' for k, n in SIZES.items())} rows to {out}")


if __name__ == "__main__":
    main()
