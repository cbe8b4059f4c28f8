"""Log-probs and entropy from logits, the clipped PPO policy loss and the clipped value loss.

Formulas: PPO (Schulman et al. 2017, arXiv:1707.06347) as written in DeepSpeed-Chat's
``actor_loss_fn`` / ``critic_loss_fn``
(https://github.com/microsoft/DeepSpeedExamples/blob/master/applications/DeepSpeed-Chat/dschat/rlhf/ppo_trainer.py);
the dual clip of Ye et al. 2020 (arXiv:1912.09729), the clamped log-ratio and the stats as
in verl 0.9.1's ``compute_policy_loss_vanilla`` / ``compute_value_loss``
(https://github.com/volcengine/verl/blob/main/verl/trainer/ppo/core_algos.py).
Losses return ``(loss, stats)`` with detached 0-dim float stats.

Policy losses are in one registry, ``POLICY_LOSSES``, under verl's
``actor.policy_loss.loss_mode`` names; each is called as ``fn(log_prob, old_log_prob,
advantages, response_mask, agg=..., clip_ratio_low=..., clip_ratio_high=..., clip_ratio_c=...,
is_weights=..., **options)`` and returns ``(loss, stats)``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ._checks import (
    check_ratio_clips,
    check_same_shape,
    check_temperature,
    detached_stats,
    map_row_chunks,
    select,
    weighted,
)
from .masked import aggregate_loss, masked_max, masked_mean, masked_var

# The log-ratio is clamped before exp so exp never overflows (verl clamps to [-20, 20]).
LOG_RATIO_BOUND = 20.0


def logprobs_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """log softmax(logits / temperature)[label] for every position.

    Args:
        logits: [B, T, V] in any float dtype (bf16/fp16 are upcast one chunk at a time).
        labels: [B, T] integer token ids.
        temperature: the sampling temperature, so the log-probs are those of the sampler.
        chunk_size: positions per chunk; None keeps each float32 chunk around 16M elements.

    Returns [B, T] float32. Computed as gathered logit minus logsumexp per chunk, so no
    float32 [B, T, V] log-softmax copy is built in one piece (when autograd is recording,
    the float32 chunks are still kept for the backward pass).
    """
    check_temperature("logprobs_from_logits", temperature)
    _check_labels("logprobs_from_logits", logits, labels)

    def chunk_logprobs(chunk: torch.Tensor, chunk_labels: torch.Tensor) -> torch.Tensor:
        scaled = _scaled_float(chunk, temperature)
        picked = scaled.gather(-1, chunk_labels.long().unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(scaled, dim=-1)

    return map_row_chunks(chunk_logprobs, logits, labels, chunk_size=chunk_size)


def entropy_from_logits(
    logits: torch.Tensor, temperature: float = 1.0, chunk_size: int | None = None
) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) per position: logsumexp(z) - sum softmax(z) z,
    with z shifted by its row maximum (`_shifted`).

    logits [B, T, V] (any float dtype) -> [B, T] float32, chunked like ``logprobs_from_logits``.
    """
    check_temperature("entropy_from_logits", temperature)

    def chunk_entropy(chunk: torch.Tensor) -> torch.Tensor:
        z = _shifted(chunk, temperature)
        return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)

    return map_row_chunks(chunk_entropy, logits, chunk_size=chunk_size)


def logprobs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    entropy_grad: bool = True,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logprobs_from_logits`` and ``entropy_from_logits`` from one pass over the
    vocabulary: both need logsumexp(z), computed once per chunk (the entropy is
    lse - sum_v softmax(z)_v z_v with softmax(z) = exp(z - lse); z shifted by its row
    maximum, `_shifted`).

    `entropy_grad=False`: the entropy is computed without gradient (a stat only), while
    the log-probs keep theirs. Returns ([B, T], [B, T]) float32.
    """
    check_temperature("logprobs_and_entropy", temperature)
    _check_labels("logprobs_and_entropy", logits, labels)

    def chunk_both(chunk: torch.Tensor, chunk_labels: torch.Tensor) -> torch.Tensor:
        z = _shifted(chunk, temperature)
        lse = torch.logsumexp(z, dim=-1)
        picked = z.gather(-1, chunk_labels.long().unsqueeze(-1)).squeeze(-1)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            zz, ll = (z, lse) if entropy_grad else (z.detach(), lse.detach())
            entropy = ll - (torch.exp(zz - ll.unsqueeze(-1)) * zz).sum(dim=-1)
        return torch.stack([picked - lse, entropy], dim=-1)

    both = map_row_chunks(chunk_both, logits, labels, chunk_size=chunk_size, per_row=(2,))
    return both[..., 0], both[..., 1]


def _check_labels(where: str, logits: torch.Tensor, labels: torch.Tensor) -> None:
    """Raise ValueError unless labels [...] index logits [..., V] position by position."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(
            f"{where}: shape mismatch: logits {list(logits.shape)} vs labels "
            f"{list(labels.shape)}; labels must be logits' shape without the vocabulary dim"
        )


