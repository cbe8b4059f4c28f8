"""The samplers chosen once from the config, the trainer's state registry (checkpoint,
snapshot and undo from one list) and the per-source moments that `WeightedReward` owns."""

from __future__ import annotations

import pytest
import torch

from proxima.rewards import WeightedPart, WeightedReward
from proxima.trainer.samplers import Ahead, DynamicSampling, InProcess, InWorkers, OnPolicy
from proxima.trainer.state import Part, StateRegistry, stateful
from tests.trainer.nano import nano_files, nano_trainer


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return nano_files(tmp_path_factory.mktemp("samplers"))


@pytest.mark.parametrize(
    ("extra", "kinds"),
    [
        ((), [OnPolicy]),
        (("algorithm.filter_groups=true", "rollout.n=2"), [DynamicSampling, OnPolicy]),
        (("rollout.max_staleness=1",), [Ahead, InWorkers, OnPolicy]),
        (("rollout.max_staleness=2", "rollout.workers=0"), [Ahead, InProcess, OnPolicy]),
        (
            (
                "algorithm.filter_groups=true",
                "rollout.n=2",
                "rollout.max_staleness=1",
                "rollout.workers=0",
            ),
            [Ahead, InProcess, DynamicSampling, OnPolicy],
        ),
    ],
)
def test_the_sampler_is_chosen_once_from_the_config(files, extra, kinds):
    trainer = nano_trainer(files, *extra)
    chain, sampler = [], trainer.sampler
    while sampler is not None:
        chain.append(type(sampler))
        sampler = next(
            (getattr(sampler, k) for k in ("backend", "inner", "rounds") if hasattr(sampler, k)),
            None,
        )
    assert chain == kinds
    assert chain[-1] is OnPolicy and trainer.on_policy.context is trainer.context


def test_the_state_registry_saves_loads_and_undoes_in_registration_order():
    seen, box = [], {"a": 1, "b": 2}

    def part(name: str, undo: bool) -> Part:
        def load(v):
            seen.append(name)
            box[name] = v

        get = lambda: box[name]  # noqa: E731
        return Part(get, load, get if undo else None, load if undo else None)

    reg = StateRegistry()
    reg.add("b", part("b", undo=False))
    reg.add("a", part("a", undo=True))
    with pytest.raises(ValueError, match="'a' registered twice"):
        reg.add("a", part("a", undo=True))
    assert list(reg.state_dict()) == ["b", "a"]
    snap = reg.snapshot()
    assert snap == {"a": 1}  # only the parts an iteration puts back
    box.update(a=10, b=20)
    reg.restore(snap)
    assert box == {"a": 1, "b": 20}
    seen.clear()
    reg.load_state_dict({"a": 5, "b": 6})
    assert seen == ["b", "a"] and box == {"a": 5, "b": 6}
    reg.load_state_dict({"a": 7})  # a part the checkpoint lacks keeps its state
    assert box == {"a": 7, "b": 6}


def test_stateful_snapshots_by_its_own_snapshot_when_it_has_one():
    class Kept:
        def __init__(self):
            self.value, self.calls = 0, []

        def state_dict(self):
            self.calls.append("state_dict")
            return {"value": self.value}

        def load_state_dict(self, s):
            self.value = s["value"]

        def snapshot(self):
            return self.value

        def restore(self, v):
            self.value = v

    kept = Kept()
    part = stateful(kept)
    kept.value = 3
    snap = part.snapshot()
    kept.value = 4
    part.restore(snap)
    assert kept.value == 3 and kept.calls == []
    assert stateful(kept, undo=False).snapshot is None


def test_weighted_reward_owns_the_running_moments_of_its_standardised_sources():
    const = lambda value: lambda p, r, c, s=None, m=None: torch.full((len(r),), value)  # noqa: E731
    reward = WeightedReward(
        [
            WeightedPart("a", 2.0, const(1.0), normalize=True),
            WeightedPart("b", 0.5, const(4.0)),
        ]
    )
    scores, components = reward.scored(["p", "q"], ["x", "y"], {})
    assert components.tolist() == [[1.0, 4.0], [1.0, 4.0]]
    assert scores.tolist() == [4.0, 4.0]  # 2 * 1 + 0.5 * 4
    # source a: values 1 and 3 -> mean 2, unbiased std sqrt(2); b stays raw
    comps = torch.tensor([[1.0, 4.0], [3.0, 4.0]])
    raw = reward.combine(comps) + torch.tensor([-1.0, 0.0])  # e.g. an overlong penalty
    got = reward.standardise(raw, comps)
    z = 1 / 2**0.5
    assert torch.allclose(got, torch.tensor([2 * -z + 2.0 - 1.0, 2 * z + 2.0]))
    state = reward.state_dict()
    assert state["a"]["count"] == 2 and state["a"]["mean"] == 2.0 and list(state) == ["a"]
    fresh = WeightedReward(reward.parts)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    plain = WeightedReward([WeightedPart("b", 0.5, const(4.0))])
    assert plain.standardise(raw, comps) is raw  # no source standardised: untouched
