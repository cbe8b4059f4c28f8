"""Load the four PPO roles from local Hugging Face folders.

- actor and reference: `AutoModelForCausalLM` (`load_causal_lm`, trainable or frozen);
- critic: `AutoModelForTokenClassification` with one label, so a saved critic is a normal
  Hugging Face folder (`load_critic`);
- reward model: `AutoModelForSequenceClassification` with one label (`load_reward_model`).

Every forward pass (logits, values, scores) is in `proxima.models.forward`, and what a folder
holds is checked from its files in `proxima.models.folders`; this module loads only.

Dropout is switched off everywhere: PPO's ratio pi/pi_old must be exactly 1 on the first
mini-batch, and dropout noise breaks that.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors import SafetensorError, safe_open
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils import logging as hf_logging

from proxima.config.choices import CRITIC_INIT, DTYPE_NAMES, HEAD_INITS
from proxima.models.folders import policy_folder_problem, weights_problem

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}  # model.dtype -> torch dtype
_HEAD_NAMES = ("score", "classifier")  # one-label heads of *ForSequence/TokenClassification

_FIX = {
    "model": "point the config at a Hugging Face model folder, or create a tiny one with "
    "`proxima init-model --out {path}`",
    "tokenizer": "point the config at a folder saved with tokenizer.save_pretrained, or create "
    "a tiny model and tokenizer with `proxima init-model --out {path}`",
    "critic": "use critic init_from='actor' (or 'reward_model') to build a new critic",
    "reward model": "point the reward model path at a folder saved from an "
    "AutoModelForSequenceClassification with num_labels=1 (train one with `proxima rm`)",
}


def _check_folder(path: str | Path, role: str, needs: str = "config.json") -> Path:
    folder = Path(path)
    fix = _FIX.get(role, _FIX["model"]).format(path=folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{role} folder {folder} does not exist; {fix}")
    if needs and not (folder / needs).is_file():
        raise FileNotFoundError(f"{role} folder {folder} has no {needs}; {fix}")
    return folder


@contextlib.contextmanager
def quiet_transformers() -> Iterator[None]:
    """Silence transformers' load report and progress bars; we check the keys ourselves."""
    verbosity = hf_logging.get_verbosity()
    bars_were_off = hf_logging.is_progress_bar_enabled() is False
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if not bars_were_off:
            hf_logging.enable_progress_bar()


def _dtype_kwarg(dtype: torch.dtype) -> dict[str, torch.dtype]:
    # transformers >= 4.56 names it `dtype`; older releases only know `torch_dtype`.
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def _config_without_dropout(folder: Path, **updates: Any) -> PretrainedConfig:
    """The folder's config with every dropout probability set to 0 (before the model is built,
    since attention modules copy `attention_dropout` into a float at construction)."""
    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    for key, value in list(config.to_dict().items()):
        is_prob = isinstance(value, (int, float)) and not isinstance(value, bool)
        if is_prob and ("dropout" in key or key.endswith("_pdrop")):
            setattr(config, key, 0.0)
    config.classifier_dropout = 0.0  # read by classification heads, may be absent (None)
    for key, value in updates.items():
        setattr(config, key, value)
    return config


def _disable_dropout(model: nn.Module) -> None:
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0


def _finish(model: PreTrainedModel, device: str | torch.device, trainable: bool) -> PreTrainedModel:
    """Move to device, drop dropout, and freeze (eval, no grads) or unfreeze (train mode)."""
    _disable_dropout(model)
    model.to(device)
    model.requires_grad_(trainable)
    model.train(trainable)
    return model


def _load(auto_cls, folder: Path, config: PretrainedConfig, dtype: torch.dtype):
    """from_pretrained from a local folder only; returns (model, loading info). Unreadable
    weights raise a ValueError naming the folder (not safetensors' bare error)."""
    problem = weights_problem(folder)
    if problem:
        raise ValueError(f"model folder {folder} {problem}; save or copy the model again.")
    try:
        with quiet_transformers():
            return auto_cls.from_pretrained(
                folder,
                config=config,
                local_files_only=True,
                output_loading_info=True,
                **_dtype_kwarg(dtype),
            )
    except SafetensorError as err:
        raise ValueError(
            f"the weights in {folder} cannot be read ({err}); save or copy the model again."
        ) from err


