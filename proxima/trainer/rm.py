"""Reward-model training on preference pairs (DeepSpeed-Chat step 2, InstructGPT eq. 1).

The reward model r(x, y) is a sequence classifier with one label, read at the last real
token (``reward_model_scores``). Given a prompt x with a chosen response y_c and a rejected
one y_r, the Bradley-Terry model says P(y_c > y_r) = sigmoid(r(x, y_c) - r(x, y_r)); training
maximises its log-likelihood: loss = -mean(log sigmoid(r_c - r_r - m)), m an optional margin
(Llama 2, eq. 2). Only score differences are trained, so the scale of r is free.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel

from proxima.data import PromptLoader
from proxima.data.preferences import PreferenceItem, collate_preferences
from proxima.logging import StepProgress
from proxima.models.forward import reward_model_scores
from proxima.trainer.optim import finetune_optimizer, optimizer_step

CURVES = ("loss", "accuracy", "margin")


def preference_accuracy(chosen: torch.Tensor, rejected: torch.Tensor) -> float:
    """Share of pairs with r_chosen > r_rejected (ties count as wrong). chosen, rejected: [B]."""
    return float((chosen > rejected).float().mean())


def pairwise_loss(
    chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor | None = None
) -> tuple[torch.Tensor, dict[str, float]]:
    """Bradley-Terry loss -mean(log sigmoid(r_c - r_r - margin)) (InstructGPT eq. 1; margin:
    Llama 2 eq. 2). chosen, rejected, margin: [B] scores. Returns (loss, detached stats):
    loss, accuracy, margin (mean r_c - r_r, without the target margin), mean chosen and
    rejected scores."""
    diff = chosen - rejected
    target = diff if margin is None else diff - margin
    loss = -F.logsigmoid(target).mean()  # logsigmoid is stable for large |diff|
    stats = {
        "loss": float(loss.detach()),
        "accuracy": preference_accuracy(chosen.detach(), rejected.detach()),
        "margin": float(diff.detach().mean()),
        "chosen_score": float(chosen.detach().mean()),
        "rejected_score": float(rejected.detach().mean()),
    }
    return loss, stats


def pair_scores(
    model: PreTrainedModel, batch: dict[str, torch.Tensor], device: torch.device | str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Scores of both sides in one forward pass over chosen stacked on rejected [2B, L]
    (as DeepSpeed-Chat does). Returns (chosen [B], rejected [B]) float32."""
    n = batch["chosen_input_ids"].shape[0]
    ids = torch.cat([batch["chosen_input_ids"], batch["rejected_input_ids"]]).to(device)
    mask = torch.cat([batch["chosen_attention_mask"], batch["rejected_attention_mask"]])
    scores = reward_model_scores(model, ids, mask.to(device))
    return scores[:n], scores[n:]


@torch.no_grad()
def evaluate_preferences(
    model: PreTrainedModel,
    pairs: Sequence[PreferenceItem],
    pad_token_id: int | None,
    batch_size: int = 32,
    device: torch.device | str = "cpu",
) -> dict[str, float]:
    """Loss, accuracy, mean margin and mean scores over all `pairs` (eval mode, no grads)."""
    chosen, rejected, margins = all_pair_scores(model, pairs, pad_token_id, batch_size, device)
    _, stats = pairwise_loss(chosen, rejected, margins)
    return {**stats, "n": len(pairs)}


