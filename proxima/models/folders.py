"""What a model folder holds, read from its files before anything loads: whether it is a
loadable Hugging Face model folder (`folder_problem`: config.json, weights, tokenizer files;
a truncated .safetensors is named), whether it is a policy (`policy_folder_problem`: not a
reward model, a critic, or a proxima run or checkpoint folder), and what its config says
(`config_vocab_size`, `config_positions`). `proxima.models.loading` loads what passes.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from transformers import AutoConfig

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)


def has_tokenizer(folder: str | Path) -> bool:
    """Whether `folder` holds tokenizer files (any of TOKENIZER_FILES or a *.tiktoken)."""
    folder = Path(folder)
    return any((folder / f).is_file() for f in TOKENIZER_FILES) or any(folder.glob("*.tiktoken"))


def config_vocab_size(folder: str | Path) -> int | None:
    """`vocab_size` of the model config in `folder` (rows of its embedding table), read from
    config.json without building anything; None when absent."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    size = config.get("vocab_size", (config.get("text_config") or {}).get("vocab_size"))
    return size if isinstance(size, int) else None


def config_positions(folder: str | Path) -> int | None:
    """The positions a model in `folder` encodes (max_position_embeddings, GPT-2's
    n_positions), read from its config without building it; None when it names none."""
    try:
        config = AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError):
        return None
    size = getattr(config, "max_position_embeddings", None)
    return size if isinstance(size, int) else None


def vocabulary_difference(tokenizer: Any, other: Any) -> str | None:
    """None when two tokenizers number every token alike, else what differs (sizes and one
    token with another id, or missing): a model of one cannot read the other's token ids."""
    mine, theirs = tokenizer.get_vocab(), other.get_vocab()
    if mine == theirs:
        return None
    sizes = f"{len(theirs)} tokens there, {len(mine)} in the policy's"
    for token in sorted(mine, key=mine.get):
        if theirs.get(token) != mine[token]:
            there = "missing" if token not in theirs else f"id {theirs[token]}"
            return f"{sizes}; e.g. token {token!r} is {there} there, id {mine[token]} here"
    extra = next(t for t in theirs if t not in mine)
    return f"{sizes}; e.g. token {extra!r} (id {theirs[extra]}) is not in the policy's"


WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


