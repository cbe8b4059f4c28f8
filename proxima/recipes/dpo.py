"""`proxima dpo`: Direct Preference Optimization of `model.actor_path` on the preference pairs
`proxima rm` reads (`dpo.train_path`), evaluated on held-out pairs (`dpo.eval_path`) before
and after. The run folder `dpo.out` holds the trained policy as a plain Hugging Face folder
(`actor/`, adapters merged under LoRA, the adapter beside it in `actor_adapter/`), the
per-step metrics (`metrics.jsonl`), `summary.json` and `curves.png`."""

from __future__ import annotations

import json
from pathlib import Path

from proxima import launch
from proxima.config import Config, ConfigError
from proxima.data import load_records
from proxima.data.preferences import PreferenceDataset
from proxima.launch import Interrupted, signum_of
from proxima.logging import RunLogger, plot_metrics, write_atomic
from proxima.models import load_tokenizer
from proxima.models.loading import checkpoint_activations
from proxima.models.saving import save_role
from proxima.recipes.common import process_setup, writable_folder
from proxima.trainer.checks import check_enough, check_model_folders, with_key
from proxima.trainer.dpo import dpo_train, step_units, total_steps
from proxima.trainer.roles import load_actor

PLOT_KEYS = (
    "loss",
    "rewards/accuracies",
    "rewards/margins",
    "rewards/chosen",
    "rewards/rejected",
    "logratio_per_token",
)


def _pairs(cfg: Config, tok, key: str, path: str) -> PreferenceDataset:
    d = cfg.dpo
    opts = {
        "prompt_key": cfg.data.prompt_key,
        "chosen_key": d.chosen_key,
        "rejected_key": d.rejected_key,
        "max_length": d.max_length,
        "overlong": d.overlong,
        "command": "proxima dpo",
    }
    return with_key(key, lambda: PreferenceDataset(load_records(path), tok, **opts))


def _new_run_folder(path: str) -> Path:
    """`dpo.out` as an empty (or new) writable folder: nothing already there is overwritten."""
    out = Path(path)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ConfigError(
            f"`dpo.out`={out} already exists and is not an empty folder; choose a new folder "
            "(--out) or delete that one first."
        )
    return writable_folder(out, "dpo.out")


def _check_scope(cfg: Config) -> None:
    """What `proxima dpo` does not do, said before anything runs rather than ignored."""
    _, world, _ = launch.world()
    if world > 1:
        raise ConfigError(
            "`proxima dpo` runs in one process (each of several would train its own copy and "
            "write the same folder): run it without torchrun."
        )
    if cfg.model.reference_path:
        raise ConfigError(
            f"`model.reference_path`={cfg.model.reference_path}: the reference of `proxima "
            "dpo` is the policy it starts from, model.actor_path; unset model.reference_path "
            "(or start DPO from that model)."
        )


def _inputs(cfg: Config):
    """Every input checked and read before the model loads: the run folder, the model
    folder, the tokenizer, the pairs (each error named by its key)."""
    d = cfg.dpo
    _check_scope(cfg)
    out = _new_run_folder(d.out)
    check_model_folders(cfg, "dpo")
    tok = load_tokenizer(cfg.model.actor_path)
    train = _pairs(cfg, tok, "dpo.train_path", d.train_path)
    held = _pairs(cfg, tok, "dpo.eval_path", d.eval_path) if d.eval_path else None
    units = step_units(train, d)
    if d.group_by_prompt and len(units) < d.batch_size:
        raise ConfigError(
            f"`dpo.train_path` holds pairs of {len(units)} prompts, fewer than one batch of "
            f"`dpo.batch_size`={d.batch_size} prompts (dpo.group_by_prompt); lower "
            "`dpo.batch_size` or add prompts."
        )
    check_enough(units, d.batch_size, "dpo.batch_size", "dpo.train_path")
    return out, tok, train, held, len(units)


def dpo(cfg: Config) -> dict:
    """Train and save; returns the summary written to summary.json."""
    d = cfg.dpo
    out, tok, train, held, units = _inputs(cfg)
    device = process_setup(cfg)
    model = load_actor(cfg, device)  # with LoRA adapters when model.lora_rank > 0
    if cfg.model.gradient_checkpointing:
        checkpoint_activations(model)
    steps = total_steps(units, d)
    batch = f"{d.batch_size} prompts with all their pairs" if d.group_by_prompt else None
    print(
        f"dpo: {len(train)} pairs ({train.num_dropped} dropped as too long), {d.epochs} "
        f"epoch(s) of {steps // d.epochs} steps{f' of {batch}' if batch else ''}; loss "
        f"{d.loss_type}, beta {d.beta}; the reference is the starting policy, its log-probs "
        "computed once per response"
    )
    try:
        with RunLogger(out, tensorboard=False) as logger:
            opts = {"seed": cfg.trainer.seed, "eval_dataset": held, "device": device}
            res = dpo_train(model, tok, train, d, log=logger.log, **opts)
    except KeyboardInterrupt as err:
        raise Interrupted(
            f"DPO interrupted ({str(err) or 'Ctrl-C'}): {out} holds the metrics so far, the "
            "policy is saved only at the end",
            signum_of(err),
        ) from None
    save_role(model, tok, out, "actor")
    summary = {"config": cfg.to_dict(), "pairs": len(train), "dropped": train.num_dropped}
    summary.update(eval_pairs=len(held) if held else 0, **res)
    write_atomic(out / "summary.json", json.dumps(summary, indent=2))
    plot_metrics(out / "metrics.jsonl", out / "curves.png", PLOT_KEYS)
    _report(res, out)
    return summary


def _report(res: dict, out: Path) -> None:
    for name in ("train", "eval"):
        if f"{name}_after" in res:
            before, after = res[f"{name}_before"], res[f"{name}_after"]
            print(
                f"{name} pairs, implicit-reward accuracy: before "
                f"{before['rewards/accuracies']:.4f} -> after {after['rewards/accuracies']:.4f} "
                f"(mean margin {after['rewards/margins']:.4f}, log-ratio to the reference "
                f"{after['logratio_per_token']:.4f} per chosen token, {after['n']} pairs)"
            )
    print(f"dpo: {res['steps']} steps; the policy is saved to {out / 'actor'}")
