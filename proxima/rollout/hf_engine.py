"""`rollout.name=hf`: sampling on the trainer's own actor, with the KV cache.

`HFEngine` serves the actor in micro-batches, each by the decode loop
(`proxima.rollout.decode`) or, where the loop does not apply (`decode.loop_applies`), by
HF `generate` with the glue it needs here: stop strings (`StopOnStrings`) and the log-probs
of the sampled tokens (`SampledLogprobs`).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import replace

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
)

from proxima.models.critic import generate_with_values
from proxima.models.unwrap import base_model
from proxima.rollout.decode import (
    EpisodeCaches,
    caches_kept_apply,
    decode_loop,
    loop_applies,
    sampling_warpers,
    synced_generation,
)
from proxima.rollout.types import Generation, Sampling, cat_generations


def with_model_stops(sampling: Sampling, model: torch.nn.Module) -> Sampling:
    """`sampling`, also stopping at the end-of-sequence ids of `model`'s generation_config
    (one id or a list), as HF `generate` and vLLM do: an instruct model whose turn ends
    with a token other than the tokenizer's EOS (Gemma 3's `<end_of_turn>`, added on
    import) stops there without `rollout.stop_token_ids`."""
    config = getattr(base_model(model), "generation_config", None)
    eos = getattr(config, "eos_token_id", None)
    eos = eos if isinstance(eos, list | tuple) else [eos]
    extra = tuple(int(i) for i in eos if i is not None and int(i) not in sampling.stop_ids)
    return replace(sampling, stop_ids=sampling.stop_ids + extra) if extra else sampling


class HFEngine:
    """`rollout.name=hf`: the decode loop (HF `generate` where it does not apply) in
    micro-batches of sequences.

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
        self.decode: Callable[[list[int]], str] | None = None
        if tokenizer is not None:
            self.decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)
        self.weight_version = -1
        # on_step(t, rows) before the decode loop samples the t-th token of a micro-batch of
        # `rows` rows (a rollout worker's partial rollouts); None: nothing to call
        self.on_step: Callable[[int, int], None] | None = None

    def generate(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling
    ) -> Generation:
        ids = prompt_ids.repeat_interleave(sampling.n, dim=0)
        mask = prompt_mask.repeat_interleave(sampling.n, dim=0)
        return self._micro_batches(ids, mask, sampling)

    def _micro_batches(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        sampling: Sampling,
        caches: EpisodeCaches | None = None,
        keys: Sequence[Hashable] = (),
    ) -> Generation:
        """One response per row, `micro_batch_size` rows at a time (`_respond`); with
        `caches`, row i is the episode `keys[i]` and its KV cache is kept."""
        size = self.micro_batch_size
        parts = [
            self._respond(
                prompt_ids[i : i + size],
                prompt_mask[i : i + size],
                sampling,
                None if caches is None else (caches, keys[i : i + size]),
            )
            for i in range(0, prompt_ids.shape[0], size)
        ]
        return cat_generations(parts, self.pad_token_id)

    def session(self) -> EpisodeSession | None:
        """Multi-turn episodes whose KV caches are kept between turns (`EpisodeSession`),
        or None where the decode loop cannot keep them (`decode.caches_kept_apply`): the
        episodes then continue their contexts with `generate`, prefilled whole."""
        return None if caches_kept_apply(self.model) else EpisodeSession(self)

    @torch.no_grad()
    def _respond(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        sampling: Sampling,
        kept: tuple[EpisodeCaches, Sequence[Hashable]] | None = None,
    ) -> Generation:
        """One response per row of a micro-batch of left-padded prompts [B, P]: the decode
        loop's, or HF `generate`'s where the loop does not apply. With `sampling.logprobs`,
        also the log-prob of each sampled token (`Generation.logprobs`); with
        `sampling.values` (a model that carries the critic), also the value of the state
        each token was sampled from (`Generation.values`: the decode step's final hidden
        state, the one its logits came from). `kept`: the decode loop's episode caches and
        the rows' keys (`EpisodeSession`)."""
        model, pad_token_id = self.model, self.pad_token_id
        sampling = with_model_stops(sampling, model)
        was_training = model.training
        model.eval()
        if loop_applies(model):
            out = self._hf_generate(prompt_ids, prompt_mask, sampling)
        else:
            step = self.on_step
            hook = None if step is None else (lambda t, rows=prompt_ids.shape[0]: step(t, rows))
            out = decode_loop(
                model, prompt_ids, prompt_mask, sampling, pad_token_id, self.decode, kept, hook
            )
        response_ids, mask, stopped, sampled, state_values = out
        model.train(was_training)
        # tokens after the first stop become padding so they can never leak into a forward pass
        response_ids = torch.where(
            mask.bool(), response_ids, torch.full_like(response_ids, pad_token_id)
        )
        return Generation(
            input_ids=torch.cat([prompt_ids, response_ids], dim=1),
            attention_mask=torch.cat([prompt_mask.long(), mask], dim=1),
            response_mask=mask,
            stopped=stopped,
            # after its stop a row's tokens are padding, possibly outside the top-k / top-p
            # set (-inf): where, not a product, so no NaN
            logprobs=torch.where(mask.bool(), sampled, 0.0) if sampling.logprobs else None,
            values=state_values * mask if state_values is not None else None,
        )

    def _hf_generate(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling
    ) -> tuple[torch.Tensor, ...]:
        """`decode_loop`'s result from HF `generate`: (tokens [B, n], mask [B, n], stopped
        [B], log-probs [B, n] or None, values [B, n] or None), the stop strings met by
        `StopOnStrings`, the log-probs recorded by `SampledLogprobs`."""
        stop_ids = list(sampling.stop_ids)
        sample = (
            {"do_sample": False}
            if sampling.greedy
            else {
                "do_sample": True,
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "top_k": sampling.top_k,
            }
        )
        recorder = SampledLogprobs(sampling_warpers(sampling)) if sampling.logprobs else None
        strings = None
        if sampling.stop_strings and self.decode is not None:
            width = prompt_ids.shape[1]
            strings = StopOnStrings(sampling.stop_strings, self.decode, width, stop_ids)
        kwargs = dict(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            max_new_tokens=sampling.max_new_tokens,
            eos_token_id=stop_ids,
            pad_token_id=self.pad_token_id,
            use_cache=True,
            synced_gpus=synced_generation(self.model),
            logits_processor=LogitsProcessorList([recorder]) if recorder else None,
            stopping_criteria=StoppingCriteriaList([strings]) if strings else None,
            **sample,
        )
        state_values = None
        if sampling.values:
            out, state_values = generate_with_values(self.model, **kwargs)
        else:
            out = self.model.generate(**kwargs)
        response_ids = out[:, prompt_ids.shape[1] :]
        mask, stopped = response_mask_after_stop(response_ids, stop_ids)
        if strings is not None:
            mask, stopped = strings.cut(mask, stopped)
        sampled = recorder.finish(out[:, -1]) if recorder else None
        return response_ids, mask, stopped, sampled, state_values

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


