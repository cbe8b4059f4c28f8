"""The value head of a shared-backbone actor-critic (`critic.shared_backbone`, seed 001: one
network, a policy head and a value head, V(s_t) = W_v h_t + b_v).

It reads h_t, the actor's final hidden state: exactly the input of the actor's LM head,
captured by a forward pre-hook on that head (`HeadInput`). The hook works for every
architecture, through peft (LoRA), DDP and the KV-cached decode of `generate`, and the
captured tensor stays in the autograd graph, so the value loss trains the backbone too.

The head is a plain `nn.Linear(hidden, 1)` kept outside the actor, so the actor stays a
plain Hugging Face model (its saved folder, its vLLM weights); it is saved beside it as
`value_head/model.safetensors` (`save_value_head` / `load_value_head`).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

VALUE_HEAD_FOLDER = "value_head"


def lm_head(model: nn.Module) -> nn.Module:
    """The LM head (output embeddings) of a causal LM, inside DDP and peft wrappers."""
    inner = getattr(model, "module", model)  # DistributedDataParallel
    inner = inner.get_base_model() if hasattr(inner, "get_base_model") else inner  # peft
    head = inner.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(inner).__name__} has no LM head (get_output_embeddings)")
    return head


def new_value_head(
    actor: nn.Module, seed: int, dtype: torch.dtype = torch.float32, device="cpu"
) -> nn.Linear:
    """Linear(hidden, 1) drawn as a new critic's head: weight ~ N(0, 1/sqrt(hidden+1)),
    bias 0, reproducible given `seed` without touching the global RNG."""
    hidden = lm_head(actor).weight.shape[-1]
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = nn.Linear(hidden, 1)  # its default init draws too: inside the fork
        head.weight.copy_(torch.randn(1, hidden) / (hidden + 1) ** 0.5)
        head.bias.zero_()
    return head.to(device=device, dtype=dtype)


class HeadInput:
    """Context manager recording the input of `model`'s LM head on every call (one per
    forward pass; one per decode step in `generate`): `.calls` holds them in order, [B, L, H]
    each (L: the positions the head projects; `logits_to_keep` may cut it)."""

    def __init__(self, model: nn.Module) -> None:
        self.head = lm_head(model)
        self.calls: list[torch.Tensor] = []
        self._handle = None

    def _record(self, module, args) -> None:
        self.calls.append(args[0])

    def __enter__(self) -> HeadInput:
        self._handle = self.head.register_forward_pre_hook(self._record)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()


def value_of(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """[..., H] hidden states -> [...] float32 values."""
    return head(hidden.to(head.weight.dtype))[..., 0].float()


def save_value_head(head: nn.Module, parent: Path) -> None:
    """`parent/value_head/`: the head's weight and bias, and what it reads."""
    folder = Path(parent) / VALUE_HEAD_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    save_file(state, folder / "model.safetensors")
    about = {
        "hidden_size": int(head.weight.shape[-1]),
        "reads": "the actor's final hidden state (the input of its LM head)",
        "value": "weight @ h + bias",
    }
    (folder / "config.json").write_text(json.dumps(about, indent=2) + "\n")


def load_value_head(head: nn.Module, parent: Path) -> None:
    """`save_value_head`'s weights back into `head`, in place (the optimizer keeps them)."""
    file = Path(parent) / VALUE_HEAD_FOLDER / "model.safetensors"
    if not file.is_file():
        raise FileNotFoundError(
            f"{file} is missing: this checkpoint holds no value head of a shared-backbone "
            "critic. Resume with the critic.shared_backbone setting it was written with."
        )
    weights = load_file(file)
    try:
        head.load_state_dict(weights)
    except RuntimeError as err:
        raise ValueError(
            f"the value head in {file} does not fit this run's actor: {err}. Resume with the "
            "model the checkpoint was written with."
        ) from err
