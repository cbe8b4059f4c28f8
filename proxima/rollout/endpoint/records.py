"""What the endpoint records of an episode's calls, in token ids: the training rows of
`rollout.agent` are built from these, never from text."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Choice:
    """One sampled answer of a call, in ids: what it trains."""

    ids: list[int]
    logprobs: list[float]
    values: list[float]
    finish: str  # "stop" (a stop token or string) or "length"


@dataclass
class Call:
    """One request of an episode as the model saw it: the prompt's ids and each choice."""

    prompt_ids: list[int]
    choices: list[Choice]


@dataclass
class EpisodeLog:
    """One episode's calls, in the order they were made, and its time limit."""

    id: int
    calls: list[Call] = field(default_factory=list)
    requests: int = 0  # calls asked for, refused ones included
    deadline: float = float("inf")  # time.monotonic() after which it is ended
    ended: bool = False
