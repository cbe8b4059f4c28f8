"""Direct Preference Optimization on preference pairs (Rafailov et al. 2023,
arXiv:2305.18290): the policy itself trained on (prompt, chosen, rejected), no reward model,
no sampling; the loss is `algos.dpo_loss`.

A pair is laid out as the policy reads a rollout (`collate_policy_rows`: prompts
left-padded, responses with their EOS right-padded), so the log-probs are those of
`models.forward.response_logprobs`, summed over the response tokens. A sequence in several
pairs of a batch (every two of K answers to a prompt) is read once.

The reference is the starting policy. Its log-probs never change, so they are computed once
per response before the first step (TRL's `precompute_ref_log_probs`): no second copy of the
weights is held, with or without LoRA (a fresh LoRA adapter leaves the model's output
unchanged, so the actor at step 0 IS its base model with the adapters off).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from proxima.algos import dpo_loss
from proxima.config import DPOConfig
from proxima.data import PromptLoader
from proxima.data.preferences import (
    PreferenceItem,
    collate_policy_rows,
    distinct_sequences,
    prompt_groups,
)
from proxima.logging import EVAL_PREFIX, StepProgress, format_line
from proxima.models.forward import response_logprobs
from proxima.trainer.optim import finetune_optimizer, optimizer_step

TRAIN_PROBE = 256  # training pairs evaluated before and after, beside the held-out ones
LINE_KEYS = {  # the console line of an evaluation
    "loss": "loss",
    "rewards/accuracies": "acc",
    "rewards/margins": "margin",
    "logratio_per_token": "log-ratio/token",
}


@dataclass
class PairLogprobs:
    """Sequence log-probs of N pairs under one model: ``chosen``, ``rejected`` [N] float32,
    summed over the response tokens (EOS included); ``chosen_tokens``, ``rejected_tokens``
    [N] float32, the response lengths."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor

    def select(self, index: Sequence[int]) -> PairLogprobs:
        i = torch.as_tensor(list(index), dtype=torch.long)
        return PairLogprobs(*(t[i] for t in vars(self).values()))

    def to(self, device: torch.device | str) -> PairLogprobs:
        return PairLogprobs(*(t.to(device) for t in vars(self).values()))