def _shifted(chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    """`_scaled_float` minus its row maximum (a constant: softmax, log-probs and entropy are
    unchanged, and so are their gradients). A collapsed policy's logits reach 1e4-1e5, where
    lse(z) - sum p z would cancel to float32's rounding of z (negative entropies); shifted,
    the terms stay within log V of 0."""
    z = _scaled_float(chunk, temperature)
    return z - z.detach().amax(dim=-1, keepdim=True)


def _scaled_float(chunk: torch.Tensor, temperature: float) -> torch.Tensor:
    """A chunk of logits in float32, divided by the temperature (no copy at 1)."""
    z = chunk.float()
    return z / temperature if temperature != 1.0 else z


def sum_pi_squared(
    logits: torch.Tensor, temperature: float = 1.0, chunk_size: int | None = None
) -> torch.Tensor:
    """sum_v softmax(logits / temperature)_v^2 per position (the collision probability; the
    optimal token baseline's ||s||^2 = 1 - 2 pi_t + this). logits [B, T, V] -> [B, T] float32,
    chunked like ``logprobs_from_logits``."""
    check_temperature("sum_pi_squared", temperature)

    def chunk_sum(chunk: torch.Tensor) -> torch.Tensor:
        return torch.softmax(_scaled_float(chunk, temperature), dim=-1).square().sum(dim=-1)

    return map_row_chunks(chunk_sum, logits, chunk_size=chunk_size)


class EmptyMaskWarning(UserWarning):
    """policy_loss or value_loss got a response_mask with no real token: the loss is 0."""


def warn_if_empty(where: str, mask: torch.Tensor, stacklevel: int = 3) -> None:
    """Warn (``EmptyMaskWarning``) when the mask has no real token: the loss is then 0 with a
    zero gradient. ``stacklevel=3`` points at the caller of the loss that calls this."""
    if not bool((mask != 0).any()):
        warnings.warn(
            f"{where}: response_mask has no real token; the loss is 0 with a zero gradient "
            "and the stats are 0 (check the micro-batch: every response may be empty)",
            EmptyMaskWarning,
            stacklevel=stacklevel,
        )


@dataclass(frozen=True)
class PolicyLoss:
    """An entry of ``POLICY_LOSSES``: calling it calls ``fn``. ``options``: its own keyword
    options beyond the shared ones (``agg``, the clip ratios, ``is_weights``), named as the
    ``actor.policy_loss.*`` config fields that set them (verl's field names), so a trainer
    passes them by name and never asks which loss it runs."""

    name: str
    fn: Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
    options: tuple[str, ...] = ()

    def __call__(self, *args, **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return self.fn(*args, **kwargs)


POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str, *, options: tuple[str, ...] = ()):
    """Decorator: add a policy loss to ``POLICY_LOSSES`` under ``name`` (verl's
    ``actor.policy_loss.loss_mode`` names) with its own ``options``."""

    def register(fn):
        POLICY_LOSSES[name] = PolicyLoss(name, fn, options)
        return fn

    return register


@register_policy_loss("vanilla")
def policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    agg: str = "token-mean",
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: float | None = 3.0,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped PPO surrogate loss with the dual clip for negative advantages (``vanilla``).

    Per token (PPO, arXiv:1707.06347): r = exp(log_prob - old_log_prob) with the log-ratio
    clamped to [-20, 20], and loss = max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))
    (clip_ratio_high > clip_ratio_low: DAPO's clip-higher). Dual clip (arXiv:1912.09729): where
    A < 0 the loss is further capped at -A * clip_ratio_c (must be > 1; None disables).
    The per-token loss [B, T] is reduced with ``aggregate_loss(..., agg)``. Optional
    ``is_weights`` [B, T] (constants, e.g. ``truncated_is_weights``) multiply the per-token
    loss after clipping, as verl applies its rollout importance weights.

    All of log_prob, old_log_prob, advantages, response_mask are [B, T]. Returns
    (0-dim loss, stats) with detached 0-dim stats: ``clipfrac`` (share of tokens where the
    clipped term is strictly larger), ``clipfrac_lower`` (share where the dual clip binds),
    ``ppo_kl`` = mean(-clamp(new - old, -20, 20)) (the clamped log-ratio the loss uses, as
    verl's ``ppo_kl``), ``approx_kl`` = mean(0.5 (new - old)^2) (unclamped), ``ratio_mean``,
    ``ratio_max`` (means and max over real tokens).

    A response_mask with no real token gives loss 0 (finite, zero gradient, in every ``agg``
    mode; verl gives NaN), all stats 0, and an ``EmptyMaskWarning`` per call.
    """
    check_same_shape(
        "policy_loss",
        log_prob=log_prob,
        old_log_prob=old_log_prob,
        advantages=advantages,
        response_mask=response_mask,
    )
    low, high = clip_ratio_low, clip_ratio_high
    check_ratio_clips("policy_loss", low, high)
    if clip_ratio_c is not None and not clip_ratio_c > 1:
        raise ValueError(
            f"policy_loss: clip_ratio_c must be > 1 (dual clip lower bound), got "
            f"{clip_ratio_c}; use e.g. 3.0, or None to disable the dual clip"
        )
    mask = response_mask
    warn_if_empty("policy_loss", mask)
    # Padding may hold -inf log-probs; zero it before exp so no NaN reaches the gradients.
    log_ratio = select(log_prob - old_log_prob, mask)
    adv = select(advantages, mask)
    clamped_log_ratio = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(clamped_log_ratio)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1 - low, 1 + high)
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)
    dual_binds = torch.zeros_like(mask, dtype=torch.bool)
    if clip_ratio_c is not None:
        loss_cap = -adv * clip_ratio_c
        dual_binds = (adv < 0) & (loss_mat > loss_cap)
        loss_mat = torch.where(dual_binds, loss_cap, loss_mat)
    if is_weights is not None:
        check_same_shape("policy_loss", is_weights=is_weights, response_mask=mask)
    loss_mat = weighted(loss_mat, is_weights, mask)
    loss = aggregate_loss(loss_mat, mask, agg)
    stats = detached_stats(
        clipfrac=masked_mean((loss_clipped > loss_unclipped).float(), mask),
        clipfrac_lower=masked_mean(dual_binds.float(), mask),
        ppo_kl=masked_mean(-clamped_log_ratio, mask),
        approx_kl=masked_mean(0.5 * log_ratio.square(), mask),
        ratio_mean=masked_mean(ratio, mask),
        ratio_max=masked_max(ratio, mask),
    )
    return loss, stats


def explained_variance(
    values: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor, min_var: float = 0.0
) -> torch.Tensor:
    """1 - Var(returns - values) / Var(returns) over real tokens (values, returns, mask:
    [B, T]); 0 when Var(returns) <= ``min_var``: returns that are constant (or, with a
    floor such as 1e-8, constant up to rounding) leave nothing to explain, and dividing by
    their variance would only magnify noise (-1e14 for returns that are all about 0).

    In float64, then clamped to float32's range: a tiny but nonzero Var(returns) (say 1e-40)
    under a zero floor gives a very negative finite number instead of -inf.
    """
    returns = returns.double()
    var_returns = masked_var(returns, mask)
    if var_returns <= min_var:
        return torch.zeros_like(var_returns)
    explained = 1 - masked_var(returns - values.double(), mask) / var_returns
    return explained.clamp(min=torch.finfo(torch.float32).min)


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    cliprange_value: float | None = 0.2,
    agg: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped value loss: 0.5 max((V - R)^2, (clip(V, V_old -+ eps) - R)^2).

    values (current critic), old_values (at rollout time), returns, response_mask: [B, T].
    ``cliprange_value=None`` disables the clip (plain 0.5 (V - R)^2). The per-token loss is
    reduced with ``aggregate_loss(..., agg)``. Stats (detached, 0-dim): ``vf_clipfrac``
    (share of real tokens where the clipped term is strictly larger), ``explained_variance``
    (1 - Var(R - V) / Var(R) over real tokens, 0 if Var(R) = 0), ``vpred_mean``.

    A response_mask with no real token gives loss 0 (finite, zero gradient, in every ``agg``
    mode), all stats 0, and an ``EmptyMaskWarning`` per call.
    """
    check_same_shape(
        "value_loss",
        values=values,
        old_values=old_values,
        returns=returns,
        response_mask=response_mask,
    )
    if cliprange_value is not None and cliprange_value < 0:
        raise ValueError(
            f"value_loss: cliprange_value must be >= 0, got {cliprange_value}; "
            "use e.g. 0.2, or None to disable value clipping"
        )
    mask = response_mask
    warn_if_empty("value_loss", mask)
    v, v_old, target = select(values, mask), select(old_values, mask), select(returns, mask)
    err = (v - target).square()
    clipfrac = torch.zeros((), dtype=err.dtype, device=err.device)
    if cliprange_value is None:
        loss_mat = 0.5 * err
    else:
        v_clipped = v_old + (v - v_old).clamp(-cliprange_value, cliprange_value)
        err_clipped = (v_clipped - target).square()
        loss_mat = 0.5 * torch.maximum(err, err_clipped)
        clipfrac = masked_mean((err_clipped > err).float(), mask)
    loss = aggregate_loss(loss_mat, mask, agg)
    stats = detached_stats(
        vf_clipfrac=clipfrac,
        explained_variance=explained_variance(v.detach(), target, mask),
        vpred_mean=masked_mean(v, mask),
    )
    return loss, stats
