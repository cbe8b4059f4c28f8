"""The checks of a run's inputs before any model loads: the models' folders and their
vocabularies, the token ids the config names, a checkpoint to resume, prompt lengths and
dataset sizes; each error names the key and the fix."""

from __future__ import annotations

import warnings
from pathlib import Path

from proxima.checkpoint import checkpoint_iteration, list_checkpoints, state_problem
from proxima.checkpoint import model_folders as checkpoint_model_folders
from proxima.config import Config, ConfigError
from proxima.config.roles import role_plan
from proxima.models import (
    config_positions,
    config_vocab_size,
    folder_problem,
    has_tokenizer,
    load_tokenizer,
    policy_folder_problem,
    vocabulary_difference,
)
from proxima.models.critic import check_critic
from proxima.models.folders import safetensors_problem


def _id_readers(cfg: Config) -> list[tuple[str, str, str]]:
    """(config key, folder, fix) of every model other than the actor that reads the policy's
    token ids: the critic (GAE runs) and the reference, when they come from another folder,
    and the teacher."""
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
    if roles.has_teacher:
        fix = (
            "on-policy distillation scores the student's sampled tokens by their ids, so "
            "teacher and student must share one tokenizer: distil from a teacher of the "
            "student's family (or a student with the teacher's tokenizer)"
        )
        out.append(("model.teacher_path", roles.teacher_folder, fix))
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


def role_folders(cfg: Config, command: str = "train") -> list[tuple[str, str, bool]]:
    """(config key, folder, needs a tokenizer) of every model folder `command` loads."""
    roles = role_plan(cfg)
    out = [("model.actor_path", cfg.model.actor_path, True)]
    if command == "train":
        if roles.reference_reads_other_folder:
            out.append((roles.reference_key, roles.reference_folder, False))
        if roles.critic_model and roles.critic_key == "model.critic_path":
            out.append((roles.critic_key, roles.critic_folder, False))
        if roles.has_teacher:
            out.append(("model.teacher_path", roles.teacher_folder, False))
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
    for key, folder, tokenizer in role_folders(cfg, command):
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
