"""Rollout engines: who writes the responses, behind one small interface.

Training (phase 1) and evaluation both call `engine.generate(prompt_ids, prompt_mask,
sampling)`; the trainer pushes the actor's weights into the engine after every optimizer
phase (`update_weights`), and an engine that holds memory between rollouts (vLLM's KV cache)
releases it in `sleep()` and takes it back in `wake_up()`. The shape follows verl's rollout
workers (`rollout.name`, `update_weights`, sleep / wake-up around generation) and TRL's
colocated vLLM mode.

- `hf` (`proxima.rollout.hf_engine.HFEngine`): a KV-cached decode loop
  (`proxima.rollout.decode`) on the trainer's own actor, transformers `generate` where the
  loop does not apply; nothing to push, works everywhere.
- `vllm` (`proxima.rollout.vllm_engine.VLLMEngine`): vLLM in the training process, loaded
  from the actor and updated after each optimizer phase.

This module is the contract only (`RolloutEngine`; what it exchanges, `Sampling` and
`Generation`, is `proxima.rollout.types`); `proxima.rollout.engines` builds the engine
`rollout.name` names.

A LoRA actor can reach an engine as its frozen base and its adapter instead of a merged copy
of the whole model: an engine that applies adapters itself also has `takes_adapter(model)`
and `update_adapter(base, adapter, version)` (vLLM built with LoRA support: the base is read
once, each push after that carries the adapter alone); `engines.sync_weights` uses them when
the engine has them and takes that actor's adapter, `update_weights` otherwise.

An engine may also keep multi-turn episodes' KV caches between turns: `session()` returns
an object (or None where it cannot) whose `generate(keys, prompt_ids, prompt_mask,
sampling)` answers one row per episode key and prefills only what that episode's kept cache
lacks (`hf`: `hf_engine.EpisodeSession`); `rollout.episodes` uses it when offered, with
`rollout.env.keep_kv_cache`, and `generate` otherwise.

An engine counts the weights it holds by the trainer's `weight_version`: the trainer pushes
whenever its actor is newer, so a rollout never samples from stale weights (tested with a
fake engine that serves from its own copy).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, runtime_checkable

import torch

from proxima.rollout.types import Generation, Sampling


class LogprobMismatchWarning(UserWarning):
    """The engine's log-probs are further from the trainer's than rollout.logprob_diff_warn."""


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
