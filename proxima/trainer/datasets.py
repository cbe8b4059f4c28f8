"""A run's data from its config: the prompt sets (one file or several, mixed by weight),
the held-out items, the SFT records of the ptx loss."""

from __future__ import annotations

from pathlib import Path

from proxima.config import Config, ConfigError
from proxima.config.sections import set_names
from proxima.data import PromptDataset, SFTDataset, load_records
from proxima.data.mixing import all_items, tag_records
from proxima.trainer.checks import check_enough, with_key


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