def _require_loaded(info: dict, folder: Path, role: str, allowed: tuple[str, ...] = ()) -> None:
    """Raise when weights other than `allowed` prefixes were missing from the folder (they
    would silently be random)."""
    missing = sorted(
        k for k in info["missing_keys"] if not any(k.startswith(f"{a}.") for a in allowed)
    )
    if missing:
        shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
        fix = _FIX.get(role, _FIX["model"]).format(path=folder)
        raise ValueError(f"{role} folder {folder} lacks weights {shown}; {fix}")


def _check_architecture(config: PretrainedConfig, suffix: str, folder: Path, role: str) -> None:
    """A scalar-head role must be a *{suffix} with num_labels == 1."""
    fix = _FIX[role].format(path=folder)
    archs = getattr(config, "architectures", None) or []
    if archs and not any(a.endswith(suffix) for a in archs):
        raise ValueError(f"{role} folder {folder} holds a {archs[0]}, not a *{suffix}; {fix}")
    if config.num_labels != 1:
        raise ValueError(
            f"{role} folder {folder} has num_labels={config.num_labels}, a scalar head needs 1; "
            + fix
        )


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    """AutoTokenizer from a local folder, left padding, pad token falling back to EOS."""
    folder = _check_folder(path, "tokenizer", needs="")
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    tokenizer.padding_side = "left"  # generation continues from the right edge
    # proxima checks every prompt against data.max_prompt_length and the model's positions,
    # naming the keys; the tokenizer's own "indexing errors" warning (against its
    # model_max_length, which need not be the model's) is marked as already given
    tokenizer.deprecation_warnings["sequence-length-is-longer-than-the-specified-maximum"] = True
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"tokenizer in {folder} has neither a pad nor an eos token; "
                "set one with tokenizer.add_special_tokens and save it again"
            )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def generation_config(path: str | Path):
    """The generation config a causal LM loaded from `path` gets (its generation_config.json,
    else derived from its config.json, as transformers does), read without loading it."""
    from transformers import GenerationConfig

    folder = Path(path)
    if (folder / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(folder)
    return GenerationConfig.from_model_config(AutoConfig.from_pretrained(folder))


def load_causal_lm(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    trainable: bool = True,
) -> PreTrainedModel:
    """Actor (trainable=True, train mode) or reference (trainable=False: frozen, eval)."""
    problem = policy_folder_problem(path)
    if problem:
        raise ValueError(f"model folder {path} {problem}.")
    folder = _check_folder(path, "model")
    config = _config_without_dropout(folder)
    model, info = _load(AutoModelForCausalLM, folder, config, dtype)
    _require_loaded(info, folder, "model")
    return _finish(model, device, trainable)


def checkpoint_activations(model: nn.Module) -> None:
    """`model.gradient_checkpointing`: transformers' activation checkpointing on the
    outermost transformers model inside `model` (a LoRA wrapper or the actor with a value
    head included), non-reentrant, so frozen inputs (LoRA) and unused outputs need nothing
    special. Only in training mode: generation and scoring run as before."""
    for module in model.modules():
        if isinstance(module, PreTrainedModel):
            if not module.supports_gradient_checkpointing:
                raise ValueError(
                    f"`model.gradient_checkpointing=true`, but {type(module).__name__} does not "
                    "support it in transformers; set model.gradient_checkpointing=false."
                )
            # transformers >= 5.2x names it activation_checkpointing_enable (the old name warns)
            enable = getattr(module, "activation_checkpointing_enable", None)
            enable = enable or module.gradient_checkpointing_enable
            enable({"use_reentrant": False})
            return
    raise ValueError(f"no transformers model inside {type(model).__name__} to checkpoint")


def load_reward_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> PreTrainedModel:
    """Reward model: AutoModelForSequenceClassification with num_labels=1, frozen, eval."""
    folder = _check_folder(path, "reward model")
    config = _config_without_dropout(folder)
    _check_architecture(config, "ForSequenceClassification", folder, "reward model")
    model, info = _load(AutoModelForSequenceClassification, folder, config, dtype)
    _require_loaded(info, folder, "reward model")
    return _finish(model, device, trainable=False)


# config.json key of a reward model's score normalisation ({"mean", "std", "n"}), written
# by `proxima rm` and applied by every run that reads the model as a reward source
SCORE_NORMALIZATION = "score_normalization"


def score_normalization(path: str | Path) -> tuple[float, float] | None:
    """(mean, std) stored in a reward-model folder's config.json, or None when it has none."""
    config = json.loads((Path(path) / "config.json").read_text())
    norm = config.get(SCORE_NORMALIZATION)
    if norm is None:
        return None
    mean, std = norm.get("mean"), norm.get("std")
    ok = all(isinstance(v, (int, float)) and math.isfinite(v) for v in (mean, std))
    if not ok or std <= 0:
        raise ValueError(
            f"{path}/config.json has an invalid `{SCORE_NORMALIZATION}` {norm!r}: it needs a "
            "finite mean and a std > 0. Fix or delete the entry (scores are then used raw)."
        )
    return float(mean), float(std)


def scalar_head(model: PreTrainedModel) -> nn.Module:
    """The one-output head (`score` or `classifier`) of a classification model."""
    for name in _HEAD_NAMES:
        head = getattr(model, name, None)
        if isinstance(head, nn.Module):
            return head
    raise ValueError(
        f"{type(model).__name__} has no scalar head named {' or '.join(_HEAD_NAMES)}; "
        "use a *ForSequenceClassification / *ForTokenClassification model"
    )


def _read_head_weights(folder: Path) -> dict[str, torch.Tensor]:
    """`weight` (and `bias` when present) of the one-label head saved in a reward-model folder,
    read straight from its safetensors files without building a second model."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
    elif (folder / "model.safetensors").is_file():
        with safe_open(folder / "model.safetensors", framework="pt") as f:
            weight_map = {k: "model.safetensors" for k in f.keys()}
    else:
        return {}
    for name in _HEAD_NAMES:
        if f"{name}.weight" in weight_map:
            found = {}
            for part in ("weight", "bias"):
                key = f"{name}.{part}"
                if key in weight_map:
                    with safe_open(folder / weight_map[key], framework="pt") as f:
                        found[part] = f.get_tensor(key)
            return found
    return {}


def _head_from_reward_model(folder: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The reward model's head as a critic starts from it: with a stored score normalisation
    (mean m, std s) the head of the normalised score, weight / s and bias (b - m) / s, so
    the critic's first values are on the scale of the rewards a run gets from the reward
    model (as OpenRLHF's critic applies the reward model's mean and std to its values,
    `openrlhf/models/model.py`)."""
    found = _read_head_weights(folder)
    if not found:  # not safetensors (e.g. pytorch_model.bin): build the reward model once
        rm_head = scalar_head(load_reward_model(folder, dtype))
        found = {k: v.detach() for k, v in rm_head.state_dict().items()}
    norm = score_normalization(folder)
    if norm is None:
        return found
    mean, std = norm
    bias = found.get("bias", torch.zeros(1, dtype=found["weight"].dtype))
    return {"weight": found["weight"] / std, "bias": (bias - mean) / std}


def new_head_weight(shape: tuple[int, ...], init: str = "random") -> torch.Tensor:
    """A new scalar head's weight (`critic.head_init`), float32, from the global RNG (fork
    it to keep the caller's draws): random, ~ N(0, 1/sqrt(fan_in+1)), the init of the
    *reward* head in OpenAI's lm-human-preferences, distinct initial values to learn from;
    zero, as the value head starts there."""
    if init not in HEAD_INITS:
        raise ValueError(f"unknown head init {init!r}; choose one of {HEAD_INITS}")
    if init == "zero":
        return torch.zeros(shape)
    return torch.randn(shape, dtype=torch.float32) / (shape[-1] + 1) ** 0.5


@torch.no_grad()
def _set_head(
    critic: PreTrainedModel,
    weights: dict[str, torch.Tensor] | None,
    seed: int,
    init: str = "random",
) -> None:
    """Copy a head (bias 0 when absent), or with `weights=None` make a new one
    (`new_head_weight`), bias 0, reproducible given `seed`."""
    head = scalar_head(critic)
    if weights is None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            weights = {"weight": new_head_weight(tuple(head.weight.shape), init)}
    head.weight.copy_(weights["weight"].reshape(head.weight.shape))
    bias = weights.get("bias")
    if getattr(head, "bias", None) is not None:
        head.bias.copy_(bias.reshape(head.bias.shape) if bias is not None else 0.0)
    elif bias is not None and bool(bias.any()):
        raise ValueError(
            f"{type(critic).__name__}'s head has no bias to start from the reward model's "
            "(or from its score normalisation's mean); start the critic from the actor "
            "(model.critic_init=actor), or drop the reward model's score_normalization."
        )


def load_critic(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    init_from: str = "actor",
    trainable: bool = True,
    seed: int = 0,
    head_init: str = "random",
) -> PreTrainedModel:
    """Critic as AutoModelForTokenClassification(num_labels=1).

    init_from="actor": backbone from a causal-LM folder, new seeded head (`head_init`).
    init_from="reward_model": backbone and head from a sequence-classification folder, so
    the critic starts as the reward model (as OpenRLHF and the InstructGPT setup advise),
    as a run reads it: normalised by its stored score normalisation, if any.
    init_from="critic": a saved critic.
    """
    if init_from not in CRITIC_INIT:
        raise ValueError(f"unknown critic init_from={init_from!r}; choose one of {CRITIC_INIT}")
    role = {"actor": "model", "reward_model": "reward model", "critic": "critic"}[init_from]
    folder = _check_folder(path, role)
    config = _config_without_dropout(folder)
    if init_from == "reward_model":
        _check_architecture(config, "ForSequenceClassification", folder, "reward model")
    elif init_from == "critic":
        _check_architecture(config, "ForTokenClassification", folder, "critic")
    config.num_labels = 1
    model, info = _load(AutoModelForTokenClassification, folder, config, dtype)
    if init_from == "critic":
        _require_loaded(info, folder, role)
    else:
        _require_loaded(info, folder, role, allowed=_HEAD_NAMES)
        head = _head_from_reward_model(folder, dtype) if init_from == "reward_model" else None
        _set_head(model, head, seed, head_init)
    return _finish(model, device, trainable)


def describe_model(model: nn.Module) -> dict[str, Any]:
    """What a role costs in memory: parameter counts and bytes.

    `grad_and_adam_bytes` estimates training state for the trainable parameters: one
    gradient plus Adam's exp_avg and exp_avg_sq, each in the parameter's dtype. Frozen roles
    (reference, reward model) cost only `parameter_bytes`.
    """
    params = list(model.parameters())
    trainable = [p for p in params if p.requires_grad]
    first = params[0] if params else None
    return {
        "parameters": sum(p.numel() for p in params),
        "trainable_parameters": sum(p.numel() for p in trainable),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in params),
        "grad_and_adam_bytes": sum(3 * p.numel() * p.element_size() for p in trainable),
        "dtype": str(first.dtype).removeprefix("torch.") if first is not None else None,
        "device": str(first.device) if first is not None else None,
    }


def init_reward_model(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    seed: int = 0,
    pad_token_id: int | None = None,
) -> PreTrainedModel:
    """A trainable reward model (AutoModelForSequenceClassification, num_labels=1).

    From a reward-model folder: continue from it as saved. From a causal-LM folder (e.g. an
    SFT model): its backbone plus a new head drawn like the critic's value head
    (N(0, 1/sqrt(hidden+1)), bias 0, seeded). Dropout is off (a deterministic score).
    """
    folder = _check_folder(path, "model")
    config = _config_without_dropout(folder)
    if any(a.endswith("ForSequenceClassification") for a in config.architectures or []):
        return _finish(load_reward_model(folder, dtype=dtype), device, trainable=True)
    config.num_labels = 1
    if getattr(config, "pad_token_id", None) is None and pad_token_id is not None:
        config.pad_token_id = pad_token_id  # HF's own forward needs it for batches > 1
    model, info = _load(AutoModelForSequenceClassification, folder, config, dtype)
    _require_loaded(info, folder, "model", allowed=_HEAD_NAMES)
    _set_head(model, None, seed)
    return _finish(model, device, trainable=True)
