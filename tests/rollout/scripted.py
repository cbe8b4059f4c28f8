"""A scripted policy (an engine that writes given actions) and scripted environments, for the
exact tests of multi-turn episodes (tests/rollout/test_episodes.py, tests/trainer/
test_multiturn.py). The environment classes are named in configs as
`tests/rollout/scripted.py:<Class>` (`spec(name)`)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from proxima.rollout.types import Generation, Sampling

ALPHABET = "abcxyz"  # the char tokenizer's ids: 0 <pad>, 1 <s>, 2 </s>, 3 <unk>, a=4, b=5, ...
EOS = 2


def spec(name: str) -> str:
    return f"{Path(__file__).resolve()}:{name}"


class ScriptedEngine:
    """Call k of `generate` answers row j of the live episodes with `actions[k][j]` (token
    ids, right-padded by it), each token's log-prob -0.1 x (its index + 1) and value
    +0.1 x (its index + 1); records what it was asked (`calls`: contexts and sampling)."""

    name = "scripted"
    weight_version = 0

    def __init__(self, actions: list[list[list[int]]], pad: int = 0) -> None:
        self.actions, self.pad, self.calls = actions, pad, []

    def generate(self, prompt_ids, prompt_mask, sampling: Sampling) -> Generation:
        rows = [ids[m.bool()].tolist() for ids, m in zip(prompt_ids, prompt_mask, strict=True)]
        self.calls.append((rows, sampling))
        acts = self.actions[len(self.calls) - 1]
        assert len(acts) == len(rows), (acts, rows)
        return scripted_generation(prompt_ids, prompt_mask, acts, self.pad)

    def update_weights(self, named_tensors, version: int) -> None:
        self.weight_version = version

    def sleep(self) -> None:
        pass

    def wake_up(self) -> None:
        pass

    def close(self) -> None:
        pass


def scripted_generation(prompt_ids, prompt_mask, acts: list[list[int]], pad: int = 0) -> Generation:
    """Row j answers prompt row j with `acts[j]` (token ids, right-padded with `pad`), each
    token's log-prob -0.1 x (its index + 1) and value +0.1 x (its index + 1)."""
    width = max(1, *(len(a) for a in acts))
    response = torch.full((len(acts), width), pad, dtype=torch.long)
    mask = torch.zeros((len(acts), width), dtype=torch.long)
    for j, a in enumerate(acts):
        response[j, : len(a)] = torch.tensor(a, dtype=torch.long)
        mask[j, : len(a)] = 1
    steps = torch.arange(1, width + 1).float().expand(len(acts), width)
    return Generation(
        input_ids=torch.cat([prompt_ids, response], dim=1),
        attention_mask=torch.cat([prompt_mask, mask], dim=1),
        response_mask=mask,
        stopped=torch.tensor([bool(a) and a[-1] == EOS for a in acts]),
        logprobs=-0.1 * steps * mask,
        values=0.1 * steps * mask,
    )


class TwoTurns:
    """Turn 1: observation "xy", reward 0.5; turn 2: done, reward 1.0. Keeps its actions."""

    max_reward = 1.5

    def __init__(self, row: dict) -> None:
        self.row, self.actions = row, []

    def step(self, action: str):
        self.actions.append(action)
        if len(self.actions) == 1:
            return "xy", 0.5, False
        return None, 1.0, True


class Recorder(TwoTurns):
    """TwoTurns that keeps every instance in `built` (class-wide)."""

    built: list = []

    def __init__(self, row: dict) -> None:
        super().__init__(row)
        self.built.append(self)


class Never:
    """Never done: observation "z", reward 0.25 every turn."""

    def __init__(self, row: dict) -> None:
        pass

    def step(self, action: str):
        return "z", 0.25, False


class LongObservation:
    """Answers with an observation of 5 tokens, reward 0.5; never done."""

    def __init__(self, row: dict) -> None:
        pass

    def step(self, action: str):
        return "xyzxy", 0.5, False


class HugeObservation:
    """Answers with an observation of 100,000 characters."""

    def __init__(self, row: dict) -> None:
        pass

    def step(self, action: str):
        return "xyz" * 33_334, 0.5, False


class FailsSecond:
    """Raises on its second step."""

    def __init__(self, row: dict) -> None:
        self.turn = 0

    def step(self, action: str):
        self.turn += 1
        if self.turn == 2:
            raise RuntimeError("the calculator broke")
        return "x", 0.5, False


class Sleeps:
    """Its step takes 5 s when the row's column `slow` is true."""

    def __init__(self, row: dict) -> None:
        self.slow = row.get("slow", False)

    def step(self, action: str):
        if self.slow:
            time.sleep(5.0)
        return None, 1.0, True


class Exits:
    """Its step calls sys.exit(3), as a script's code might."""

    def __init__(self, row: dict) -> None:
        pass

    def step(self, action: str):
        sys.exit(3)


class BrokenInit:
    def __init__(self, row: dict) -> None:
        raise KeyError("answer")

    def step(self, action: str):
        return None, 1.0, True


class BadReturn:
    def __init__(self, row: dict) -> None:
        pass

    def step(self, action: str):
        return "x", 1.0  # two values, not three


class Echo:
    """Done at once, reward 1 when the action is exactly EOS (an empty turn)."""

    def __init__(self, row: dict) -> None:
        pass

    def step(self, action: str):
        return None, float(action == "</s>"), True


class WithInfo:
    """Answers "x" with its `info` once, then is done with a non-JSON info."""

    def __init__(self, row: dict) -> None:
        self.turn = 0

    def step(self, action: str):
        self.turn += 1
        if self.turn == 1:
            return "x", 0.5, False, {"outcome": "ok", "seconds": 0.25}
        return None, 1.0, True, {"bad": object()}


class Varied:
    """Observations "z", "zy" or "zyz" (by the row's column `i` and the turn), reward 0.5 a turn;
    done after the row's column `turns` actions, so episodes end at different turns."""

    def __init__(self, row: dict) -> None:
        self.i, self.turns, self.turn = row["i"], row["turns"], 0

    def step(self, action: str):
        self.turn += 1
        if self.turn >= self.turns:
            return None, 0.5, True
        return "zyz"[: 1 + (self.i + self.turn) % 3], 0.5, False
