"""Self-describing checkpoints and exact resume (USERS.md #5).

A checkpoint folder holds everything a run needs to continue as if it had never stopped::

    actor/           Hugging Face folder (weights + tokenizer), loadable on its own
    critic/          the same for the value model (GAE runs; USERS.md #8)
    actor_adapter/   LoRA runs only: the peft adapters (and critic_adapter/); actor/ and
                     critic/ then hold the merged models, and resume loads the adapters
                     onto the base model of model.actor_path, which never changes
    state.pt         iteration, optimizer and scheduler states, KL coefficient, prompt
                     loader positions, the mini-batch shuffle generator, torch / numpy /
                     python RNG states and the resolved config
    checkpoint.json  the human-readable part: iteration, config, time, proxima version

A folder is written under a temporary name and renamed once complete, so a crash never
leaves a half checkpoint under a real name. Resuming with the same config replays exactly
the iterations an uninterrupted run would have done (same prompts, samples, shuffles and
optimizer steps), because every source of randomness and every counter is restored.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file

from proxima.config import Config, ConfigError, OptimConfig
from proxima.models.lora import is_lora, load_adapter_weights, save_role

STATE_FILE = "state.pt"
META_FILE = "checkpoint.json"
FORMAT_VERSION = 1
CONTENTS = (
    "actor/, critic/ (GAE runs), actor_adapter/ and critic_adapter/ (LoRA runs), state.pt "
    "and checkpoint.json"
)

# Keys whose change makes the saved state mean something else: batch shapes and optimizer
# steps per iteration (scheduler position, loader position), which models exist and where
# they come from (the reference must stay the ORIGINAL initial policy), the prompt order.
# Every other key (learning rates, clip ranges, trainer.iterations, ...) may change.
RESUME_KEYS = (
    "task.name",
    "model.actor_path",
    "model.reference_path",
    "model.critic_init",
    "model.dtype",
    "model.lora_rank",
    "model.lora_alpha",
    "model.lora_target_modules",
    "model.critic_lora",
    "data.train_path",
    "data.prompt_key",
    "data.train_batch_size",
    "rollout.n",
    "algorithm.adv_estimator",
    "algorithm.kl_ctrl.type",
    "actor.ppo_epochs",
    "actor.ppo_mini_batch_size",
    "critic.ppo_epochs",
    "critic.ppo_mini_batch_size",
    "trainer.seed",
)
# A built-in task fills these itself; a resumed task run takes them from the checkpoint
# instead of preparing the task (and its SFT) again.
TASK_PATHS = ("model.actor_path", "data.train_path", "data.eval_path")


# --------------------------------------------------------------------------- RNG


def rng_state() -> dict[str, Any]:
    """torch (CPU + CUDA), numpy and python RNG states, in types `torch.load` accepts with
    weights_only=True (numpy's key array becomes a tensor)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
        "numpy": {
            "name": name,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached),
        },
        "python": random.getstate(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    n = state["numpy"]
    keys = n["keys"].numpy().astype(np.uint32)
    np.random.set_state((n["name"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))


@contextmanager
def preserve_rng() -> Iterator[None]:
    """Run a block (e.g. an evaluation) without shifting any global random stream."""
    saved = rng_state()
    try:
        yield
    finally:
        set_rng_state(saved)


# --------------------------------------------------------------------------- saving


def _trainer_state(trainer) -> dict[str, Any]:
    actor_opt, actor_sched = trainer.actor_opt
    critic = trainer.critic_opt
    return {
        "format_version": FORMAT_VERSION,
        "iteration": int(trainer.iteration),
        "actor_optimizer": actor_opt.state_dict(),
        "actor_scheduler": actor_sched.state_dict(),
        "critic_optimizer": critic[0].state_dict() if critic is not None else None,
        "critic_scheduler": critic[1].state_dict() if critic is not None else None,
        "kl_coef": float(trainer.kl_ctl.value),
        "score_moments": trainer.score_moments.state_dict(),
        "loader": trainer.loader.state_dict(),
        "sft_loader": trainer.sft_loader.state_dict() if trainer.sft_loader else None,
        "generator": trainer.generator.get_state(),
        "rng": rng_state(),
        "config": trainer.cfg.to_dict(),
    }


def proxima_version() -> str:
    try:
        return metadata.version("proxima")
    except metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


def _write(folder: Path, trainer, extra: dict) -> None:
    folder.mkdir(parents=True)
    roles = trainer.roles
    for name in ("actor", "critic"):
        model = getattr(roles, name)
        if model is not None:
            save_role(model, roles.tokenizer, folder, name)
    state = _trainer_state(trainer)
    torch.save({**state, "extra": extra}, folder / STATE_FILE)
    meta = {
        "iteration": state["iteration"],
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "proxima_version": proxima_version(),
        "format_version": FORMAT_VERSION,
        "contents": CONTENTS,
        "extra": extra,
        "config": state["config"],
    }
    (folder / META_FILE).write_text(json.dumps(meta, indent=2, default=str))


def save_checkpoint(folder: str | Path, trainer, extra: dict | None = None) -> Path:
    """Write a complete checkpoint of `trainer` to `folder` (which must not exist yet).

    Everything goes to a hidden sibling `.NAME.tmp-PID` first, renamed to `folder` only
    when complete; on any error the temporary folder is removed and nothing else changes.
    `extra` (JSON-friendly) is stored in state.pt and checkpoint.json.
    """
    folder = Path(folder)
    if folder.exists():
        raise FileExistsError(
            f"checkpoint folder {folder} already exists and was left untouched; "
            "save to a new folder (or delete that one first)."
        )
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)  # a leftover of an earlier crash of this pid
    try:
        _write(tmp, trainer, dict(extra or {}))
        tmp.rename(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return folder


def list_checkpoints(folder: str | Path) -> list[Path]:
    """Complete `iter_N` checkpoints in `folder`, oldest first (temporary folders skipped)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    found = []
    for child in folder.iterdir():
        match = re.fullmatch(r"iter_(\d+)", child.name)
        if match and (child / STATE_FILE).is_file() and (child / META_FILE).is_file():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def save_periodic(trainer, run_dir: str | Path, keep: int, extra: dict | None = None) -> Path:
    """Checkpoint to run_dir/checkpoints/iter_N, then delete all but the newest `keep`
    (0 = keep all). Old ones go only after the new one is complete."""
    root = Path(run_dir) / "checkpoints"
    folder = save_checkpoint(root / f"iter_{trainer.iteration}", trainer, extra)
    if keep > 0:
        for old in list_checkpoints(root)[:-keep]:
            shutil.rmtree(old)
    return folder


# --------------------------------------------------------------------------- finding


def find_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder as is, or a run folder's latest checkpoints/iter_N."""
    path = Path(path)
    if (path / STATE_FILE).is_file() and (path / META_FILE).is_file():
        return path
    found = list_checkpoints(path / "checkpoints")
    if found:
        return found[-1]
    what = "does not exist" if not path.exists() else "is not a checkpoint"
    raise FileNotFoundError(
        f"checkpoint {path} {what}: a proxima checkpoint folder holds {CONTENTS} "
        "(written to <run folder>/checkpoints/iter_N by trainer.save_every and at the end "
        "of a run). Point trainer.resume_from at such a folder, or at a run folder that "
        "has a checkpoints/ subfolder."
    )


def read_meta(folder: str | Path) -> dict[str, Any]:
    """checkpoint.json of a checkpoint folder (iteration, config, time, version)."""
    return json.loads((find_checkpoint(folder) / META_FILE).read_text())


# --------------------------------------------------------------------------- config checks


def _flatten(tree: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def config_differences(saved: dict, cfg: Config) -> dict[str, tuple[Any, Any]]:
    """{dotted key: (checkpoint value, current value)} for every key that differs. A key
    that a checkpoint of an older proxima lacks counts as its default (e.g. model.lora_rank
    0: that checkpoint was full fine-tuning)."""
    old = {**_flatten(Config().to_dict()), **_flatten(saved)}
    new = _flatten(cfg.to_dict())
    return {k: (old.get(k), new[k]) for k in new if old.get(k) != new[k]}


def check_config(saved: dict, cfg: Config, folder: str | Path) -> None:
    """Raise ValueError listing the RESUME_KEYS on which `cfg` and the checkpoint differ."""
    diff = config_differences(saved, cfg)
    bad = {k: v for k, v in diff.items() if k in RESUME_KEYS}
    if not bad:
        return
    listed = "; ".join(f"{k}: checkpoint {a!r}, this run {b!r}" for k, (a, b) in bad.items())
    hint = (
        " (model.actor_path must stay the ORIGINAL initial policy: it is the reference; the "
        "trained actor comes from the checkpoint itself)"
        if "model.actor_path" in bad
        else ""
    )
    raise ValueError(
        f"cannot resume from {folder}: the config differs in keys that change batch shapes "
        f"or what the saved state means: {listed}{hint}. Resume with the checkpoint's values "
        f"(its full config is in {Path(folder) / META_FILE}), or start a new run."
    )


def resume_point(cfg: Config) -> Path | None:
    """Checks of the checkpoint settings, before anything is written. With
    trainer.resume_from: returns the checkpoint folder, after filling a task run's paths
    from the checkpoint's config (the task is not prepared again) and checking that the
    config still fits and that iterations remain to be trained."""
    t = cfg.trainer
    for key in ("save_every", "keep_checkpoints"):
        if getattr(t, key) < 0:
            raise ConfigError(f"`trainer.{key}` must be >= 0, got {getattr(t, key)}.")
    if not t.resume_from:
        return None
    folder = find_checkpoint(t.resume_from)
    meta = read_meta(folder)
    saved = _flatten(meta["config"])
    if cfg.task.name:
        for key in TASK_PATHS:
            section, name = key.split(".")
            setattr(getattr(cfg, section), name, saved.get(key, ""))
        if not cfg.reward.function and not cfg.reward.model_path:
            cfg.reward.function = saved.get("reward.function", "")
            cfg.reward.model_path = saved.get("reward.model_path", "")
    check_config(meta["config"], cfg, folder)
    done = int(meta["iteration"])
    if t.iterations <= done:
        raise ValueError(
            f"nothing to do: checkpoint {folder} is at iteration {done} and "
            f"trainer.iterations={t.iterations}. Raise trainer.iterations above {done} "
            f"(e.g. trainer.iterations={done + max(1, t.save_every or done)}) to train more."
        )
    changed = {
        k: v
        for k, v in config_differences(meta["config"], cfg).items()
        if k not in ("trainer.resume_from", "trainer.output_dir")
    }
    if changed:
        print(
            "resume: changed since the checkpoint: "
            + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items())
        )
    return folder


# --------------------------------------------------------------------------- loading


def _saved_names(model: torch.nn.Module) -> dict[str, str]:
    """{name in the saved file: name in model.state_dict()}.

    transformers 5's save_pretrained writes some weights under the hub's names (e.g.
    GPT-NeoX's `lm_head` as `embed_out`); the same reversal it applies, run on the live
    state dict, maps each saved name back to the tensor (same storage) it came from.
    """
    own = model.state_dict()
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4.x saves state_dict names unchanged
        return {k: k for k in own}
    by_storage = {(v.data_ptr(), tuple(v.shape)): k for k, v in own.items()}
    names = {}
    for saved, tensor in revert_weight_conversion(model, dict(own)).items():
        key = by_storage.get((tensor.data_ptr(), tuple(tensor.shape)))
        if key is not None:
            names[saved] = key
    return names


def _load_weights(model: torch.nn.Module, folder: Path, role: str) -> None:
    """Copy the safetensors of a saved HF folder into an already-built model, in place.

    Weights tied to another (a tied LM head) are not saved separately; they are accepted
    as missing when they share storage with a loaded tensor.
    """
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{folder} holds no *.safetensors weights of the {role}: the checkpoint is "
            f"incomplete (it should hold {CONTENTS}). Resume from another checkpoint."
        )
    names = _saved_names(model)
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update({names.get(k, k): v for k, v in load_file(f).items()})
    own = model.state_dict()
    loaded_ptrs = {own[k].data_ptr() for k in weights if k in own}
    missing = sorted(k for k in own.keys() - weights.keys() if own[k].data_ptr() not in loaded_ptrs)
    unexpected = sorted(weights.keys() - own.keys())
    if missing or unexpected:
        raise ValueError(
            f"the {role} weights in {folder} do not fit this run's {role} (missing "
            f"{missing[:5]}, unexpected {unexpected[:5]}): resume with the model.* settings "
            "the checkpoint was written with."
        )
    model.load_state_dict(weights, strict=False)


def _load_role(model: torch.nn.Module, folder: Path, role: str) -> None:
    """Weights of a role in place: a LoRA role from its adapter folder (the merged folder
    cannot be split back into base + adapter exactly), any other from its HF folder."""
    if is_lora(model):
        load_adapter_weights(model, folder / f"{role}_adapter", role)
    else:
        _load_weights(model, folder / role, role)


def _load_optimizer(pair, opt_state: dict, sched_state: dict, ocfg: OptimConfig) -> None:
    """Restore optimizer + scheduler, then apply the current config's hyper-parameters (a
    resumed run may lower the lr); with the saved config this rewrites identical values,
    lr = base_lr * factor(step) exactly as LambdaLR computes it."""
    opt, sched = pair
    opt.load_state_dict(opt_state)
    sched.load_state_dict(sched_state)
    for group, factor in zip(opt.param_groups, sched.lr_lambdas, strict=True):
        group.update(
            betas=tuple(ocfg.betas),
            eps=ocfg.eps,
            weight_decay=ocfg.weight_decay,
            initial_lr=ocfg.lr,
            lr=ocfg.lr * factor(sched.last_epoch),
        )
    sched.base_lrs = [ocfg.lr for _ in opt.param_groups]
    sched._last_lr = [group["lr"] for group in opt.param_groups]


def load_checkpoint(folder: str | Path, trainer) -> dict[str, Any]:
    """Restore a checkpoint (or a run folder's latest) into an already-built trainer:
    weights in place, optimizers, schedulers, KL coefficient (adaptive controller; a fixed
    one keeps the config's value), loaders, generator, RNG, iteration. Returns state.pt."""
    folder = find_checkpoint(folder)
    state = torch.load(folder / STATE_FILE, map_location="cpu", weights_only=True)
    check_config(state["config"], trainer.cfg, folder)
    cfg, roles = trainer.cfg, trainer.roles
    _load_role(roles.actor, folder, "actor")
    _load_optimizer(
        trainer.actor_opt, state["actor_optimizer"], state["actor_scheduler"], cfg.actor.optim
    )
    if trainer.critic_opt is not None:
        _load_role(roles.critic, folder, "critic")
        _load_optimizer(
            trainer.critic_opt,
            state["critic_optimizer"],
            state["critic_scheduler"],
            cfg.critic.optim,
        )
    if cfg.algorithm.kl_ctrl.type == "adaptive":
        trainer.kl_ctl.value = float(state["kl_coef"])
    trainer.score_moments.load_state_dict(state["score_moments"])
    trainer.loader.load_state_dict(state["loader"])
    if trainer.sft_loader is not None and state["sft_loader"] is not None:
        trainer.sft_loader.load_state_dict(state["sft_loader"])
    trainer.generator.set_state(state["generator"])
    set_rng_state(state["rng"])
    trainer.iteration = int(state["iteration"])
    return state
