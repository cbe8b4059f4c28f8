"""The run's configuration: one tree of dataclasses, a help text per field.

Loaded from YAML, overridden on the command line as ``section.key=value``, validated
before anything heavy happens. Defaults are DeepSpeed-Chat's step-3 values (kl 0.1,
clip 0.2, value clip 0.2, reward clip 5, gamma 1.0, lam 0.95; learning rates from the
PPO-tricks seed: actor 5e-7, critic 9e-6).

- `sections`: the sections a PPO run reads (model, data, rollout, algorithm, actor, critic,
  reward, trainer, fsdp, guard); `schema`: the root `Config`, the other commands' sections
  (task, eval, sft, rm) and `ConfigError`;
- `choices`: every set of allowed values, defined once;
- `loading`: YAML + overrides -> `Config` (`load_config`);
- `validation`: `validate` (one check after another, in a fixed order) and `check_sources`;
- `plans`: what start-up prints (`batch_plan`, `kl_plan`) and every key with its default and
  help (`describe_fields`, `keys_markdown`);
- `reference`: docs/config.md, generated from those (`python -m proxima.config`).

Everything is imported from here: `from proxima.config import Config, load_config`.
"""

from proxima.config.loading import load_config, parse_overrides, read_yaml
from proxima.config.plans import batch_plan, describe_fields, fixed_keys, keys_markdown, kl_plan
from proxima.config.schema import (
    Config,
    ConfigError,
    DPOConfig,
    EvalConfig,
    PipelineConfig,
    RMConfig,
    SFTConfig,
    TaskConfig,
)
from proxima.config.sections import (
    ActorConfig,
    AgentConfig,
    AlgorithmConfig,
    CriticConfig,
    DataConfig,
    EnvConfig,
    FSDPConfig,
    GuardConfig,
    KLControlConfig,
    ModelConfig,
    OptimConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
    VLLMConfig,
)
from proxima.config.sources import RewardSource, reward_model_paths, reward_sources
from proxima.config.validation import check_sources, validate

__all__ = [
    "RewardSource",
    "reward_model_paths",
    "reward_sources",
    "ActorConfig",
    "AgentConfig",
    "AlgorithmConfig",
    "Config",
    "ConfigError",
    "CriticConfig",
    "DPOConfig",
    "DataConfig",
    "EnvConfig",
    "EvalConfig",
    "FSDPConfig",
    "GuardConfig",
    "KLControlConfig",
    "ModelConfig",
    "OptimConfig",
    "PipelineConfig",
    "RMConfig",
    "RewardConfig",
    "RolloutConfig",
    "SFTConfig",
    "TaskConfig",
    "TrainerConfig",
    "VLLMConfig",
    "batch_plan",
    "check_sources",
    "describe_fields",
    "fixed_keys",
    "keys_markdown",
    "kl_plan",
    "load_config",
    "parse_overrides",
    "read_yaml",
    "validate",
]
