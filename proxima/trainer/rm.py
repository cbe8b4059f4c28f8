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
from proxima.data.preferences import (
    PreferenceItem,
    distinct_sequences,
    pad_sequences,
    prompt_groups,
)
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


def sequence_scores(
    model: PreTrainedModel,
    seqs: Sequence[Sequence[int]],
    pad_token_id: int | None,
    device: torch.device | str,
) -> torch.Tensor:
    """The reward model's score of each sequence [U] (float32), right-padded into one
    forward pass; the score is read at each sequence's last token."""
    ids, mask = pad_sequences(seqs, pad_token_id)
    return reward_model_scores(model, ids.to(device), mask.to(device))


def _margins(items: Sequence[PreferenceItem]) -> torch.Tensor:
    return torch.tensor([item.margin for item in items], dtype=torch.float32)


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
def distinct_scores(
    model: PreTrainedModel,
    pairs: Sequence[PreferenceItem],
    pad_token_id: int | None,
    batch_size: int = 32,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The score of each distinct sequence of the pairs [U] and each pair's two indices into
    them (chosen [N], rejected [N]), in eval mode, 2 x batch_size sequences per forward."""
    was_training = model.training
    model.eval()
    rows, chosen, rejected = distinct_sequences([pairs[i] for i in range(len(pairs))])
    seqs, width = [ids for ids, _ in rows], 2 * batch_size
    scores = torch.cat(
        [
            sequence_scores(model, seqs[start : start + width], pad_token_id, device).cpu()
            for start in range(0, len(seqs), width)
        ]
    )
    model.train(was_training)
    return scores, chosen, rejected


def all_pair_scores(
    model: PreTrainedModel,
    pairs: Sequence[PreferenceItem],
    pad_token_id: int | None,
    batch_size: int = 32,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen [N], rejected [N], target margins [N]) scores of every pair, in eval mode;
    each distinct sequence is scored once."""
    scores, chosen, rejected = distinct_scores(model, pairs, pad_token_id, batch_size, device)
    return scores[chosen], scores[rejected], _margins([pairs[i] for i in range(len(pairs))])


def score_normalization(
    model: PreTrainedModel, pairs: Sequence[PreferenceItem], pad_token_id: int | None, device
) -> dict[str, float]:
    """Mean and std of the model's scores over every distinct response of the pairs: the
    reward model's normalisation, so that (score - mean) / std has mean 0 and std 1 on the
    responses it learned from (a response in several pairs counts once). Returns
    {"mean", "std", "n"}."""
    scores = distinct_scores(model, pairs, pad_token_id, device=device)[0].double()
    std = float(scores.std(unbiased=False)) if scores.numel() > 1 else 0.0
    return {"mean": float(scores.mean()), "std": std if std > 0 else 1.0, "n": scores.numel()}


def _evaluate_all(model, probes: dict[str, Sequence[PreferenceItem]], pad, device, when: str):
    return {
        f"{name}_{when}": evaluate_preferences(model, pairs, pad, device=device)
        for name, pairs in probes.items()
    }


def _check_sizes(dataset: Sequence, steps: int, batch_size: int, by_prompt: bool) -> None:
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1; set --steps.")
    what = "prompts of the training pairs" if by_prompt else "training pairs"
    if batch_size < 1 or len(dataset) < batch_size:
        raise ValueError(
            f"batch_size={batch_size} needs 1 <= batch_size <= {len(dataset)} (the number of "
            f"{what}); lower --batch-size or add pairs."
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
    group_by_prompt: bool = False,
) -> dict[str, Any]:
    """`steps` AdamW steps of the pairwise loss on batches of `batch_size` pairs, or with
    `group_by_prompt` of `batch_size` prompts with all their pairs (InstructGPT's batch
    element: the K-choose-2 comparisons of one prompt's K answers; the loss is the mean over
    the batch's pairs). Each distinct sequence of a batch is scored once.

    Returns the per-step curves ``loss``, ``accuracy``, ``margin`` and the metrics of
    :func:`evaluate_preferences` before and after training on the first `train_probe_size`
    training pairs (``train_before``/``train_after``; none for 0) and on `eval_dataset` when given
    (``eval_before``/``eval_after``).
    """
    groups = prompt_groups(dataset) if group_by_prompt else None
    _check_sizes(dataset if groups is None else groups, steps, batch_size, group_by_prompt)
    pad = tokenizer.pad_token_id
    probes = {}
    if train_probe_size > 0:
        probes["train"] = [dataset[i] for i in range(min(len(dataset), train_probe_size))]
    if eval_dataset is not None:
        probes["eval"] = eval_dataset
    result: dict[str, Any] = _evaluate_all(model, probes, pad, device, "before")
    opt, sched = finetune_optimizer(model, lr, steps, warmup_steps)
    loader = PromptLoader(dataset if groups is None else groups, batch_size, seed=seed)
    curves: dict[str, list[float]] = {k: [] for k in CURVES}
    model.train()
    bar = StepProgress(steps, "rm")
    for step in range(1, steps + 1):
        items = next(loader) if groups is None else [p for g in next(loader) for p in g]
        rows, c, r = distinct_sequences(items)
        scores = sequence_scores(model, [ids for ids, _ in rows], pad, device)
        loss, stats = pairwise_loss(scores[c], scores[r], _margins(items).to(device))
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
