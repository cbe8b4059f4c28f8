"""The CUDA tier (marker `gpu`, skipped without a GPU; `benchmarks/gpu_check.sh` runs it on a
GPU machine): one process on the GPU gives the CPU's gradients for every role and loss
aggregation mode; a run on the GPU (fp32, and bf16 mixed precision) trains, checkpoints and
resumes bit for bit (the CUDA RNG state travels with the checkpoint); two processes on the GPUs
under DDP and FSDP2 (NCCL, one GPU each), or DDP sharing one GPU (gloo), give the gradients of
one process."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from proxima.cli import main
from proxima.logging import read_metrics
from proxima.trainer.dist import Dist
from tests.distributed.common import MODES, global_batch, mini_batch_grads, models

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")
NOT_COMPARED = ("time/", "tokens_per_s", "memory/")  # wall-clock and allocator readings


@pytest.mark.parametrize("role", ["actor", "critic", "shared"])
@pytest.mark.parametrize("mode", MODES)
def test_gradients_on_the_gpu_equal_the_cpu(role, mode):
    grads = {}
    for device in (torch.device("cpu"), CUDA):
        actor, critic = models()
        exp = global_batch(actor)
        model = critic if role == "critic" else actor
        grads[device.type] = mini_batch_grads(model, role, mode, exp, Dist(), 1, device)
    want, got = grads["cpu"], grads["cuda"]
    assert want.keys() == got.keys() and want
    assert any(g.abs().sum() > 0 for g in want.values())
    for name in want:  # fp32 on both (TF32 matmuls are off by default in torch)
        torch.testing.assert_close(got[name], want[name], atol=1e-5, rtol=1e-4, msg=name)


def _metrics(run: Path) -> dict[int, dict]:
    rows = read_metrics(run / "metrics.jsonl")
    return {r["step"]: {k: v for k, v in r.items() if not k.startswith(NOT_COMPARED)} for r in rows}


@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_a_run_on_the_gpu_trains_and_resumes_exactly(
    tmp_path, make_model, fast_overrides, precision
):
    init = make_model("llama")
    torch.cuda.reset_peak_memory_stats()
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    gpu = ["model.device=cuda", f"model.mixed_precision={precision}", "trainer.save_every=2"]
    assert main(["train", *fast_overrides(init, run_a, 4, *gpu)]) == 0
    resume = f"trainer.resume_from={run_a / 'checkpoints' / 'iter_2'}"
    assert main(["train", *fast_overrides(init, run_b, 4, *gpu, resume)]) == 0
    a, b = _metrics(run_a), _metrics(run_b)
    assert sorted(a) == [1, 2, 3, 4] and sorted(b) == [3, 4]
    for step in (1, 2, 3, 4):
        assert math.isfinite(a[step]["actor/pg_loss"]) and math.isfinite(a[step]["kl"])
    for step in (3, 4):
        assert b[step] == a[step], step  # every metric, bit for bit
    assert torch.cuda.max_memory_allocated() > 0  # the models lived on the GPU


@pytest.mark.parametrize(
    "backend, strategies", [("nccl", ("ddp", "fsdp2")), ("gloo", ("ddp",))], ids=["nccl", "gloo"]
)
def test_two_processes_on_the_gpus_equal_one_process(tmp_path, backend, strategies):
    """2 ranks on however many GPUs there are (rank % count). NCCL refuses two ranks on one
    device ("Duplicate GPU detected"), so with one GPU only DDP through gloo (CUDA tensors)
    takes part; FSDP2 through gloo with CUDA tensors crashed (SIGSEGV) on torch 2.11."""
    from tests.distributed.conftest import torchrun
    from tests.distributed.test_parity import _one_process

    if backend == "nccl" and torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs one GPU per rank; this machine has 1 (the gloo case runs)")
    out = tmp_path / "grads.pt"
    torchrun(["tests/distributed/grad_worker.py", str(out), "cuda", backend, ",".join(strategies)])
    got_all = torch.load(out, weights_only=False)
    for strategy in strategies:
        for role in ("actor", "critic", "shared"):
            for mode in MODES:
                want, got = _one_process(role, mode), got_all[(strategy, role, mode)]
                assert want.keys() == got.keys() and want
                for name in want:
                    torch.testing.assert_close(
                        got[name], want[name], atol=1e-5, rtol=1e-4, msg=f"{strategy} {name}"
                    )
