"""What a rollout engine is given and what it returns (the contract of
`proxima.rollout.contract`): `Sampling`, how to sample one batch, and `Generation`, the
sampled rows; `cat_generations` joins generations of different widths; `take_rows` and
`cat_rows` select and join the per-row fields of a batch, whatever their kind."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from proxima.config import RolloutConfig


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
        episode = cfg.episodes == "env"
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


@dataclass(kw_only=True)
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
    # actor carries the critic (`Sampling.values`), 0 where masked; else None
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
        input_ids=torch.cat(ids),
        attention_mask=torch.cat(attn),
        response_mask=torch.cat(
            [pad(g.response_mask, 0, r - g.response_mask.shape[1], 0) for g in parts]
        ),
        stopped=torch.cat([g.stopped for g in parts]),
        logprobs=per_token("logprobs"),
        values=per_token("values"),
        turn_rewards=per_token("turn_rewards"),
    )


def take_rows(value, index: torch.Tensor):
    """The rows `index` ([K] long), in that order, of one per-row field: a tensor, a list, a
    dict of them, or an object with its own `rows` (a `Generation`); None stays None. Any
    other kind is refused rather than passed on unselected."""
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value[index.to(value.device)]
    if isinstance(value, list):
        return [value[i] for i in index.tolist()]
    if isinstance(value, dict):
        return {k: take_rows(v, index) for k, v in value.items()}
    if hasattr(value, "rows"):
        return value.rows(index)
    raise TypeError(f"no rows to select in a per-row field of type {type(value).__name__}")


def cat_rows(parts: list, lengths: list[int]):
    """One per-row field of several batches (`lengths[i]` rows in `parts[i]`) joined:
    tensors concatenated, lists chained, dicts of them joined key by key (a key a part lacks
    is None in its rows); None when a part has none."""
    if any(p is None for p in parts):
        return None
    first = parts[0]
    if isinstance(first, torch.Tensor):
        return torch.cat(parts)
    if isinstance(first, list):
        return [x for p in parts for x in p]
    if isinstance(first, dict):
        keys = dict.fromkeys(k for p in parts for k in p)
        return {
            k: cat_rows(
                [p.get(k, [None] * n) for p, n in zip(parts, lengths, strict=True)], lengths
            )
            for k in keys
        }
    raise TypeError(f"no rows to join in a per-row field of type {type(first).__name__}")
