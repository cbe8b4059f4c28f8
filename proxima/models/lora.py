"""Opt-in LoRA (Hu et al. 2021, arXiv:2106.09685) for the actor and the critic, via peft.

W x becomes W x + (alpha / r) B A x with A [r, in], B [out, r]; only A and B are trained (and
the critic's value head, kept fully trainable through peft's `modules_to_save`). B starts at
zero, so a fresh adapter leaves the model's output exactly unchanged.

The reference policy of a LoRA run is the actor itself with its adapters switched off
(`AdapterDisabled`): the frozen base weights ARE the initial policy, so no second copy of
the weights is loaded (OpenRLHF issues #1081 and #1349 kept a full reference model).

peft is imported only when LoRA is used: a full fine-tuning run never pays for it.
"""

from __future__ import annotations

import copy
import json
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.pytorch_utils import Conv1D

if TYPE_CHECKING:
    from proxima.config import ModelConfig

TASK_TYPES = ("CAUSAL_LM", "TOKEN_CLS")
_HEADS = ("score", "classifier")  # the critic's one-label head (see models/loading.py)


def is_lora(model: nn.Module) -> bool:
    """True for a peft model; False without importing peft when it was never imported."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def backbone_linear_names(model: PreTrainedModel) -> list[str]:
    """Leaf names of the backbone's linear layers (nn.Linear, GPT-2's Conv1D), e.g.
    ["down_proj", "gate_proj", ...]: peft's "all-linear" minus any head. peft's own
    "all-linear" keeps a token-classification head, which must stay a plain trainable layer."""
    backbone = model.base_model  # the `model` / `transformer` / `gpt_neox` submodule
    return sorted(
        {
            name.rsplit(".", 1)[-1]
            for name, module in backbone.named_modules()
            if name and isinstance(module, (nn.Linear, Conv1D))
        }
    )


def _lora_config(model: PreTrainedModel, cfg: ModelConfig, task_type: str):
    from peft import LoraConfig

    targets = list(cfg.lora_target_modules) or backbone_linear_names(model)
    conv1d = any(isinstance(m, Conv1D) for m in model.base_model.modules())
    heads = [h for h in _HEADS if isinstance(getattr(model, h, None), nn.Module)]
    return LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=targets,
        fan_in_fan_out=conv1d,  # Conv1D stores its weight [in, out]
        bias="none",
        task_type=task_type,
        modules_to_save=heads if task_type == "TOKEN_CLS" else None,
    )


def add_lora(model: PreTrainedModel, cfg: ModelConfig, task_type: str, seed: int = 0):
    """Wrap `model` in a peft LoRA model: base weights frozen, adapters (and a token-
    classification head) trainable. The random init of A is drawn from `seed` without
    touching the global RNG, so the same config gives the same adapters every time.

    task_type: "CAUSAL_LM" (actor) or "TOKEN_CLS" (critic). Returns a peft.PeftModel.
    """
    if task_type not in TASK_TYPES:
        raise ValueError(f"task_type must be one of {TASK_TYPES}, got {task_type!r}")
    from peft import get_peft_model

    lora_cfg = _lora_config(model, cfg, task_type)
    try:
        with torch.random.fork_rng(devices=[]), warnings.catch_warnings():
            # peft asks transformers 5 a deprecated question; nothing a user can act on
            warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
            torch.manual_seed(seed)
            peft_model = get_peft_model(model, lora_cfg)
    except ValueError as err:
        raise ValueError(
            f"cannot add LoRA to {type(model).__name__}: {err}. Set `model.lora_target_modules` "
            f"to names of its linear layers (e.g. {backbone_linear_names(model)}), or leave it "
            "empty for all linear layers of the backbone."
        ) from err
    peft_model.train(model.training)
    return peft_model


class AdapterDisabled(nn.Module):
    """The reference policy of a LoRA run: the actor's forward with its adapters disabled,
    i.e. exactly the frozen base model the run started from.

    The actor is held outside the module tree (not a submodule): this view owns no
    parameters, so it costs no memory, `.parameters()` is empty, and `.train()` / `.to()`
    never reach the actor.
    """

    def __init__(self, actor: nn.Module) -> None:
        super().__init__()
        if not is_lora(actor):
            raise ValueError("AdapterDisabled needs a LoRA actor (see proxima.models.lora)")
        self._actor = (actor,)  # a tuple keeps nn.Module from registering it

    @property
    def actor(self) -> nn.Module:
        return self._actor[0]

    def get_base_model(self) -> nn.Module:
        """The HF model whose forward runs (so callers can inspect its signature)."""
        return self.actor.get_base_model()

    @torch.no_grad()
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with self.actor.disable_adapter():
            return self.actor(*args, **kwargs)

    def describe(self) -> str:
        return "the actor with its LoRA adapters disabled: shares the actor's weights, 0 MiB extra"


def merged_copy(model: nn.Module) -> PreTrainedModel:
    """A plain HF model with the adapters merged into the weights (W + alpha/r B A), for
    saving a folder that loads without peft. Works on a copy: unmerging in place would not
    restore the base weights bit for bit, and they are the reference. Costs one model copy
    while it lives."""
    return copy.deepcopy(model).merge_and_unload()


@dataclass(frozen=True)
class Adapter:
    """A LoRA model's adapter as peft saves it, in memory: what a rollout engine that applies
    adapters itself (vLLM with `enable_lora`) takes instead of a merged copy of the model."""

    config: dict  # adapter_config.json
    tensors: dict[str, torch.Tensor]  # adapter_model.safetensors (peft's names)

    @property
    def rank(self) -> int:
        return max([self.config["r"], *(self.config.get("rank_pattern") or {}).values()])

    def save(self, folder: Path) -> None:
        """Write the peft adapter folder (adapter_config.json, adapter_model.safetensors)."""
        from safetensors.torch import save_file

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "adapter_config.json").write_text(json.dumps(self.config, indent=2))
        save_file(self.tensors, str(folder / "adapter_model.safetensors"))


def export_adapter(model: nn.Module) -> Adapter:
    """The adapter of a LoRA model, copied to CPU (an FSDP2 shard would be gathered first;
    LoRA runs use DDP): the A and B matrices only, a few MiB where the model has GiB."""
    from peft.utils import get_peft_model_state_dict

    config = model.peft_config[model.active_adapter].to_dict()
    config = {k: sorted(v) if isinstance(v, set) else v for k, v in config.items()}
    tensors = {
        k: v.detach().to("cpu", copy=True).contiguous()
        for k, v in get_peft_model_state_dict(model).items()
    }
    return Adapter(json.loads(json.dumps(config, default=str)), tensors)


def adapter_problem(model: nn.Module) -> str | None:
    """Why this LoRA model's adapter cannot be served on its own by an engine that applies
    adapters to the backbone's linear layers only (vLLM), or None when it can: adapters on
    an embedding or on the LM head, or fully trained modules (`modules_to_save`)."""
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer

    config = model.peft_config[model.active_adapter]
    if config.modules_to_save:
        return f"it trains whole modules too (modules_to_save={sorted(config.modules_to_save)})"
    inner = model.get_base_model()
    head = inner.get_output_embeddings()
    for name, module in inner.named_modules():
        if isinstance(module, LoraLayer) and (not isinstance(module, LoraLinear) or module is head):
            return f"{name} is not a linear layer of the backbone"
    return None


def load_adapter_weights(model: nn.Module, folder: Path, role: str) -> None:
    """Copy the adapter saved by `save_role` into an already-built LoRA model, in place
    (so an optimizer keeps pointing at the same tensors). Raises ValueError when the saved
    adapter does not fit (another rank, other target modules)."""
    from peft.utils import load_peft_weights, set_peft_model_state_dict

    if not (folder / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"{folder} holds no LoRA adapter of the {role} (adapter_config.json): the "
            "checkpoint was not written by a LoRA run or is incomplete. Resume with the "
            "model.lora_* settings it was written with, or from another checkpoint."
        )
    try:
        result = set_peft_model_state_dict(model, load_peft_weights(str(folder), device="cpu"))
    except RuntimeError as err:  # shape mismatch: another rank or other layers
        raise ValueError(
            f"the {role} adapter in {folder} does not fit this run's {role} ({err}): resume "
            "with the model.lora_* settings the checkpoint was written with."
        ) from err
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    missing = sorted(trainable & set(result.missing_keys))
    if missing or result.unexpected_keys:
        raise ValueError(
            f"the {role} adapter in {folder} does not fit this run's {role} (missing "
            f"{missing[:5]}, unexpected {list(result.unexpected_keys)[:5]}): resume with the "
            "model.lora_* settings the checkpoint was written with."
        )
