"""Builds what a run needs from its config: device, the four roles, data, reward source."""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from proxima.checkpoint import checkpoint_iteration, list_checkpoints, state_problem
from proxima.checkpoint import model_folders as checkpoint_model_folders
from proxima.config import Config, ConfigError
from proxima.config.roles import role_plan
from proxima.config.run import run_plan
from proxima.config.sections import set_names
from proxima.data import PromptDataset, SFTDataset, load_records
from proxima.data.mixing import all_items, tag_records
from proxima.models import (
    DTYPES,
    config_positions,
    config_vocab_size,
    describe_model,
    folder_problem,
    has_tokenizer,
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    policy_folder_problem,
    reward_model_scores,
    score_normalization,
    vocabulary_difference,
)
from proxima.models.critic import Critic, build_critic, check_critic
from proxima.models.folders import safetensors_problem
from proxima.models.loading import checkpoint_activations, generation_config
from proxima.models.lora import AdapterDisabled, add_lora
from proxima.rewards import (
    FunctionReward,
    ModelReward,
    NoScore,
    WeightedPart,
    WeightedReward,
    load_reward_function,
)
from proxima.rollout.agent import check_agent
from proxima.rollout.engines import engine_class
from proxima.rollout.environments import check_env
from proxima.rollout.plan import ScoringPlan, plan_scoring


def frozen_dtype(cfg: Config) -> torch.dtype:
    """Dtype of the frozen roles (reference, reward model): bfloat16 under mixed precision
    (autocast computes in it anyway; half the memory), else model.dtype."""
    return torch.bfloat16 if cfg.model.mixed_precision == "bf16" else DTYPES[cfg.model.dtype]


def autocast(cfg: Config, device: torch.device):
    """The context of every forward pass (generation with the hf engine, scoring, reward
    model, updates, evaluation): bfloat16 autocast under model.mixed_precision=bf16, with
    the weights and optimizer state staying float32; else nothing."""
    if cfg.model.mixed_precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def resolve_device(name: str, local_rank: int = 0, key: str = "model.device") -> torch.device:
    """`model.device` (or the config `key` that names it): auto (CUDA when visible), cpu,
    cuda or cuda:N. Under torchrun, `cuda` and auto mean this process's GPU, cuda:LOCAL_RANK."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:  # not a device string torch knows
        device = None
    mps = device is not None and device.type == "mps" and torch.backends.mps.is_available()
    if device is None or (device.type not in ("cpu", "cuda") and not mps):
        raise ValueError(
            f"`{key}`={name} is not a device this machine has for proxima: use "
            "auto (CUDA when visible, else the CPU), cpu, cuda or cuda:N."
        )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"`{key}`={name} but no CUDA device is visible. Use {key}=cpu (or auto).")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    return device


@dataclass
class Roles:
    """The four models of PPO-RLHF (InstructGPT, DeepSpeed-Chat) and the policy's tokenizer.

    `actor` is the module every forward pass of the policy goes through (generation,
    scoring, updates): the actor itself, or the actor with the critic's value head on it
    (`models.critic.PolicyValue`). `critic`: the critic object (`models.critic`), None for
    the critic-free estimators."""

    tokenizer: object
    actor: torch.nn.Module
    reference: torch.nn.Module | None
    critic: Critic | None
    reward: object  # callable reward source, see proxima.rewards

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
        lines.append(f"  reward   : {self.reward.name}")
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
    in a multi-turn run whose environment gives every reward (`rewards.NoScore`)."""
    sources = role_plan(cfg).rewards
    if not sources:
        return NoScore()
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
    )


def _id_readers(cfg: Config) -> list[tuple[str, str, str]]:
    """(config key, folder, fix) of every model other than the actor that reads the policy's
    token ids: the critic (GAE runs) and the reference, when they come from another folder."""
    roles, out = role_plan(cfg), []
    if roles.critic_reads_other_folder:
        fix = "point it at a model with the policy's tokenizer, or leave it empty"
        key = roles.critic_key
        if key != "model.critic_path":  # the first reward model
            fix = (
                "a reward source may keep its own tokenizer (its text is re-tokenized) but the "
                "critic reads the policy's ids: start the critic from the actor "
                "(model.critic_init=actor) or train the reward model from the policy "
                "(`proxima rm --model <model.actor_path>`)"
            )
            key += " (reward.model_path)"
        out.append((key, roles.critic_folder, fix))
    if roles.reference_reads_other_folder:
        fix = "point it at a model with the policy's tokenizer, or leave it empty"
        out.append((roles.reference_key, roles.reference_folder, fix))
    return out


