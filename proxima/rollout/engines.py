"""The rollout engine `rollout.name` names: checked before anything heavy, built once per run.

vLLM is imported only when it is chosen (an optional dependency)."""

from __future__ import annotations

import torch

from proxima.config import Config, RolloutConfig
from proxima.models.critic import policy_of
from proxima.models.lora import export_adapter, is_lora
from proxima.models.saving import export_base_weights, export_weights
from proxima.rollout.engine import RolloutEngine
from proxima.rollout.hf_engine import HFEngine


def check_engine(cfg: Config, model_path: str | None = None) -> None:
    """Stop before anything heavy when the configured engine cannot run (ConfigError naming
    the key and the fix); the `hf` engine always can."""
    if cfg.rollout.name == "vllm":
        from proxima.rollout.vllm_engine import check_engine as check_vllm

        check_vllm(cfg, model_path)


def build_engine(cfg: Config, actor: torch.nn.Module, tokenizer, device: torch.device):
    """The engine `rollout.name` names, for a run whose actor module is `actor` (the `hf`
    engine serves it directly; vLLM loads the actor's folder and gets its weights pushed)."""
    if cfg.rollout.name == "vllm":
        from proxima.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(cfg, tokenizer, device)
    return HFEngine(actor, tokenizer.pad_token_id, cfg.rollout.micro_batch_size, tokenizer)


def as_engine(actor_or_engine, tokenizer, cfg: RolloutConfig) -> RolloutEngine:
    """An engine as given, or a model wrapped in the `hf` engine (the model is served live)."""
    if isinstance(actor_or_engine, torch.nn.Module):
        return HFEngine(actor_or_engine, tokenizer.pad_token_id, cfg.micro_batch_size, tokenizer)
    return actor_or_engine


def sync_weights(engine: RolloutEngine, actor: torch.nn.Module, version: int) -> RolloutEngine:
    """`engine`, holding the weights of `actor` at `version`: pushed unless it holds them
    already. A LoRA policy goes as its frozen base and its adapter to an engine that takes
    adapters (`takes_adapter`, `update_adapter`: vLLM built with LoRA support); any other
    as whole weights (`models.saving.export_weights`: HF names, LoRA merged into a copy; the
    `hf` engine serves the actor itself and never reads them). An actor's value head stays."""
    if engine.weight_version == version:
        return engine
    policy = policy_of(actor)
    takes_adapter = getattr(engine, "takes_adapter", None)
    if is_lora(policy) and takes_adapter is not None and takes_adapter(policy):
        engine.update_adapter(export_base_weights(policy), export_adapter(policy), version)
    else:
        engine.update_weights(export_weights(policy), version)
    return engine
