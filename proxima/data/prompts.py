"""Prompt datasets for PPO: render (chat templates), tokenize, check lengths, batch.

A prompt is either a plain string (used as is) or a list of chat messages
``[{"role": ..., "content": ...}, ...]`` rendered with the tokenizer's chat template.
Every other column of a record travels with the prompt (``PromptItem.columns``) so that
reward functions can read e.g. the reference answer.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from proxima.config.choices import OVERLONG_MODES
from proxima.data.records import source_of


class UnknownCharactersWarning(UserWarning):
    """Prompts hold characters the tokenizer has no token for: they are encoded as its
    unknown token, and the policy never sees what they were."""


@dataclass
class PromptItem:
    """One tokenized prompt. ``ids`` has no padding; ``columns`` are the record's other keys."""

    text: str
    ids: list[int]
    columns: dict[str, Any] = field(default_factory=dict)
    # the chat messages the text was rendered from, None for a plain-text prompt
    messages: list[dict[str, str]] | None = None


def render_prompt(prompt: str | Sequence[Mapping[str, str]], tokenizer: Any) -> str:
    """Turn a prompt (string or chat messages) into the text the policy continues."""
    if isinstance(prompt, str):
        return prompt
    messages = _check_messages(prompt)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # No template (base models): a plain transcript that ends where the assistant speaks.
    lines = "".join(f"{m['role']}: {m['content']}\n" for m in messages)
    return lines + "assistant: "


ACTION_MARK = "\u2063ACTION\u2063"  # stands in for the model's turn when rendering


def observation_text(
    messages: list[dict[str, str]] | None, observation: str, role: str, tokenizer: Any
) -> str:
    """The text an environment's observation adds to a multi-turn episode after the model's
    turn, up to where the model speaks again: the observation itself after a plain-text
    prompt; after chat messages, what the chat template writes between an assistant message
    and the next assistant turn, with the observation as a message of `role` (the end of the
    assistant's message, e.g. `<|im_end|>`, included: the caller drops it when the model's
    turn already ended with it). Without a template, the plain transcript of
    `render_prompt`."""
    if messages is None:
        return observation
    if not getattr(tokenizer, "chat_template", None):
        return f"\n{role}: {observation}\nassistant: "
    turn = [*messages, {"role": "assistant", "content": ACTION_MARK}]
    before = tokenizer.apply_chat_template(turn, tokenize=False)
    after = tokenizer.apply_chat_template(
        [*turn, {"role": role, "content": observation}], tokenize=False, add_generation_prompt=True
    )
    if ACTION_MARK not in before or not after.startswith(before):
        raise ValueError(
            f"the chat template does not render a {role!r} message after an assistant "
            "message as an addition to the conversation; set rollout.env.observation_role to a "
            "role the template knows (e.g. user or tool)."
        )
    return before[before.rindex(ACTION_MARK) + len(ACTION_MARK) :] + after[len(before) :]


def _check_messages(prompt: Any) -> list[dict[str, str]]:
    if not isinstance(prompt, Sequence) or not prompt:
        raise ValueError(
            f"a prompt must be a string or a non-empty list of chat messages, got {prompt!r:.200}"
        )
    for m in prompt:
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise ValueError(
                f"chat message {m!r:.200} must be an object with 'role' and 'content' keys, "
                'e.g. {"role": "user", "content": "Hi"}.'
            )
    return [dict(m) for m in prompt]


def tokenize_text(text: str, tokenizer: Any, add_bos: bool = False) -> list[int]:
    """Token ids of ``text`` without special tokens, plus BOS in front when asked.

    Chat templates often write the BOS token into the text themselves, so BOS is only
    prepended when the ids do not already start with it (no double BOS).
    """
    ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    bos = getattr(tokenizer, "bos_token_id", None)
    if add_bos and bos is not None and (not ids or ids[0] != bos):
        ids = [bos] + ids
    return ids


def missing_column_error(key: str, record: Mapping[str, Any], index: int, config_key: str):
    """The ValueError for a record without the column ``key`` (shared with SFT data)."""
    return ValueError(
        f"record {index} has no column {key!r}; columns found: {sorted(record)}. "
        f"Set `{config_key}` to the column that holds it."
    )


