"""Independent computations the tests compare proxima's forward passes against."""

from __future__ import annotations

import torch

from proxima.models import position_ids_from_mask, scalar_head


def critic_values(critic, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Value of every position [B, L] float32: the backbone's last hidden states through the
    critic's one-label head, positions from the mask (a path apart from the model's own
    token-classification forward that proxima uses)."""
    out = critic.base_model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    return scalar_head(critic)(out.last_hidden_state)[..., 0].float()


def ragged_experience(
    actor,
    prompt_lens: list[int],
    response_lens: list[int],
    temperature: float,
    vocab: int,
    seed: int = 0,
):
    """A hand-built Experience of rows with these prompt and response lengths (left-padded
    prompts, right-padded responses, pad id 0, token ids in [4, 4 + vocab)): old log-probs
    from the actor plus noise (so that some ratios leave [0.8, 1.2] and get clipped), random
    advantages, values, returns and reference log-probs."""
    from proxima.algos import logprobs_from_logits
    from proxima.models.forward import response_logits
    from proxima.types import Experience

    gen = torch.Generator().manual_seed(seed)
    p, r = max(prompt_lens), max(response_lens)
    ids = torch.randint(4, 4 + vocab, (len(prompt_lens), p + r), generator=gen)
    attn = torch.zeros_like(ids)
    for row, (lp, lr) in enumerate(zip(prompt_lens, response_lens, strict=True)):
        attn[row, p - lp : p + lr] = 1
    ids = torch.where(attn.bool(), ids, torch.zeros_like(ids))
    mask = attn[:, p:].clone()
    with torch.no_grad():
        logits = response_logits(actor, ids, attn, r, temperature)
        current = logprobs_from_logits(logits, ids[:, p:])
    noise = lambda: torch.randn(mask.shape, generator=gen)  # noqa: E731
    return Experience(
        input_ids=ids,
        attention_mask=attn,
        response_mask=mask,
        old_logprobs=(current + 0.3 * noise()) * mask,
        ref_logprobs=(current + 0.5 * noise()) * mask,
        values=noise() * mask,
        returns=noise() * mask,
        advantages=noise() * mask,
        group_ids=torch.arange(ids.shape[0]),
    )
