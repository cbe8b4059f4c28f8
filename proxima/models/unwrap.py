"""The model inside the wrappers proxima puts around it, found one way everywhere.

`unwrap` looks inside DistributedDataParallel only: the module that was trained. `base_model`
goes down to the Hugging Face model itself, through every wrapper that exposes peft's
`get_base_model()`: a peft (LoRA) model, the LoRA reference view, the actor with a value
head (`models.critic.PolicyValue`). FSDP2 shards modules in place: nothing to unwrap there.
"""

from __future__ import annotations

from torch import nn
from torch.nn.parallel import DistributedDataParallel


def unwrap(module: nn.Module) -> nn.Module:
    """The module inside a DistributedDataParallel wrapper, else `module` itself."""
    return module.module if isinstance(module, DistributedDataParallel) else module


def base_model(module: nn.Module) -> nn.Module:
    """The Hugging Face model (a PreTrainedModel) inside every wrapper."""
    inner = unwrap(module)
    return inner.get_base_model() if hasattr(inner, "get_base_model") else inner
