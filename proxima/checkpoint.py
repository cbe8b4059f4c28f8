"""Self-describing checkpoints and exact resume: the folder format only.

A checkpoint folder holds everything a run needs to continue as if it had never stopped::

    actor/           Hugging Face folder (weights + tokenizer), loadable on its own
    critic/ ...      the critic's folder(s) (`models.critic.save_module`), kept rather than
                     thrown away: a value model's HF folder, or a value head on the actor's
    actor_adapter/   LoRA runs only: the peft adapters (and critic_adapter/); actor/ and
                     critic/ then hold the merged models, and resume loads the adapters
                     onto the base model of model.actor_path, which never changes
    state.pt         the trainer's `state_dict()` (iteration, optimizer and scheduler
                     states, KL coefficient, loader positions, generators, RNG states...)
                     and the resolved config
    checkpoint.json  the human-readable part: iteration, config, time, proxima version

The trainer says what its state is (`state_dict()` / `load_state_dict()`, `save_models()` /
`load_models()`); this module writes it atomically, finds checkpoints and checks that a
config may resume one. A folder is written under a temporary name and renamed once
complete, so a crash never leaves a half checkpoint under a real name. Resuming with the
same config replays exactly the iterations an uninterrupted run would have done (same
prompts, samples, shuffles and optimizer steps): every random stream and counter is restored.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
import zipfile
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from proxima.config import Config, fixed_keys
from proxima.files import FULL_DISK_HINT, pid_running, write_error, write_whole

STATE_FILE = "state.pt"
META_FILE = "checkpoint.json"
FORMAT_VERSION = 2  # 2: state.pt holds the trainer's state_dict() under `trainer`
CONTENTS = (
    "the model folders (actor/, the critic's; the adapters of LoRA runs), state.pt and "
    "checkpoint.json"
)

# Keys whose change makes the saved state mean something else: the schema marks them
# (`fixed`); every other key (learning rates, clip ranges, trainer.iterations, ...) may change.
RESUME_KEYS = fixed_keys()
# --------------------------------------------------------------------------- saving


def proxima_version() -> str:
    try:
        return metadata.version("proxima")
    except metadata.PackageNotFoundError:  # run from a source tree that is not installed
        return "unknown"


def _write_state(folder: Path, state: dict, config: dict, extra: dict) -> None:
    payload = {"format_version": FORMAT_VERSION, "trainer": state, "config": config}
    torch.save({**payload, "extra": extra}, folder / STATE_FILE)
    meta = {
        "iteration": state["iteration"],
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "proxima_version": proxima_version(),
        "format_version": FORMAT_VERSION,
        "contents": CONTENTS,
        "extra": extra,
        "config": config,
    }
    (folder / META_FILE).write_text(json.dumps(meta, indent=2, default=str))


def save_checkpoint(folder: str | Path, trainer, extra: dict | None = None) -> Path:
    """Write a complete checkpoint of `trainer` to `folder` (which must not exist yet).

    Everything goes to a hidden sibling `.NAME.tmp-PID` first, renamed to `folder` only
    when complete; on any error the temporary folder is removed and nothing else changes.
    `extra` (JSON-friendly) is stored in state.pt and checkpoint.json. In a multi-process
    job every rank calls it (the trainer gathers its state); the main rank alone writes.
    """
    main = trainer.dist.is_main
    folder = Path(folder)
    if main and folder.exists():
        raise FileExistsError(
            f"checkpoint folder {folder} already exists and was left untouched; "
            "save to a new folder (or delete that one first)."
        )
    tmp = folder.with_name(f".{folder.name}.tmp-{os.getpid()}")
    made_parent = main and not folder.parent.exists()
    if main:
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover of an earlier crash of this pid
        tmp.mkdir(parents=True)
    what = "the model folders"
    try:
        trainer.save_models(tmp)
        state = trainer.state_dict()
        if main:
            what = f"{STATE_FILE} and {META_FILE}"
            _write_state(tmp, state, trainer.cfg.to_dict(), dict(extra or {}))
            tmp.rename(folder)
    except BaseException as err:
        if main:
            shutil.rmtree(tmp, ignore_errors=True)
            if made_parent:  # the checkpoints/ folder made for this one, empty again
                with contextlib.suppress(OSError):
                    tmp.parent.rmdir()
        cause = write_error(err)
        if cause is None:
            raise
        where = getattr(cause, "filename", None) or what
        raise CheckpointWriteError(
            f"writing the checkpoint {folder} failed at {where} ({type(err).__name__}: "
            f"{err}); {FULL_DISK_HINT}. The partial checkpoint was removed; the earlier "
            "checkpoints are intact."
        ) from err
    return folder


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (the message names where and why)."""


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


