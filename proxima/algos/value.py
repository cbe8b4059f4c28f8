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


def leave_one_out_mean(x: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Each row's mean over the *other* rows of its group (RLOO's baseline), [B] from x [B]
    and group_ids [B]; NaN for a row alone in its group (no other row to average)."""
    check_same_shape("leave_one_out_mean", x=x, group_ids=group_ids)
    _, group = torch.unique(group_ids, return_inverse=True)
    n = int(group.max()) + 1 if group.numel() else 0
    sums = x.new_zeros(n).index_add_(0, group, x)
    sizes = x.new_zeros(n).index_add_(0, group, torch.ones_like(x))
    others = (sizes[group] - 1).to(x.dtype)
    return torch.where(others > 0, (sums[group] - x) / others.clamp(min=1), torch.nan)


def first_token_explained_variance(
    values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor,
    min_var: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """How well each response's return at its first token (the whole answer's, from the
    prompt) is predicted, over the rows that have a first token: (by the critic's value
    there, by the leave-one-out mean of the group's other returns). The first tells a
    critic that reads the prompt from one that learned only the batch's mean (about 0);
    the second is the reference a baseline of the group's other samples reaches (RLOO's;
    rows alone in their group left out). Each `explained_variance`: 0 where nothing varies
    or no row applies."""
    check_same_shape(
        "first_token_explained_variance",
        values=values,
        returns=returns,
        response_mask=response_mask,
    )
    rows = response_mask[:, 0] > 0  # responses are left-aligned: token 0 is the first
    v, r, g = values[rows, 0], returns[rows, 0], group_ids[rows]
    critic = explained_variance(v[None], r[None], torch.ones_like(r)[None], min_var=min_var)
    loo = leave_one_out_mean(r.double(), g)
    paired = ~loo.isnan()
    if not paired.any():
        return critic, torch.zeros_like(critic)
    group = explained_variance(
        loo[paired][None], r[paired][None], torch.ones_like(r[paired])[None], min_var=min_var
    )
    return critic, group


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
