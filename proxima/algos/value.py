"""The clipped value loss and the explained variance of the critic's values.

Formulas: PPO's clipped value loss (Schulman et al. 2017, arXiv:1707.06347) as written in
DeepSpeed-Chat's ``critic_loss_fn``
(https://github.com/microsoft/DeepSpeedExamples/blob/master/applications/DeepSpeed-Chat/dschat/rlhf/ppo_trainer.py);
the stats as in verl 0.9.1's ``compute_value_loss``
(https://github.com/volcengine/verl/blob/main/verl/trainer/ppo/core_algos.py).
"""

from __future__ import annotations

import torch

from ._checks import check_same_shape, detached_stats, select, warn_if_empty
from .masked import aggregate_loss, masked_mean, masked_var


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
