"""Datasets: load records from disk, render and tokenize prompts, batch them."""

from proxima.data.preferences import PreferenceDataset, PreferenceItem, pad_sequences
from proxima.data.prompts import (
    PromptDataset,
    PromptItem,
    PromptLoader,
    collate_prompts,
    observation_text,
    render_prompt,
    tokenize_text,
)
from proxima.data.records import load_records
from proxima.data.sft import SFTDataset, SFTItem, collate_sft

__all__ = [
    "PreferenceDataset",
    "PreferenceItem",
    "PromptDataset",
    "PromptItem",
    "PromptLoader",
    "SFTDataset",
    "SFTItem",
    "collate_prompts",
    "collate_sft",
    "load_records",
    "observation_text",
    "pad_sequences",
    "render_prompt",
    "tokenize_text",
]
