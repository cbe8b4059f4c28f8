"""A rollout engine for tests that serves from its own copy of the weights, like vLLM, and
checks on every rollout that the copy is the actor's current weights.

It starts from perturbed weights (vLLM starts from dummy ones), so a trainer that forgets a
push, at the start or after any update, samples from stale weights and the engine raises.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable

import torch

from proxima.models.critic import policy_of
from proxima.models.lora import is_lora, merged_copy
from proxima.models.saving import export_weights, load_named_weights
from proxima.rollout.hf_engine import HFEngine
from proxima.rollout.types import Generation, Sampling


class StaleWeightsError(AssertionError):
    pass


class FakeEngine:
    name = "fake"

    def __init__(
        self,
        model: torch.nn.Module,
        pad_token_id: int,
        micro_batch_size: int = 64,
        *,
        watch: Callable[[], torch.nn.Module] | None = None,
        logprob_shift: float = 0.0,
    ) -> None:
        model = policy_of(model)  # an engine serves the policy; the actor's value head stays
        own = merged_copy(model) if is_lora(model) else copy.deepcopy(model)
        with torch.no_grad():  # "dummy" weights until the first push
            for p in own.parameters():
                p.add_(0.5)
        self.inner = HFEngine(own, pad_token_id, micro_batch_size)
        self.watch, self.logprob_shift = watch, logprob_shift
        self.pushes: list[int] = []  # the version of each push
        self.served: list[int] = []  # the version held at each generate
        self.awake = False

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    def generate(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling
    ) -> Generation:
        assert self.awake, "generate called on a sleeping engine"
        if self.watch is not None:
            self.check_current(self.watch())
        self.served.append(self.weight_version)
        gen = self.inner.generate(prompt_ids, prompt_mask, sampling)
        if gen.logprobs is not None and self.logprob_shift:
            gen.logprobs = (gen.logprobs + self.logprob_shift) * gen.response_mask
        return gen

    def check_current(self, actor: torch.nn.Module) -> None:
        mine = dict(export_weights(self.inner.model))
        for name, tensor in export_weights(policy_of(actor)):
            if not torch.equal(mine[name], tensor):
                raise StaleWeightsError(
                    f"sampling from stale weights: {name} differs from the actor's "
                    f"(engine holds version {self.weight_version})"
                )

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int):
        with torch.no_grad():
            load_named_weights(self.inner.model, named_tensors, "the pushed actor weights")
        self.inner.update_weights((), version)
        self.pushes.append(version)

    def sleep(self) -> None:
        self.awake = False

    def wake_up(self) -> None:
        self.awake = True

    def close(self) -> None:
        self.closed = True
