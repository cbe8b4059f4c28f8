"""Rollout engines: who writes the responses, behind one small interface.

Training (phase 1) and evaluation both call `engine.generate(prompt_ids, prompt_mask,
sampling)`; the trainer pushes the actor's weights into the engine after every optimizer
phase (`update_weights`), and an engine that holds memory between rollouts (vLLM's KV cache)
releases it in `sleep()` and takes it back in `wake_up()`. The shape follows verl's rollout
workers (`rollout.name`, `update_weights`, sleep / wake-up around generation) and TRL's
colocated vLLM mode.

- `hf` (`HFEngine`): transformers `generate` with the KV cache on the trainer's own actor
  (a thin wrapper over `generate_responses`); nothing to push, works everywhere.
- `vllm` (`proxima.rollout.vllm_engine.VLLMEngine`): vLLM in the training process, loaded
  from the actor and updated after each optimizer phase.

An engine counts the weights it holds by the trainer's `weight_version`: the trainer pushes
whenever its actor is newer, so a rollout never samples from stale weights (tested with a
fake engine that serves from its own copy).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from proxima.config import Config, RolloutConfig
from proxima.models.saving import load_named_weights
from proxima.rollout.generate import Generation, generate_responses


class LogprobMismatchWarning(UserWarning):
    """The engine's log-probs are further from the trainer's than rollout.logprob_diff_warn."""


@dataclass(frozen=True)
class Sampling:
    """How to sample one batch: what every engine must honour."""

    max_new_tokens: int
    stop_ids: tuple[int, ...]  # a response ends at (and includes) the first of these
    greedy: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    n: int = 1  # samples per prompt: rows i * n ... i * n + n - 1 answer prompt i
    logprobs: bool = False  # also return the engine's own log-probs (`Generation.logprobs`)
    # also the values of the served actor's shared-backbone value head (`Generation.values`);
    # only the hf engine, given a `value_head`, can
    values: bool = False

    @classmethod
    def from_config(
        cls,
        cfg: RolloutConfig,
        stop_ids: list[int],
        *,
        greedy: bool,
        n: int,
        logprobs: bool,
        values: bool = False,
    ) -> Sampling:
        return cls(
            max_new_tokens=cfg.max_response_length,
            stop_ids=tuple(stop_ids),
            greedy=greedy,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            n=n,
            logprobs=logprobs,
            values=values,
        )


@runtime_checkable
class RolloutEngine(Protocol):
    name: str
    weight_version: int  # the trainer's weight version the engine serves (-1: none yet)

    def generate(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling
    ) -> Generation:
        """Responses to left-padded prompts [B, P]: a Generation of B * sampling.n rows,
        prompt-major, on the prompts' device."""
        ...

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Serve these weights (HF checkpoint names, `models.saving.export_weights`) from now
        on. The iterable is lazy: an engine that serves the actor itself never reads it."""
        ...

    def sleep(self) -> None:
        """Release what generation alone needs (KV cache) until `wake_up`."""
        ...

    def wake_up(self) -> None: ...


def cat_generations(parts: list[Generation], pad_id: int) -> Generation:
    """Concatenate generation chunks whose response widths differ (pad on the right)."""
    r = max(p.response_mask.shape[1] for p in parts)

    def pad(t: torch.Tensor, width: int, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    def per_token(name: str) -> torch.Tensor | None:
        got = [getattr(p, name) for p in parts]
        return None if any(t is None for t in got) else torch.cat([pad(t, r, 0.0) for t in got])

    ids, attn = [], []
    for p in parts:
        extra = r - p.response_mask.shape[1]
        ids.append(pad(p.input_ids, p.input_ids.shape[1] + extra, pad_id))
        attn.append(pad(p.attention_mask, p.attention_mask.shape[1] + extra, 0))
    return Generation(
        torch.cat(ids),
        torch.cat(attn),
        torch.cat([pad(p.response_mask, r, 0) for p in parts]),
        torch.cat([p.stopped for p in parts]),
        logprobs=per_token("logprobs"),
        values=per_token("values"),
    )


class HFEngine:
    """`rollout.name=hf`: transformers `generate` (KV cache) in micro-batches of sequences.

    By default it serves the model it was given, the trainer's actor itself: its weights
    are always current, so `update_weights` only records the version and never reads the
    tensors (no LoRA merge, nothing copied). With `own_weights=True` the model is a separate
    copy and `update_weights` copies the tensors into it. `value_head`: a shared-backbone
    critic's head on the served actor, for `Sampling.values`.
    """

    name = "hf"

    def __init__(
        self,
        model: torch.nn.Module,
        pad_token_id: int,
        micro_batch_size: int,
        *,
        own_weights: bool = False,
        value_head: torch.nn.Module | None = None,
    ) -> None:
        self.model, self.pad_token_id = model, pad_token_id
        self.micro_batch_size, self.own_weights = micro_batch_size, own_weights
        self.value_head = value_head
        self.weight_version = -1

    def generate(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling
    ) -> Generation:
        if sampling.values and self.value_head is None:
            raise ValueError("Sampling.values needs an hf engine built with a value_head")
        ids = prompt_ids.repeat_interleave(sampling.n, dim=0)
        mask = prompt_mask.repeat_interleave(sampling.n, dim=0)
        size = self.micro_batch_size
        parts = [
            generate_responses(
                self.model,
                ids[i : i + size],
                mask[i : i + size],
                max_new_tokens=sampling.max_new_tokens,
                stop_ids=list(sampling.stop_ids),
                pad_token_id=self.pad_token_id,
                greedy=sampling.greedy,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                logprobs=sampling.logprobs,
                value_head=self.value_head if sampling.values else None,
            )
            for i in range(0, ids.shape[0], size)
        ]
        return cat_generations(parts, self.pad_token_id)

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        if self.own_weights:
            with torch.no_grad():
                load_named_weights(self.model, named_tensors, "the pushed actor weights")
        self.weight_version = version

    def sleep(self) -> None:  # nothing held between rollouts
        pass

    def wake_up(self) -> None:
        pass


def as_engine(actor_or_engine, tokenizer, cfg: RolloutConfig) -> RolloutEngine:
    """An engine as given, or a model wrapped in the `hf` engine (the model is served live)."""
    if isinstance(actor_or_engine, torch.nn.Module):
        return HFEngine(actor_or_engine, tokenizer.pad_token_id, cfg.micro_batch_size)
    return actor_or_engine


def check_engine(cfg: Config, model_path: str | None = None) -> None:
    """Stop before anything heavy when the configured engine cannot run (ConfigError naming
    the key and the fix); the `hf` engine always can."""
    if cfg.rollout.name == "vllm":
        from proxima.rollout.vllm_engine import check_engine as check_vllm

        check_vllm(cfg, model_path)


def build_engine(
    cfg: Config,
    actor: torch.nn.Module,
    tokenizer,
    device: torch.device,
    value_head: torch.nn.Module | None = None,
):
    """The engine `rollout.name` names, for a run whose actor is `actor` (and whose shared-
    backbone critic is `value_head`, which only the hf engine can read)."""
    if cfg.rollout.name == "vllm":
        from proxima.rollout.vllm_engine import VLLMEngine

        return VLLMEngine(cfg, tokenizer, device)
    return HFEngine(
        actor, tokenizer.pad_token_id, cfg.rollout.micro_batch_size, value_head=value_head
    )
