"""What a model costs, measured before it loads: its parameters counted exactly from a model
built on the meta device (`model_shape`, `count_parameters`, `lora_parameters`), the bytes
autograd saves for one training micro-batch traced on fake tensors
(`saved_activation_bytes`), and the logits, KV cache and forward temporaries of a batch.
The memory plan (`trainer.memory`) adds these up per role and phase."""

from __future__ import annotations

import inspect
from contextlib import nullcontext
from dataclasses import dataclass
from functools import lru_cache

import torch

from proxima.config import Config
from proxima.models.loading import checkpoint_activations, quiet_transformers

# chunked log-softmax: about this many float32 elements per chunk (algos._checks)
CHUNK_ELEMENTS = 2**24


@dataclass(frozen=True)
class Shape:
    """What the plan needs of one model, read from its config.json."""

    params: int
    trainable: int  # parameters trained (0 for a frozen role; LoRA: the adapters)
    dtype_bytes: int
    layers: int
    hidden: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int

    @property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes


# --------------------------------------------------------------------------- the models


def hf_config(folder: str, kind: str):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder, local_files_only=True)
    if kind != "causal_lm":
        config.num_labels = 1
    return config


def _auto_class(kind: str):
    import transformers

    return {
        "causal_lm": transformers.AutoModelForCausalLM,
        "value": transformers.AutoModelForTokenClassification,
        "reward": transformers.AutoModelForSequenceClassification,
    }[kind]


@lru_cache(maxsize=16)
def count_parameters(folder: str, kind: str = "causal_lm") -> int:
    """Parameters of the model in `folder` built as `kind` (causal_lm, value: one label per
    token, reward: one label per sequence), exactly, from its config on the meta device
    (nothing allocated; shared tensors, like tied embeddings, counted once)."""
    config = hf_config(folder, kind)
    with torch.device("meta"), quiet_transformers():
        model = _auto_class(kind).from_config(config)
    return sum(p.numel() for p in model.parameters())


@lru_cache(maxsize=16)
def lora_parameters(folder: str, kind: str, rank: int, targets: tuple[str, ...]) -> int:
    """Parameters of LoRA adapters of rank `rank` on the model in `folder`: r x (in + out)
    for each targeted Linear (every Linear of the backbone when `targets` is empty, as
    peft's all-linear: the output head left out)."""
    config = hf_config(folder, kind)
    with torch.device("meta"), quiet_transformers():
        model = _auto_class(kind).from_config(config)
    head = model.get_output_embeddings() if kind == "causal_lm" else None
    total = 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or module is head:
            continue
        leaf = name.rsplit(".", 1)[-1]
        if (targets and leaf in targets) or (not targets and leaf not in ("score", "classifier")):
            total += rank * (module.in_features + module.out_features)
    return total


