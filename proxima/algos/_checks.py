"""Argument checks and masking helpers shared by the modules of ``proxima.algos``.

The module is private to the package (nothing here is part of the public API), so its
names carry no leading underscore: the other algos modules import them from here rather
than reaching into each other's private names.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import torch

# Default chunk budget for the vocabulary-wide ops: about 16M float32 elements (64 MB) per
# chunk of rows, whatever the vocabulary size.
CHUNK_ELEMENTS = 1 << 24


def check_same_shape(where: str, **tensors: torch.Tensor) -> None:
    """Raise ValueError unless every tensor has the shape of the first one.

    The message names both tensors and shapes, e.g. ``policy_loss: shape mismatch:
    logprobs [2, 3] vs response_mask [2, 4]``.
    """
    items = list(tensors.items())
    first_name, first = items[0]
    for name, tensor in items[1:]:
        if tensor.shape != first.shape:
            raise ValueError(
                f"{where}: shape mismatch: {first_name} {list(first.shape)} vs "
                f"{name} {list(tensor.shape)}; pass tensors of the same shape "
                "([B, T] aligned on response tokens for per-token inputs)"
            )


def select(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """x where mask is nonzero, 0 elsewhere; same shape as x.

    ``torch.where`` rather than ``x * mask``: NaN or inf on masked positions never reach the
    result (``nan * 0`` is NaN), and the gradient there is exactly 0.
    """
    return torch.where(mask != 0, x, torch.zeros((), dtype=x.dtype, device=x.device))


def detached_stats(**values: torch.Tensor) -> dict[str, torch.Tensor]:
    """The stats of a loss: each value detached, as a float tensor."""
    return {name: value.detach().float() for name, value in values.items()}


def check_temperature(where: str, temperature: float) -> None:
    """Raise ValueError unless the sampling temperature is > 0."""
    if not temperature > 0:
        raise ValueError(f"{where}: temperature must be > 0, got {temperature}")


def map_row_chunks(
    fn: Callable[..., torch.Tensor],
    *tensors: torch.Tensor,
    chunk_size: int | None = None,
    per_row: tuple[int, ...] = (),
) -> torch.Tensor:
    """Apply fn to chunks of rows of tensors shaped [..., V] (or [...] for index tensors).

    The leading dims of the first tensor are flattened into rows; fn maps each chunk to one
    value per row (a `per_row`-shaped tensor per row, when given). Returns those values
    reshaped to the leading dims (float32). None as chunk_size keeps each chunk around
    ``CHUNK_ELEMENTS`` elements.
    """
    lead = tensors[0].shape[:-1]
    n_rows = math.prod(lead)
    if chunk_size is None:
        chunk_size = max(1, CHUNK_ELEMENTS // max(1, tensors[0].shape[-1]))
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1 (or None for automatic), got {chunk_size}")
    flat = [t.reshape(n_rows, *t.shape[len(lead) :]) for t in tensors]
    # no rows: fn still runs once, on the empty chunk, so a result that needs a gradient
    # still has its graph (a loss over no token backwards to zero gradients)
    starts = range(0, max(1, n_rows), chunk_size)
    pieces = [fn(*(f[start : start + chunk_size] for f in flat)) for start in starts]
    return torch.cat(pieces).reshape(*lead, *per_row)


def check_ratio_clips(where: str, low: float, high: float) -> None:
    """Clip ranges of a ratio: [1 - low, 1 + high] must stay positive."""
    if not (0 <= low < 1 and high >= 0):
        raise ValueError(
            f"{where}: clip ratios must satisfy 0 <= low < 1 and high >= 0, got "
            f"low={low}, high={high}; e.g. 0.2 for both"
        )


def weighted(loss_mat: torch.Tensor, is_weights: torch.Tensor | None, mask: torch.Tensor):
    """The per-token loss times the (constant) importance weights, if any."""
    if is_weights is None:
        return loss_mat
    return loss_mat * select(is_weights.detach(), mask)


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