class EpisodeSession:
    """The turns of one batch of multi-turn episodes on the hf engine, each episode's KV
    cache kept from one turn to the next (`decode.EpisodeCaches`), so a turn prefills only
    the tokens its context gained since (the observation, the action's last token) and
    then decodes; what `rollout.episodes` uses when the engine offers it."""

    def __init__(self, engine: HFEngine) -> None:
        self.engine, self.caches = engine, EpisodeCaches()

    def generate(
        self,
        keys: Sequence[Hashable],
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        sampling: Sampling,
    ) -> Generation:
        """`HFEngine.generate` of one sample per row (`sampling.n` = 1) for the episodes
        `keys` (one per row of the left-padded contexts), in the same micro-batches; the
        caches of the episodes not named (ended) are dropped first."""
        if sampling.n != 1:
            raise ValueError(f"an episode turn samples one action per row, not n={sampling.n}")
        self.caches.retain(keys)
        return self.engine._micro_batches(prompt_ids, prompt_mask, sampling, self.caches, keys)


def response_mask_after_stop(
    response_ids: torch.Tensor, stop_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask of tokens up to and including the first stop token, and whether one occurred.

    response_ids: [B, R]. Returns (mask [B, R] long, stopped [B] bool). Everything after the
    first stop token (padding, or tokens a batch-mate kept generating) is masked out.
    """
    is_stop = torch.isin(response_ids, torch.tensor(stop_ids, device=response_ids.device))
    # number of stop tokens strictly before position t; a token is kept while that is 0
    before = torch.cumsum(is_stop.long(), dim=1) - is_stop.long()
    return (before == 0).long(), is_stop.any(dim=1)


class StopOnStrings(StoppingCriteria):
    """Ends a row once the text of its new tokens contains one of `stop_strings` (a turn's
    end, `rollout.env.turn_stop`); `stop_at[b]` is then the index of the response token that
    completed it. Rows that already produced one of `stop_ids` are left to those."""

    def __init__(
        self,
        stop_strings: tuple[str, ...],
        decode: Callable[[list[int]], str],
        prompt_width: int,
        stop_ids: list[int],
    ) -> None:
        self.stop_strings, self.decode = stop_strings, decode
        self.start, self.stop_ids = prompt_width, set(stop_ids)
        self.stop_at: dict[int, int] = {}

    def __call__(self, input_ids: torch.LongTensor, scores, **_) -> torch.BoolTensor:
        for b, row in enumerate(input_ids[:, self.start :].tolist()):
            if b in self.stop_at or self.stop_ids.intersection(row):
                continue
            if any(s in self.decode(row) for s in self.stop_strings):
                self.stop_at[b] = len(row) - 1
        hit = [b in self.stop_at for b in range(input_ids.shape[0])]
        return torch.tensor(hit, dtype=torch.bool, device=input_ids.device)

    def cut(self, mask: torch.Tensor, stopped: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`mask` [B, R] and `stopped` [B] with the rows that met a string ending there."""
        mask, stopped = mask.clone(), stopped.clone()
        for b, at in self.stop_at.items():
            mask[b, at + 1 :] = 0
            stopped[b] = True
        return mask, stopped


class SampledLogprobs(LogitsProcessor):
    """Records the log-prob of each sampled token under the distribution it was drawn from.

    transformers runs the processors a caller passes before its own temperature / top-k /
    top-p warpers, so this one applies the same warpers, in generate's order, to a copy of
    the scores and keeps the log-softmax of the step; the token drawn from it is known one
    step later (the last column of `input_ids`), or after generate returns for the last step
    (`finish`). Memory: one [B, V] step, never [B, R, V]. Scores pass through unchanged.
    """

    def __init__(self, warpers: LogitsProcessorList) -> None:
        self.warpers = warpers
        self.previous: torch.Tensor | None = None
        self.picked: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor):
        if self.previous is not None:
            self.picked.append(self.previous.gather(1, input_ids[:, -1:]))
        warped = self.warpers(input_ids, scores.detach().float().clone())
        self.previous = torch.log_softmax(warped, dim=-1)
        return scores

    def finish(self, last_tokens: torch.Tensor) -> torch.Tensor:
        """[B, R] float32, given the last generated column [B]."""
        self.picked.append(self.previous.gather(1, last_tokens.unsqueeze(1)))
        return torch.cat(self.picked, dim=1)
