"""The gradient parity of test_parity.py on two GPUs with NCCL (skipped without them)."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.common import MODES
from tests.distributed.conftest import torchrun
from tests.distributed.test_parity import _one_process

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.dist,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices"),
]


@pytest.fixture(scope="module")
def two_gpus(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("grads") / "grads.pt"
    torchrun(["tests/distributed/grad_worker.py", str(out), "cuda"])
    return torch.load(out, weights_only=False)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
@pytest.mark.parametrize("role", ["actor", "critic"])
@pytest.mark.parametrize("mode", MODES)
def test_two_gpus_equal_one_cpu_process(two_gpus, strategy, role, mode):
    want, got = _one_process(role, mode), two_gpus[(strategy, role, mode)]
    assert want.keys() == got.keys() and want
    for name in want:  # fp32 on GPU (TF32 off by default for matmul in torch) vs CPU
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, msg=name)