class PromptDataset:
    """Tokenized prompts; ``dataset[i]`` is a :class:`PromptItem`.

    ``overlong``: what to do with prompts longer than ``max_prompt_length`` tokens:
    ``"error"`` stops with the index, ``"drop"`` skips them, ``"truncate"`` keeps the last
    ``max_prompt_length`` tokens (the end holds the question and the generation prompt).
    """

    def __init__(
        self,
        records: Sequence[Mapping[str, Any]],
        tokenizer: Any,
        prompt_key: str = "prompt",
        max_prompt_length: int = 512,
        overlong: str = "error",
        add_bos: bool = False,
    ) -> None:
        if overlong not in OVERLONG_MODES:
            raise ValueError(
                f"overlong={overlong!r} is not one of {OVERLONG_MODES}; "
                "set `data.overlong_prompts` to error, drop or truncate."
            )
        if max_prompt_length < 1:
            raise ValueError(
                f"max_prompt_length={max_prompt_length} must be >= 1; set `data.max_prompt_length`."
            )
        if len(records) == 0:
            raise ValueError(
                "the prompt dataset is empty; point `data.train_path` (or `data.eval_path`) "
                "at a file with prompts."
            )
        self.items: list[PromptItem] = []
        self.num_dropped = 0
        unknown: list[PromptItem] = []  # prompts with the unknown token, as tokenized
        unk = getattr(tokenizer, "unk_token_id", None)
        for i, record in enumerate(records):
            item = self._make_item(i, record, tokenizer, prompt_key, add_bos)
            if unk is not None and unk in item.ids:
                unknown.append(item)
            item = self._apply_limit(i, item, tokenizer, max_prompt_length, overlong, add_bos)
            if item is not None:
                self.items.append(item)
        if unknown:
            _warn_unknown(unknown, len(records), tokenizer, source_of(records))
        if not self.items:
            raise ValueError(
                f"all {len(records)} prompts are longer than max_prompt_length="
                f"{max_prompt_length} and were dropped; raise `data.max_prompt_length`."
            )

    @staticmethod
    def _make_item(i: int, record: Mapping[str, Any], tokenizer: Any, key: str, add_bos: bool):
        if key not in record:
            raise missing_column_error(key, record, i, "data.prompt_key")
        try:
            text = render_prompt(record[key], tokenizer)
        except ValueError as exc:
            raise ValueError(f"record {i}, column {key!r}: {exc}") from exc
        ids = tokenize_text(text, tokenizer, add_bos)
        if not ids:
            raise ValueError(f"record {i}: the prompt is empty after tokenization; remove it.")
        columns = {k: v for k, v in record.items() if k != key}
        messages = None if isinstance(record[key], str) else _check_messages(record[key])
        return PromptItem(text=text, ids=ids, columns=columns, messages=messages)

    def _apply_limit(
        self, i: int, item: PromptItem, tokenizer: Any, limit: int, overlong: str, add_bos: bool
    ):
        if len(item.ids) <= limit:
            return item
        if overlong == "drop":
            self.num_dropped += 1
            return None
        if overlong == "truncate":
            bos = getattr(tokenizer, "bos_token_id", None)
            keep_bos = add_bos and limit > 1 and item.ids[0] == bos
            ids = [bos] + item.ids[-(limit - 1) :] if keep_bos else item.ids[-limit:]
            return PromptItem(tokenizer.decode(ids), ids, item.columns, item.messages)
        raise ValueError(
            f"prompt {i} has {len(item.ids)} tokens, more than max_prompt_length={limit}; "
            "raise `data.max_prompt_length` or set `data.overlong_prompts=drop|truncate`."
        )

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> PromptItem:
        return self.items[index]


def unknown_pieces(text: str, tokenizer: Any) -> list[str]:
    """The parts of `text` the tokenizer encodes as its unknown token: from the offsets of a
    fast tokenizer, else the characters that alone encode as it."""
    unk = tokenizer.unk_token_id
    try:
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, ValueError, TypeError):  # slow tokenizers have no offsets
        return [c for c in dict.fromkeys(text) if tokenize_text(c, tokenizer) == [unk]]
    spans = zip(enc["input_ids"], enc["offset_mapping"], strict=True)
    return [text[a:b] for i, (a, b) in spans if i == unk]


