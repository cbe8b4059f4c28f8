"""Supervised fine-tuning on prompt/response records (a starting policy for PPO)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from proxima.data import PromptLoader, collate_sft
from proxima.logging import StepProgress
from proxima.trainer.optim import finetune_optimizer, optimizer_step


def sft_train(
    model: torch.nn.Module,
    tokenizer,
    dataset,
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int = 0,
    warmup_steps: int = 0,
    device: torch.device | str = "cpu",
    stop_fn: Callable[[int], bool] | None = None,
    check_every: int = 25,
) -> list[float]:
    """Up to `steps` AdamW steps of next-token cross-entropy on response tokens.

    `stop_fn(step)` is asked every `check_every` steps whether to stop early (e.g. a target
    validation accuracy). Returns the loss of every step taken.
    """
    opt, sched = finetune_optimizer(model, lr, steps, warmup_steps)
    loader = PromptLoader(dataset, batch_size, seed=seed)
    model.train()
    losses = []
    bar = StepProgress(steps, "sft")
    for step in range(1, steps + 1):
        batch = collate_sft(next(loader), tokenizer.pad_token_id)
        out = model(**{k: v.to(device) for k, v in batch.items()})
        out.loss.backward()
        optimizer_step(model, opt, sched, grad_clip=1.0)  # a non-finite step is skipped
        losses.append(float(out.loss.detach()))
        bar.update(step, loss=f"{losses[-1]:.4f}")
        if stop_fn is not None and step % check_every == 0 and stop_fn(step):
            break
    bar.close()
    return losses
