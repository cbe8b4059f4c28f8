"""The `hf` engine's decode loop: KV-cached sampling on the actor itself.

The prompts are prefilled in groups of similar length (no left padding computed), a row that
has ended leaves the batch (its KV cache with it), so the later steps compute only the rows
still going, and a token is drawn by inverting the cumulative distribution (one uniform
number per row and a binary search: an exact draw from p, where `torch.multinomial` draws an
exponential number per token of the vocabulary). Where the loop does not apply
(`loop_applies`: an FSDP2 model under torchrun, whose ranks must step together; a model
whose forward takes no KV cache (`cache`, or `past_key_values` in transformers before the
rename), `position_ids` or `logits_to_keep`; a generation_config
with logits processors beyond `suppress_tokens`) the engine runs HF `generate`
(`proxima.rollout.hf_engine`), whose samples come from the same distribution.

Multi-turn episodes keep their KV caches between turns (`EpisodeCaches`): a turn's loop
starts from them and computes only the columns its contexts gained since.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Hashable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch.nn.functional import pad
from transformers import (
    DynamicCache,
    LogitsProcessorList,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.cache_utils import DynamicLayer

from proxima.models.critic import HeadInput, PolicyValue, check_policy_value, value_of
from proxima.models.unwrap import base_model
from proxima.rollout.plan import NEUTRAL_GENERATION_FIELDS
from proxima.rollout.types import Sampling
from proxima.types import prompt_groups, token_budget_groups

# what the decode loop applies of the actor's generation_config, beyond the neutral fields
LOOP_GENERATION_FIELDS = NEUTRAL_GENERATION_FIELDS | {"suppress_tokens"}
# compact the batch once this share of its rows has ended (each compaction copies the cache)
COMPACT_SHARE = 0.25
# padded prompt tokens per prefill pass, when prompts of different lengths are prefilled in
# groups of similar length
PREFILL_TOKENS = 2048


def synced_generation(model: torch.nn.Module) -> bool:
    """An FSDP2-sharded model in a multi-process job: every forward all-gathers the layers
    from all ranks, so a rank whose responses have all ended must keep stepping until every
    rank has (transformers' `synced_gpus`), else the ranks' collectives fall out of step
    (transformers #33483)."""
    import torch.distributed as tdist
    from torch.distributed.fsdp import FSDPModule

    multi = tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1
    return multi and isinstance(model, FSDPModule)


def sampling_warpers(sampling: Sampling) -> LogitsProcessorList:
    """transformers' warpers for `sampling` (temperature, top-k, top-p, in `generate`'s
    order); none when it is greedy."""
    if sampling.greedy:
        return LogitsProcessorList()
    out = LogitsProcessorList()
    if sampling.temperature != 1.0:
        out.append(TemperatureLogitsWarper(sampling.temperature))
    if sampling.top_k:
        out.append(TopKLogitsWarper(top_k=sampling.top_k, min_tokens_to_keep=1))
    if sampling.top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=sampling.top_p, min_tokens_to_keep=1))
    return out


def _hf(model: torch.nn.Module) -> torch.nn.Module:
    return base_model(model.policy if isinstance(model, PolicyValue) else model)


def cache_argument(model: torch.nn.Module) -> str | None:
    """What the model's forward calls its KV cache, the argument and the output's field:
    `cache` (recent transformers), `past_key_values` (earlier releases), or None."""
    params = inspect.signature(_hf(model).forward).parameters
    return next((k for k in ("cache", "past_key_values") if k in params), None)


def loop_applies(model: torch.nn.Module) -> str:
    """Why `decode_loop` cannot serve `model` ("" when it can): see the module's docstring."""
    if synced_generation(model):
        return "an FSDP2 model under torchrun: every rank steps until all have ended"
    hf = _hf(model)
    params = inspect.signature(hf.forward).parameters
    missing = [k for k in ("position_ids", "logits_to_keep") if k not in params]
    missing = missing if cache_argument(model) else ["cache", *missing]
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


def _prefill_groups(policy: torch.nn.Module, mask: torch.Tensor) -> list[list[int]]:
    """The rows of a prefill in groups of similar length (`types.token_budget_groups`,
    PREFILL_TOKENS padded tokens each) where their caches can be joined, else one group."""
    if mask.shape[0] > 1 and _cache_groupable(policy):
        return token_budget_groups(mask, PREFILL_TOKENS)
    return [list(range(mask.shape[0]))]