def check_vocabularies(cfg: Config, tokenizer) -> None:
    """The critic and the reference read the policy's token ids through their own embedding
    tables: a model whose tokenizer numbers tokens otherwise would read other tokens, silently.
    Checked on the tokenizer files (every token -> id alike), before any model loads; a
    folder without a tokenizer is checked on its config's vocab_size against the actor's."""
    for key, folder, fix in _id_readers(cfg):
        if has_tokenizer(folder):
            why = vocabulary_difference(tokenizer, load_tokenizer(folder))
        else:
            theirs, mine = config_vocab_size(folder), config_vocab_size(cfg.model.actor_path)
            why = (
                f"an embedding table of {theirs} rows, the actor's {mine}"
                if theirs != mine
                else None
            )
        if why:
            raise ConfigError(
                f"`{key}`: {folder} has another vocabulary than the policy "
                f"(model.actor_path={cfg.model.actor_path}): {why}. That model would read the "
                f"policy's token ids as other tokens. Fix: {fix}."
            )


def model_folders(cfg: Config, command: str = "train") -> list[tuple[str, str, bool]]:
    """(config key, folder, needs a tokenizer) of every model folder `command` loads."""
    roles = role_plan(cfg)
    out = [("model.actor_path", cfg.model.actor_path, True)]
    if command == "train":
        if roles.reference_reads_other_folder:
            out.append((roles.reference_key, roles.reference_folder, False))
        if roles.critic_model and roles.critic_key == "model.critic_path":
            out.append((roles.critic_key, roles.critic_folder, False))
    if command in ("train", "eval"):
        for i, src in enumerate(roles.rewards):
            if src.kind == "model_path":
                key = (
                    f"reward.sources[{i}].model_path" if cfg.reward.sources else "reward.model_path"
                )
                out.append((key, src.target, True))
    return out


def check_model_folders(cfg: Config, command: str = "train") -> None:
    """Every model folder the command loads holds config.json, readable weights (a truncated
    safetensors file is caught from its header) and, where needed, tokenizer files; checked
    from the files, before anything is loaded or written."""
    for key, folder, tokenizer in model_folders(cfg, command):
        if key == "model.actor_path":  # a run folder or a reward model is no policy
            problem = policy_folder_problem(folder)
            if problem:
                raise ConfigError(f"`{key}`: {folder} {problem}.")
        problem = folder_problem(folder, tokenizer=tokenizer)
        if problem:
            raise ConfigError(
                f"`{key}`: {folder} {problem}. Point `{key}` at a Hugging Face model folder "
                "(config.json, weights and tokenizer files, as save_pretrained writes them), "
                "or build a tiny one with `proxima init-model --out DIR --alphabet CHARS`."
            )


def with_key(key: str, fn, *args, **kwargs):
    """fn(*args, **kwargs), with a data or reward error's message prefixed by its config key."""
    try:
        return fn(*args, **kwargs)
    except (ValueError, OSError) as err:
        if isinstance(err, ConfigError) or str(err).startswith(f"`{key}`"):
            raise
        try:
            named = type(err)(f"`{key}`: {err}")
        except TypeError:  # an error type with more arguments (UnicodeDecodeError, ...)
            named = ValueError(f"`{key}`: {err}")
        raise named from err


def check_enough(data, batch_size: int, size_key: str, data_key: str) -> None:
    """A data set must fill one batch (the loaders drop an incomplete last batch)."""
    if len(data) < batch_size:
        raise ConfigError(
            f"`{data_key}` holds {len(data)} usable records, fewer than one batch of "
            f"`{size_key}`={batch_size}; lower `{size_key}` or add records."
        )


def load_prompt_sets(cfg: Config, key: str, tokenizer) -> dict[str | None, PromptDataset]:
    """The prompt files of `key` (data.train_path or data.eval_path) by set name: {None:
    the set} for one file; for several, each named by its file (`set_names`) and each of
    its records given that name in its `dataset` column."""
    files = cfg.data.train_files() if key == "data.train_path" else cfg.data.eval_files()
    if len(files) == 1:
        return {None: with_key(key, load_prompts, cfg, files[0], tokenizer)}
    try:
        names = set_names(files)
    except ValueError as err:
        raise ConfigError(f"`{key}`: {err}") from None
    return {
        name: with_key(f"{key}` file `{path}", load_prompts, cfg, path, tokenizer, dataset=name)
        for name, path in zip(names, files, strict=True)
    }


