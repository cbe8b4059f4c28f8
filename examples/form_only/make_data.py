"""The prompts of `proxima train chat` as files, for a run without its built-in task (the
task writes the same prompts itself): the chat recipe's settings with task.name empty.

    python examples/form_only/make_data.py --out data/form_only [--seed 0]
    proxima train chat task.name= model.actor_path=MODEL \
        data.train_path=data/form_only/train.jsonl data.eval_path=data/form_only/eval.jsonl \
        reward.function=examples/form_only/reward.py:score

Each row: the chat prompt and the columns the verifiers read (kind, n, word, topic,
category); the held-out prompts name topics the training prompts never do.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from proxima.tasks.common import write_jsonl
from proxima.tasks.instructions import make_splits


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--n-train", type=int, default=2000)
    p.add_argument("--n-eval", type=int, default=120)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in make_splits(a.n_train, a.n_eval, a.seed).items():
        write_jsonl(out / f"{name}.jsonl", rows)
        print(f"wrote {len(rows)} prompts to {out / name}.jsonl")


if __name__ == "__main__":
    main()