def sequence_logprobs(
    model: torch.nn.Module, rows: Sequence[tuple[list[int], int]], pad: int | None, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed response log-probs and response lengths [N] of (ids, prompt_length) rows, in
    one forward pass; the log-probs keep the model's gradient when it is recorded."""
    batch = {k: v.to(device) for k, v in collate_policy_rows(rows, pad).items()}
    token = response_logprobs(
        model, batch["input_ids"], batch["attention_mask"], batch["response_ids"]
    )
    mask = batch["response_mask"].float()
    return (token * mask).sum(-1), mask.sum(-1)


def pair_logprobs(
    model: torch.nn.Module, items: Sequence[PreferenceItem], pad: int | None, device
) -> PairLogprobs:
    """One forward pass over the distinct sequences of `items`; the log-probs keep the
    model's gradient when it is recorded."""
    rows, chosen, rejected = distinct_sequences(items)
    sums, counts = sequence_logprobs(model, rows, pad, device)
    c, r = chosen.to(sums.device), rejected.to(sums.device)
    return PairLogprobs(sums[c], sums[r], counts[c], counts[r])


@torch.no_grad()
def all_pair_logprobs(
    model: torch.nn.Module,
    items: Sequence[PreferenceItem],
    pad: int | None,
    batch_size: int,
    device: torch.device | str = "cpu",
) -> PairLogprobs:
    """`pair_logprobs` of every item in eval mode, on the CPU: each distinct sequence read
    once, 2 x batch_size of them per forward pass."""
    was_training = model.training
    model.eval()
    rows, chosen, rejected = distinct_sequences(items)
    width = 2 * batch_size
    parts = [
        sequence_logprobs(model, rows[i : i + width], pad, device)
        for i in range(0, len(rows), width)
    ]
    model.train(was_training)
    sums = torch.cat([s.cpu() for s, _ in parts])
    counts = torch.cat([n.cpu() for _, n in parts])
    return PairLogprobs(sums[chosen], sums[rejected], counts[chosen], counts[rejected])


def _loss(policy: PairLogprobs, reference: PairLogprobs, d: DPOConfig):
    """`dpo_loss` of `policy` against `reference` with the run's options."""
    return dpo_loss(
        policy.chosen,
        policy.rejected,
        reference.chosen,
        reference.rejected,
        d.beta,
        d.loss_type,
        d.label_smoothing,
        chosen_tokens=policy.chosen_tokens,
        rejected_tokens=policy.rejected_tokens,
    )


def dpo_stats(policy: PairLogprobs, reference: PairLogprobs, d: DPOConfig) -> dict[str, float]:
    """`dpo_loss`'s stats of `policy` against `reference` over all their pairs, plus ``n`` and
    ``logratio_per_token``: the mean of log pi - log pi_ref over the chosen responses'
    tokens, how far the policy moved from the reference per token. A KL-like figure, not a
    KL: a KL would average over the policy's own samples, this over fixed responses."""
    _, stats = _loss(policy, reference, d)
    ratio = (policy.chosen - reference.chosen).sum() / policy.chosen_tokens.sum()
    return {**stats, "logratio_per_token": float(ratio), "n": int(policy.chosen.numel())}


@dataclass
class Probe:
    """Pairs evaluated during training (held-out or a slice of the training pairs), with
    their reference log-probs."""

    name: str
    items: Sequence[PreferenceItem]
    reference: PairLogprobs


def evaluate(model, probe: Probe, d: DPOConfig, pad: int | None, device) -> dict[str, float]:
    policy = all_pair_logprobs(model, probe.items, pad, d.batch_size, device)
    return dpo_stats(policy, probe.reference, d)


def _train_step(model, items, reference: PairLogprobs, d: DPOConfig, pad, device, opt, sched):
    policy = pair_logprobs(model, items, pad, device)
    loss, stats = _loss(policy, reference.to(device), d)
    if not torch.isfinite(loss):
        raise ValueError(f"the DPO loss is {stats['loss']}; lower dpo.lr or raise dpo.beta.")
    loss.backward()
    lr = opt.param_groups[0]["lr"]
    norm, _ = optimizer_step(model, opt, sched, d.grad_clip)  # a non-finite step is skipped
    return {**stats, "grad_norm": norm, "lr": lr}


def step_units(items: Sequence[PreferenceItem], d: DPOConfig) -> list[list[int]]:
    """What a batch is made of, as indices into `items`: single pairs, or with
    `d.group_by_prompt` each prompt's pairs together (`d.batch_size` counts them)."""
    if not d.group_by_prompt:
        return [[i] for i in range(len(items))]
    where = {id(item): i for i, item in enumerate(items)}
    return [[where[id(item)] for item in group] for group in prompt_groups(items)]


def total_steps(units: int, d: DPOConfig) -> int:
    """Optimizer steps of `d.epochs` passes over `units` pairs (prompts with
    `d.group_by_prompt`; each epoch's tail that fills no batch is left out, as
    `PromptLoader` leaves it out)."""
    return d.epochs * (units // d.batch_size)


def dpo_train(
    model: torch.nn.Module,
    tokenizer: Any,
    dataset: Sequence[PreferenceItem],
    d: DPOConfig,
    *,
    seed: int = 0,
    eval_dataset: Sequence[PreferenceItem] | None = None,
    device: torch.device | str = "cpu",
    log: Callable[[int, dict[str, float]], None] | None = None,
) -> dict[str, Any]:
    """`d.epochs` passes of AdamW steps on the DPO loss over batches of `d.batch_size` pairs
    (prompts with all their pairs, with `d.group_by_prompt`).

    `log(step, metrics)` gets every step's stats (`dpo_loss`'s, ``grad_norm``, ``lr``) and
    the held-out ones as ``eval/<key>`` every `d.eval_every` steps. Returns ``steps`` and,
    for the probes ``train`` (the first TRAIN_PROBE training pairs) and ``eval``
    (`eval_dataset`, when given), ``<probe>_before`` and ``<probe>_after``: `dpo_stats`.
    Before training the policy is the reference: every implicit reward is 0 (the ties count
    as wrong, so the accuracy is 0) and the loss is log 2 for sigmoid.
    """
    items = [dataset[i] for i in range(len(dataset))]
    units = step_units(items, d)
    pad, steps = tokenizer.pad_token_id, total_steps(len(units), d)
    reference = all_pair_logprobs(model, items, pad, d.batch_size, device)
    probes = _probes(model, items, reference, eval_dataset, d, pad, device)
    result: dict[str, Any] = {
        f"{p.name}_before": dpo_stats(p.reference, p.reference, d) for p in probes
    }
    opt, sched = finetune_optimizer(model, d.lr, steps, d.warmup_steps)
    loader = PromptLoader(units, d.batch_size, seed=seed)
    log = log or (lambda step, metrics: None)
    model.train()
    bar = StepProgress(steps, "dpo")
    for step in range(1, steps + 1):
        index = [i for unit in next(loader) for i in unit]
        batch, ref = [items[i] for i in index], reference.select(index)
        stats = _train_step(model, batch, ref, d, pad, device, opt, sched)
        log(step, stats)
        if d.eval_every and step % d.eval_every == 0 and step < steps:
            _evaluate_and_log(model, probes[-1], d, pad, device, step, steps, log)
        bar.update(step, loss=f"{stats['loss']:.4f}", acc=f"{stats['rewards/accuracies']:.2f}")
    bar.close()
    for p in probes:
        result[f"{p.name}_after"] = _evaluate_and_log(model, p, d, pad, device, steps, steps, log)
    return {"steps": steps, **result}


def _probes(model, items, reference: PairLogprobs, eval_dataset, d: DPOConfig, pad, device):
    """The first TRAIN_PROBE training pairs, then the held-out pairs when there are any
    (their reference log-probs computed now, from the starting policy)."""
    first = range(min(len(items), TRAIN_PROBE))
    probes = [Probe("train", items[: len(first)], reference.select(first))]
    if eval_dataset is not None:
        held = [eval_dataset[i] for i in range(len(eval_dataset))]
        ref = all_pair_logprobs(model, held, pad, d.batch_size, device)
        probes.append(Probe("eval", held, ref))
    return probes


def _evaluate_and_log(model, probe: Probe, d: DPOConfig, pad, device, step, steps, log):
    """`evaluate` on `probe`, printed as one line; the held-out pairs' figures also go to
    `log` as ``eval/<key>`` (plotted over the training curves)."""
    stats = evaluate(model, probe, d, pad, device)
    if probe.name == "eval":
        log(step, {EVAL_PREFIX + k: v for k, v in stats.items() if k != "n"})
    print(f"dpo {probe.name} pairs: " + format_line(step, steps, stats, LINE_KEYS))
    return stats
