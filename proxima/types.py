"""Experience: everything phases 1-5 produce for the update (phase 6), in one typed container.

Shapes: B sequences, P prompt positions (left-padded), R response positions (right-padded).
Per-token tensors are aligned on response tokens: ``old_logprobs[b, t]`` is the
log-probability of response token t of row b (DESIGN.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

# the [B, R] fields, aligned on response tokens
PER_TOKEN = (
    "response_mask",
    "old_logprobs",
    "ref_logprobs",
    "values",
    "kl",
    "token_rewards",
    "advantages",
    "returns",
    "rollout_logprobs",
    "is_weights",
    "sum_pi_squared",
    "turn_rewards",
)


@dataclass
class Experience:
    input_ids: torch.Tensor  # [B, P + R] prompt (left-padded) then response (right-padded)
    attention_mask: torch.Tensor  # [B, P + R] 1 on real prompt tokens and real response tokens
    response_mask: torch.Tensor  # [B, R] 1 on response tokens up to and including the first stop
    old_logprobs: torch.Tensor  # [B, R] actor log-probs at rollout time (logits / temperature)
    ref_logprobs: torch.Tensor | None = None  # [B, R] reference log-probs
    values: torch.Tensor | None = None  # [B, R] critic values at rollout time
    scores: torch.Tensor | None = None  # [B] raw score of the reward source
    stopped: torch.Tensor | None = None  # [B] bool: the response ended with a stop token
    kl: torch.Tensor | None = (
        None  # [B, R] per-token KL(actor || reference), the reward's estimator
    )
    token_rewards: torch.Tensor | None = None  # [B, R]
    advantages: torch.Tensor | None = None  # [B, R]
    returns: torch.Tensor | None = None  # [B, R]
    group_ids: torch.Tensor | None = None  # [B] prompt index of each sequence (rollout.n groups)
    # [B, R] the rollout engine's own log-probs of the sampled tokens (the behaviour policy
    # it actually sampled from), when the engine returned them
    rollout_logprobs: torch.Tensor | None = None
    # [B, R] truncated importance weights pi_old / mu (algorithm.rollout_correction), or None
    is_weights: torch.Tensor | None = None
    # [B, R] sum over the vocabulary of pi_old^2 at each response token, when the advantage
    # estimator needs it (optimal_token_baseline), else None
    sum_pi_squared: torch.Tensor | None = None
    # [B] the score of a greedy response to the row's prompt (ReMax's baseline), or None
    reward_baselines: torch.Tensor | None = None
    # [B, K] the raw score of each of reward.sources (K sources), or None for one source
    score_components: torch.Tensor | None = None
    # [B, R] multi-turn episodes: each turn's reward at its last action token, else None
    turn_rewards: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def prompt_length(self) -> int:
        return self.input_ids.shape[1] - self.response_mask.shape[1]

    @property
    def response_ids(self) -> torch.Tensor:
        """[B, R] the response tokens."""
        return self.input_ids[:, self.prompt_length :]

    def _tensor_fields(self) -> dict[str, torch.Tensor]:
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if isinstance(getattr(self, f.name), torch.Tensor)
        }

    def to(self, device: torch.device | str) -> Experience:
        moved = {k: v.to(device) for k, v in self._tensor_fields().items()}
        return dataclasses.replace(self, **moved)

    def select(self, idx: torch.Tensor | list[int]) -> Experience:
        """The rows `idx` of every tensor field."""
        idx = torch.as_tensor(idx, dtype=torch.long)
        picked = {k: v[idx.to(v.device)] for k, v in self._tensor_fields().items()}
        return dataclasses.replace(self, **picked)

    def trimmed(self, keep_response_width: bool = False) -> Experience:
        """The same rows without the padding columns every row has: the prompt columns no
        row attends to (left padding) and, unless `keep_response_width`, the response
        columns after the last real response token of any row. Positions are counted from
        each row's first real token and attention is causal, so every real token's
        log-prob and value are unchanged (`seq-mean-token-sum-norm` divides by the
        response width: keep it there)."""
        r = self.response_mask.shape[1]
        p = self.prompt_length
        real = self.attention_mask[:, :p].bool().any(dim=0)
        start = int(real.float().argmax()) if bool(real.any()) else p
        width = r
        if not keep_response_width:  # at least one column: an all-masked micro-batch still
            # goes through the model, its loss 0 with a zero gradient (every rank backwards)
            cols = self.response_mask.bool().any(dim=0).nonzero()
            width = int(cols.max()) + 1 if cols.numel() else min(1, r)
        if start == 0 and width == r:
            return self
        keep = slice(start, p + width)
        changed = {
            "input_ids": self.input_ids[:, keep],
            "attention_mask": self.attention_mask[:, keep],
        }
        for name in PER_TOKEN:
            value = getattr(self, name)
            if value is not None:
                changed[name] = value[:, :width]
        return dataclasses.replace(self, **changed)

    def split(self, size: int) -> list[Experience]:
        """Consecutive chunks of `size` rows (the last may be smaller)."""
        return [
            self.select(torch.arange(i, min(i + size, self.batch_size)))
            for i in range(0, self.batch_size, size)
        ]
