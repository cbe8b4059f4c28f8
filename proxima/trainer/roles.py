"""The roles of a run, loaded: the actor (trained), the reference (frozen; under LoRA the
actor with its adapters off), the critic, the reward source and, for on-policy
distillation, the teacher (frozen), as the role plan names them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from proxima.config import Config, ConfigError
from proxima.config.roles import role_plan
from proxima.models import (
    DTYPES,
    describe_model,
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    reward_model_scores,
    score_normalization,
)
from proxima.models.critic import Critic, build_critic
from proxima.models.loading import checkpoint_activations
from proxima.models.lora import AdapterDisabled, add_lora
from proxima.models.packing import packing_problem
from proxima.rewards import (
    FunctionReward,
    ModelReward,
    NoScore,
    WeightedPart,
    WeightedReward,
    load_reward_function,
)
from proxima.trainer.checks import check_models, with_key
from proxima.trainer.device import frozen_dtype


@dataclass
class Roles:
    """The four models of PPO-RLHF (InstructGPT, DeepSpeed-Chat) and the policy's tokenizer.

    `actor` is the module every forward pass of the policy goes through (generation,
    scoring, updates): the actor itself, or the actor with the critic's value head on it
    (`models.critic.PolicyValue`). `critic`: the critic object (`models.critic`), None for
    the critic-free estimators. `teacher`: on-policy distillation's frozen teacher, or
    None."""

    tokenizer: object
    actor: torch.nn.Module
    reference: torch.nn.Module | None
    critic: Critic | None
    reward: object  # callable reward source, see proxima.rewards
    teacher: torch.nn.Module | None = None
    # the passes take packed rows (`model.packing`, resolved by `check_packing`); `unpacked`:
    # why not, when model.packing was unset and a model cannot take them
    packed: bool = False
    unpacked: str = ""

    def report(self) -> str:
        """What each role costs in memory (parameters, trainable, bytes) and where it
        comes from."""
        lines = [_model_line("actor", self.actor), _model_line("reference", self.reference)]
        if self.critic is None:
            lines.append("  critic   : none (a critic-free estimator)")
        elif self.critic.model is None:
            lines.append(f"  critic   : {self.critic.describe()}")
        else:
            lines.append(_model_line("critic", self.critic.model))
            lines.append(f"             {self.critic.describe()}")
        if self.teacher is not None:
            lines.append(_model_line("teacher", self.teacher))
        lines.append(f"  reward   : {self.reward.name}")
        if self.unpacked:
            lines.append(f"  layout   : padded rows (model.packing unset): {self.unpacked}")
        return "\n".join(lines)


def _model_line(name: str, model: torch.nn.Module | None) -> str:
    if model is None:
        return f"  {name:9s}: not loaded"
    if isinstance(model, AdapterDisabled):
        return f"  {name:9s}: {model.describe()}"
    d = describe_model(model)
    train_mib = d["grad_and_adam_bytes"] / 2**20
    return (
        f"  {name:9s}: {d['parameters'] / 1e6:.3f} M params ({d['dtype']}), "
        f"{d['parameter_bytes'] / 2**20:.1f} MiB weights"
        + (f" + {train_mib:.1f} MiB grads and AdamW state" if train_mib else ", frozen")
    )


def build_reward(cfg: Config, tokenizer, device: torch.device, fn=None):
    """The reward source: the function of reward.function (`fn` when already imported), the
    reward model of reward.model_path, or the weighted sum of `reward.sources`
    (`rewards.WeightedReward`; a remote source's server is asked whether it is up); none
    in a multi-turn run whose environment gives every reward, or in on-policy distillation
    alone (`rewards.NoScore`)."""
    plan = role_plan(cfg)
    sources = plan.rewards
    if not sources:
        return NoScore(plan.estimator == "distill")
    if not cfg.reward.sources:  # a single-source key: the source itself, no weighted sum
        if cfg.reward.function:
            fn = fn or with_key("reward.function", load_reward_function, cfg.reward.function)
            return FunctionReward(fn, cfg.reward.function)
        return _model_source(cfg, cfg.reward.model_path, tokenizer, device, cfg.reward.batch_size)
    parts = []
    for i, src in enumerate(sources):
        key = f"reward.sources[{i}].{src.kind}"
        if src.kind == "function":
            loaded = with_key(key, load_reward_function, src.target)
            source = FunctionReward(loaded, src.target, **src.options)
        elif src.kind == "model_path":
            size = src.options.get("batch_size", cfg.reward.batch_size)
            source = _model_source(cfg, src.target, tokenizer, device, size)
        else:
            from proxima.rewards.remote import RemoteReward

            source = RemoteReward(src.target, name=src.name, **src.options)
            source.check()  # a server that is down stops the run here, before any model loads
        parts.append(WeightedPart(src.name, src.weight, source, src.clip, src.normalize))
    return WeightedReward(parts)


def _model_source(cfg: Config, folder: str, tokenizer, device, batch_size: int) -> ModelReward:
    rm = load_reward_model(folder, dtype=frozen_dtype(cfg), device=device)
    return ModelReward(
        rm,
        load_tokenizer(folder),
        tokenizer,
        reward_model_scores,
        device=device,
        batch_size=batch_size,
        name=f"the reward model {folder}",
        normalization=score_normalization(folder),
        max_tokens=cfg.reward.max_tokens_per_micro,
        packed=cfg.model.packing is True,  # unset: `check_packing` turns it on
    )


def load_roles(cfg: Config, device: torch.device, tokenizer=None, reward_fn=None) -> Roles:
    """Actor (trained), reference (frozen), critic (`models.critic.build_critic`), reward
    source. `tokenizer`: the policy's, from `check_models` (a run's set-up passes it);
    without it, the models are checked here first.

    With model.lora_rank > 0 the actor (and a value model, if model.critic_lora) trains LoRA
    adapters. The reference is the one the role plan names (`config.roles`): under LoRA
    the actor with its adapters disabled (no second copy of the weights) unless
    model.reference_path names another model. The teacher (model.teacher_path) loads as
    a frozen reference from a folder does."""
    if tokenizer is None:
        tokenizer = check_models(cfg)
    actor = load_actor(cfg, device)
    reference, plan = None, role_plan(cfg)
    if plan.reference == "adapters off":
        reference = AdapterDisabled(actor)
    elif plan.reference == "folder":
        reference = _frozen(cfg, plan.reference_folder, device)
    teacher = _frozen(cfg, plan.teacher_folder, device) if plan.has_teacher else None
    actor, critic = build_critic(cfg, actor, device)
    if cfg.model.gradient_checkpointing:
        for trained in (actor, critic.model if critic is not None else None):
            if trained is not None:
                checkpoint_activations(trained)
    reward = build_reward(cfg, tokenizer, device, reward_fn)
    roles = Roles(tokenizer, actor, reference, critic, reward, teacher)
    if cfg.model.packing is not False:
        check_packing(roles, required=cfg.model.packing is True)
    return roles


def _reward_models(reward) -> list[ModelReward]:
    """The reward models among the reward sources."""
    parts = reward.parts if isinstance(reward, WeightedReward) else [reward]
    sources = [getattr(part, "source", part) for part in parts]
    return [s for s in sources if isinstance(s, ModelReward)]


def check_packing(roles: Roles, required: bool = True) -> None:
    """`model.packing`: each model a pass packs for must keep packed sequences apart
    (`models.packing.packing_problem`, one small forward each, before any work). Sets
    `roles.packed`; where one does not, `required` (model.packing=true) raises a ConfigError
    naming it and the fix, and otherwise (unset) every pass takes padded rows and
    `roles.unpacked` says why."""
    models = [("the actor", roles.actor, False), ("the reference", roles.reference, False)]
    models.append(("the teacher", roles.teacher, False))
    critic = roles.critic.model if roles.critic is not None else None
    models.append(("the critic", critic, False))
    rewards = _reward_models(roles.reward)
    models += [(source.name, source.model, True) for source in rewards]
    for name, model, scores in models:
        if model is None or isinstance(model, AdapterDisabled):  # the actor's own weights
            continue
        problem = packing_problem(model, scores=scores)
        if problem and required:
            raise ConfigError(
                f"`model.packing=true`, but {name} cannot take packed sequences: {problem}. "
                "Set model.packing=false (padded batches), or load the model with an "
                "attention implementation whose transformers code reads packed position ids."
            )
        if problem:
            roles.unpacked = f"{name} cannot take packed sequences: {problem}"
            return
    roles.packed = True
    for source in rewards:
        source.packed = True


def _frozen(cfg: Config, folder: str, device: torch.device) -> torch.nn.Module:
    """A frozen causal LM (the reference, the teacher) in the frozen roles' dtype."""
    return load_causal_lm(folder, dtype=frozen_dtype(cfg), device=device, trainable=False)


