"""Phase 1 with the `hf` engine: a KV-cached decode loop over the actor.

`generate_responses` is the one function the `hf` rollout engine (proxima.rollout.engine)
wraps; other engines (vLLM) return the same `Generation`. It runs its own loop
(`decode_loop`): the prompts are prefilled in groups of similar length (no left padding
computed), a row that has ended leaves the batch (its KV cache with it), so the later
steps compute only the rows still going, and a token is drawn by inverting the cumulative
distribution (one uniform number per row and a binary search: an exact draw from p, where
`torch.multinomial` draws an exponential number per token of the vocabulary). Where the
loop does not apply (an FSDP2 model under torchrun, whose ranks must step together; a model
whose forward takes no `cache`, `position_ids` or `logits_to_keep`; a generation_config
with logits processors beyond `suppress_tokens`) it is HF `generate`, whose samples come
from the same distribution.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, fields

import torch
from torch.nn.functional import pad
from transformers import (
    DynamicCache,
    LogitsProcessor,
    LogitsProcessorList,
    StoppingCriteria,
    StoppingCriteriaList,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.cache_utils import DynamicLayer

from proxima.models.critic import (
    HeadInput,
    PolicyValue,
    check_policy_value,
    generate_with_values,
    value_of,
)
from proxima.models.unwrap import base_model
from proxima.rollout.plan import NEUTRAL_GENERATION_FIELDS
from proxima.types import token_budget_groups


@dataclass
class Generation:
    input_ids: torch.Tensor  # [B, P + R] prompt (left-padded) + response (right-padded)
    attention_mask: torch.Tensor  # [B, P + R]
    response_mask: torch.Tensor  # [B, R] up to and including the first stop token
    stopped: torch.Tensor  # [B] bool: the response ended with a stop token
    # [B, R] float32, the engine's own log-prob of each response token under the distribution
    # it was sampled from (after temperature, top-k, top-p), 0 where masked; None when the
    # engine was not asked for them
    logprobs: torch.Tensor | None = None
    # [B, R] float32, the values of the states the tokens were sampled from, when the served
    # actor carries the critic (`generate_responses(values=True)`), 0 where masked; else None
    values: torch.Tensor | None = None
    # [B, R] float32, multi-turn episodes (`rollout.env`): each turn's reward at the turn's
    # last action token, 0 elsewhere; None for single responses
    turn_rewards: torch.Tensor | None = None

    @property
    def response_ids(self) -> torch.Tensor:
        return self.input_ids[:, -self.response_mask.shape[1] :]

    def rows(self, index: torch.Tensor) -> Generation:
        """The rows `index` ([K] long), in that order."""
        return Generation(
            **{
                f.name: getattr(self, f.name)[index.to(self.input_ids.device)]
                for f in fields(self)
                if getattr(self, f.name) is not None
            }
        )

    def to(self, device: torch.device | str) -> Generation:
        moved = {
            f.name: getattr(self, f.name).to(device)
            for f in fields(self)
            if getattr(self, f.name) is not None
        }
        return Generation(**moved)


def cat_generations(parts: list[Generation], pad_id: int) -> Generation:
    """Concatenate generations whose prompt widths P and response widths R differ: prompts
    are padded on the left (positions are counted from each row's first real token, so a
    row's log-probs do not change), responses on the right."""
    p = max(g.input_ids.shape[1] - g.response_mask.shape[1] for g in parts)
    r = max(g.response_mask.shape[1] for g in parts)

    def pad(t: torch.Tensor, left: int, right: int, value: float) -> torch.Tensor:
        return torch.nn.functional.pad(t, (left, right), value=value)

    def per_token(name: str) -> torch.Tensor | None:
        got = [getattr(g, name) for g in parts]
        if any(t is None for t in got):
            return None
        return torch.cat([pad(t, 0, r - t.shape[1], 0.0) for t in got])

    ids, attn = [], []
    for g in parts:
        left = p - (g.input_ids.shape[1] - g.response_mask.shape[1])
        right = r - g.response_mask.shape[1]
        ids.append(pad(g.input_ids, left, right, pad_id))
        attn.append(pad(g.attention_mask, left, right, 0))
    return Generation(
        torch.cat(ids),
        torch.cat(attn),
        torch.cat([pad(g.response_mask, 0, r - g.response_mask.shape[1], 0) for g in parts]),
        torch.cat([g.stopped for g in parts]),
        logprobs=per_token("logprobs"),
        values=per_token("values"),
        turn_rewards=per_token("turn_rewards"),
    )


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


def synced_generation(model: torch.nn.Module) -> bool:
    """An FSDP2-sharded model in a multi-process job: every forward all-gathers the layers
    from all ranks, so a rank whose responses have all ended must keep stepping until every
    rank has (transformers' `synced_gpus`), else the ranks' collectives fall out of step
    (transformers #33483)."""
    import torch.distributed as tdist
    from torch.distributed.fsdp import FSDPModule

    multi = tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1
    return multi and isinstance(model, FSDPModule)


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


def _warpers(greedy: bool, temperature: float, top_p: float, top_k: int) -> LogitsProcessorList:
    if greedy:
        return LogitsProcessorList()
    out = LogitsProcessorList()
    if temperature != 1.0:
        out.append(TemperatureLogitsWarper(temperature))
    if top_k:
        out.append(TopKLogitsWarper(top_k=top_k, min_tokens_to_keep=1))
    if top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=top_p, min_tokens_to_keep=1))
    return out