def held_out_items(cfg: Config, tokenizer) -> list:
    """The prompts of `data.eval_path`, at most `eval.max_prompts` of each file."""
    limit = cfg.eval.max_prompts or None
    sets = load_prompt_sets(cfg, "data.eval_path", tokenizer)
    return [item for s in sets.values() for item in s.items[:limit]]


def load_data(cfg: Config, tokenizer) -> tuple:
    """Training prompts (one set, or {name: set} for several files), held-out evaluation
    prompts (maybe none), ptx records (maybe none), each error named by its config key; a
    prompt set smaller than one batch is refused."""
    sets = load_prompt_sets(cfg, "data.train_path", tokenizer)
    prompts = sets[None] if None in sets else sets
    size = cfg.data.train_batch_size  # several sets: all of them together fill a batch
    check_enough(all_items(prompts), size, "data.train_batch_size", "data.train_path")
    eval_items = held_out_items(cfg, tokenizer) if cfg.data.eval_files() else []
    sft = None
    if cfg.actor.ptx_coef:
        max_len = cfg.data.max_prompt_length + cfg.rollout.max_response_length
        sft = with_key("data.sft_path", load_sft, cfg, cfg.data.sft_path, tokenizer, max_len)
        micro = cfg.actor.ppo_micro_batch_size
        check_enough(sft, micro, "actor.ppo_micro_batch_size", "data.sft_path")
    return prompts, eval_items, sft


@dataclass
class RunInputs:
    """What a PPO run reads besides its models, checked and loaded before a run folder is
    created or any model is loaded (a failed start leaves nothing behind)."""

    tokenizer: object
    prompts: PromptDataset
    eval_items: list
    sft: SFTDataset | None
    reward_fn: object | None  # the imported reward.function, or None for a reward model
    plan: ScoringPlan


def check_models(cfg: Config):
    """The model folders a PPO run loads (files, weights, tokenizers), the vocabularies the
    other models share with the policy and the critic's options, checked from the files
    before any model loads; returns the policy's tokenizer."""
    check_critic(cfg)
    check_model_folders(cfg)
    tokenizer = load_tokenizer(cfg.model.actor_path)
    check_token_ids(tokenizer, cfg.model.actor_path, "model.actor_path")
    check_vocabularies(cfg, tokenizer)
    return tokenizer


class VocabularyGapWarning(UserWarning):
    """The model's embedding table has many more rows than its tokenizer has tokens."""


def check_token_ids(tokenizer, folder: str, key: str) -> None:
    """Every id the tokenizer can produce must have a row in the model's embedding table
    (else the forward pass indexes past it); read from config.json, before loading. A
    table far larger than the tokenizer (a few hundred rows of padding are common) is
    warned about: the policy can sample ids that no token stands for."""
    rows, size = config_vocab_size(folder), len(tokenizer)
    if rows is not None and size < 0.9 * rows:
        warnings.warn(
            VocabularyGapWarning(
                f"`{key}`: the tokenizer in {folder} has {size} tokens for {rows} embedding "
                f"rows: the policy can sample {rows - size} ids that decode to no text. Is it "
                "the tokenizer the model was trained with?"
            ),
            stacklevel=2,
        )
    if rows is not None and size > rows:
        raise ConfigError(
            f"`{key}`: the tokenizer in {folder} has {size} tokens but the model's embedding "
            f"table has {rows} rows (vocab_size): ids {rows} to {size - 1} would index past "
            "it. Fix: use the tokenizer the model was trained with, or resize the model's "
            "embeddings to the tokenizer (model.resize_token_embeddings(len(tokenizer)), "
            "then save_pretrained) and fine-tune them."
        )


def check_checkpoint(folder: Path) -> None:
    """A checkpoint to resume from is whole: every model folder's safetensors (from their
    headers) and state.pt (its zip directory), checked before anything loads or is written.
    A damaged one is named with the newest intact checkpoint before it."""
    problems = [state_problem(folder)] + [
        safetensors_problem(file)
        for name in checkpoint_model_folders(folder)
        for file in sorted((folder / name).glob("*.safetensors"))
    ]
    problems = [p for p in problems if p]
    if not problems:
        return
    earlier = [c for c in list_checkpoints(folder.parent) if c.name != folder.name]
    intact = [c for c in earlier if checkpoint_iteration(c) < checkpoint_iteration(folder)]
    offer = (
        f" The checkpoint {intact[-1]} is older: resume from it with "
        f"trainer.resume_from={intact[-1]}."
        if intact
        else ""
    )
    raise ConfigError(
        f"`trainer.resume_from`: the checkpoint {folder} is damaged: {problems[0]}.{offer}"
    )


