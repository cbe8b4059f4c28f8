"""`rollout.name=hf`: transformers `generate` with the KV cache, on the trainer's own actor."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from proxima.rollout.engine import Sampling
from proxima.rollout.generate import Generation, cat_generations, generate_responses


class HFEngine:
    """`rollout.name=hf`: transformers `generate` (KV cache) in micro-batches of sequences.

    It serves the model it was given, the trainer's actor module itself: its weights are
    always current, so `update_weights` only records the version and never reads the
    tensors (no LoRA merge, nothing copied). An actor that carries the critic
    (`models.critic.PolicyValue`) also gives the values of the sampled states
    (`Sampling.values`). With a `tokenizer` it stops on `Sampling.stop_strings` too.
    """

    name = "hf"

    def __init__(
        self,
        model: torch.nn.Module,
        pad_token_id: int,
        micro_batch_size: int,
        tokenizer=None,
    ) -> None:
        self.model, self.pad_token_id = model, pad_token_id
        self.micro_batch_size = micro_batch_size
        self.decode = None
        if tokenizer is not None:
            self.decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)
        self.weight_version = -1

    def generate(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling
    ) -> Generation:
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
                values=sampling.values,
                stop_strings=sampling.stop_strings,
                decode=self.decode,
            )
            for i in range(0, ids.shape[0], size)
        ]
        return cat_generations(parts, self.pad_token_id)

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        self.weight_version = version

    def sleep(self) -> None:  # nothing held between rollouts
        pass

    def wake_up(self) -> None:
        pass

    def close(self) -> None:  # the actor belongs to the trainer
        pass
