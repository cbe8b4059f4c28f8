"""Multi-digit addition with a verifiable 0/1 reward: the default example.

The small-scale analogue of verl's GSM8K example (seed 002): a prompt "37+48=", the answer
"85", reward 1 for an exact answer. The operand pairs are split once, by seed, into
disjoint held-out, SFT and RL sets, so the evaluation measures generalisation.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from proxima.config import Config

ALPHABET = "0123456789+="
REWARD_FN = "proxima.tasks.arithmetic:reward"


def reward(prompts: list[str], responses: list[str], answer: list[str], **_: list) -> list[float]:
    """1.0 when the response is exactly the answer (surrounding spaces ignored), else 0.0."""
    return [float(r.strip() == str(a)) for r, a in zip(responses, answer, strict=True)]


def make_splits(
    digits: int, n_eval: int, n_sft: int, n_train: int, seed: int
) -> dict[str, list[tuple[int, int]]]:
    """Disjoint operand pairs for eval / sft / train, drawn from all pairs below 10**digits."""
    top = 10**digits
    pairs = [(a, b) for a in range(top) for b in range(top)]
    need = n_eval + n_sft + n_train
    if need > len(pairs):
        raise ValueError(
            f"task.n_eval + task.n_sft + task.n_train = {need} exceeds the "
            f"{len(pairs)} distinct problems with {digits} digit(s). Lower them "
            "or raise task.digits."
        )
    random.Random(seed).shuffle(pairs)
    return {
        "eval": pairs[:n_eval],
        "sft": pairs[n_eval : n_eval + n_sft],
        "train": pairs[n_eval + n_sft : need],
    }


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def write_data(folder: Path, splits: dict[str, list[tuple[int, int]]]) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, pairs in splits.items():
        rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a, b in pairs]
        if name == "sft":
            rows = [{"prompt": r["prompt"], "response": r["answer"]} for r in rows]
        paths[name] = folder / f"{name}.jsonl"
        _write_jsonl(paths[name], rows)
    return paths


def prepare(cfg: Config, folder: Path) -> dict:
    """Write the data, build the tiny model, SFT warm start; point cfg at the results."""
    from proxima.models import init_model, load_causal_lm, load_tokenizer
    from proxima.trainer.setup import load_sft
    from proxima.trainer.sft import sft_train

    t = cfg.task
    start = time.perf_counter()
    paths = write_data(
        folder, make_splits(t.digits, t.n_eval, t.n_sft, t.n_train, cfg.trainer.seed)
    )
    init_dir = init_model(
        folder / "init",
        arch=t.arch,
        size=t.size,
        alphabet=ALPHABET,
        max_positions=64,
        seed=cfg.trainer.seed,
    )
    tok = load_tokenizer(init_dir)
    model = load_causal_lm(init_dir)
    losses = []
    if t.sft_steps:
        data = load_sft(cfg, paths["sft"], tok, 32)
        losses = sft_train(
            model,
            tok,
            data,
            steps=t.sft_steps,
            lr=t.sft_lr,
            batch_size=t.sft_batch_size,
            seed=cfg.trainer.seed,
            warmup_steps=min(20, t.sft_steps // 10),
        )
    model.save_pretrained(folder / "sft")
    tok.save_pretrained(folder / "sft")
    cfg.model.actor_path = str(folder / "sft")
    cfg.data.train_path, cfg.data.eval_path = str(paths["train"]), str(paths["eval"])
    if not cfg.reward.function and not cfg.reward.model_path:
        cfg.reward.function = REWARD_FN
    return {
        "name": t.name,
        "sft_steps": t.sft_steps,
        "sft_final_loss": losses[-1] if losses else None,
        "sft_seconds": time.perf_counter() - start,
        "files": {k: str(v) for k, v in paths.items()},
    }
