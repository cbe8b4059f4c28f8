"""The same seed on the same machine gives identical metrics: the default example (data
split, tiny model, SFT warm start with its stopping rule, PPO with a critic, evaluations),
shortened, run twice in one process. Wall-clock metrics (time/*, tokens_per_s) are the only
ones allowed to differ."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from proxima.cli.args import default_config_path
from proxima.config import load_config
from proxima.recipes import train

pytestmark = pytest.mark.slow


def _metrics(run_dir: str) -> list[dict]:
    rows = [json.loads(x) for x in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return [
        {k: v for k, v in r.items() if not k.startswith("time/") and k != "tokens_per_s"}
        for r in rows
    ]


def test_same_seed_same_metrics(tmp_path):
    runs = []
    for name in ("a", "b"):
        cfg = load_config(
            default_config_path(),
            [
                f"trainer.output_dir={tmp_path / name}",
                "trainer.seed=3",
                "trainer.iterations=6",
                "trainer.threads=1",
                "trainer.tensorboard=false",
                "task.n_train=256",
                "task.n_eval=32",
                "task.n_sft=128",
                "task.sft_steps=40",
                "task.sft_target_accuracy=0.3",
                "eval.every=3",
            ],
        )
        runs.append(train(cfg))
    a, b = runs
    assert a["task"]["sft_val_accuracy"] == b["task"]["sft_val_accuracy"]
    assert a["eval_before"] == b["eval_before"] and a["eval_after"] == b["eval_after"]
    ma, mb = _metrics(a["run_dir"]), _metrics(b["run_dir"])
    assert sum("score" in m for m in ma) == 6  # one row per iteration (+ evaluations)
    assert ma == mb
