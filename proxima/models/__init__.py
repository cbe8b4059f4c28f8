"""Models of the four PPO roles, loaded from local Hugging Face folders, and tiny models
built locally for tests and examples."""

from proxima.models.folders import (
    config_positions,
    config_vocab_size,
    folder_problem,
    has_tokenizer,
    policy_folder_problem,
    vocabulary_difference,
)
from proxima.models.forward import position_ids_from_mask, reward_model_scores
from proxima.models.loading import (
    CRITIC_INIT,
    DTYPES,
    describe_model,
    init_reward_model,
    load_causal_lm,
    load_critic,
    load_reward_model,
    load_tokenizer,
    quiet_transformers,
    scalar_head,
    score_normalization,
)
from proxima.models.tiny import (
    ARCHITECTURES,
    SIZES,
    build_tiny_model,
    build_tiny_reward_model,
    init_model,
    tiny_config,
)
from proxima.models.tokenizers import SPECIAL_TOKENS, build_bpe_tokenizer, build_char_tokenizer

__all__ = [
    "init_reward_model",
    "ARCHITECTURES",
    "CRITIC_INIT",
    "DTYPES",
    "config_positions",
    "config_vocab_size",
    "folder_problem",
    "policy_folder_problem",
    "has_tokenizer",
    "vocabulary_difference",
    "SIZES",
    "SPECIAL_TOKENS",
    "build_bpe_tokenizer",
    "build_char_tokenizer",
    "build_tiny_model",
    "build_tiny_reward_model",
    "describe_model",
    "init_model",
    "load_causal_lm",
    "load_critic",
    "load_reward_model",
    "load_tokenizer",
    "position_ids_from_mask",
    "quiet_transformers",
    "reward_model_scores",
    "scalar_head",
    "score_normalization",
    "tiny_config",
]