# what the decode loop applies of the actor's generation_config, beyond the neutral fields
LOOP_GENERATION_FIELDS = NEUTRAL_GENERATION_FIELDS | {"suppress_tokens"}
# compact the batch once this share of its rows has ended (each compaction copies the cache)
COMPACT_SHARE = 0.25
# padded prompt tokens per prefill pass, when prompts of different lengths are prefilled in
# groups of similar length
PREFILL_TOKENS = 2048


def loop_applies(model: torch.nn.Module) -> str:
    """Why `decode_loop` cannot serve `model` ("" when it can): see the module's docstring."""
    if synced_generation(model):
        return "an FSDP2 model under torchrun: every rank steps until all have ended"
    hf = base_model(model.policy if isinstance(model, PolicyValue) else model)
    params = inspect.signature(hf.forward).parameters
    missing = [k for k in ("cache", "position_ids", "logits_to_keep") if k not in params]
    if missing:
        return f"{type(hf).__name__}.forward takes no {', '.join(missing)}"
    config = getattr(hf, "generation_config", None)
    extra = set(config.to_diff_dict()) - LOOP_GENERATION_FIELDS if config is not None else ()
    if extra:
        return f"the generation_config sets {', '.join(sorted(extra))}"
    return ""


def inverse_cdf_draw(probs: torch.Tensor) -> torch.Tensor:
    """One draw per row of `probs` [B, V] (any non-negative weights): the first token whose
    cumulative weight exceeds u x the total, u ~ U[0, 1) one per row. The cumulative sum is
    in float64, so the draw is from p to ~1e-16; a token of weight 0 is never picked (its
    cumulative weight equals its predecessor's, which would be picked first). A row of
    non-finite weights (a diverged policy) gets a token in range, and its non-finite
    log-probs are what the trainer's checks report."""
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1:]
    u = torch.rand(total.shape, dtype=torch.float64, device=probs.device)
    x = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True)[:, 0].clamp_(max=probs.shape[1] - 1)


def _cache_groupable(policy: torch.nn.Module) -> bool:
    """Whether prefill groups' caches can be joined: the model's cache holds every layer's
    keys and values in full (a `DynamicLayer`), not a sliding window's."""
    try:
        probe = DynamicCache(config=base_model(policy).config)
    except Exception:  # a config the cache cannot read: leave the prefill whole
        return False
    return all(type(layer) is DynamicLayer for layer in probe.layers)


def _last_position(policy, ids, mask, positions, cache, values: bool):
    """One KV-cached forward pass that projects only the last position: (its output, and
    with `values` the LM head's input there [B, H], else None)."""
    with HeadInput(policy) if values else nullcontext() as seen:
        out = policy(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            logits_to_keep=1,
        )
    return out, seen.calls[-1][:, -1] if values else None