@torch.no_grad()
def all_pair_scores(
    model: PreTrainedModel,
    pairs: Sequence[PreferenceItem],
    pad_token_id: int | None,
    batch_size: int = 32,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen [N], rejected [N], target margins [N]) scores of every pair, in eval mode."""
    was_training = model.training
    model.eval()
    chosen, rejected, margins = [], [], []
    for start in range(0, len(pairs), batch_size):
        items = [pairs[i] for i in range(start, min(start + batch_size, len(pairs)))]
        batch = collate_preferences(items, pad_token_id)
        c, r = pair_scores(model, batch, device)
        chosen.append(c.cpu())
        rejected.append(r.cpu())
        margins.append(batch["margin"])
    model.train(was_training)
    return torch.cat(chosen), torch.cat(rejected), torch.cat(margins)


def score_normalization(
    model: PreTrainedModel, pairs: Sequence[PreferenceItem], pad_token_id: int | None, device
) -> dict[str, float]:
    """Mean and std of the model's scores over both responses of every pair: the reward
    model's normalisation, so that (score - mean) / std has mean 0 and std 1 on the
    responses it learned from. Returns {"mean", "std", "n"}."""
    chosen, rejected, _ = all_pair_scores(model, pairs, pad_token_id, device=device)
    scores = torch.cat([chosen, rejected]).double()
    std = float(scores.std(unbiased=False)) if scores.numel() > 1 else 0.0
    return {"mean": float(scores.mean()), "std": std if std > 0 else 1.0, "n": scores.numel()}


def _evaluate_all(model, probes: dict[str, Sequence[PreferenceItem]], pad, device, when: str):
    return {
        f"{name}_{when}": evaluate_preferences(model, pairs, pad, device=device)
        for name, pairs in probes.items()
    }


def _check_sizes(dataset: Sequence[PreferenceItem], steps: int, batch_size: int) -> None:
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1; set --steps.")
    if batch_size < 1 or len(dataset) < batch_size:
        raise ValueError(
            f"batch_size={batch_size} needs 1 <= batch_size <= {len(dataset)} (the number of "
            "training pairs); lower --batch-size or add pairs."
        )


def rm_train(
    model: PreTrainedModel,
    tokenizer: Any,
    dataset: Sequence[PreferenceItem],
    *,
    steps: int,
    lr: float,
    batch_size: int,
    seed: int = 0,
    eval_dataset: Sequence[PreferenceItem] | None = None,
    device: torch.device | str = "cpu",
    warmup_steps: int = 0,
    train_probe_size: int = 512,
) -> dict[str, Any]:
    """`steps` AdamW steps of the pairwise loss on batches of `batch_size` pairs.

    Returns the per-step curves ``loss``, ``accuracy``, ``margin`` and the metrics of
    :func:`evaluate_preferences` before and after training on the first `train_probe_size`
    training pairs (``train_before``/``train_after``; none for 0) and on `eval_dataset` when given
    (``eval_before``/``eval_after``).
    """
    _check_sizes(dataset, steps, batch_size)
    pad = tokenizer.pad_token_id
    probes = {}
    if train_probe_size > 0:
        probes["train"] = [dataset[i] for i in range(min(len(dataset), train_probe_size))]
    if eval_dataset is not None:
        probes["eval"] = eval_dataset
    result: dict[str, Any] = _evaluate_all(model, probes, pad, device, "before")
    opt, sched = finetune_optimizer(model, lr, steps, warmup_steps)
    loader = PromptLoader(dataset, batch_size, seed=seed)
    curves: dict[str, list[float]] = {k: [] for k in CURVES}
    model.train()
    bar = StepProgress(steps, "rm")
    for step in range(1, steps + 1):
        batch = collate_preferences(next(loader), pad)
        chosen, rejected = pair_scores(model, batch, device)
        loss, stats = pairwise_loss(chosen, rejected, batch["margin"].to(device))
        if not math.isfinite(stats["loss"]):
            raise ValueError(
                f"the reward-model loss is {stats['loss']} at step {step}; lower --lr."
            )
        loss.backward()
        optimizer_step(model, opt, sched, grad_clip=1.0)  # a non-finite step is skipped
        for key in CURVES:
            curves[key].append(stats[key])
        bar.update(step, loss=f"{stats['loss']:.4f}", acc=f"{stats['accuracy']:.2f}")
    bar.close()
    result.update(_evaluate_all(model, probes, pad, device, "after"))
    return {**curves, **result}
