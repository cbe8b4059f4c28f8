"""Supervised fine-tuning data: prompt + response + EOS, loss on the response only.

The prompt is rendered exactly as for PPO (:func:`render_prompt`), so the SFT model learns
to answer the text it will be prompted with during RL. Prompt and response are tokenized
separately and concatenated, so the prompt/response boundary is exact in token space.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from proxima.data.prompts import (
    OVERLONG_MODES,
    missing_column_error,
    render_prompt,
    tokenize_text,
)

IGNORE_INDEX = -100  # the label value torch's cross-entropy (and HF models) skip


@dataclass
class SFTItem:
    """One example: ``ids`` = prompt ids + response ids (+ EOS); the first
    ``prompt_length`` of them are not trained on."""

    ids: list[int]
    prompt_length: int


class SFTDataset:
    """Tokenized (prompt, response) pairs; ``dataset[i]`` is an :class:`SFTItem`.

    ``overlong`` handles examples longer than ``max_length`` tokens: ``"error"`` stops,
    ``"drop"`` skips, ``"truncate"`` cuts the end of the response (examples whose prompt
    alone fills ``max_length`` have nothing to learn and still raise).
    """

    def __init__(
        self,
        records: Sequence[Mapping[str, Any]],
        tokenizer: Any,
        prompt_key: str = "prompt",
        response_key: str = "response",
        max_length: int = 1024,
        overlong: str = "error",
        add_bos: bool = False,
    ) -> None:
        if overlong not in OVERLONG_MODES:
            raise ValueError(f"overlong={overlong!r} is not one of {OVERLONG_MODES}.")
        if len(records) == 0:
            raise ValueError("the SFT dataset is empty; point the data path at (prompt, response).")
        if tokenizer.eos_token_id is None:
            raise ValueError(
                "the tokenizer has no eos token, so the model could not learn to stop; "
                "set tokenizer.eos_token in the model folder."
            )
        self.items: list[SFTItem] = []
        self.num_dropped = 0
        for i, record in enumerate(records):
            item = self._make_item(i, record, tokenizer, prompt_key, response_key, add_bos)
            item = self._apply_limit(i, item, max_length, overlong)
            if item is not None:
                self.items.append(item)
        if not self.items:
            raise ValueError(f"all examples are longer than max_length={max_length}; raise it.")

    @staticmethod
    def _make_item(
        i: int,
        record: Mapping[str, Any],
        tokenizer: Any,
        prompt_key: str,
        response_key: str,
        add_bos: bool,
    ) -> SFTItem:
        for key, config_key in (
            (prompt_key, "data.prompt_key"),
            (response_key, "data.response_key"),
        ):
            if key not in record:
                raise missing_column_error(key, record, i, config_key)
        response = record[response_key]
        if not isinstance(response, str):
            raise ValueError(
                f"record {i}: column {response_key!r} holds a {type(response).__name__}, "
                "expected the response text (a string)."
            )
        prompt_ids = tokenize_text(render_prompt(record[prompt_key], tokenizer), tokenizer, add_bos)
        ids = prompt_ids + tokenize_text(response, tokenizer) + [tokenizer.eos_token_id]
        return SFTItem(ids, len(prompt_ids))

    def _apply_limit(self, i: int, item: SFTItem, limit: int, overlong: str) -> SFTItem | None:
        if len(item.ids) <= limit:
            return item
        if overlong == "drop":
            self.num_dropped += 1
            return None
        if overlong == "truncate" and item.prompt_length < limit:
            return SFTItem(item.ids[:limit], item.prompt_length)
        raise ValueError(
            f"example {i} has {len(item.ids)} tokens (prompt {item.prompt_length}), more than "
            f"max_length={limit}; raise the limit (`sft.max_length`, --max-length of "
            f"`proxima sft`; for ptx data "
            f"`data.max_prompt_length` + `rollout.max_response_length`) or set "
            f"`data.overlong_prompts=drop`"
            + ("." if item.prompt_length >= limit else " or truncate.")
        )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> SFTItem:
        return self.items[index]


def collate_sft(items: Sequence[SFTItem], pad_token_id: int | None) -> dict[str, torch.Tensor]:
    """Right-pad a batch for teacher forcing.

    Returns ``input_ids``, ``attention_mask`` and ``labels``, each [B, L] long, L = longest
    example. ``labels`` equal ``input_ids`` on response tokens (EOS included) and are -100 on
    the prompt and on padding; the model shifts labels itself (HF causal-LM convention).
    """
    if pad_token_id is None:
        raise ValueError(
            "the tokenizer has no pad token; set tokenizer.pad_token (e.g. to the eos token)."
        )
    width = max(len(item.ids) for item in items)
    input_ids = torch.full((len(items), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(items), width), dtype=torch.long)
    labels = torch.full((len(items), width), IGNORE_INDEX, dtype=torch.long)
    for row, item in enumerate(items):
        n = len(item.ids)
        ids = torch.tensor(item.ids, dtype=torch.long)
        input_ids[row, :n] = ids
        attention_mask[row, :n] = 1
        labels[row, item.prompt_length : n] = ids[item.prompt_length :]
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