def _prefill(policy, ids, mask, positions, values: bool):
    """The prompts' forward pass, in groups of rows of similar length
    (`types.token_budget_groups`, PREFILL_TOKENS padded tokens each), each group cut to
    its longest prompt, so left padding is not computed; the groups' KV caches are then
    left-padded back to the batch's width (the padding masked, as in one pass) and joined.
    Returns (the rows' order, the last position's logits [B, V], the cache, and with
    `values` the LM head's input there [B, H])."""
    groups = [list(range(ids.shape[0]))]
    if ids.shape[0] > 1 and _cache_groupable(policy):
        groups = token_budget_groups(mask, PREFILL_TOKENS)
    starts, outs, hidden = [], [], []
    for group in groups:
        rows = torch.tensor(group, device=ids.device)
        start = 0 if len(groups) == 1 else int(mask[rows].argmax(dim=1).min())
        out, last = _last_position(
            policy, ids[rows, start:], mask[rows, start:], positions[rows, start:], None, values
        )
        starts.append(start)
        outs.append(out)
        hidden += [last] if values else []
    order = torch.tensor([i for group in groups for i in group], device=ids.device)
    logits = torch.cat([out.logits[:, -1] for out in outs])
    hidden = torch.cat(hidden) if values else None
    if len(outs) == 1:
        return order, logits, outs[0].cache, hidden

    def joined(layer: int, name: str) -> torch.Tensor:  # its keys or values, every row
        return torch.cat(
            [
                pad(getattr(out.cache.layers[layer], name), (0, 0, start, 0))
                for start, out in zip(starts, outs, strict=True)
            ]
        )

    layers = range(len(outs[0].cache.layers))
    cache = DynamicCache([(joined(i, "keys"), joined(i, "values")) for i in layers])
    return order, logits, cache, hidden


