"""The rollout engines `rollout.name` names, as classes in a registry (`ENGINES`): each one
answers, before anything heavy is built, whether it can run (`check`), what memory it holds
of its own (`held_memory`), whether its log-probs of the sampled tokens are the trainer's
(`logprobs_differ`), and builds itself once per run (`build`). The rest of proxima asks the
engine's class instead of comparing `rollout.name`.

- `hf` (`HFSpec`): transformers `generate` on the trainer's own actor module
  (`rollout.hf_engine.HFEngine`): under the trainer's autocast, its KV cache counted in the
  memory plan's generate phase, its log-probs exact under the conditions of
  `HFSpec.logprobs_differ`, and a value head's values come with the tokens.
- `vllm` (`VLLMSpec`): vLLM in the training process (`rollout.vllm_engine.VLLMEngine`, imported
  only when chosen: an optional dependency), with its own copy of the weights, its own
  KV-cache reservation and its own kernels.

An engine built outside proxima (a test's fake, a caller's own) is answered by the base class
`EngineSpec`: its own kernels, nothing known of its memory (`spec_of`).
"""

from __future__ import annotations

import os

import torch

from proxima.config import Config, ConfigError, RolloutConfig
from proxima.models import DTYPES
from proxima.models.critic import policy_of
from proxima.models.lora import export_adapter, is_lora
from proxima.models.saving import export_base_weights, export_weights
from proxima.rollout.contract import RolloutEngine
from proxima.rollout.hf_engine import HFEngine
from proxima.rollout.plan import NEUTRAL_GENERATION_FIELDS

GiB = 2**30


class EngineSpec:
    """A rollout engine as proxima knows it before one is built. This base class answers
    for an engine built outside proxima (named `name`): its own kernels, nothing held that
    the memory plan would count, nothing to check."""

    name = "external"
    # generates with the trainer's actor module itself: under the trainer's autocast, with
    # the value head of a critic on the actor giving values during generation, its KV cache
    # in the trainer's memory
    serves_actor = False
    # keys that bring its log-probs nearer the trainer's (beyond rollout correction)
    logprob_fixes: tuple[str, ...] = ()

    def __init__(self, name: str | None = None) -> None:
        if name is not None:
            self.name = name

    def check(self, cfg: Config, model_path: str | None = None) -> None:
        """Stop before anything heavy when this engine cannot run (ConfigError naming the
        key and the fix); `model_path`: the actor's folder when not yet model.actor_path."""

    def build(self, cfg: Config, actor: torch.nn.Module, tokenizer, device: torch.device):
        raise ConfigError(f"the {self.name} engine is built by its caller, not from the config")

    def held_memory(
        self, cfg: Config, actor_params: int, actor_dtype_bytes: int, device_total: int | None
    ) -> dict[str, int]:
        """Bytes it holds through the whole run besides the trainer's models, by part
        (`device_total`: the GPU's bytes, None on a CPU)."""
        return {}

    def logprobs_differ(self, cfg: Config, generation_config=None) -> str:
        """Why its log-probs of the sampled tokens are NOT the trainer's old log-probs, or
        "" when they are the same quantity (`rollout.plan`: `rollout.old_logprobs=auto`).
        `generation_config`: the actor's (a transformers GenerationConfig; None: nothing
        set)."""
        return f"the {self.name} engine has its own kernels"


class HFSpec(EngineSpec):
    """`rollout.name=hf`: transformers `generate` with the KV cache on the trainer's actor."""

    name = "hf"
    serves_actor = True

    def build(self, cfg: Config, actor: torch.nn.Module, tokenizer, device: torch.device):
        return HFEngine(actor, tokenizer.pad_token_id, cfg.rollout.micro_batch_size, tokenizer)

    def logprobs_differ(self, cfg: Config, generation_config=None) -> str:
        """Its log-probs are the actor's own (the same module and the same pass, up to the
        KV-cached decode's float rounding, ~1e-7) in float32 without autocast, sampled with
        no truncation (top_k=0, top_p=1), and when the actor's generation_config adds no
        logits processor (e.g. suppress_tokens, repetition_penalty)."""
        r = cfg.rollout
        if cfg.model.dtype != "float32" or cfg.model.mixed_precision != "no":
            return "not float32 (the KV-cached decode rounds differently from the forward pass)"
        if r.top_k or r.top_p < 1.0:
            return "top_k / top_p renormalise the sampled distribution"
        if cfg.algorithm.corrects_rollout:
            return "algorithm.rollout_correction / rollout_rejection compare the two"
        diff = generation_config.to_diff_dict() if generation_config is not None else {}
        extra = sorted(set(diff) - NEUTRAL_GENERATION_FIELDS)
        if extra:
            return f"the actor's generation_config sets {', '.join(extra)}"
        return ""


