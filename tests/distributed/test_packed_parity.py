"""Packed rows (`model.packing`) with 2 processes: DDP and FSDP2 give one padded process's
gradients, for the actor, a value model and the actor with a value head on its backbone, in
every loss aggregation mode, with micro-batches by a token budget that counts packed rows
(whose counts differ between the ranks and are evened out), and with the samples of a prompt
in one micro-batch, the prompt laid once for them (`+shared`)."""

from __future__ import annotations

import pytest
import torch

from proxima.trainer.dist import Dist
from tests.distributed.common import MODES, global_batch, mini_batch_grads, models
from tests.distributed.conftest import torchrun

pytestmark = [pytest.mark.dist, pytest.mark.slow]
STRATEGIES = (
    "ddp+tokens+packed",
    "fsdp2+tokens+packed",
    "ddp+packed+shared",
    "fsdp2+packed+shared",
)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("grads") / "grads.pt"
    torchrun(["tests/distributed/grad_worker.py", str(out), "cpu", "auto", ",".join(STRATEGIES)])
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("role", ["actor", "critic", "shared"])
@pytest.mark.parametrize("mode", MODES)
def test_two_packed_ranks_equal_one_padded_process(two_ranks, strategy, role, mode):
    torch.set_num_threads(1)
    actor, critic = models()
    exp = global_batch(actor, shared="shared" in strategy)
    want = mini_batch_grads(critic if role == "critic" else actor, role, mode, exp, Dist(), 1)
    got = two_ranks[(strategy, role, mode)]
    assert want.keys() == got.keys() and want
    assert any(float(g.abs().max()) > 1e-4 for g in want.values())  # a real gradient
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-5, msg=name)