@torch.no_grad()
def decode_loop(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    stop_ids: list[int],
    pad_token_id: int,
    greedy: bool,
    warpers: LogitsProcessorList,
    logprobs: bool = False,
    values: bool = False,
    stop_strings: tuple[str, ...] = (),
    decode: Callable[[list[int]], str] | None = None,
) -> tuple[torch.Tensor, ...]:
    """Responses [B, n] to left-padded prompts (pad after a row's end; n: the longest row's
    steps), their mask [B, n] (up to and including the token that ended the row), whether
    each row ended [B] (else it ran out of tokens), with `logprobs` the log-prob of each
    token under the distribution it was drawn from [B, n] (the generation_config's
    suppressed tokens removed, then `warpers`; greedy: no warpers; else None), and with
    `values` (a PolicyValue) the
    value of each state a token was drawn from [B, n] (else None).

    Positions are HF generate's (the attention mask's cumulative sum); the prompts are
    prefilled in groups of similar length (`_prefill`); a row that ends (a
    stop id, or its text meets a stop string) stops being recorded, and once
    COMPACT_SHARE of the batch has ended those rows leave it, KV cache included."""
    if values:
        check_policy_value(model)
    policy = model.policy if isinstance(model, PolicyValue) else model
    config = getattr(base_model(policy), "generation_config", None)
    suppress = list(getattr(config, "suppress_tokens", None) or [])
    n_rows, device = prompt_ids.shape[0], prompt_ids.device
    processors = LogitsProcessorList()
    if suppress:
        processors.append(SuppressTokensLogitsProcessor(suppress, device=device))
    if not greedy:
        processors.extend(warpers)
    stop = torch.tensor(stop_ids, device=device)
    tokens = torch.full((n_rows, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    sampled = torch.zeros((n_rows, max_new_tokens), device=device) if logprobs else None
    state_values = torch.zeros((n_rows, max_new_tokens), device=device) if values else None
    mask = prompt_mask.long()
    positions = (mask.cumsum(dim=1) - 1).masked_fill(mask == 0, 1)
    rows = torch.arange(n_rows, device=device)  # the batch's rows, as indices of the output
    ended = torch.zeros(n_rows, dtype=torch.bool, device=device)
    lengths = torch.zeros(n_rows, dtype=torch.long, device=device)
    stopped = torch.zeros(n_rows, dtype=torch.bool, device=device)
    ids, cache, steps = prompt_ids, None, 0
    for t in range(max_new_tokens):
        if t == 0:  # the prompts, in groups of similar length (the rows in their order)
            order, logits, cache, hidden = _prefill(policy, ids, mask, positions, values)
            rows, ids, mask, positions = rows[order], ids[order], mask[order], positions[order]
        else:
            out, hidden = _last_position(policy, ids, mask, positions, cache, values)
            cache, logits = out.cache, out.logits[:, -1]
        steps = t + 1
        scores = processors(ids, logits.float())
        picked = scores.argmax(dim=-1) if greedy else inverse_cdf_draw(scores.softmax(dim=-1))
        live = ~ended
        at = rows[live]
        tokens[at, t] = picked[live]
        if logprobs:
            sampled[at, t] = scores.log_softmax(dim=-1).gather(1, picked[:, None])[live, 0]
        if values:
            state_values[at, t] = value_of(model.value_head, hidden[live])
        ended |= torch.isin(picked, stop)
        if stop_strings and decode is not None:
            for b in live.nonzero()[:, 0].tolist():
                text = decode(tokens[rows[b], : t + 1].tolist())
                ended[b] |= any(x in text for x in stop_strings)
        lengths[at] += 1
        stopped[at] = ended[live]
        if bool(ended.all()):
            break
        if ended.sum() >= max(1, COMPACT_SHARE * len(rows)):
            keep = (~ended).nonzero()[:, 0]
            cache.batch_select_indices(keep)
            rows, mask, positions, picked = rows[keep], mask[keep], positions[keep], picked[keep]
            ended = ended[keep]
        ids = picked[:, None]
        mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=1)
        positions = positions[:, -1:] + 1
    mask = (torch.arange(steps, device=device) < lengths[:, None]).long()
    vals = state_values[:, :steps] if values else None
    lps = sampled[:, :steps] if logprobs else None
    return tokens[:, :steps], mask, stopped, lps, vals


@torch.no_grad()
def generate_responses(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    stop_ids: list[int],
    pad_token_id: int,
    greedy: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    logprobs: bool = False,
    values: bool = False,
    stop_strings: tuple[str, ...] = (),
    decode: Callable[[list[int]], str] | None = None,
) -> Generation:
    """Sample (or greedily decode) responses to left-padded prompts [B, P]; with
    `logprobs`, also the log-prob of each sampled token (`Generation.logprobs`); with
    `values` (a model that carries the critic, `models.critic.PolicyValue`), also the value
    of the state each token was sampled from (`Generation.values`: the decode step's final
    hidden state, the one its logits came from). `stop_strings` (with `decode`, ids ->
    text) also end a response, at the token that completes one (`StopOnStrings`)."""
    was_training = model.training
    model.eval()
    warpers = _warpers(greedy, temperature, top_p, top_k)
    state_values = sampled = None
    if not loop_applies(model):
        response_ids, mask, stopped, sampled, state_values = decode_loop(
            model,
            prompt_ids,
            prompt_mask,
            max_new_tokens=max_new_tokens,
            stop_ids=stop_ids,
            pad_token_id=pad_token_id,
            greedy=greedy,
            warpers=warpers,
            logprobs=logprobs,
            values=values,
            stop_strings=stop_strings,
            decode=decode,
        )
    else:  # HF generate
        sampling = (
            {"do_sample": False}
            if greedy
            else {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": top_k}
        )
        recorder = SampledLogprobs(warpers) if logprobs else None
        strings = None
        if stop_strings and decode is not None:
            strings = StopOnStrings(stop_strings, decode, prompt_ids.shape[1], stop_ids)
        kwargs = dict(
            input_ids=prompt_ids,
            attention_mask=prompt_mask,
            max_new_tokens=max_new_tokens,
            eos_token_id=stop_ids,
            pad_token_id=pad_token_id,
            use_cache=True,
            synced_gpus=synced_generation(model),
            logits_processor=LogitsProcessorList([recorder]) if recorder else None,
            stopping_criteria=StoppingCriteriaList([strings]) if strings else None,
            **sampling,
        )
        if values:
            out, state_values = generate_with_values(model, **kwargs)
        else:
            out = model.generate(**kwargs)
        response_ids = out[:, prompt_ids.shape[1] :]
        mask, stopped = response_mask_after_stop(response_ids, stop_ids)
        if strings is not None:
            mask, stopped = strings.cut(mask, stopped)
        sampled = recorder.finish(out[:, -1]) if recorder else None
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
        # after its stop a row's tokens are padding, possibly outside the top-k / top-p set
        # (-inf): where, not a product, so no NaN
        logprobs=torch.where(mask.bool(), sampled, 0.0) if logprobs else None,
        values=state_values * mask if state_values is not None else None,
    )