def _last_position(policy, ids, mask, positions, cache, values: bool):
    """One KV-cached forward pass that projects only the last position: (its last
    position's logits [B, V], its KV cache, and with `values` the LM head's input there
    [B, H], else None)."""
    name = cache_argument(policy)
    with HeadInput(policy) if values else nullcontext() as seen:
        out = policy(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **{name: cache},
        )
    return out.logits[:, -1], getattr(out, name), seen.calls[-1][:, -1] if values else None


def distinct_rows(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the first row of each distinct prompt [D], each row's distinct prompt [B]): rows
    with the same ids and mask are one prompt (the `rollout.n` samples of a prompt,
    `types.prompt_groups`)."""
    groups = prompt_groups(ids, mask, ids.shape[1])
    prompt_of = torch.empty(ids.shape[0], dtype=torch.long, device=ids.device)
    for d, group in enumerate(groups):
        prompt_of[group] = d
    return torch.tensor([g[0] for g in groups], device=ids.device), prompt_of


def _prefill(policy, ids, mask, positions, values: bool):
    """The prompts' forward pass, each distinct prompt once (the `rollout.n` copies of a
    prompt share its keys, values and last logits: the rows' caches are copies of its),
    in groups of similar length (`_prefill_rows`). Returns (the rows' order, the last
    position's logits [B, V], the cache, and with `values` the LM head's input there
    [B, H]), the rows in the order their groups give (as without copies)."""
    first, prompt_of = distinct_rows(ids, mask)
    if len(first) == ids.shape[0]:
        return _prefill_rows(policy, ids, mask, positions, values)
    groups = _prefill_groups(policy, mask)
    order = torch.tensor([i for group in groups for i in group], device=ids.device)
    done, logits, cache, hidden = _prefill_rows(
        policy, ids[first], mask[first], positions[first], values
    )
    at = torch.empty_like(done)  # where each distinct prompt is in the cache's rows
    at[done] = torch.arange(len(done), device=ids.device)
    index = at[prompt_of[order]]
    cache.batch_select_indices(index)
    return order, logits[index], cache, hidden[index] if values else None


def _prefill_rows(policy, ids, mask, positions, values: bool):
    """The prompts' forward pass, in groups of rows of similar length
    (`types.token_budget_groups`, PREFILL_TOKENS padded tokens each), each group cut to
    its longest prompt, so left padding is not computed; the groups' KV caches are then
    left-padded back to the batch's width (the padding masked, as in one pass) and joined.
    Returns (the rows' order, the last position's logits [B, V], the cache, and with
    `values` the LM head's input there [B, H])."""
    groups = _prefill_groups(policy, mask)
    starts, logits, caches, hidden = [], [], [], []
    for group in groups:
        rows = torch.tensor(group, device=ids.device)
        start = 0 if len(groups) == 1 else int(mask[rows].argmax(dim=1).min())
        last_logits, group_cache, last = _last_position(
            policy, ids[rows, start:], mask[rows, start:], positions[rows, start:], None, values
        )
        starts.append(start)
        logits.append(last_logits)
        caches.append(group_cache)
        hidden += [last] if values else []
    order = torch.tensor([i for group in groups for i in group], device=ids.device)
    logits = torch.cat(logits)
    hidden = torch.cat(hidden) if values else None
    if len(caches) == 1:
        return order, logits, caches[0], hidden

    def joined(layer: int, name: str) -> torch.Tensor:  # its keys or values, every row
        return torch.cat(
            [
                pad(getattr(c.layers[layer], name), (0, 0, start, 0))
                for start, c in zip(starts, caches, strict=True)
            ]
        )

    layers = range(len(caches[0].layers))
    cache = DynamicCache([(joined(i, "keys"), joined(i, "values")) for i in layers])
    return order, logits, cache, hidden


def caches_kept_apply(model: torch.nn.Module) -> str:
    """Why `EpisodeCaches` cannot serve `model` ("" when it can): the decode loop must
    apply (`loop_applies`) and the model's cache hold every layer in full (a sliding
    window's layer keeps only its window, not every column a kept row is read from)."""
    reason = loop_applies(model)
    if not reason and not _cache_groupable(_hf(model)):
        reason = f"{type(_hf(model)).__name__} has sliding-window cache layers"
    return reason


@dataclass
class _Kept:
    """One episode's kept cache: the ids it holds, and per layer their keys and values
    [kv heads, len(ids), head dim]."""

    ids: list[int]
    layers: list[tuple[torch.Tensor, torch.Tensor]]


class EpisodeCaches:
    """The KV caches of multi-turn episodes kept between their turns (`HFEngine.session`),
    by episode key: the ids each holds and their keys and values, in order, unpadded.

    A turn's context is the episode's previous context, its action and the observation
    after it. The decode loop prefills only what the kept caches lack (`prefill`): a row
    reuses the longest prefix of its context that its cache holds (so tokens sampled after
    a stop string the episode cut, or past its budget, are never attended to), at most all
    but its last token (whose logits start the turn). The rows keep a whole prefill's
    layout, the contexts left-padded, and only the last columns are computed: as many as
    the row with the most new tokens needs. At the end of the turn, and when an ended row
    leaves the batch, the loop hands each row's cache back (`keep`)."""

    def __init__(self) -> None:
        self.held: dict[Hashable, _Kept] = {}

    def retain(self, keys: Sequence[Hashable]) -> None:
        """Forget every episode but `keys` (the others have ended)."""
        live = set(keys)
        self.held = {k: v for k, v in self.held.items() if k in live}

    def _reusable(self, key: Hashable, context: list[int]) -> int:
        """How many of `context`'s first tokens the kept cache of `key` holds, at most all
        but the last."""
        held = self.held[key].ids if key in self.held else []
        n = 0
        for a, b in zip(held, context[:-1], strict=False):
            if a != b:
                break
            n += 1
        return n

    def prefill(self, policy, keys: Sequence[Hashable], ids, mask, positions, values: bool):
        """`_prefill`'s result, the rows in its order, for the left-padded contexts `ids`
        [B, P] of the episodes `keys`: the kept caches give each row's first tokens, one
        forward pass the last columns; `_prefill` itself where no row has a kept prefix
        that reaches into the columns left of the new tokens."""
        width = ids.shape[1]
        lengths = mask.sum(dim=1).tolist()
        reused = [
            self._reusable(key, row[width - n :])
            for key, row, n in zip(keys, ids.tolist(), lengths, strict=True)
        ]
        new = max(n - r for n, r in zip(lengths, reused, strict=True))  # columns computed
        take = [n - new for n in lengths]  # each row's tokens read from its kept cache
        if max(take) <= 0:
            return _prefill(policy, ids, mask, positions, values)
        cached = width - new
        order = [i for group in _prefill_groups(policy, mask) for i in group]
        like = self.held[keys[take.index(max(take))]].layers
        layers = []
        for i, pair in enumerate(like):
            joined = []
            for t, one in enumerate(pair):  # keys, then values: [B, heads, cached, dim]
                out = one.new_zeros((len(order), one.shape[0], cached, one.shape[2]))
                for row, b in enumerate(order):
                    if take[b] > 0:
                        out[row, :, cached - take[b] :] = self.held[keys[b]].layers[i][t][
                            :, : take[b]
                        ]
                joined.append(out)
            layers.append(tuple(joined))
        order = torch.tensor(order, device=ids.device)
        logits, cache, hidden = _last_position(
            policy,
            ids[order, cached:],
            mask[order],
            positions[order, cached:],
            DynamicCache(layers),
            values,
        )
        return order, logits, cache, hidden

    def keep(self, cache, index: list[int], keys: list, held: list[list[int]], starts: list[int]):
        """Keep the caches of the batch's rows `index`: row `index[j]` of `cache` is
        episode `keys[j]`, holding the ids `held[j]` from column `starts[j]` on."""
        for i, key, ids, start in zip(index, keys, held, starts, strict=True):
            cols = slice(start, start + len(ids))
            layers = [
                (x.keys[i, :, cols].clone(), x.values[i, :, cols].clone()) for x in cache.layers
            ]
            self.held[key] = _Kept(ids, layers)


@torch.no_grad()
def decode_loop(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    sampling: Sampling,
    pad_token_id: int,
    decode: Callable[[list[int]], str] | None = None,
    kept: tuple[EpisodeCaches, Sequence[Hashable]] | None = None,
    on_step: Callable[[int], None] | None = None,
) -> tuple[torch.Tensor, ...]:
    """One response per row of the left-padded prompts [B, P], sampled as `sampling` says
    (`n` aside: the engine repeats the rows): the tokens [B, n] (pad after a row's end; n:
    the longest row's steps), their mask [B, n] (up to and including the token that ended
    the row), whether each row ended [B] (else it ran out of tokens), with
    `sampling.logprobs` the log-prob of each token under the distribution it was drawn from
    [B, n] (the generation_config's suppressed tokens removed, then `sampling_warpers`;
    else None), and with `sampling.values` (a PolicyValue) the value of each state a token
    was drawn from [B, n] (else None). `decode` (ids -> text) lets `sampling.stop_strings`
    end rows. `on_step(t)` is called before the forward pass that samples the t-th token of
    every row (a rollout worker takes newer weights there: partial rollouts).

    Positions are HF generate's (the attention mask's cumulative sum); the prompts are
    prefilled in groups of similar length (`_prefill`); a row that ends (a
    stop id, or its text meets a stop string) stops being recorded, and once
    COMPACT_SHARE of the batch has ended those rows leave it, KV cache included.

    `kept` (episode caches, and the key of each row: a turn of multi-turn episodes) starts
    from the rows' kept caches (`EpisodeCaches.prefill`) and hands every row's cache back
    to them, the rows that leave the batch as they leave, the others at the end."""
    greedy, logprobs, values = sampling.greedy, sampling.logprobs, sampling.values
    max_new_tokens, stop_strings = sampling.max_new_tokens, sampling.stop_strings
    if values:
        check_policy_value(model)
    policy = model.policy if isinstance(model, PolicyValue) else model
    config = getattr(base_model(policy), "generation_config", None)
    suppress = list(getattr(config, "suppress_tokens", None) or [])
    n_rows, device = prompt_ids.shape[0], prompt_ids.device
    processors = LogitsProcessorList()
    if suppress:
        processors.append(SuppressTokensLogitsProcessor(suppress, device=device))
    processors.extend(sampling_warpers(sampling))
    stop = torch.tensor(list(sampling.stop_ids), device=device)
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
        if on_step is not None:
            on_step(t)
        if t == 0:  # the prompts, in groups of similar length (the rows in their order)
            if kept is None:
                order, logits, cache, hidden = _prefill(policy, ids, mask, positions, values)
            else:
                order, logits, cache, hidden = kept[0].prefill(
                    policy, kept[1], ids, mask, positions, values
                )
            rows, ids, mask, positions = rows[order], ids[order], mask[order], positions[order]
        else:
            logits, cache, hidden = _last_position(policy, ids, mask, positions, cache, values)
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
            if kept is not None:
                left = ended.nonzero()[:, 0]
                _keep_rows(kept, cache, left, rows, prompt_ids, prompt_mask, tokens, lengths, t)
            cache.batch_select_indices(keep)
            rows, mask, positions, picked = rows[keep], mask[keep], positions[keep], picked[keep]
            ended = ended[keep]
        ids = picked[:, None]
        mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=1)
        positions = positions[:, -1:] + 1
    if kept is not None:
        every = torch.arange(len(rows), device=device)
        _keep_rows(kept, cache, every, rows, prompt_ids, prompt_mask, tokens, lengths, steps - 1)
    mask = (torch.arange(steps, device=device) < lengths[:, None]).long()
    vals = state_values[:, :steps] if values else None
    lps = sampled[:, :steps] if logprobs else None
    return tokens[:, :steps], mask, stopped, lps, vals


def _keep_rows(
    kept, cache, index, rows, prompt_ids, prompt_mask, tokens, lengths, fed: int
) -> None:
    """Hand the batch's rows `index` to the episode caches `kept` once `fed` of their
    sampled tokens went through the model: each row's cache holds its context (the prompt
    row's last columns, from `prompt_mask`'s first 1) and its first `fed` tokens, of which
    those up to its end are its own (the ones after are never reused)."""
    caches, keys = kept
    out = rows[index]
    starts = (prompt_ids.shape[1] - prompt_mask[out].sum(dim=1)).tolist()
    owns = lengths[out].clamp(max=fed).tolist()
    contexts, sampled = prompt_ids[out].tolist(), tokens[out].tolist()
    held = [
        c[start:] + s[:own]
        for c, s, start, own in zip(contexts, sampled, starts, owns, strict=True)
    ]
    caches.keep(cache, index.tolist(), [keys[r] for r in out.tolist()], held, starts)
