"""N processes give the same gradients as one process on the same global batch: DDP and
FSDP2 (with fixed micro-batches, and with micro-batches by a token budget, `+tokens`, whose
counts differ between the ranks), actor, critic and the actor with a value head on its
backbone, every loss
aggregation mode, unequal token counts per rank (the first rank's responses are long, the
second's short: a loss normalised per rank instead of by the global token count is 4-13%
off, and fails here)."""

from __future__ import annotations

import pytest
import torch

from proxima.trainer.dist import Dist
from tests.distributed.common import MODES, global_batch, mini_batch_grads, models
from tests.distributed.conftest import torchrun

pytestmark = [pytest.mark.dist, pytest.mark.slow]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("grads") / "grads.pt"
    torchrun(["tests/distributed/grad_worker.py", str(out)])
    return torch.load(out, weights_only=False)


def _one_process(role: str, mode: str) -> dict[str, torch.Tensor]:
    torch.set_num_threads(1)
    actor, critic = models()
    exp = global_batch(actor)
    model = critic if role == "critic" else actor
    return mini_batch_grads(model, role, mode, exp, Dist(), world=1)


@pytest.mark.parametrize(
    "strategy, role",
    [
        ("ddp", "actor"),
        ("ddp", "critic"),
        ("ddp", "shared"),
        ("fsdp2", "actor"),
        ("fsdp2", "critic"),
        ("fsdp2", "shared"),
        ("ddp+tokens", "actor"),
        ("ddp+tokens", "critic"),
        ("ddp+tokens", "shared"),
        ("fsdp2+tokens", "actor"),
        ("fsdp2+tokens", "critic"),
        ("fsdp2+tokens", "shared"),
    ],
)
@pytest.mark.parametrize("mode", MODES)
def test_two_ranks_equal_one_process(two_ranks, strategy, role, mode):
    """`shared`: the actor and its value head, one module (DDP and FSDP2 reduce the head's
    gradients like any other)."""
    want = _one_process(role, mode)
    if role == "shared":
        assert "value_head.weight" in want and float(want["value_head.weight"].abs().max()) > 0
    got = two_ranks[(strategy, role, mode)]
    assert want.keys() == got.keys() and want
    assert any(float(g.abs().max()) > 1e-4 for g in want.values())  # a real gradient
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-5, msg=name)


def test_per_rank_normalisation_would_differ():
    """Control: token-mean normalised by each rank's own tokens (the bug of verl #5641)
    gives another gradient, so the test above can tell."""
    actor, _ = models()
    exp = global_batch(actor)
    whole = mini_batch_grads(actor, "actor", "token-mean", exp, Dist(), world=1)
    halves = []
    for rows in (range(0, 4), range(4, 8)):
        a, _ = models()
        halves.append(mini_batch_grads(a, "actor", "token-mean", exp.select(list(rows)), Dist(), 1))
    naive = {k: (halves[0][k] + halves[1][k]) / 2 for k in whole}  # DDP's average of the two
    assert any(not torch.allclose(naive[k], whole[k], atol=1e-6) for k in whole)
