"""Direct Preference Optimization: the policy trained on preference pairs directly, its
log-ratio to a frozen reference standing in for the reward (Rafailov et al. 2023,
arXiv:2305.18290).

For a prompt x with a chosen response y_c and a rejected one y_r, the implicit reward of a
response is r(x, y) = beta * (log pi(y|x) - log pi_ref(y|x)) (eq. 5 without its prompt-only
term log Z(x), which cancels between two responses to one prompt), and with

    logits = (log pi(y_c|x) - log pi(y_r|x)) - (log pi_ref(y_c|x) - log pi_ref(y_r|x))

the losses are, per pair:

- ``sigmoid`` (DPO, eq. 7): -log sigmoid(beta * logits), the Bradley-Terry likelihood of the
  label under the implicit reward. With label smoothing eps (conservative DPO, Mitchell 2023,
  "A note on DPO with noisy preferences", written as TRL's DPOTrainer writes it: the label is
  taken to be flipped with probability eps):
  -(1 - eps) log sigmoid(beta * logits) - eps log sigmoid(-beta * logits).
- ``ipo`` (Azar et al. 2023, arXiv:2310.12036, the empirical IPO loss):
  (logits - 1 / (2 beta))^2, a regression of the log-ratio gap onto a fixed target, which
  stays bounded where DPO's loss keeps pushing the gap of a deterministic preference to
  infinity.

Which log-probs: DPO's are summed over the response tokens (the sequence's log-likelihood,
as the paper writes it). For IPO they are averaged per token, as TRL does (its `ipo` divides
each sequence's log-prob by its length): the target 1 / (2 beta) is then a per-token gap, so
one beta suits responses of any length, where with sums a long pair would need a larger gap
than a short one to reach the same loss. The rewards reported are those of the log-probs the
loss used (per token for IPO), again as TRL reports them.

Inputs are one value per pair, [B]; nothing here knows of models or tokens beyond the counts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._checks import check_same_shape

DPO_LOSS_TYPES = ("sigmoid", "ipo")
PER_TOKEN_LOSSES = ("ipo",)  # the loss types that read log-probs averaged per token


def dpo_logits(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
) -> torch.Tensor:
    """(pi_c - pi_r) - (ref_c - ref_r): the policy's log-ratio gap beyond the reference's.
    Every input [B] (sequence log-probs); returns [B]."""
    check_same_shape(
        "dpo_logits",
        policy_chosen=policy_chosen,
        policy_rejected=policy_rejected,
        ref_chosen=ref_chosen,
        ref_rejected=ref_rejected,
    )
    return (policy_chosen - policy_rejected) - (ref_chosen - ref_rejected)


def _check_options(beta: float, loss_type: str, label_smoothing: float) -> None:
    if loss_type not in DPO_LOSS_TYPES:
        raise ValueError(f"dpo_loss: loss_type={loss_type!r} is not one of {DPO_LOSS_TYPES}")
    if not beta > 0:
        raise ValueError(f"dpo_loss: beta must be > 0, got {beta}")
    if not 0 <= label_smoothing < 0.5:
        raise ValueError(
            f"dpo_loss: label_smoothing is a flip probability in [0, 0.5), got {label_smoothing}"
        )
    if loss_type == "ipo" and label_smoothing:
        raise ValueError("dpo_loss: label_smoothing applies to the sigmoid loss, not to ipo")


def _per_token(logps: torch.Tensor, tokens: torch.Tensor | None, name: str) -> torch.Tensor:
    if tokens is None:
        raise ValueError(f"dpo_loss: the ipo loss averages per token; pass {name}")
    check_same_shape("dpo_loss", logps=logps, **{name: tokens})
    if bool((tokens <= 0).any()):
        raise ValueError(f"dpo_loss: {name} must be >= 1 for every pair")
    return logps / tokens.to(logps.dtype)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_tokens: torch.Tensor | None = None,
    rejected_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The mean DPO / cDPO / IPO loss of B pairs (module docstring).

    policy_*, ref_*: [B] log-probs of the response given the prompt, summed over its tokens
    (the reference's without gradient). chosen_tokens, rejected_tokens: [B] response lengths,
    needed by ``ipo`` only (it averages per token). Returns (loss, stats): the scalar loss
    with the policy's gradient, and detached means over the batch: ``loss``,
    ``rewards/chosen`` = beta (pi_c - ref_c), ``rewards/rejected``, ``rewards/margins`` (their
    difference), ``rewards/accuracies`` (share of pairs whose chosen reward is higher; ties
    count as wrong) and ``logits``.
    """
    _check_options(beta, loss_type, label_smoothing)
    logps = [policy_chosen, policy_rejected, ref_chosen, ref_rejected]
    if loss_type in PER_TOKEN_LOSSES:
        counts = [chosen_tokens, rejected_tokens, chosen_tokens, rejected_tokens]
        names = ["chosen_tokens", "rejected_tokens"] * 2
        logps = [_per_token(x, n, name) for x, n, name in zip(logps, counts, names, strict=True)]
    pc, pr, rc, rr = logps
    logits = dpo_logits(pc, pr, rc, rr)
    if loss_type == "ipo":
        losses = (logits - 1 / (2 * beta)) ** 2
    else:  # logsigmoid is stable for large |beta * logits|
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * logits)
        if label_smoothing:
            losses = losses - label_smoothing * F.logsigmoid(-beta * logits)
    loss = losses.mean()
    chosen = beta * (pc - rc).detach()
    rejected = beta * (pr - rr).detach()
    stats = {
        "loss": float(loss.detach()),
        "rewards/chosen": float(chosen.mean()),
        "rewards/rejected": float(rejected.mean()),
        "rewards/margins": float((chosen - rejected).mean()),
        "rewards/accuracies": float((chosen > rejected).float().mean()),
        "logits": float(logits.detach().mean()),
    }
    return loss, stats
