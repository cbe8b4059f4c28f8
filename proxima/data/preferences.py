"""Preference pairs for reward-model training and DPO: (prompt, chosen, rejected) records.

Each side is tokenized exactly like an SFT example (prompt + response + EOS, prompt rendered
with :func:`render_prompt`), so the reward model sees the same token layout it will score
during PPO, where a finished response ends with EOS and the score is read at that last real
token (DeepSpeed-Chat step 2 scores chosen and rejected in one batch). A response marked as
cut at the token limit (`<key>_ended` false) gets no EOS, as PPO scores such a response.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from proxima.config.choices import PREFERENCE_OVERLONG
from proxima.data.prompts import missing_column_error, render_prompt, tokenize_text
from proxima.data.records import source_of

# `<response column>_ended`: an optional boolean column per side, false for a response cut
# at the token limit (no EOS after it), true when absent
ENDED_SUFFIX = "_ended"


class IdenticalPairWarning(UserWarning):
    """Pairs whose chosen and rejected responses are the same: the two scores are equal
    whatever the weights, so such a pair gives the loss no gradient and teaches nothing."""


@dataclass
class PreferenceItem:
    """One tokenized pair: both sides start with the same ``prompt_length`` prompt ids.

    ``margin`` is the optional per-pair margin m of Llama 2's ranking loss (0 = plain
    Bradley-Terry)."""

    chosen_ids: list[int]
    rejected_ids: list[int]
    prompt_length: int
    margin: float = 0.0


class PreferenceDataset:
    """Tokenized preference pairs; ``dataset[i]`` is a :class:`PreferenceItem`.

    Each side is the prompt, the response and EOS, or no EOS where the record's optional
    boolean column ``<chosen_key>_ended`` / ``<rejected_key>_ended`` is false (a response
    cut at the token limit, as PPO's rollouts and `proxima pipeline`'s pairs mark it).

    ``overlong`` handles pairs whose longer side exceeds ``max_length`` tokens: ``"error"``
    stops with the index, ``"drop"`` skips the pair (counted in ``num_dropped``).
    ``margin_key`` names an optional numeric column added as a margin to the loss.
    ``command`` is the command whose options the error messages name (`proxima dpo`
    reads the same records).
    """

    def __init__(
        self,
        records: Sequence[Mapping[str, Any]],
        tokenizer: Any,
        prompt_key: str = "prompt",
        chosen_key: str = "chosen",
        rejected_key: str = "rejected",
        margin_key: str | None = None,
        max_length: int = 1024,
        overlong: str = "error",
        add_bos: bool = False,
        command: str = "proxima rm",
    ) -> None:
        if overlong not in PREFERENCE_OVERLONG:
            raise ValueError(f"overlong={overlong!r} is not one of {PREFERENCE_OVERLONG}.")
        if len(records) == 0:
            raise ValueError(
                "the preference dataset is empty; point --data at (prompt, chosen, rejected) "
                "records."
            )
        if tokenizer.eos_token_id is None:
            raise ValueError(
                "the tokenizer has no eos token, which marks where the score is read; "
                "set tokenizer.eos_token in the model folder."
            )
        keys = {"--prompt-key": prompt_key, "--chosen-key": chosen_key}
        keys["--rejected-key"] = rejected_key
        if margin_key:
            keys["--margin-key"] = margin_key
        self.items: list[PreferenceItem] = []
        self.num_dropped = 0
        identical: list[int] = []  # record indices of pairs with chosen == rejected
        for i, record in enumerate(records):
            item = _make_item(i, record, tokenizer, keys, add_bos, command)
            if item.chosen_ids == item.rejected_ids:
                identical.append(i)
            if _longest(item) <= max_length:
                self.items.append(item)
            elif overlong == "drop":
                self.num_dropped += 1
            else:
                raise _overlong_error(i, item, max_length)
        if not self.items:
            raise ValueError(
                f"all {len(records)} pairs are longer than max_length={max_length} tokens and "
                "were dropped; raise --max-length."
            )
        if identical:
            _warn_identical(identical, len(records), source_of(records), keys)

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> PreferenceItem:
        return self.items[index]


def _warn_identical(indices: list[int], total: int, source: str, keys: dict[str, str]) -> None:
    where = f"{source}: " if source else ""
    chosen, rejected = keys["--chosen-key"], keys["--rejected-key"]
    warnings.warn(
        IdenticalPairWarning(
            f"{where}{len(indices)} of {total} pairs have the same {chosen!r} and {rejected!r} "
            f"response (the first: record {indices[0]}); they teach the reward model nothing "
            "(equal scores, no gradient). Fix or remove them."
        ),
        stacklevel=3,
    )


def _longest(item: PreferenceItem) -> int:
    return max(len(item.chosen_ids), len(item.rejected_ids))


def _overlong_error(i: int, item: PreferenceItem, limit: int) -> ValueError:
    return ValueError(
        f"pair {i} has {_longest(item)} tokens (prompt {item.prompt_length}, chosen "
        f"{len(item.chosen_ids)}, rejected {len(item.rejected_ids)} with the prompt), more "
        f"than max_length={limit}; raise --max-length or drop long pairs (--overlong drop)."
    )


def _make_item(
    i: int,
    record: Mapping[str, Any],
    tokenizer: Any,
    keys: dict[str, str],
    add_bos: bool,
    command: str,
) -> PreferenceItem:
    """Tokenize record ``i``; ``keys`` maps each CLI option to the column it names."""
    for option, key in keys.items():
        if key not in record:
            raise missing_column_error(key, record, i, f"{command} {option}")
    try:
        prompt = render_prompt(record[keys["--prompt-key"]], tokenizer)
    except ValueError as exc:
        raise ValueError(f"record {i}, column {keys['--prompt-key']!r}: {exc}") from exc
    sides = []
    for option in ("--chosen-key", "--rejected-key"):
        text = record[keys[option]]
        if not isinstance(text, str):
            raise ValueError(
                f"record {i}: column {keys[option]!r} holds a {type(text).__name__}, expected "
                f"the response text (a string); point `{command} {option}` at the text column."
            )
        ended = _ended(i, record, keys[option])
        ids, prompt_length = reward_input_ids(prompt, text, tokenizer, ended, add_bos)
        sides.append(ids)
    margin = _margin(i, record, keys.get("--margin-key"))
    return PreferenceItem(sides[0], sides[1], prompt_length, margin)


def reward_input_ids(
    prompt: str, response: str, tokenizer: Any, ended: bool = True, add_bos: bool = False
) -> tuple[list[int], int]:
    """The token layout a reward model is trained on (`proxima rm`) and scored in during PPO
    when it has its own tokenizer (`ModelReward`): the rendered prompt and the response, each
    tokenized on its own without special tokens, then EOS when the response ended with it.
    Returns (ids, number of prompt ids).

    Tokenizing the two texts apart gives the ids the policy fed the reward model (its prompt
    ids, then the response ids it generated); tokenizing their concatenation would let a
    BPE merge across the boundary and give other ids.
    """
    prompt_ids = tokenize_text(prompt, tokenizer, add_bos)
    ids = prompt_ids + tokenize_text(response, tokenizer)
    if ended and tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return ids, len(prompt_ids)


def _ended(i: int, record: Mapping[str, Any], key: str) -> bool:
    """Whether the response in column `key` ended (EOS follows it): the optional boolean
    column `<key>_ended`, true when absent. A response cut at the token limit is false, so
    it is laid out as PPO lays out a response that never stopped: no EOS after it."""
    value = record.get(f"{key}{ENDED_SUFFIX}", True)
    if not isinstance(value, bool):
        raise ValueError(
            f"record {i}: column {key + ENDED_SUFFIX!r} holds {value!r:.50}, expected true "
            "(the response ended: EOS follows it) or false (it was cut at the token limit)."
        )
    return value


def _margin(i: int, record: Mapping[str, Any], key: str | None) -> float:
    if not key:
        return 0.0
    value = record[key]
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not ok or not math.isfinite(value):
        raise ValueError(
            f"record {i}: margin column {key!r} holds {value!r:.50}, expected a finite number; "
            "fix the record or drop --margin-key."
        )
    return float(value)


def pad_sequences(
    seqs: Sequence[Sequence[int]], pad_token_id: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad sequences to the longest: (input_ids, attention_mask), each [N, L] long.
    The reward model reads its score at the last position with attention_mask == 1
    (``reward_model_scores``)."""
    if pad_token_id is None:
        raise ValueError(
            "the tokenizer has no pad token; set tokenizer.pad_token (e.g. to the eos token)."
        )
    width = max(len(seq) for seq in seqs)
    ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, seq in enumerate(seqs):
        ids[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
        mask[row, : len(seq)] = 1
    return ids, mask


def distinct_sequences(
    items: Sequence[PreferenceItem],
) -> tuple[list[tuple[list[int], int]], torch.Tensor, torch.Tensor]:
    """The distinct sequences of a set of pairs as (ids, prompt_length), in order of first
    appearance, and each pair's two indices into them: (sequences, chosen [B], rejected
    [B]). Pairs drawn from the same answers (every two of K answers to a prompt) share
    sequences, so that each is scored once (InstructGPT: K forward passes for the
    K-choose-2 comparisons of a prompt)."""
    slots: dict[tuple[int, ...], int] = {}
    seqs: list[tuple[list[int], int]] = []

    def slot(ids: list[int], prompt_length: int) -> int:
        key = (prompt_length, *ids)
        if key not in slots:
            slots[key] = len(seqs)
            seqs.append((ids, prompt_length))
        return slots[key]

    index = [
        (slot(item.chosen_ids, item.prompt_length), slot(item.rejected_ids, item.prompt_length))
        for item in items
    ]
    chosen, rejected = torch.tensor(index, dtype=torch.long).reshape(-1, 2).unbind(1)
    return seqs, chosen, rejected


def prompt_groups(items: Sequence[PreferenceItem]) -> list[list[PreferenceItem]]:
    """The pairs grouped by their prompt (its token ids), in order of first appearance."""
    groups: dict[tuple[int, ...], list[PreferenceItem]] = {}
    for i in range(len(items)):
        item = items[i]
        groups.setdefault(tuple(item.chosen_ids[: item.prompt_length]), []).append(item)
    return list(groups.values())


def collate_policy_rows(
    rows: Sequence[tuple[Sequence[int], int]], pad_token_id: int | None
) -> dict[str, torch.Tensor]:
    """Sequences given as (ids, prompt_length) in the policy's rollout layout (`proxima
    dpo`): each prompt left-padded to the longest prompt P, each response (with its EOS)
    right-padded to the longest response R, so one forward pass reads them all and
    `models.forward.response_logprobs` finds response token t at position P + t.

    Returns ``input_ids`` and ``attention_mask`` [N, P + R], ``response_ids`` and
    ``response_mask`` [N, R] (long; the mask is 1 on real response tokens).
    """
    if pad_token_id is None:
        raise ValueError(
            "the tokenizer has no pad token; set tokenizer.pad_token (e.g. to the eos token)."
        )
    width_p = max(p for _, p in rows)
    width_r = max(len(ids) - p for ids, p in rows)
    input_ids = torch.full((len(rows), width_p + width_r), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, (ids, p) in enumerate(rows):
        seq = torch.tensor(ids, dtype=torch.long)
        start, end = width_p - p, width_p + len(ids) - p
        input_ids[row, start:end] = seq
        attention_mask[row, start:end] = 1
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "response_ids": input_ids[:, width_p:].clone(),
        "response_mask": attention_mask[:, width_p:].clone(),
    }