def check_lengths(cfg: Config, *prompt_sets) -> None:
    """The longest prompt plus rollout.max_response_length (rollout.env.max_episode_tokens in
    multi-turn episodes) must fit the actor's positions (max_position_embeddings: a GPT-2
    indexes past its position table, vLLM refuses the length): checked on the data, for
    every engine alike, before any model loads."""
    positions = config_positions(cfg.model.actor_path)
    longest = max((len(item.ids) for items in prompt_sets for item in items), default=0)
    key, after = cfg.rollout.after_prompt_key, cfg.rollout.after_prompt_tokens
    need = longest + after
    if positions is not None and need > positions:
        raise ConfigError(
            f"the longest prompt ({longest} tokens) + `rollout.{key}`="
            f"{after} = {need} positions exceed the "
            f"{positions} of `model.actor_path` (its max_position_embeddings). Fix: lower "
            f"rollout.{key}, or shorten the prompts (`data.max_prompt_length` "
            "with data.overlong_prompts=truncate or drop)."
        )


def prepare_inputs(cfg: Config) -> RunInputs:
    """Everything a PPO run is checked for before a model loads: the models' folders and
    vocabularies, the scoring plan, the environment of multi-turn episodes, the data, the
    reward function."""
    tok = check_models(cfg)
    check_rollout_devices(cfg)
    check_env(cfg)
    check_agent(cfg)
    engine = engine_class(cfg.rollout.name)
    plan = plan_scoring(cfg, engine, generation_config(cfg.model.actor_path))
    prompts, eval_items, sft = load_data(cfg, tok)
    check_lengths(cfg, all_items(prompts), eval_items)
    fn = None
    if cfg.reward.function:
        fn = with_key("reward.function", load_reward_function, cfg.reward.function)
    return RunInputs(tok, prompts, eval_items, sft, fn, plan)


def load_roles(cfg: Config, device: torch.device, tokenizer=None, reward_fn=None) -> Roles:
    """Actor (trained), reference (frozen), critic (`models.critic.build_critic`), reward
    source. `tokenizer`: the policy's, from `check_models` (a run's set-up passes it);
    without it, the models are checked here first.

    With model.lora_rank > 0 the actor (and a value model, if model.critic_lora) trains LoRA
    adapters. The reference is the one the role plan names (`config.roles`): under LoRA
    the actor with its adapters disabled (no second copy of the weights) unless
    model.reference_path names another model."""
    if tokenizer is None:
        tokenizer = check_models(cfg)
    actor = load_actor(cfg, device)
    reference, plan = None, role_plan(cfg)
    if plan.reference == "adapters off":
        reference = AdapterDisabled(actor)
    elif plan.reference == "folder":
        reference = load_causal_lm(
            plan.reference_folder, dtype=frozen_dtype(cfg), device=device, trainable=False
        )
    actor, critic = build_critic(cfg, actor, device)
    if cfg.model.gradient_checkpointing:
        for trained in (actor, critic.model if critic is not None else None):
            if trained is not None:
                checkpoint_activations(trained)
    reward = build_reward(cfg, tokenizer, device, reward_fn)
    return Roles(tokenizer, actor, reference, critic, reward)


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


def check_rollout_devices(cfg: Config) -> None:
    """`rollout.devices` (rollout workers spawned onto them) exist on this machine: checked
    at start-up, before any model loads."""
    if not run_plan(cfg).workers:
        return
    count = torch.cuda.device_count()
    for name in cfg.rollout.devices:
        device = torch.device(name)
        if device.type == "cuda" and (device.index or 0) >= count:
            seen = f"{count} CUDA device(s): cuda:0 to cuda:{count - 1}" if count else "none"
            raise ConfigError(
                f"`rollout.devices` names {name}, but this machine has {seen}. Fix: list the "
                "devices that exist (CUDA_VISIBLE_DEVICES renumbers them from 0), or leave "
                "rollout.devices empty: the workers share the trainer's device."
            )


def load_prompts(cfg: Config, path: str, tokenizer, dataset: str | None = None) -> PromptDataset:
    """The prompt file `path`; `dataset`: the name of its set, put in a `dataset` column."""
    records = load_records(path)
    return PromptDataset(
        tag_records(records, dataset) if dataset else records,
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
        overlong=cfg.data.overlong_prompts,
    )
