"""Fixtures of the end-to-end tier: tiny models made by `proxima init-model`, prompt files,
the reward file, and the overrides of a fast run (nano models, a handful of sequences)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from proxima.cli import main

ALPHABET = "0123456789+="
REWARDS_FILE = Path(__file__).with_name("rewards_fixture.py")


@pytest.fixture
def reward_spec() -> Callable[[str], str]:
    """`reward_spec("fn")` -> "<abs path>/rewards_fixture.py:fn"."""
    return lambda name="fn": f"{REWARDS_FILE}:{name}"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def prompt_file(tmp_path: Path) -> Path:
    """100 prompts "a+b=" (a, b < 10) in order a = 0, 1, ...: the first 20 are a = 0 and 1."""
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
    return write_jsonl(tmp_path / "prompts.jsonl", rows)


@pytest.fixture
def sft_file(tmp_path: Path) -> Path:
    rows = [{"prompt": f"{a}+{b}=", "response": str(a + b)} for a in range(10) for b in range(10)]
    return write_jsonl(tmp_path / "sft.jsonl", rows)


@pytest.fixture
def make_model(tmp_path: Path) -> Callable[..., Path]:
    """`make_model("gpt2")` -> folder of a nano model built by `proxima init-model`."""

    def make(arch: str = "llama", size: str = "nano", seed: int = 0) -> Path:
        out = tmp_path / f"init-{arch}-{size}-{seed}"
        rc = main(
            [
                "init-model",
                "--out",
                str(out),
                "--arch",
                arch,
                "--size",
                size,
                "--alphabet",
                ALPHABET,
                "--max-positions",
                "64",
                "--seed",
                str(seed),
            ]
        )
        assert rc == 0 and (out / "config.json").is_file()
        return out

    return make


@pytest.fixture
def fast_overrides(prompt_file: Path, reward_spec) -> Callable[..., list[str]]:
    """Overrides of a run that takes a few seconds: 4 prompts x 2 samples, 4 new tokens,
    micro-batches of 4 (so accumulation is exercised), lr high enough to move weights.

    Without a YAML, `proxima train` starts from the built-in example's config, so every
    setting these tests rely on is pinned here rather than inherited from it."""

    def overrides(model: Path, out: Path, iterations: int = 2, *extra: str) -> list[str]:
        return [
            "task.name=",  # no built-in task: train the given model on the given prompts
            f"model.actor_path={model}",
            "model.device=cpu",
            f"data.train_path={prompt_file}",
            "data.max_prompt_length=16",
            "data.train_batch_size=4",
            f"reward.function={reward_spec('fn')}",
            "rollout.n=2",
            "rollout.max_response_length=4",
            "algorithm.adv_estimator=gae",
            "algorithm.kl_ctrl.kl_coef=0.05",
            "actor.ppo_epochs=1",
            "actor.ppo_mini_batch_size=8",
            "actor.ppo_micro_batch_size=4",
            "actor.optim.lr=1e-3",
            "actor.optim.warmup_steps=0",
            "critic.ppo_mini_batch_size=8",
            "critic.ppo_micro_batch_size=4",
            "critic.optim.lr=1e-3",
            "critic.optim.warmup_steps=0",
            "critic.ppo_epochs=1",
            "critic.warmup_iterations=0",  # the default example waits; here the actor must move
            f"trainer.iterations={iterations}",
            f"trainer.output_dir={out}",
            "trainer.tensorboard=false",
            "trainer.threads=2",
            "trainer.log_samples=2",
            *extra,
        ]

    return overrides


def arithmetic_pairs(tmp_path: Path, wrong_per_prompt: int) -> tuple[Path, Path]:
    """Preference pairs on one-digit sums: `wrong_per_prompt` training pairs per prompt (the
    right sum chosen, a wrong one rejected) and one held-out pair with a wrong answer unseen
    in training; 100 prompts."""
    rng = random.Random(0)
    train, held = [], []
    for a in range(10):
        for b in range(10):
            wrong = [s for s in range(19) if s != a + b]
            rng.shuffle(wrong)
            for i, w in enumerate(wrong[: wrong_per_prompt + 1]):
                row = {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(w)}
                (held if i == wrong_per_prompt else train).append(row)
    return write_jsonl(tmp_path / "pairs.jsonl", train), write_jsonl(tmp_path / "held.jsonl", held)


@pytest.fixture
def keep_threads():
    """Restore torch's thread count after a test that sets it (it is process-wide)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)
