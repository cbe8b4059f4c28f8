"""KL divergence between the actor and the reference policy, and the KL coefficient controllers.

Per-token estimators follow John Schulman, "Approximating KL Divergence"
(http://joschu.net/blog/kl-approx.html), with tokens sampled from the actor pi and
d = log pi(token) - log ref(token):

- ``k1`` (alias ``kl``): d. Unbiased for KL(pi || ref), can be negative per token.
- ``abs``: |d|.
- ``k2`` (alias ``mse``): 0.5 d^2. Biased, always >= 0.
- ``k3`` (alias ``low_var_kl``): r - 1 - log r with r = ref / pi = exp(-d), i.e.
  exp(-d) - 1 + d. Unbiased and always >= 0, low variance.

Straight-through variants (any name above with a ``+`` suffix: ``k1+``, ``kl+``, ``abs+``,
``k2+``, ``mse+``, ``k3+``, ``low_var_kl+``), as verl 0.9.1's ``kl_penalty``
(https://github.com/volcengine/verl/blob/main/verl/trainer/ppo/core_algos.py): the value is
the base estimator's, the gradient is k2's (d, w.r.t. logprobs). k1 and k3 have the right
expected value but not the right expected gradient of KL(pi || ref) as a loss; k2's
gradient is the right one (same blog post). This only matters for a KL *loss*: as a reward
penalty no gradient flows. ``k2+`` equals ``k2``.
"""

from __future__ import annotations

import torch

from ._checks import check_same_shape, check_temperature, map_row_chunks

_BASE_ESTIMATORS = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")
# Every name accepted by `kl_penalty`, aliases and straight-through (+) variants included.
KL_ESTIMATORS = (*_BASE_ESTIMATORS, *(f"{name}+" for name in _BASE_ESTIMATORS))
_CANONICAL = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}

# k3 guards (the same bounds verl uses for low_var_kl): exp(-d) overflows float32 for
# d < -88, so d is clamped to [-20, 20] first; the per-token value is then clamped to
# [-10, 10] so one wildly off-policy token cannot dominate the penalty.
K3_LOG_RATIO_BOUND = 20.0
K3_VALUE_BOUND = 10.0


def _estimate(d: torch.Tensor, kind: str) -> torch.Tensor:
    """The base estimator ``kind`` (canonical: k1, abs, k2 or k3) of d [B, T] -> [B, T]."""
    if kind == "k1":
        return d
    if kind == "abs":
        return d.abs()
    if kind == "k2":
        return 0.5 * d.square()
    # For small |d| the result (~d^2 / 2) is far below float32 resolution of exp(-d) - 1, so
    # the sum cancels; float64 with expm1 keeps it accurate ([B, T] only, so cheap).
    d64 = d.double().clamp(-K3_LOG_RATIO_BOUND, K3_LOG_RATIO_BOUND)
    k3 = (torch.expm1(-d64) + d64).clamp(-K3_VALUE_BOUND, K3_VALUE_BOUND)
    return k3.to(d.dtype)


def kl_penalty(
    logprobs: torch.Tensor, ref_logprobs: torch.Tensor, kind: str = "k1"
) -> torch.Tensor:
    """Per-token KL estimate [B, T] from the sampled tokens' log-probs [B, T] (see module doc).

    ``kind`` is one of ``KL_ESTIMATORS``; a ``+`` suffix keeps the value of the base
    estimator and takes the gradient of k2 (straight-through, as in verl). The exact
    ``full`` KL needs logits, not log-probs: use ``kl_full`` for it. Masking is left to the
    caller (values on padding are arbitrary).
    """
    check_same_shape("kl_penalty", logprobs=logprobs, ref_logprobs=ref_logprobs)
    if kind == "full":
        raise ValueError(
            "kl_penalty: kind 'full' needs the full logits, not sampled log-probs; "
            "call kl_full(logits, ref_logits) instead, or pick one of "
            f"{', '.join(KL_ESTIMATORS)}"
        )
    if kind not in KL_ESTIMATORS:
        raise ValueError(
            f"kl_penalty: unknown KL estimator {kind!r}; valid names: {', '.join(KL_ESTIMATORS)}"
        )
    straight_through = kind.endswith("+")
    base = _CANONICAL.get(kind.removesuffix("+"), kind.removesuffix("+"))
    d = logprobs - ref_logprobs
    value = _estimate(d, base)
    if not straight_through or base == "k2":
        return value
    # k2 - k2.detach() is exactly 0 in the forward pass and carries k2's gradient.
    k2 = 0.5 * d.square()
    return k2 - k2.detach() + value.detach()


def kl_full(
    logits: torch.Tensor,
    ref_logits: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Exact KL(pi || ref) = sum_v p_v (log p_v - log q_v) per position.

    Args:
        logits, ref_logits: [B, T, V] actor and reference logits (any float dtype).
        temperature: both are divided by it (the sampling temperature) before the softmax.
        chunk_size: rows (positions) per chunk; None picks a size that keeps each float32
            chunk around 16M elements, so memory stays bounded for large vocabularies.

    Returns [B, T] float32, >= 0.
    """
    check_same_shape("kl_full", logits=logits, ref_logits=ref_logits)
    check_temperature("kl_full", temperature)

    def chunk_kl(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
        log_p = torch.log_softmax(p_logits.float() / temperature, dim=-1)
        log_q = torch.log_softmax(q_logits.float() / temperature, dim=-1)
        # Clamp tiny negative round-off: KL is non-negative.
        return (log_p.exp() * (log_p - log_q)).sum(dim=-1).clamp(min=0.0)

    return map_row_chunks(chunk_kl, logits, ref_logits, chunk_size=chunk_size)


class FixedKLController:
    """Constant KL coefficient (DeepSpeed-Chat default 0.1)."""

    def __init__(self, kl_coef: float) -> None:
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        """No-op: the coefficient stays fixed."""


class AdaptiveKLController:
    """Adaptive KL coefficient of Ziegler et al. 2019 (arXiv:1909.08593, section 2.2).

    After each batch: error = clip(current_kl / target_kl - 1, -0.2, 0.2) and
    value *= 1 + error * n_steps / horizon, so the coefficient grows while the measured KL
    is above target and shrinks while it is below.
    """

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: int) -> None:
        if target_kl <= 0:
            raise ValueError(f"AdaptiveKLController: target_kl must be > 0, got {target_kl}")
        if horizon <= 0:
            raise ValueError(f"AdaptiveKLController: horizon must be > 0, got {horizon}")
        self.value = float(init_kl_coef)
        self.target_kl = float(target_kl)
        self.horizon = horizon

    def update(self, current_kl: float, n_steps: int) -> None:
        """Move the coefficient toward keeping ``current_kl`` at ``target_kl``."""
        error = min(max(float(current_kl) / self.target_kl - 1.0, -0.2), 0.2)
        self.value *= 1.0 + error * n_steps / self.horizon
