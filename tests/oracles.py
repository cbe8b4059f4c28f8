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
