"""Supervised fine-tuning on prompt/response records (a starting policy for PPO)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from proxima.data import PromptLoader, collate_sft
from proxima.logging import progress
from proxima.trainer.optim import finetune_optimizer, optimizer_step

# where the bar is hidden (stderr is a log file, not a terminal): a line at the first step
# and then every this many seconds, so that a log shows the run is alive and where it is
LINE_EVERY_S = 30.0


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
    bar = progress(total=steps, desc="sft")
    start, said = time.monotonic(), None
    for step in range(1, steps + 1):
        batch = collate_sft(next(loader), tokenizer.pad_token_id)
        out = model(**{k: v.to(device) for k, v in batch.items()})
        out.loss.backward()
        optimizer_step(model, opt, sched, grad_clip=1.0)  # a non-finite step is skipped
        losses.append(float(out.loss.detach()))
        bar.update(1)
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
        if bar.disable and (said is None or time.monotonic() - said >= LINE_EVERY_S):
            said = time.monotonic()
            line = f"sft step {step}/{steps} | loss {losses[-1]:.4f} | {said - start:.0f} s"
            print(line, flush=True)
        if stop_fn is not None and step % check_every == 0 and stop_fn(step):
            break
    bar.close()
    return losses