class VLLMSpec(EngineSpec):
    """`rollout.name=vllm`: vLLM in the training process, loaded from the actor's folder and
    sent its weights after every update."""

    name = "vllm"
    logprob_fixes = ("rollout.vllm.dtype=float32",)

    def check(self, cfg: Config, model_path: str | None = None) -> None:
        """vLLM installed, and able to run this model (`vllm_engine.check_vllm`)."""
        from proxima.rollout.vllm_engine import check_vllm

        check_vllm(cfg, model_path)

    def build(self, cfg: Config, actor: torch.nn.Module, tokenizer, device: torch.device):
        from proxima.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(cfg, tokenizer, device)

    def held_memory(
        self, cfg: Config, actor_params: int, actor_dtype_bytes: int, device_total: int | None
    ) -> dict[str, int]:
        """Its copy of the weights and its KV-cache reservation (VLLM_CPU_KVCACHE_SPACE GiB
        on a CPU); on a GPU its whole share, rollout.vllm.gpu_memory_utilization of it."""
        # the reservation the engine asks for when VLLM_CPU_KVCACHE_SPACE is unset (not vLLM's
        # own default): the plan runs before the engine sets it (`vllm_engine.CPU_KV_GIB`)
        from proxima.rollout.vllm_engine import CPU_KV_GIB

        v = cfg.rollout.vllm
        if device_total is not None:
            return {"vllm engine": int(v.gpu_memory_utilization * device_total)}
        dtype_bytes = actor_dtype_bytes if v.dtype == "auto" else DTYPES[v.dtype].itemsize
        kv = float(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or CPU_KV_GIB)
        return {"vllm weights": actor_params * dtype_bytes, "vllm kv cache": int(kv * GiB)}


# the names are config.choices.ENGINES, which validation checks rollout.name against
ENGINES: dict[str, type[EngineSpec]] = {cls.name: cls for cls in (HFSpec, VLLMSpec)}


def engine_spec(name: str) -> EngineSpec:
    """The engine `rollout.name`=`name` names; ConfigError for a name no engine has."""
    if name not in ENGINES:
        raise ConfigError(
            f"`rollout.name`={name!r} is no rollout engine. Use one of: {', '.join(ENGINES)}."
        )
    return ENGINES[name]()


def spec_of(engine: RolloutEngine | str) -> EngineSpec:
    """The class answering for a built engine (or the name of one): its registered class,
    or the base `EngineSpec` for one built outside proxima."""
    name = engine if isinstance(engine, str) else engine.name
    return ENGINES[name]() if name in ENGINES else EngineSpec(name)


def check_engine(cfg: Config, model_path: str | None = None) -> None:
    """Stop before anything heavy when the configured engine cannot run (ConfigError naming
    the key and the fix); the `hf` engine always can."""
    engine_spec(cfg.rollout.name).check(cfg, model_path)


def build_engine(cfg: Config, actor: torch.nn.Module, tokenizer, device: torch.device):
    """The engine `rollout.name` names, for a run whose actor module is `actor` (the `hf`
    engine serves it directly; vLLM loads the actor's folder and gets its weights pushed)."""
    return engine_spec(cfg.rollout.name).build(cfg, actor, tokenizer, device)


def as_engine(actor_or_engine, tokenizer, cfg: RolloutConfig) -> RolloutEngine:
    """An engine as given, or a model wrapped in the `hf` engine (the model is served live)."""
    if isinstance(actor_or_engine, torch.nn.Module):
        return HFEngine(actor_or_engine, tokenizer.pad_token_id, cfg.micro_batch_size, tokenizer)
    return actor_or_engine


def sync_weights(engine: RolloutEngine, actor: torch.nn.Module, version: int) -> RolloutEngine:
    """`engine`, holding the weights of `actor` at `version`: pushed unless it holds them
    already. A LoRA policy goes as its frozen base and its adapter to an engine that takes
    adapters (`takes_adapter`, `update_adapter`: vLLM built with LoRA support); any other
    as whole weights (`models.saving.export_weights`: HF names, LoRA merged into a copy; the
    `hf` engine serves the actor itself and never reads them). An actor's value head stays."""
    if engine.weight_version == version:
        return engine
    policy = policy_of(actor)
    takes_adapter = getattr(engine, "takes_adapter", None)
    if is_lora(policy) and takes_adapter is not None and takes_adapter(policy):
        engine.update_adapter(export_base_weights(policy), export_adapter(policy), version)
    else:
        engine.update_weights(export_weights(policy), version)
    return engine