def safetensors_problem(file: Path) -> str | None:
    """Why a .safetensors file cannot be read (truncated, not safetensors), or None. Reads
    only its header: 8 bytes of header length, the JSON header, whose data offsets say how
    long the file must be (https://github.com/huggingface/safetensors#format)."""
    size = file.stat().st_size
    try:
        with file.open("rb") as f:
            n = int.from_bytes(f.read(8), "little") if size >= 8 else -1
            if n < 0 or 8 + n > size:
                return f"has a {file.name} that is truncated or not safetensors ({size} bytes)"
            header = json.loads(f.read(n))
    except (OSError, ValueError) as err:
        return f"has a {file.name} with an unreadable header ({err})"
    ends = [v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"]
    needed = 8 + n + max(ends, default=0)
    if size < needed:
        return f"has a truncated {file.name} ({size} bytes, its header promises {needed})"
    return None


def weights_problem(folder: Path) -> str | None:
    """Why the weights of a model folder cannot be loaded, or None (checked without loading)."""
    present = [f for f in WEIGHT_FILES if (folder / f).is_file()]
    if not present:
        return f"holds no weights ({', '.join(WEIGHT_FILES)})"
    files = []
    for index in [f for f in present if f.endswith(".index.json")]:
        try:
            shards = sorted(set(json.loads((folder / index).read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, AttributeError) as err:
            return f"has an unreadable {index} ({err})"
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            return f"lacks weight shards listed in {index}: {', '.join(missing[:3])}"
        files += [folder / s for s in shards]
    files += [folder / f for f in present if f.endswith(".safetensors")]
    for file in files:
        if file.suffix == ".safetensors":
            problem = safetensors_problem(file)
            if problem:
                return problem
    return None


def _run_folder_problem(folder: Path) -> str | None:
    """A proxima run folder (`proxima train`'s output: summary.json, metrics.jsonl, actor/,
    checkpoints/) or checkpoint folder (checkpoint.json, actor/) given where a model folder
    belongs: the model is one level down, in actor/."""
    if (folder / "checkpoint.json").is_file():
        kind, marks = "checkpoint", ("checkpoint.json", "state.pt", "actor")
    elif any((folder / f).exists() for f in ("summary.json", "metrics.jsonl", "checkpoints")):
        kind, marks = "run", ("summary.json", "metrics.jsonl", "actor", "checkpoints")
    else:
        return None
    held = ", ".join(m + "/" * (folder / m).is_dir() for m in marks if (folder / m).exists())
    what = f"is a proxima {kind} folder ({held}), not a model folder"
    if (folder / "actor" / "config.json").is_file():
        return f"{what}: pass its trained policy, {folder / 'actor'}, instead"
    found = sorted(folder.glob("checkpoints/iter_*/actor/config.json"), key=_iteration)
    if found:
        return (
            f"{what}, and it has no final actor/ yet: pass the policy of its latest "
            f"checkpoint, {found[-1].parent}, instead"
        )
    return f"{what}, and it holds no trained policy (actor/) to pass instead"


def _iteration(config_file: Path) -> int:
    """N of checkpoints/iter_N/actor/config.json (the newest checkpoint is the largest N)."""
    name = config_file.parent.parent.name
    return int(name.removeprefix("iter_")) if name.removeprefix("iter_").isdigit() else -1


_HEADS = {  # architecture suffix: (what such a folder is, where it belongs)
    "ForSequenceClassification": (
        "a reward model (a score head, no language-model head)",
        "as a reward source it belongs in `reward.model_path` (--reward-model)",
    ),
    "ForTokenClassification": (
        "a value model (a critic: a value head, no language-model head)",
        "as a critic it belongs in `model.critic_path`",
    ),
}


def policy_folder_problem(path: str | Path) -> str | None:
    """Why `path`, maybe a sound folder, is not a policy (a causal LM to generate with and
    train): a proxima run or checkpoint folder (the policy is in its actor/), or a model with
    a score or value head (`proxima rm` output, a saved critic); None otherwise, and for a
    folder with other problems (`folder_problem` reports those)."""
    folder = Path(path)
    if not folder.is_dir():
        return None
    if not (folder / "config.json").is_file() or weights_problem(folder):
        return _run_folder_problem(folder)  # a run folder's config.json is proxima's own
    try:
        archs = json.loads((folder / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError, AttributeError):
        return None
    head = next((h for h in _HEADS if archs and all(a.endswith(h) for a in archs)), None)
    if head is None:
        return None
    what, belongs = _HEADS[head]
    origin = _trained_from(folder)
    origin = f" ({origin})" if origin else ""
    return (
        f"holds a {archs[0]}: {what}, which cannot generate text; {belongs}. Pass a causal "
        f"language model instead, e.g. the one it was trained from{origin}, a `proxima sft` "
        "output, or the policy of a `proxima train` run (RUN/actor)"
    )


def _trained_from(folder: Path) -> str | None:
    """The model a `proxima rm` output started from, read from its rm_summary.json."""
    try:
        summary = json.loads((folder / "rm_summary.json").read_text())
        origin = summary["config"]["model"]["actor_path"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return origin if isinstance(origin, str) and origin else None


def folder_problem(path: str | Path, tokenizer: bool = True) -> str | None:
    """What keeps `path` from being a loadable Hugging Face model folder (config.json, weights
    and, when `tokenizer`, tokenizer files), or None; checked from the files, before loading."""
    folder = Path(path)
    if not folder.exists():
        return "does not exist"
    if not folder.is_dir():
        return "is a file, not a model folder"
    if not (folder / "config.json").is_file():
        run = _run_folder_problem(folder)
        if run:
            return run
        empty = not any(folder.iterdir())
        return "is empty" if empty else "has no config.json, so it is not a model folder"
    try:
        json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as err:
        return f"has a config.json that is not valid JSON ({err})"
    problem = weights_problem(folder)
    if problem is None and tokenizer and not has_tokenizer(folder):
        problem = f"has no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...)"
    return problem