def load_actor(cfg: Config, device: torch.device) -> torch.nn.Module:
    """The policy of model.actor_path (trainable, model.dtype), with its LoRA adapters when
    model.lora_rank > 0."""
    actor = load_causal_lm(
        cfg.model.actor_path, dtype=DTYPES[cfg.model.dtype], device=device, trainable=True
    )
    if cfg.model.lora_rank > 0:
        actor = add_lora(actor, cfg.model, "CAUSAL_LM", seed=cfg.trainer.seed)
    return actor


def load_rollout_roles(cfg: Config, device: torch.device) -> Roles:
    """What a spawned rollout worker process samples and scores with (`trainer.workers`),
    built as `load_roles` builds the trainer's: the policy's tokenizer, the actor module
    (with the critic's value head when it rides on the actor: the engine may read the values
    while generating) and the reward source, on `device`. No reference, no critic model:
    the worker never scores against them; the actor's weights are the trainer's, copied in
    from the shared `WeightBox` before each batch."""
    tokenizer = load_tokenizer(cfg.model.actor_path)
    actor = load_actor(cfg, device)
    if role_plan(cfg).critic_on_actor:
        actor, _ = build_critic(cfg, actor, device)
    return Roles(tokenizer, actor, None, None, build_reward(cfg, tokenizer, device))
