"""Log-probs, entropy and sum of pi^2 from logits, chunked over the rows so that no float32
[B, T, V] copy is built in one piece.

Every function takes logits [..., V] in any float dtype and returns float32 values per
position; temperature divides the logits first, so the values are those of the sampler.
"""

from __future__ import annotations

import torch

from ._checks import check_temperature, map_row_chunks


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
