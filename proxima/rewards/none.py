"""The reward source of a multi-turn run whose environment or agent gives every reward
(`rollout.env` or `rollout.agent` without `reward.function` / `reward.model_path`): the
final score is 0."""

from __future__ import annotations

import torch


class NoScore:
    """Scores every episode 0: its return is the sum of its turn rewards."""

    name = "none (the environment's or agent's rewards only)"

    def __call__(self, prompts, responses, columns, sequences=None, attention_mask=None):
        return torch.zeros(len(responses), dtype=torch.float32)
