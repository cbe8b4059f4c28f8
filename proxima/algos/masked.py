"""Masked reductions over response tokens, loss aggregation and running moments.

Conventions (shared by all of ``proxima.algos``): per-token tensors are ``[B, T]`` and
aligned on response tokens; ``mask`` (a ``response_mask``) is nonzero on real tokens and
zero elsewhere. Masks may have holes and rows may be empty. Values on masked-out positions
never reach a result, even when they are NaN or inf (they are selected away with
``torch.where`` rather than multiplied by zero, because ``nan * 0`` is NaN).
"""

from __future__ import annotations

import math

import torch

from ._checks import check_same_shape, select

# Loss aggregation modes accepted by `aggregate_loss` (names follow verl's `loss_agg_mode`).
AGG_MODES = (
    "token-mean",
    "token-sum",
    "seq-mean-token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum-norm",
)

# Added to the variance inside the rsqrt of `masked_whiten` so constant inputs do not divide
# by zero (the value used by DeepSpeed-Chat / TRL whitening).
WHITEN_EPS = 1e-8


def masked_sum(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of x over positions where mask is nonzero; [B, T] -> scalar, or reduced on dim."""
    check_same_shape("masked_sum", x=x, mask=mask)
    selected = select(x, mask)
    return selected.sum() if dim is None else selected.sum(dim=dim)


def masked_mean(x: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of x over positions where mask is nonzero.

    Args:
        x: [B, T] values (any shape, same as mask).
        mask: [B, T] nonzero on the positions to average.
        dim: None for one global mean (0-dim result), else the dimension to reduce
            (e.g. dim=-1 gives one mean per row, [B]).

    Returns 0 (not NaN) where the mask is empty: globally, or per row when dim is given.
    """
    check_same_shape("masked_mean", x=x, mask=mask)
    count = (mask != 0).sum() if dim is None else (mask != 0).sum(dim=dim)
    total = masked_sum(x, mask, dim)
    return total / count.clamp(min=1).to(total.dtype)


def masked_max(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Max of x over positions where mask is nonzero (0-dim); 0 when the mask is empty."""
    check_same_shape("masked_max", x=x, mask=mask)
    if not (mask != 0).any():
        return torch.zeros((), dtype=x.dtype, device=x.device)
    return torch.where(mask != 0, x, torch.full_like(x, -torch.inf)).max()


def masked_var(x: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of x over the positions where mask is nonzero (0-dim tensor).

    ``unbiased=True`` applies Bessel's correction n / (n - 1). With fewer than two real
    positions the unbiased variance is undefined; it is returned as 0 so that callers
    (whitening, explained variance) stay finite. The biased variance of an empty mask is 0.
    """
    check_same_shape("masked_var", x=x, mask=mask)
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    if not unbiased:
        return var
    n = (mask != 0).sum().to(var.dtype)
    if n < 2:
        return torch.zeros_like(var)
    return var * n / (n - 1)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise x to zero mean and unit (unbiased) variance over the masked positions.

    [B, T] -> [B, T]: (x - mean) * rsqrt(var + 1e-8); with ``shift_mean=False`` the mean is
    added back (only the scale changes, as in TRL's whiten). Zero on masked-out positions;
    same dtype as x.

    Computed in float64: the rsqrt(1e-8) = 1e4 factor magnifies rounding in x - mean, and a
    constant input (e.g. one outcome broadcast over a row's tokens) must give exactly 0
    whatever the padding; n equal float32 values sum and divide back exactly in float64.
    """
    x64 = x.double()
    mean = masked_mean(x64, mask)
    var = masked_var(x64, mask, unbiased=True)
    whitened = (x64 - mean) * torch.rsqrt(var + WHITEN_EPS)
    if not shift_mean:
        whitened = whitened + mean
    return select(whitened, mask).to(x.dtype)


def aggregate_loss(
    loss_mat: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean"
) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a scalar.

    Modes (see verl 0.9.1's ``agg_loss`` in ``verl/trainer/ppo/core_algos.py`` and the
    Dr. GRPO paper, arXiv:2503.20783):
      - ``token-mean``: mean over all real tokens of the batch.
      - ``token-sum``: sum over all real tokens of the batch (not normalised: the loss, and
        so the gradient, grows with the number of tokens).
      - ``seq-mean-token-sum``: per-row sum over tokens, then mean over rows.
      - ``seq-mean-token-mean``: per-row mean over tokens, then mean over rows.
      - ``seq-mean-token-sum-norm``: per-row sum divided by the mask's width T (a constant,
        so long and short answers are not re-weighted: Dr. GRPO), then mean over rows.
    The mean over rows only counts rows with at least one real token, so empty rows neither
    produce NaN nor dilute the loss. An all-empty mask gives 0 with a zero gradient in every
    mode (verl's ``agg_loss`` divides 0 by 0 there and gives NaN in token-mean and the
    seq-mean modes).
    """
    check_same_shape("aggregate_loss", loss_mat=loss_mat, mask=mask)
    if mode == "token-mean":
        return masked_mean(loss_mat, mask)
    if mode == "token-sum":
        return masked_sum(loss_mat, mask)
    if mode not in AGG_MODES:
        raise ValueError(
            f"unknown loss aggregation mode {mode!r}; valid modes: {', '.join(AGG_MODES)}"
        )
    row_sum = masked_sum(loss_mat, mask, dim=-1)
    row_len = (mask != 0).sum(dim=-1)
    if mode == "seq-mean-token-sum":
        per_row = row_sum
    elif mode == "seq-mean-token-mean":
        per_row = row_sum / row_len.clamp(min=1).to(row_sum.dtype)
    else:  # seq-mean-token-sum-norm
        per_row = row_sum / loss_mat.shape[-1]
    return masked_mean(per_row, row_len > 0)


# a standard deviation below this fraction of the mean's magnitude is rounding: the values
# were equal (a batch of equal scores, e.g. every sparse reward 0)
EQUAL_SPREAD = 1e-12


class RunningMoments:
    """Running mean and standard deviation over every element seen in all batches.

    Batches are merged with Chan et al.'s parallel update of (count, mean, M2), so the
    result equals the moments of the concatenated data. ``std`` is the unbiased standard
    deviation (1.0 before two elements were seen, or while every element seen is the same:
    x - mean is then 0 for each of them, whatever it is divided by; so it is always safe to
    divide by). Used for reward normalisation; state is plain floats, see ``state_dict``.
    """

    def __init__(self) -> None:
        self.count = 0
        self.mean = 0.0
        self._m2 = 0.0

    @property
    def var(self) -> float:
        """Unbiased variance of everything seen (0.0 before two elements)."""
        return self._m2 / (self.count - 1) if self.count > 1 else 0.0

    @property
    def std(self) -> float:
        """Unbiased standard deviation of everything seen (1.0 before two elements, and
        while all are equal: a spread below float64's rounding of the mean counts as 0)."""
        std = math.sqrt(self.var)
        return std if std > EQUAL_SPREAD * max(1.0, abs(self.mean)) else 1.0

    @torch.no_grad()
    def update(self, xs: torch.Tensor) -> tuple[float, float]:
        """Merge a batch (any shape, all elements count); return its (mean, unbiased std)."""
        values = xs.detach().to(torch.float64).flatten()
        n = values.numel()
        if n == 0:
            return 0.0, 0.0
        batch_mean = values.mean().item()
        batch_m2 = ((values - batch_mean) ** 2).sum().item()
        total = self.count + n
        delta = batch_mean - self.mean
        self.mean += delta * n / total
        self._m2 += batch_m2 + delta**2 * self.count * n / total
        self.count = total
        batch_std = math.sqrt(batch_m2 / (n - 1)) if n > 1 else 0.0
        return batch_mean, batch_std

    def state_dict(self) -> dict[str, float]:
        """Plain-float state for checkpoints."""
        return {"count": self.count, "mean": self.mean, "m2": self._m2}

    def load_state_dict(self, state: dict[str, float]) -> None:
        """Restore the state written by ``state_dict``."""
        self.count = int(state["count"])
        self.mean = float(state["mean"])
        self._m2 = float(state["m2"])