def remove_orphans(folder: str | Path) -> list[Path]:
    """Delete the `.iter_N.tmp-PID` folders in `folder` that a killed checkpoint write left
    behind (their process is gone; a live writer's folder is left alone). Returns them."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    removed = []
    for child in folder.iterdir():
        match = re.fullmatch(r"\.iter_\d+\.tmp-(\d+)", child.name)
        if match and child.is_dir() and not pid_running(int(match.group(1))):
            shutil.rmtree(child, ignore_errors=True)
            removed.append(child)
    return removed


def save_periodic(trainer, run_dir: str | Path, keep: int, extra: dict | None = None) -> Path:
    """Checkpoint to run_dir/checkpoints/iter_N (N = trainer.iteration), then delete all but
    the newest `keep` (0 = keep all). Old ones go only after the new one is complete, and so
    do temporary folders of killed writes (`remove_orphans`)."""
    root = Path(run_dir) / "checkpoints"
    folder = save_checkpoint(root / f"iter_{trainer.iteration}", trainer, extra)
    if trainer.dist.is_main:  # the main rank alone touches the files
        remove_orphans(root)
        for old in list_checkpoints(root)[:-keep] if keep > 0 else []:
            shutil.rmtree(old)
    return folder


def checkpoint_iteration(folder: str | Path) -> int:
    """The iteration a checkpoint folder was written at (from checkpoint.json)."""
    return int(json.loads((Path(folder) / META_FILE).read_text())["iteration"])


def model_folders(folder: str | Path) -> list[str]:
    """Names of the model folders in a checkpoint or run folder: every subfolder holding
    weights (`*.safetensors`; a LoRA adapter's are `adapter_model.safetensors`)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(c.name for c in folder.iterdir() if c.is_dir() and any(c.glob("*.safetensors")))


def copy_models(folder: str | Path, dest: str | Path) -> list[str]:
    """Copy a checkpoint's model folders into `dest` (a run folder, where they are the run's
    result), each whole or not at all (`files.write_whole`); returns the names copied."""
    copied = model_folders(folder)

    def write(tmp: Path) -> None:
        for name in copied:
            shutil.copytree(Path(folder) / name, tmp / name)

    write_whole(dest, write)
    return copied


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
    file = find_checkpoint(folder) / META_FILE
    try:
        return json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(
            f"{file} cannot be read ({err}): the checkpoint is damaged. Resume from another "
            f"checkpoint in {file.parent.parent}, or start a new run."
        ) from err


def state_problem(folder: str | Path) -> str | None:
    """Why a checkpoint's state.pt cannot be read, or None: torch.save writes a zip whose
    directory is at the end, so a truncated file has none (checked without loading it)."""
    file = Path(folder) / STATE_FILE
    try:
        with zipfile.ZipFile(file) as z:
            z.infolist()
    except (OSError, zipfile.BadZipFile) as err:
        return f"{file} is truncated or not a checkpoint's state ({err})"
    return None


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


def check_resume(cfg: Config) -> Path | None:
    """With trainer.resume_from: the checkpoint folder, after checking that the config still
    fits it and that iterations remain to be trained (before anything is written); prints
    what changed since the checkpoint. None without trainer.resume_from."""
    t = cfg.trainer
    if not t.resume_from:
        return None
    folder = find_checkpoint(t.resume_from)
    meta = read_meta(folder)
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


def saved_config(folder: str | Path) -> dict[str, Any]:
    """The resolved config a checkpoint (or a run folder's latest) was written with, flat:
    {"section.key": value}."""
    return _flatten(read_meta(folder)["config"])


# --------------------------------------------------------------------------- loading


def load_checkpoint(folder: str | Path, trainer) -> dict[str, Any]:
    """Restore a checkpoint (or a run folder's latest) into an already-built trainer: its
    models in place (`load_models`), then its `load_state_dict`. Returns state.pt."""
    folder = find_checkpoint(folder)
    state = torch.load(folder / STATE_FILE, map_location="cpu", weights_only=True)
    if state.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"checkpoint {folder} has format version {state.get('format_version')}, this "
            f"proxima reads version {FORMAT_VERSION}: resume it with the proxima version "
            f"that wrote it ({read_meta(folder).get('proxima_version')}), or start a new run."
        )
    check_config(state["config"], trainer.cfg, folder)
    trainer.load_models(folder)
    trainer.load_state_dict(state["trainer"])
    return state
