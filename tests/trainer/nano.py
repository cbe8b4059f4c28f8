"""A PPO trainer on a nano Llama with 20 arithmetic prompts, built in-process in a second:
for the trainer-level tests of tests/trainer (test_precision, test_shared_backbone)."""

from __future__ import annotations

import json
from pathlib import Path

from proxima.config import load_config
from proxima.models import init_model
from proxima.trainer.datasets import load_prompts
from proxima.trainer.device import resolve_device
from proxima.trainer.ppo import PPOTrainer
from proxima.trainer.roles import load_roles

REWARD = Path(__file__).parent.parent / "e2e" / "rewards_fixture.py"


def nano_files(root: Path) -> dict[str, Path]:
    """The model folder and the prompt file, written under `root`."""
    model = init_model(root / "m", "llama", "nano", alphabet="0123456789+=", max_positions=32)
    prompts = [{"prompt": f"{a}+{b}="} for a in range(10) for b in range(2)]
    (root / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in prompts))
    return {"model": model, "prompts": root / "p.jsonl"}


def nano_trainer(
    files: dict[str, Path], *extra: str, offload: bool | None = None, device: str = "cpu"
) -> PPOTrainer:
    """8 prompts per iteration, 6 tokens at temperature 0.7, mini-batches of 8 in micro-
    batches of 4, actor lr 1e-3, no critic warm-up, on `device`; `extra` overrides come
    last; `offload`: PPOTrainer's (True runs the moves on the CPU too)."""
    cfg = load_config(
        None,
        [
            f"model.actor_path={files['model']}",
            f"model.device={device}",
            f"data.train_path={files['prompts']}",
            "data.train_batch_size=8",
            f"reward.function={REWARD}:fn",
            "rollout.max_response_length=6",
            "rollout.temperature=0.7",
            "actor.ppo_mini_batch_size=8",
            "actor.ppo_micro_batch_size=4",
            "actor.optim.lr=1e-3",
            "critic.ppo_mini_batch_size=8",
            "critic.ppo_micro_batch_size=4",
            "critic.warmup_iterations=0",
            "trainer.iterations=3",
            *extra,
        ],
    )
    where = resolve_device(cfg.model.device)  # `device` unless `extra` says otherwise
    roles = load_roles(cfg, where)
    prompts = load_prompts(cfg, cfg.data.train_path, roles.tokenizer)
    return PPOTrainer(cfg, roles, prompts, where, offload=offload)
