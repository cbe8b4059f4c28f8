"""proxima's cell: `PPOTrainer.step()` on the workload, timed per iteration."""

from __future__ import annotations

import time
from pathlib import Path

from benchmarks.common.timing import sync
from benchmarks.common.workloads import KL_COEF, LR, SEED, TEMPERATURE, Workload
from benchmarks.systems.lengths import lengths


def proxima_overrides(spec: dict, w: Workload, a: dict, iterations: int, workdir: Path) -> list:
    """The workload as `proxima train` overrides: the models, batch, sampling, KL and
    optimizer every system shares (the cell's own overrides go after them)."""
    mb = w.mini_batch
    base = [
        f"model.actor_path={a['actor']}",
        f"reward.model_path={a['reward']}",
        "model.critic_init=reward_model",
        "model.dtype=float32",
        f"model.device={spec['device']}",
        f"data.train_path={spec['prompt_file']}",
        f"data.train_batch_size={w.prompts}",
        f"data.max_prompt_length={w.prompt_lengths[1]}",
        f"rollout.n={w.samples}",
        f"rollout.max_response_length={w.response}",
        f"rollout.temperature={TEMPERATURE}",
        "rollout.top_k=0",
        "rollout.top_p=1.0",
        f"rollout.micro_batch_size={w.sequences}",
        f"reward.batch_size={w.sequences}",
        "algorithm.adv_estimator=gae",
        f"algorithm.kl_ctrl.kl_coef={KL_COEF}",
        f"trainer.iterations={iterations}",
        f"trainer.seed={SEED}",
        f"trainer.threads={spec['threads']}",
        f"trainer.output_dir={workdir / 'proxima'}",
        "trainer.tensorboard=false",
        "trainer.save_every_minutes=0",
    ]
    for role in ("actor", "critic"):
        base += [
            f"{role}.ppo_epochs={spec['epochs']}",
            f"{role}.ppo_mini_batch_size={mb}",
            f"{role}.ppo_micro_batch_size={mb}",
            f"{role}.optim.lr={LR}",
            f"{role}.optim.grad_clip=0",  # TRL's PPO loop does not clip gradients
        ]
    return base


def proxima_cell(spec: dict, w: Workload, a: dict, iterations: int, workdir: Path) -> list[dict]:
    """`PPOTrainer.step()` for `iterations` iterations, each timed, with proxima's own phase
    timer, the sampled lengths and the engine's log-prob gap to the trainer's."""
    import torch

    from proxima.config import load_config
    from proxima.trainer.datasets import load_prompts
    from proxima.trainer.ppo import PPOTrainer
    from proxima.trainer.roles import load_roles

    base = proxima_overrides(spec, w, a, iterations, workdir)
    cfg = load_config(None, base + spec["overrides"])
    device = torch.device(spec["device"])
    roles = load_roles(cfg, device)
    prompts = load_prompts(cfg, spec["prompt_file"], roles.tokenizer)
    lo, hi = w.prompt_lengths
    assert all(lo <= len(prompts[i].ids) <= hi for i in range(len(prompts)))
    trainer = PPOTrainer(cfg, roles, prompts, device)
    records = []
    for _ in range(iterations):
        start = time.perf_counter()
        metrics, ro = trainer.step()
        sync(spec["device"])
        sec = time.perf_counter() - start
        last = dict(trainer.timer.last)
        gen = last.get("generate", 0.0)
        score = last.get("reward", 0.0) + last.get("score", 0.0)
        train = last.get("update", 0.0)
        records.append(
            {
                "seconds": sec,
                "phases": {"gen": gen, "score": score, "train": train},
                "detail": last,
                "tokens": int(ro.gen.response_mask.sum()),
                "lengths": lengths(
                    ro.gen.attention_mask,
                    ro.gen.response_mask,
                    ro.gen.input_ids[:, : -ro.gen.response_mask.shape[1]],
                ),
                "steps": {
                    k: int(metrics.get(f"{k}/optimizer_steps", 0)) for k in ("actor", "critic")
                },
                "logprob_diff_mean": metrics.get("rollout/logprob_diff_mean"),
            }
        )
    return records
