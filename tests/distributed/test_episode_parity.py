"""Multi-turn episodes under several processes: 2 ranks (DDP, FSDP2), each running its own
episodes, give one process's gradients on the same global batch, the actor and the actor
with a value head, every loss aggregation mode (the observation tokens, masked, count in no
normalisation)."""

from __future__ import annotations

import pytest
import torch

from proxima.trainer.dist import Dist
from tests.distributed.common import MODES, episode_batch, mini_batch_grads, models
from tests.distributed.conftest import torchrun

pytestmark = [pytest.mark.dist, pytest.mark.slow]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("grads") / "grads.pt"
    torchrun(["tests/distributed/episode_grad_worker.py", str(out)])
    return torch.load(out, weights_only=False)


def test_batch_has_observation_holes():
    exp = episode_batch(models()[0])
    real = exp.attention_mask[:, -exp.response_mask.shape[1] :]
    holes = (real == 1) & (exp.response_mask == 0)
    assert holes.sum(1).tolist() == [2] * 8  # each episode's observation: 2 tokens
    assert exp.response_mask.sum(1).tolist() == [7, 6, 6, 7, 2, 3, 2, 3]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
@pytest.mark.parametrize("role", ["actor", "shared"])
@pytest.mark.parametrize("mode", MODES)
def test_two_ranks_equal_one_process(two_ranks, strategy, role, mode):
    torch.set_num_threads(1)
    actor, _ = models()
    want = mini_batch_grads(actor, role, mode, episode_batch(actor), Dist(), world=1)
    got = two_ranks[(strategy, role, mode)]
    assert want.keys() == got.keys() and want
    assert any(float(g.abs().max()) > 1e-4 for g in want.values())  # a real gradient
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-5, msg=name)
