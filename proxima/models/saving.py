"""A trained role's weights on disk: written as a Hugging Face folder (plus the peft adapter
for LoRA), and read back in place into an already-built model (resume), so an optimizer
keeps pointing at the same tensors."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from proxima.models.loading import quiet_transformers
from proxima.models.lora import is_lora, load_adapter_weights, merged_copy


def save_role(
    model: nn.Module, tokenizer, parent: Path, name: str, state_dict: dict | None = None
) -> None:
    """Write `parent/name/`: a plain HF folder with the tokenizer (merged for LoRA), and for
    LoRA also `parent/name_adapter/`: the peft adapter (adapter_config.json + weights).
    `state_dict`: the full weights when the model holds only its shard (FSDP2)."""
    parent = Path(parent)
    if state_dict is not None:
        with quiet_transformers():
            model.save_pretrained(parent / name, state_dict=state_dict)
    elif is_lora(model):
        with quiet_transformers():
            merged_copy(model).save_pretrained(parent / name)
        # the base embeddings are never resized, so only the adapter weights are saved
        model.save_pretrained(parent / f"{name}_adapter", save_embedding_layers=False)
    else:
        model.save_pretrained(parent / name)
    tokenizer.save_pretrained(parent / name)


def load_role(model: nn.Module, parent: Path, name: str) -> None:
    """Weights written by `save_role` back into `model`, in place: a LoRA role from its
    adapter folder (the merged folder cannot be split back into base + adapter exactly),
    any other from its HF folder."""
    if is_lora(model):
        load_adapter_weights(model, Path(parent) / f"{name}_adapter", name)
    else:
        _load_weights(model, Path(parent) / name, name)


def read_role_weights(parent: Path, name: str) -> dict[str, torch.Tensor]:
    """Every tensor of the HF folder `parent/name` as saved (names as in the files)."""
    files = sorted((Path(parent) / name).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"{Path(parent) / name} holds no *.safetensors weights of the {name}: the "
            "checkpoint is incomplete. Resume from another checkpoint."
        )
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        weights.update(load_file(f))
    return weights


def _saved_names(model: nn.Module) -> dict[str, str]:
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


def _full(t: torch.Tensor) -> torch.Tensor:
    """A whole tensor: an FSDP2 shard (DTensor) gathered from every rank (a collective: every
    rank exports, in the same order), any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def export_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The weights `save_role` would write, as (name, tensor) pairs in memory: what a rollout
    engine loads after each update. LoRA adapters are merged into a copy (costs one model
    copy while the pairs are read); names are those of the saved HF folder (transformers 5
    writes some under the hub's names, e.g. GPT-NeoX's `embed_out`), which is what an
    engine's checkpoint loader (vLLM's `load_weights`) expects. A tied LM head appears under
    both names, as the same tensor. Lazy: nothing is copied until the pairs are read."""
    if is_lora(model):
        model = merged_copy(model)
    own = {k: _full(v.detach()) for k, v in model.state_dict().items()}
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4.x: state_dict names are the saved names
        yield from own.items()
        return
    yield from revert_weight_conversion(model, own).items()


def export_base_weights(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """A LoRA model's frozen base weights, as `export_weights` names them, without a copy
    and without the adapters (peft's `base_layer` wrappers looked through): the model its
    adapters apply to, for an engine that applies them itself. Lazy, like `export_weights`."""
    inner = model.get_base_model()
    own = {
        k.replace(".base_layer.", "."): _full(v.detach())
        for k, v in inner.state_dict().items()
        if ".lora_" not in k
    }
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # transformers 4.x: state_dict names are the saved names
        yield from own.items()
        return
    yield from revert_weight_conversion(inner, own).items()


def load_named_weights(model: nn.Module, named: Iterable[tuple[str, torch.Tensor]], where: str):
    """Copy (saved name, tensor) pairs, as `export_weights` gives or a saved folder holds,
    into an already-built plain HF model, in place. Raises ValueError naming `where` when the
    names do not fit. Weights tied to another (a tied LM head) may be missing when they share
    storage with a loaded tensor."""
    names = _saved_names(model)
    weights = {names.get(k, k): v for k, v in named}
    own = model.state_dict()
    loaded_ptrs = {own[k].data_ptr() for k in weights if k in own}
    missing = sorted(k for k in own.keys() - weights.keys() if own[k].data_ptr() not in loaded_ptrs)
    unexpected = sorted(weights.keys() - own.keys())
    if missing or unexpected:
        raise ValueError(
            f"the weights in {where} do not fit {type(model).__name__} (missing "
            f"{missing[:5]}, unexpected {unexpected[:5]})"
        )
    model.load_state_dict(weights, strict=False)


def _load_weights(model: nn.Module, folder: Path, role: str) -> None:
    """Copy the safetensors of a saved HF folder into an already-built model, in place."""
    weights = read_role_weights(folder.parent, folder.name)
    try:
        load_named_weights(model, weights.items(), f"{folder}")
    except ValueError as err:
        raise ValueError(
            f"{err}, this run's {role}: resume with the model.* settings the checkpoint was "
            "written with."
        ) from err
