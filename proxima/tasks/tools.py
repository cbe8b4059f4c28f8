"""Two-digit multiplication with a calculator: the built-in multi-turn example.

A tiny model cannot multiply two-digit numbers, but it can learn to ask: the prompt
"37*48=", the policy may write a call "[37*48]" (a turn ends at "]"), the environment
answers "1776;" and the policy writes its final answer "1776", reward 1 when it is right.
The SFT warm start sees demonstrations of both ways, most of them answering directly (which
the model cannot learn), a few through the calculator (`TOOL_SHARE`); each demonstration
turn is one SFT record (prompt = the episode so far, response = the action), so no
observation is ever a training target. PPO then finds that the calculator pays.
"""

from __future__ import annotations

import random
import re
import time
from pathlib import Path

from proxima.config import Config
from proxima.tasks.arithmetic import VAL_SIZE, make_splits
from proxima.tasks.common import task_info, task_model, warm_start, write_jsonl

ALPHABET = "0123456789*=[];"
ENV = "proxima.tasks.tools:Calculator"
TOOL_SHARE = 0.3  # the SFT demonstrations that use the calculator
CALL = re.compile(r"\[(\d+)\*(\d+)\]")


class Calculator:
    """The environment of one problem: a call "[a*b]" is answered with "a*b;" (the product,
    or "?;" for a call it cannot read) and no reward; any other action is the final answer:
    reward 1 when it is the product (its end of text ignored), and the episode is done."""

    max_reward = 1.0

    def __init__(self, row: dict) -> None:
        self.answer = str(row["answer"])

    def step(self, action: str) -> tuple[str | None, float, bool]:
        text = action.replace("</s>", "").strip()
        if text.startswith("["):
            call = CALL.fullmatch(text)
            result = str(int(call[1]) * int(call[2])) if call else "?"
            return f"{result};", 0.0, False
        return None, float(text == self.answer), True


def demonstrations(pairs: list[tuple[int, int]], seed: int) -> list[dict]:
    """SFT records: per problem one direct answer, or (a `TOOL_SHARE` of them, by seed) the
    call and then the answer after the calculator's reply, one record per turn."""
    rng = random.Random(seed + 1)
    rows = []
    for a, b in pairs:
        prompt, product = f"{a}*{b}=", str(a * b)
        if rng.random() < TOOL_SHARE:
            call = f"[{a}*{b}]"
            rows.append({"prompt": prompt, "response": call})
            rows.append({"prompt": f"{prompt}{call}{product};", "response": product})
        else:
            rows.append({"prompt": prompt, "response": product})
    return rows


def write_data(folder: Path, splits: dict[str, list[tuple[int, int]]], seed: int) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, pairs in splits.items():
        rows = [{"prompt": f"{a}*{b}=", "answer": str(a * b)} for a, b in pairs]
        if name == "sft":
            rows = demonstrations(pairs, seed)
        paths[name] = folder / f"{name}.jsonl"
        write_jsonl(paths[name], rows)
    return paths


def prepare(cfg: Config, folder: Path) -> tuple[Config, dict]:
    """Write the data, build the tiny model, SFT warm start for `task.sft_steps`; return the
    config pointed at the results (the environment gives every reward) and what was done."""
    t = cfg.task
    start = time.perf_counter()
    sizes = {"eval": t.n_eval, "val": VAL_SIZE, "sft": t.n_sft, "train": t.n_train}
    paths = write_data(folder, make_splits(t.digits, sizes, cfg.trainer.seed), cfg.trainer.seed)
    init_dir = task_model(cfg, folder, ALPHABET)
    losses = warm_start(cfg, folder, init_dir, paths["sft"], 40)
    changes = {
        "model.actor_path": str(folder / "sft"),
        "data.train_path": str(paths["train"]),
        "data.eval_path": str(paths["eval"]),
    }
    return cfg.replace(changes), task_info(cfg, losses, start, paths)