def _warn_unknown(items: list[PromptItem], total: int, tokenizer: Any, source: str) -> None:
    """One warning per data set: how many prompts hold unknown characters, and some of them."""
    pieces: dict[str, None] = {}
    for item in items[:20]:
        pieces.update(dict.fromkeys(p for p in unknown_pieces(item.text, tokenizer) if p))
    shown = ", ".join(repr(p) for p in list(pieces)[:8]) or "not located"
    more = ", ..." if len(pieces) > 8 else ""
    where = f"{source}: " if source else ""
    warnings.warn(
        UnknownCharactersWarning(
            f"{where}{len(items)} of {total} prompts hold characters the tokenizer has no "
            f"token for ({shown}{more}); they are encoded as {tokenizer.unk_token!r} (id "
            f"{tokenizer.unk_token_id}) and the policy never sees them. Use a tokenizer that "
            "covers them (for a tiny model: `proxima init-model --alphabet` with these "
            "characters), or remove them from the prompts."
        ),
        stacklevel=3,
    )


def collate_prompts(
    items: Sequence[PromptItem], pad_token_id: int | None
) -> dict[str, torch.Tensor]:
    """Left-pad a batch so every prompt ends at the same column (generation appends there).

    Returns ``input_ids`` [B, P] (long) and ``attention_mask`` [B, P] (long, 0 on padding),
    P = the longest prompt of the batch.
    """
    if pad_token_id is None:
        raise ValueError(
            "the tokenizer has no pad token; set tokenizer.pad_token (e.g. to the eos token)."
        )
    width = max(len(item.ids) for item in items)
    input_ids = torch.full((len(items), width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(items), width), dtype=torch.long)
    for row, item in enumerate(items):
        n = len(item.ids)
        input_ids[row, width - n :] = torch.tensor(item.ids, dtype=torch.long)
        attention_mask[row, width - n :] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


class PromptLoader:
    """Endless batches of prompts, reshuffled each epoch, resumable.

    The order of epoch ``e`` depends only on ``(seed, e)``, so a run restored with
    :meth:`load_state_dict` sees exactly the batches an uninterrupted run would. The tail
    that does not fill a batch is dropped each epoch (every batch has ``batch_size`` items).
    """

    def __init__(self, dataset: Sequence[Any], batch_size: int, seed: int, shuffle: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1; set `data.train_batch_size`.")
        if len(dataset) < batch_size:
            raise ValueError(
                f"the dataset has {len(dataset)} prompts, fewer than one batch of {batch_size}; "
                "lower `data.train_batch_size` or add prompts."
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0  # batches already served in the current epoch
        self._order: list[int] | None = None

    @property
    def batches_per_epoch(self) -> int:
        return len(self.dataset) // self.batch_size

    def _epoch_order(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.dataset)))
        # One generator per epoch, seeded from (seed, epoch): no hidden state to restore.
        gen = torch.Generator().manual_seed((self.seed * 1_000_003 + epoch) % (2**63))
        return torch.randperm(len(self.dataset), generator=gen).tolist()

    def __iter__(self) -> Iterator[list[Any]]:
        return self

    def __next__(self) -> list[Any]:
        if self.position >= self.batches_per_epoch:
            # Rolling over here (not after the last batch) means a state saved at an epoch
            # boundary resumes into the next epoch instead of serving nothing.
            self.epoch += 1
            self.position = 0
            self._order = None
        if self._order is None:
            self._order = self._epoch_order(self.epoch)
        start = self.position * self.batch_size
        batch = [self.dataset[i] for i in self._order[start : start + self.batch_size]]
        self.position += 1
        return batch

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position, "seed": self.seed}

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        if "seed" in state and state["seed"] != self.seed:
            raise ValueError(
                f"the saved loader used seed {state['seed']} but this run uses {self.seed}; "
                "resume with the same `seed` to replay the same prompt order."
            )
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self._order = None
