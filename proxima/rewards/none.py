"""The reward source of a run without one: a multi-turn run whose environment or agent
gives every reward (`rollout.env` or `rollout.agent` without `reward.function` /
`reward.model_path`), or on-policy distillation alone (`algorithm.adv_estimator=distill`,
the teacher's log-probs its only signal): the final score is 0."""

from __future__ import annotations

import torch


class NoScore:
    """Scores every response 0: an episode's return is the sum of its turn rewards; a
    distilled response has the teacher's signal alone."""

    def __init__(self, distill: bool = False) -> None:
        self.name = (
            "none (distillation: the teacher's log-probs only)"
            if distill
            else "none (the environment's or agent's rewards only)"
        )

    def __call__(self, prompts, responses, columns, sequences=None, attention_mask=None):
        return torch.zeros(len(responses), dtype=torch.float32)
