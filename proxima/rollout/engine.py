"""Rollout engines: who writes the responses, behind one small interface.

Training (phase 1) and evaluation both call `engine.generate(prompt_ids, prompt_mask,
sampling)`; the trainer pushes the actor's weights into the engine after every optimizer
phase (`update_weights`), and an engine that holds memory between rollouts (vLLM's KV cache)
releases it in `sleep()` and takes it back in `wake_up()`. The shape follows verl's rollout
workers (`rollout.name`, `update_weights`, sleep / wake-up around generation) and TRL's
colocated vLLM mode.

- `hf` (`proxima.rollout.hf_engine.HFEngine`): transformers `generate` with the KV cache
  on the trainer's own actor (a thin wrapper over `generate_responses`); nothing to push,
  works everywhere.
- `vllm` (`proxima.rollout.vllm_engine.VLLMEngine`): vLLM in the training process, loaded
  from the actor and updated after each optimizer phase.

This module is the contract only (`Sampling`, `RolloutEngine`); `proxima.rollout.engines`
builds the engine `rollout.name` names.

A LoRA actor can reach an engine as its frozen base and its adapter instead of a merged copy
of the whole model: an engine that applies adapters itself also has `takes_adapter(model)`
and `update_adapter(base, adapter, version)` (vLLM built with LoRA support: the base is read
once, each push after that carries the adapter alone); `engines.sync_weights` uses them when
the engine has them and takes that actor's adapter, `update_weights` otherwise.

An engine counts the weights it holds by the trainer's `weight_version`: the trainer pushes
whenever its actor is newer, so a rollout never samples from stale weights (tested with a
fake engine that serves from its own copy).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from proxima.config import RolloutConfig
from proxima.rollout.generate import Generation


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
    # also the values of the states the tokens were sampled from (`Generation.values`): only
    # the hf engine serving an actor that carries the critic can
    values: bool = False
    # strings that also end a response, at the token that completes one (multi-turn
    # episodes' rollout.env.turn_stop); an engine that cannot stop on them may run on: the
    # episode cuts each action at the first one all the same
    stop_strings: tuple[str, ...] = ()

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
        """The rollout section's sampling; with `rollout.env`, that of one turn of an
        episode (its action budget and stop strings)."""
        episode = bool(cfg.env.cls)
        return cls(
            max_new_tokens=(cfg.env.max_turn_tokens if episode else 0) or cfg.max_response_length,
            stop_ids=tuple(stop_ids),
            greedy=greedy,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            n=n,
            logprobs=logprobs,
            values=values,
            stop_strings=tuple(cfg.env.turn_stop) if episode else (),
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
        on, and no adapter on them. The iterable is lazy: an engine that serves the actor
        itself never reads it."""
        ...

    def sleep(self) -> None:
        """Release what generation alone needs (KV cache) until `wake_up`."""
        ...

    def wake_up(self) -> None: ...

    def close(self) -> None:
        """Release the engine for good, while the process group it may use is alive."""
        ...
