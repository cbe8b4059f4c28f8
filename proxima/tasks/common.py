"""What the built-in tasks share: their files, the SFT warm start of their tiny model, and
the record of what the preparation did (summary.json's `task`)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

from proxima.config import Config
from proxima.models import init_model, load_causal_lm, load_tokenizer
from proxima.rollout.engines import check_engine
from proxima.trainer.datasets import load_sft
from proxima.trainer.sft import sft_train


def task_model(cfg: Config, folder: Path, alphabet: str) -> Path:
    """The task's tiny model (task.arch, task.size, seeded by trainer.seed) with a character
    tokenizer over `alphabet`, built in folder/init."""
    t = cfg.task
    return init_model(
        folder / "init",
        arch=t.arch,
        size=t.size,
        alphabet=alphabet,
        max_positions=64,
        seed=cfg.trainer.seed,
    )


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def warm_start(
    cfg: Config,
    folder: Path,
    init_dir: Path,
    sft_path: Path,
    max_length: int,
    make_stop: Callable | None = None,
) -> list[float]:
    """SFT of the task's tiny model (`init_dir`) on `sft_path` for at most `task.sft_steps`
    (`make_stop(model, tokenizer)`: the stopping rule, or None), saved to folder/sft; returns
    the losses. The engine is checked first (e.g. a head size vLLM's CPU build lacks)."""
    t = cfg.task
    check_engine(cfg, str(init_dir))
    tok = load_tokenizer(init_dir)
    model = load_causal_lm(init_dir)
    losses: list[float] = []
    if t.sft_steps:
        losses = sft_train(
            model,
            tok,
            load_sft(cfg, sft_path, tok, max_length),
            steps=t.sft_steps,
            lr=t.sft_lr,
            batch_size=t.sft_batch_size,
            seed=cfg.trainer.seed,
            warmup_steps=min(20, t.sft_steps // 10),
            stop_fn=make_stop(model, tok) if make_stop else None,
            check_every=t.sft_check_every,
        )
    model.save_pretrained(folder / "sft")
    tok.save_pretrained(folder / "sft")
    return losses


def task_info(cfg: Config, losses: list[float], start: float, paths: dict, **extra) -> dict:
    """What a task's preparation did, for summary.json."""
    return {
        "name": cfg.task.name,
        "sft_steps": len(losses),
        "sft_final_loss": losses[-1] if losses else None,
        **extra,
        "sft_seconds": time.perf_counter() - start,
        "files": {k: str(v) for k, v in paths.items()},
    }
