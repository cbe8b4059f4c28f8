"""Builds what a run needs from its config: device, the four roles, data, reward source."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from proxima.config import Config
from proxima.data import PromptDataset, SFTDataset, load_records
from proxima.models import (
    describe_model,
    load_causal_lm,
    load_critic,
    load_reward_model,
    load_tokenizer,
    reward_model_scores,
)
from proxima.models.lora import AdapterDisabled, add_lora
from proxima.rewards import FunctionReward, ModelReward, load_reward_function

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"`model.device`={name} but no CUDA device is visible. Use model.device=cpu (or auto)."
        )
    return device


@dataclass
class Roles:
    """The four models of PPO-RLHF (InstructGPT, DeepSpeed-Chat) and the policy's tokenizer."""

    tokenizer: object
    actor: torch.nn.Module
    reference: torch.nn.Module | None
    critic: torch.nn.Module | None
    reward: object  # callable reward source, see proxima.rewards

    def report(self) -> str:
        """What each role costs in memory: parameters, trainable, bytes."""
        lines = []
        for name in ("actor", "reference", "critic"):
            model = getattr(self, name)
            if model is None:
                lines.append(f"  {name:9s}: not loaded")
                continue
            if isinstance(model, AdapterDisabled):
                lines.append(f"  {name:9s}: {model.describe()}")
                continue
            d = describe_model(model)
            train_mib = d["grad_and_adam_bytes"] / 2**20
            lines.append(
                f"  {name:9s}: {d['parameters'] / 1e6:.3f} M params ({d['dtype']}), "
                f"{d['parameter_bytes'] / 2**20:.1f} MiB weights"
                + (f" + {train_mib:.1f} MiB grads and AdamW state" if train_mib else ", frozen")
            )
        lines.append(f"  reward   : {getattr(self.reward, 'name', type(self.reward).__name__)}")
        return "\n".join(lines)


def build_reward(cfg: Config, tokenizer, device: torch.device):
    if cfg.reward.function:
        fn = load_reward_function(cfg.reward.function)
        return FunctionReward(fn, cfg.reward.function)
    rm = load_reward_model(cfg.reward.model_path, dtype=_DTYPES[cfg.model.dtype], device=device)
    return ModelReward(
        rm,
        load_tokenizer(cfg.reward.model_path),
        tokenizer,
        reward_model_scores,
        device=device,
        batch_size=cfg.reward.batch_size,
    )


def critic_source(cfg: Config) -> str:
    """The folder the critic starts from: explicit, else the reward model or the actor."""
    if cfg.model.critic_path:
        return cfg.model.critic_path
    if cfg.model.critic_init == "reward_model":
        if not cfg.reward.model_path:
            raise ValueError(
                "`model.critic_init=reward_model` needs `reward.model_path` or "
                "`model.critic_path` (a reward model folder)."
            )
        return cfg.reward.model_path
    return cfg.model.actor_path


def load_roles(cfg: Config, device: torch.device) -> Roles:
    """Actor (trained), reference (frozen), critic (trained, GAE only), reward source.

    With model.lora_rank > 0 the actor (and the critic, if model.critic_lora) trains LoRA
    adapters, and the reference is the actor with its adapters disabled unless
    model.reference_path names another model (no second copy of the weights)."""
    dtype = _DTYPES[cfg.model.dtype]
    lora = cfg.model.lora_rank > 0
    tok = load_tokenizer(cfg.model.actor_path)
    actor = load_causal_lm(cfg.model.actor_path, dtype=dtype, device=device, trainable=True)
    if lora:
        actor = add_lora(actor, cfg.model, "CAUSAL_LM", seed=cfg.trainer.seed)
    needs_ref = cfg.kl_in_reward or cfg.actor.use_kl_loss
    reference = None
    if needs_ref and lora and not cfg.model.reference_path:
        reference = AdapterDisabled(actor)
    elif needs_ref:
        reference = load_causal_lm(
            cfg.model.reference_path or cfg.model.actor_path,
            dtype=dtype,
            device=device,
            trainable=False,
        )
    critic = None
    if cfg.algorithm.adv_estimator == "gae":
        critic = load_critic(
            critic_source(cfg),
            dtype=dtype,
            device=device,
            init_from=cfg.model.critic_init,
            seed=cfg.trainer.seed,
        )
        if lora and cfg.model.critic_lora:
            critic = add_lora(critic, cfg.model, "TOKEN_CLS", seed=cfg.trainer.seed + 1)
    return Roles(tok, actor, reference, critic, build_reward(cfg, tok, device))


def load_prompts(cfg: Config, path: str, tokenizer) -> PromptDataset:
    return PromptDataset(
        load_records(path),
        tokenizer,
        prompt_key=cfg.data.prompt_key,
        max_prompt_length=cfg.data.max_prompt_length,
        overlong=cfg.data.overlong_prompts,
    )


def load_sft(cfg: Config, path: str | Path, tokenizer, max_length: int) -> SFTDataset:
    return SFTDataset(
        load_records(path),
        tokenizer,
        prompt_key=cfg.data.prompt_key,
        response_key=cfg.data.response_key,
        max_length=max_length,
    )
