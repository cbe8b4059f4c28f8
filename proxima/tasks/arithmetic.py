"""Multi-digit addition with a verifiable 0/1 reward: the default example.

The small-scale analogue of verl's GSM8K example (verl's PPO documentation): a prompt
"37+48=", the answer "85", reward 1 for an exact answer. The operand pairs are split once,
by seed, into disjoint held-out, SFT and RL sets, so the evaluation measures generalisation.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

from proxima.config import Config
from proxima.rewards import FunctionReward
from proxima.tasks.common import task_info, task_model, warm_start, write_jsonl
from proxima.trainer.datasets import load_prompts
from proxima.trainer.evaluate import evaluate

ALPHABET = "0123456789+="
REWARD_FN = "proxima.tasks.arithmetic:reward"
VAL_SIZE = 128  # validation problems that decide when the SFT warm start stops


def reward(prompts: list[str], responses: list[str], answer: list[str], **_: list) -> list[float]:
    """1.0 when the response is exactly the answer (surrounding spaces ignored), else 0.0."""
    return [float(r.strip() == str(a)) for r, a in zip(responses, answer, strict=True)]


def make_splits(digits: int, sizes: dict[str, int], seed: int) -> dict[str, list[tuple[int, int]]]:
    """Disjoint operand pairs per split (e.g. eval / val / sft / train), drawn by seed from
    all pairs below 10**digits, in the order `sizes` lists them."""
    top = 10**digits
    pairs = [(a, b) for a in range(top) for b in range(top)]
    need = sum(sizes.values())
    if need > len(pairs):
        raise ValueError(
            f"task.n_eval + task.n_sft + task.n_train (+ {VAL_SIZE} validation) = {need} "
            f"exceeds the {len(pairs)} distinct problems with {digits} digit(s). Lower them "
            "or raise task.digits."
        )
    random.Random(seed).shuffle(pairs)
    out, at = {}, 0
    for name, n in sizes.items():
        out[name], at = pairs[at : at + n], at + n
    return out


def write_data(folder: Path, splits: dict[str, list[tuple[int, int]]]) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, pairs in splits.items():
        rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]
        if name == "sft":  # demonstrations: the answer is the response
            rows = [{"prompt": r["prompt"], "response": r["answer"]} for r in rows]
        paths[name] = folder / f"{name}.jsonl"
        write_jsonl(paths[name], rows)
    return paths


def _stop_at_accuracy(cfg: Config, model, tok, val_path: Path, history: list):
    """SFT stopping rule: the mean greedy accuracy of the last `task.sft_smooth_checks`
    validation checks reaches the target. One check on 128 problems jumps by +-10 points
    between checks, and a stop at such a noisy peak starts PPO well below the target; the
    mean of a few checks stops where the accuracy is, not where it fluctuated to. Each
    check's (step, accuracy) is appended to `history`."""
    items = list(load_prompts(cfg, str(val_path), tok))
    source = FunctionReward(reward, REWARD_FN)
    k = max(1, cfg.task.sft_smooth_checks)

    def should_stop(step: int) -> bool:
        res = evaluate(model, tok, items, source, cfg.rollout, "cpu", greedy=True)
        history.append((step, res["accuracy"]))
        last = [acc for _, acc in history[-k:]]
        smoothed = sum(last) / len(last)
        print(
            f"sft step {step}: validation accuracy {res['accuracy']:.1%}, mean of the last "
            f"{len(last)} checks {smoothed:.1%} (stops at {cfg.task.sft_target_accuracy:.0%})"
        )
        return len(last) == k and smoothed >= cfg.task.sft_target_accuracy

    return should_stop


def prepare(cfg: Config, folder: Path) -> tuple[Config, dict]:
    """Write the data, build the tiny model, SFT warm start; return the config pointed at
    the results, and what was done.

    The warm start stops once greedy accuracy on a validation split (disjoint from every
    other split), averaged over the last `task.sft_smooth_checks` checks, reaches
    `task.sft_target_accuracy`, or after `task.sft_steps`: a real, partly trained starting
    point whatever the machine's numerics. Addition is learnt in a sudden transition whose
    step varies with the seed and the machine (measured: from about 550 to past 1,000 steps),
    so the budget leaves room for a late one.
    """

    t = cfg.task
    start = time.perf_counter()
    sizes = {"eval": t.n_eval, "val": VAL_SIZE, "sft": t.n_sft, "train": t.n_train}
    paths = write_data(folder, make_splits(t.digits, sizes, cfg.trainer.seed))
    init_dir = task_model(cfg, folder, ALPHABET)
    history: list[tuple[int, float]] = []

    def stop(model, tok):
        return _stop_at_accuracy(cfg, model, tok, paths["val"], history)

    losses = warm_start(
        cfg, folder, init_dir, paths["sft"], 32, stop if t.sft_target_accuracy else None
    )
    changes = {
        "model.actor_path": str(folder / "sft"),
        "data.train_path": str(paths["train"]),
        "data.eval_path": str(paths["eval"]),
    }
    if not (cfg.reward.function or cfg.reward.model_path or cfg.reward.sources):
        changes["reward.function"] = REWARD_FN
    return cfg.replace(changes), task_info(cfg, losses, start, paths, sft_val_accuracy=history)
