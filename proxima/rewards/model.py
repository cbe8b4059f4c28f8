"""Reward-model reward source, with or without the policy's tokenizer.

When the reward model shares the policy's vocabulary, the policy's token ids are scored
as they are (no decode/encode round trip). Otherwise the prompt and response texts are
re-tokenized with the reward model's own tokenizer (TRL required a shared tokenizer; here it
is optional) into the very layout `proxima rm` trains on (`reward_input_ids`: prompt ids,
response ids, EOS when the policy's response ended with its EOS), so a pair scores the same
in PPO as in reward-model training and evaluation.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from proxima.algos import last_token_index
from proxima.data.preferences import pad_sequences, reward_input_ids
from proxima.rewards.function import RewardError
from proxima.types import (
    SORTED,
    prompt_sorted_groups,
    right_shifts,
    roll_rows,
    token_budget_groups,
)

ScoreFn = Callable[[torch.nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]


def same_vocabulary(a: Any, b: Any) -> bool:
    """True when two tokenizers map every token to the same id (ids can be shared)."""
    if a is None or b is None:
        return False
    return a is b or a.get_vocab() == b.get_vocab()


def shared_columns(
    prompts: list[str], sequences: torch.Tensor, attention_mask: torch.Tensor
) -> int | None:
    """The leading columns every prompt's samples have in common (ids and mask), at least
    the prompt's own columns of the policy's layout; None when no prompt has two samples
    (or their rows share no column). Rows the same in those columns are one prompt's samples
    (`types.prompt_groups`)."""
    first: dict[str, int] = {}
    common = None
    for row, prompt in enumerate(map(str, prompts)):  # a chat's messages: their text
        if prompt not in first:
            first[prompt] = row
            continue
        a = first[prompt]
        same = (sequences[a] == sequences[row]) & (attention_mask[a] == attention_mask[row])
        n = int(same.long().cumprod(dim=0).sum())
        common = n if common is None else min(common, n)
    return common or None


class ModelReward:
    """Score (prompt, response) pairs with a reward model.

    ``score_fn(model, input_ids [b, L], attention_mask [b, L]) -> [b]`` does the forward
    pass (``proxima.models`` provides one); it must handle padding on either side, since
    policy sequences are left-padded prompts followed by right-padded responses.
    ``max_length`` (re-tokenized path only) keeps the last tokens, where the response is.
    ``normalization`` (mean, std), the one `proxima rm` stores with the model, standardises
    the scores. ``packed`` (`model.packing`): each forward through packed rows, called as
    ``score_fn(model, input_ids, attention_mask, packed=True)``; a ``max_tokens`` budget
    then counts packed rows.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        rm_tokenizer: Any,
        policy_tokenizer: Any,
        score_fn: ScoreFn,
        device: torch.device | str = "cpu",
        batch_size: int = 8,
        max_length: int | None = None,
        name: str = "a reward model",
        normalization: tuple[float, float] | None = None,
        max_tokens: int = 0,
        packed: bool = False,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1 for reward-model scoring.")
        self.model, self.name = model, name
        self.rm_tokenizer = rm_tokenizer
        self.score_fn = score_fn
        self.device = torch.device(device)
        self.batch_size = batch_size
        self.max_tokens = max_tokens  # != 0: forwards by a token budget (token_budget_groups)
        self.packed = packed
        self.max_length = max_length
        self.normalization = normalization  # (mean, std): scores become (s - mean) / std
        # Vocabularies are compared once: get_vocab() builds a dict of the whole vocabulary.
        self.shares_tokenizer = same_vocabulary(rm_tokenizer, policy_tokenizer)
        params = inspect.signature(score_fn).parameters
        self.takes_prompt_length = "prompt_length" in params
        self.policy_eos = getattr(policy_tokenizer, "eos_token_id", None)

    def __call__(
        self,
        prompts: list[str],
        responses: list[str],
        columns: dict[str, list[Any]],
        sequences: torch.Tensor,
        attention_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Scores as a float32 CPU tensor [B]; ``sequences``/``attention_mask`` are [B, L]."""
        split = None
        if self.shares_tokenizer:
            input_ids, mask = sequences, attention_mask
            split = shared_columns(prompts, sequences, attention_mask) if self.packed else None
        else:
            ended = self.ended_with_eos(sequences, attention_mask)
            input_ids, mask = self.retokenize(prompts, responses, ended)
        scores = self._score_in_chunks(input_ids, mask, split)
        bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
        if bad:
            raise RewardError(
                f"the reward model returned non-finite scores at indices {bad[:10]} (first "
                f"response: {responses[bad[0]]!r:.200}); check the reward model weights "
                "and its dtype (fp16 overflows; try bf16 or fp32)."
            )
        if self.normalization is not None:
            mean, std = self.normalization
            scores = (scores - mean) / std
        return scores

    def ended_with_eos(self, sequences: torch.Tensor, attention_mask: torch.Tensor) -> list[bool]:
        """[B] whether each policy sequence [B, L] ends (last real token) with the policy's EOS,
        which decoding drops from the response text; any other stop token stays in the text."""
        if self.policy_eos is None:
            return [False] * sequences.shape[0]
        last, _ = last_token_index(attention_mask)
        rows = torch.arange(sequences.shape[0], device=sequences.device)
        return (sequences[rows, last] == self.policy_eos).tolist()

    def retokenize(
        self, prompts: list[str], responses: list[str], ended: list[bool] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Right-padded ``input_ids`` and ``attention_mask`` [B, L] under the reward model's
        tokenizer, laid out as `proxima rm` trains (``reward_input_ids``): prompt ids, response
        ids, and the reward model's EOS where ``ended`` (default: every response ended, as
        every training pair does)."""
        ended = [True] * len(prompts) if ended is None else ended
        rows = [
            reward_input_ids(p, r, self.rm_tokenizer, ended=e)[0]
            for p, r, e in zip(prompts, responses, ended, strict=True)
        ]
        if self.max_length is not None:
            rows = [row[-self.max_length :] for row in rows]
        pad = self.rm_tokenizer.pad_token_id
        pad = self.rm_tokenizer.eos_token_id if pad is None else pad
        pad = 0 if pad is None else pad  # masked out anyway; any valid id will do
        return pad_sequences(rows, pad)

    @torch.no_grad()
    def _score_in_chunks(
        self, input_ids: torch.Tensor, mask: torch.Tensor, split: int | None = None
    ) -> torch.Tensor:
        """`batch_size` consecutive rows per forward, or groups by a token budget, each
        right-aligned and cut to the columns its rows attend to (positions come from the
        mask, the score is read at the last real token: no score changes); packed rows
        (`packed`) hold no padding, so their rows go as they are. `split` (packed, the
        policy's own sequences): the columns the samples of a prompt share, laid once for
        them (`models.packing.pack_shared`), a prompt's samples kept in one chunk."""
        n = input_ids.shape[0]
        shared = self.packed and split is not None and self.takes_prompt_length
        if shared and self.max_tokens == SORTED:
            groups = prompt_sorted_groups(input_ids, mask, split, self.batch_size)
            chunks = [torch.tensor(g) for g in groups]
        elif self.max_tokens:
            groups = token_budget_groups(mask, self.max_tokens, self.packed, self.batch_size)
            chunks = [torch.tensor(g) for g in groups]
        else:
            chunks = [
                torch.arange(i, min(i + self.batch_size, n)) for i in range(0, n, self.batch_size)
            ]
        out = torch.zeros(n)
        for rows in chunks:
            ids, m = input_ids[rows], mask[rows]
            if self.max_tokens and not self.packed:
                shift = right_shifts(m)
                ids, m = roll_rows(ids, shift), roll_rows(m, shift)
                start = int(m.bool().any(dim=0).float().argmax())
                ids, m = ids[:, start:], m[:, start:]
            packed = {"packed": True} if self.packed else {}
            if shared:
                packed["prompt_length"] = split
            chunk = self.score_fn(self.model, ids.to(self.device), m.to(self.device), **packed)
            if chunk.shape != (ids.shape[0],):
                raise RewardError(
                    f"score_fn returned shape {tuple(chunk.shape)} for {ids.shape[0]} sequences; "
                    "it must return one score per sequence [b]."
                )
            out[rows] = chunk.detach().float().cpu()
        return out