def _dims(config) -> dict[str, int]:
    """Layers, widths, KV heads and vocabulary of an HF config (Llama, Qwen, GPT-2 names)."""

    def get(*names: str, default: int = 0) -> int:
        return next((getattr(config, n) for n in names if getattr(config, n, None)), default)

    hidden = get("hidden_size", "n_embd", "d_model")
    heads = get("num_attention_heads", "n_head", default=1)
    return {
        "layers": get("num_hidden_layers", "n_layer"),
        "hidden": hidden,
        "kv_heads": get("num_key_value_heads", default=heads),
        "head_dim": get("head_dim", default=hidden // heads),
        "intermediate": get("intermediate_size", "n_inner", default=4 * hidden),
        "vocab": get("vocab_size"),
    }


def model_shape(folder: str, kind: str, dtype: torch.dtype, trainable: str, cfg: Config) -> Shape:
    """The Shape of a role's model. trainable: "all", "lora" or "none"."""
    params = count_parameters(folder, kind)
    n_train = {"all": params, "none": 0}.get(trainable)
    dims = _dims(hf_config(folder, kind))
    if n_train is None:
        m = cfg.model
        adapters = lora_parameters(folder, kind, m.lora_rank, tuple(m.lora_target_modules))
        params += adapters
        n_train = adapters + (dims["hidden"] + 1 if kind == "value" else 0)  # + the value head
    return Shape(params, n_train, torch.empty(0, dtype=dtype).element_size(), **dims)


# --------------------------------------------------------------------------- activations


def saved_activation_bytes(
    folder: str,
    kind: str,
    rows: int,
    length: int,
    response: int,
    *,
    checkpointing: bool = False,
    bf16: bool = False,
    temperature: float = 1.0,
) -> int:
    """Bytes autograd keeps for the backward pass of one training micro-batch: the model's
    forward over rows x length tokens (a causal LM's logits for the last response + 1
    positions, divided by the temperature, and their log-softmax as the policy loss takes
    it; a value model's values), traced on fake tensors. Each saved storage counted once; the
    model's parameters and buffers, which autograd saves by reference, not at all."""
    return _saved_bytes(
        folder, kind, rows, length, response, checkpointing, bf16, float(temperature)
    )


@lru_cache(maxsize=32)
def _saved_bytes(folder, kind, rows, length, response, checkpointing, bf16, temperature) -> int:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from proxima.algos import logprobs_from_logits

    config = hf_config(folder, kind)
    seen: dict[int, int] = {}
    held: set[int] = set()  # the model's own storages: counted as its weights already

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage._cdata not in held:
            seen[storage._cdata] = storage.nbytes()
        return t

    with FakeTensorMode(), quiet_transformers():
        model = _auto_class(kind).from_config(config)
        # a linear layer saves its weight for the input's gradient, the tied output head the
        # whole embedding matrix (at a 262k vocabulary, most of a small model's weights):
        # autograd keeps a reference, not a copy
        held.update(t.untyped_storage()._cdata for t in (*model.parameters(), *model.buffers()))
        if checkpointing:
            checkpoint_activations(model)  # as the run checkpoints its trained models
        model.train()
        ids = torch.zeros(rows, length, dtype=torch.long)
        mask = torch.ones(rows, length, dtype=torch.long)
        positions = torch.arange(length).expand(rows, length)
        amp = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else nullcontext()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), amp:
            if kind == "causal_lm":
                keep = {}  # only the response's logits, where the model can (models.forward)
                if "logits_to_keep" in inspect.signature(model.forward).parameters:
                    keep["logits_to_keep"] = response + 1
                inputs = dict(input_ids=ids, attention_mask=mask, position_ids=positions)
                out = model(**inputs, use_cache=False, **keep)
                logits = out.logits[:, -response - 1 : -1]
                if temperature != 1.0:
                    logits = logits / temperature
                logprobs_from_logits(logits, ids[:, -response:]).sum()
            else:
                out = model(input_ids=ids, attention_mask=mask, position_ids=positions)
                out.logits[:, -response - 1 : -1, 0].float().sum()
    return sum(seen.values())


def logits_bytes(rows: int, response: int, vocab: int, bf16: bool = False) -> int:
    """The logits of a scoring or training micro-batch ([rows, response + 1, vocab], in
    bfloat16 under autocast) plus a float32 copy of the response positions (the division by
    the temperature, or the upcast) and the chunked log-softmax's temporaries."""
    raw = rows * (response + 1) * vocab * (2 if bf16 else 4)
    scaled = rows * response * vocab * 4
    chunk = min(rows * response, max(1, CHUNK_ELEMENTS // vocab)) * vocab * 4
    return raw + scaled + 2 * chunk


def kv_cache_bytes(rows: int, length: int, shape: Shape, dtype_bytes: int) -> int:
    """A generation call's KV cache: rows x positions x layers x (K and V) x KV heads x
    head_dim elements."""
    return rows * length * shape.layers * 2 * shape.kv_heads * shape.head_dim * dtype_bytes


def forward_bytes(rows: int, length: int, shape: Shape, dtype_bytes: int) -> int:
    """Transient memory of a forward pass without autograd: one decoder layer's largest
    intermediates (the MLP's three, the residual stream and its normed copy, the attention's
    query, key, value and output) on rows x length tokens."""
    return rows * length * (3 * shape.intermediate + 6 * shape.hidden) * dtype_bytes
