"""Tiny Hugging Face models built from a config, for tests, examples and the demo.

No hub is reachable, so tiny models are built here, saved with `save_pretrained`, and loaded
back through the same code path (`proxima.models.loading`) that loads a user's real model.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    GenerationConfig,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    Qwen2Config,
)

from proxima.models.loading import quiet_transformers
from proxima.models.tokenizers import build_bpe_tokenizer, build_char_tokenizer

ARCHITECTURES = ("llama", "qwen2", "gpt2", "gpt_neox")

# head_dim (Llama, Qwen2; GPT-2 and GPT-NeoX use hidden / heads): the tiny preset keeps 4
# heads but makes each 32 wide, the smallest head size vLLM's CPU kernels accept, so the
# default example also runs with rollout.name=vllm (2 heads of 32 learnt less reliably)
SIZES: dict[str, dict[str, int]] = {
    "nano": {"hidden": 32, "layers": 1, "heads": 2, "intermediate": 128},
    "tiny": {"hidden": 64, "layers": 2, "heads": 4, "intermediate": 256, "head_dim": 32},
    "small": {"hidden": 128, "layers": 4, "heads": 4, "intermediate": 512},
}

_CONFIGS: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig,
    "qwen2": Qwen2Config,
    "gpt2": GPT2Config,
    "gpt_neox": GPTNeoXConfig,
}

# Every dropout of each architecture, set to 0: PPO compares log-probs of the same tokens
# under old and new weights, and dropout noise would make the ratio != 1 at step 0.
_NO_DROPOUT: dict[str, dict[str, float]] = {
    "llama": {"attention_dropout": 0.0},
    "qwen2": {"attention_dropout": 0.0},
    "gpt2": {
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "summary_first_dropout": 0.0,
    },
    "gpt_neox": {"attention_dropout": 0.0, "hidden_dropout": 0.0},
}


def _check_choice(arch: str, size: str) -> None:
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {', '.join(SIZES)}")


def tiny_config(
    arch: str,
    tokenizer: PreTrainedTokenizerBase,
    size: str = "tiny",
    max_positions: int = 256,
    **overrides: Any,
) -> PretrainedConfig:
    """Config of a tiny `arch` model sized by `SIZES[size]`, matched to `tokenizer`.

    `overrides` are config fields (generic names such as `hidden_size` work for GPT-2 too,
    through its attribute map) applied last.
    """
    _check_choice(arch, size)
    dims = SIZES[size]
    kwargs: dict[str, Any] = {
        "vocab_size": len(tokenizer),
        "hidden_size": dims["hidden"],
        "num_hidden_layers": dims["layers"],
        "num_attention_heads": dims["heads"],
        "max_position_embeddings": max_positions,
        "pad_token_id": tokenizer.pad_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "tie_word_embeddings": False,
        "classifier_dropout": 0.0,  # read by the token / sequence classification heads
        **_NO_DROPOUT[arch],
    }
    if arch == "gpt2":
        kwargs["n_inner"] = dims["intermediate"]
    else:
        kwargs["intermediate_size"] = dims["intermediate"]
    if arch in ("llama", "qwen2"):
        kwargs["num_key_value_heads"] = dims["heads"]
        if "head_dim" in dims:
            kwargs["head_dim"] = dims["head_dim"]
    kwargs.update(overrides)
    return _CONFIGS[arch](**kwargs)


def _seeded_float32(build, seed: int) -> PreTrainedModel:
    """Run `build()` under `torch.manual_seed(seed)` without touching the caller's RNG."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build()
    return model.to(torch.float32)


def build_tiny_model(
    arch: str,
    tokenizer: PreTrainedTokenizerBase,
    size: str = "tiny",
    max_positions: int = 256,
    seed: int = 0,
    **overrides: Any,
) -> PreTrainedModel:
    """A randomly initialised causal LM (float32), deterministic given `seed`."""
    config = tiny_config(arch, tokenizer, size, max_positions, **overrides)
    model = _seeded_float32(lambda: AutoModelForCausalLM.from_config(config), seed)
    model.generation_config = GenerationConfig(
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return model


def build_tiny_reward_model(
    arch: str,
    tokenizer: PreTrainedTokenizerBase,
    size: str = "tiny",
    seed: int = 0,
    max_positions: int = 256,
    **overrides: Any,
) -> PreTrainedModel:
    """A randomly initialised sequence-classification model with one label (a reward model)."""
    config = tiny_config(arch, tokenizer, size, max_positions, num_labels=1, **overrides)
    return _seeded_float32(lambda: AutoModelForSequenceClassification.from_config(config), seed)


def init_model(
    out_dir: str | Path,
    arch: str = "llama",
    size: str = "tiny",
    alphabet: str | None = None,
    text_file: str | Path | None = None,
    vocab_size: int = 512,
    max_positions: int = 256,
    seed: int = 0,
    overwrite: bool = False,
    **overrides: Any,
) -> Path:
    """Build a tokenizer and a tiny causal LM and save both (safetensors) into `out_dir`.

    The tokenizer is a character tokenizer over `alphabet` when given, else a byte-level BPE
    trained on `text_file`. Returns the folder, loadable by `load_causal_lm`.
    """
    out = Path(out_dir)
    if (out / "config.json").exists() and not overwrite:
        raise FileExistsError(
            f"{out} already holds a model (config.json); choose another output folder, or "
            "delete that one first (from Python, init_model(..., overwrite=True) replaces it)"
        )
    if alphabet is not None and text_file is not None:
        raise ValueError(
            "init_model got both alphabet and text_file; pass one: alphabet='...' for a "
            "character tokenizer or text_file=PATH to train a byte-level BPE"
        )
    if max_positions < 1:
        raise ValueError(
            f"max_positions={max_positions} must be positive: the most tokens of prompt + "
            "response the model reads (e.g. 256)"
        )
    if alphabet is not None:
        tokenizer = build_char_tokenizer(alphabet)
    elif text_file is not None:
        tokenizer = build_bpe_tokenizer(text_file, vocab_size)
    else:
        raise ValueError(
            "init_model needs a tokenizer source: pass alphabet='...' for a character "
            "tokenizer or text_file=PATH to train a byte-level BPE"
        )
    tokenizer.model_max_length = max_positions
    model = build_tiny_model(arch, tokenizer, size, max_positions, seed, **overrides)
    out.mkdir(parents=True, exist_ok=True)
    with quiet_transformers():
        model.save_pretrained(out)  # safetensors is the default format
        tokenizer.save_pretrained(out)
    return out
