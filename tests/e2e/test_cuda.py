"""The CUDA tier (marker `gpu`, skipped without a GPU; `benchmarks/gpu_check.sh` runs it on a
GPU machine): one process on the GPU gives the CPU's gradients for every role and loss
aggregation mode; a run on the GPU (fp32, and bf16 mixed precision) trains, checkpoints and
resumes bit for bit (the CUDA RNG state travels with the checkpoint); a rollout worker
spawned onto the actor's GPU samples what the trainer's process samples; two processes on
the GPUs under DDP and FSDP2 (NCCL, one GPU each), or DDP sharing one GPU (gloo), give the
gradients of one process."""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch

from proxima.cli import main
from proxima.logging import read_metrics
from proxima.trainer.dist import Dist
from tests.distributed.common import MODES, global_batch, mini_batch_grads, models
from tests.helpers import run_metrics

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
    return run_metrics(run, NOT_COMPARED)


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


@pytest.mark.parametrize("estimator", ["grpo", "rloo"])
def test_a_critic_free_run_on_the_gpu(tmp_path, make_model, fast_overrides, estimator):
    """The group estimators index the batch by prompt (the group ids travel to the GPU)."""
    init = make_model("llama")
    extra = ["model.device=cuda", f"algorithm.adv_estimator={estimator}"]
    assert main(["train", *fast_overrides(init, tmp_path / "run", 2, *extra)]) == 0
    rows = _metrics(tmp_path / "run")
    assert sorted(rows) == [1, 2] and all(math.isfinite(r["actor/pg_loss"]) for r in rows.values())


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


def spawned_worker_on(device: str, root: Path, *extra: str) -> None:
    """On `device`: rollout.max_staleness=1 with one rollout worker on the actor's device,
    spawned (auto, for a CUDA actor: a CUDA process cannot be forked): 3 iterations whose
    metrics and rollouts equal those sampled in the trainer's process (rollout.workers=0),
    bit for bit (the same kernels on the same device, each batch under its own seed, the
    weights copied exactly through the host); a worker that dies is named, as on the CPU."""
    from proxima.trainer.workers import RolloutWorkerError
    from tests.trainer.nano import nano_files, nano_trainer
    from tests.trainer.test_async_rollout import _run

    files = nano_files(root)
    run = (f"model.device={device}", "rollout.max_staleness=1", *extra)
    here, ros_here = _run(files, 3, *run, "rollout.workers=0")
    there, ros_there = _run(files, 3, *run, "rollout.workers=1")
    assert there == here
    for a, b in zip(ros_here, ros_there, strict=True):
        assert a.responses == b.responses
        assert torch.equal(a.gen.logprobs, b.gen.logprobs)
        assert torch.equal(a.versions, b.versions)
    assert here[0] != here[2]  # the weights changed between the batches compared
    trainer = nano_trainer(files, *run, "rollout.workers=1")
    try:
        assert trainer.sampler.backend.workers.method == "spawn"
        trainer.step()
        proc = trainer.sampler.backend.workers.procs[0]
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        with pytest.raises(RolloutWorkerError, match=r"rollout worker 0 \(pid \d+\) died with"):
            for _ in range(2):
                trainer.step()
    finally:
        trainer.close()


def test_a_spawned_rollout_worker_sharing_the_gpu_samples_what_the_trainer_samples(tmp_path):
    spawned_worker_on("cuda", tmp_path)


def test_offload_between_phases_gives_the_same_run_with_less_memory(tmp_path):
    """model.offload on the GPU (`trainer.offload`): 3 iterations of the nano trainer equal
    the run without, metrics, weights and AdamW state bit for bit; while it generates and
    scores the AdamW state is in CPU memory, and the memory allocated as generation begins
    is lower by at least that state's bytes (the GPU copies were freed, not kept)."""
    from tests.trainer.nano import nano_files
    from tests.trainer.test_offload import offload_run

    files = nano_files(tmp_path)
    plain = offload_run(files, False, 3, device="cuda")
    run = offload_run(files, True, 3, device="cuda")
    assert run.rows == plain.rows and len(run.rows) == 3  # every metric, bit for bit
    assert run.state.keys() == plain.state.keys()
    for k in plain.state:
        assert torch.equal(run.state[k], plain.state[k]), k
    assert plain.optimizer_devices["generate"] == {"cuda"}
    assert run.optimizer_devices["generate"] == run.optimizer_devices["score"] == {"cpu"}
    assert run.optimizer_devices["update"] == {"cuda"}
    adam = sum(v.nbytes for k, v in run.state.items() if k.endswith(("exp_avg", "exp_avg_sq")))
    assert plain.generating - run.generating >= adam > 0


def test_the_cli_offloads_on_the_gpu_evaluates_and_resumes(
    tmp_path, make_model, fast_overrides, prompt_file
):
    """`proxima train` with model.offload=trained: an evaluation after every iteration (the
    value model and the reference on the CPU then) and a checkpoint written after it, read
    back by a resumed run, give the metrics of the run without offload, bit for bit."""
    init = make_model("llama")
    gpu = ["model.device=cuda", f"data.eval_path={prompt_file}", "eval.every=1"]
    gpu.append("trainer.save_every=2")
    runs = {name: tmp_path / name for name in ("plain", "offload", "resumed")}
    assert main(["train", *fast_overrides(init, runs["plain"], 4, *gpu)]) == 0
    offload = [*gpu, "model.offload=trained"]
    assert main(["train", *fast_overrides(init, runs["offload"], 4, *offload)]) == 0
    resume = f"trainer.resume_from={runs['offload'] / 'checkpoints' / 'iter_2'}"
    assert main(["train", *fast_overrides(init, runs["resumed"], 4, *offload, resume)]) == 0
    plain, off, resumed = (_metrics(runs[name]) for name in ("plain", "offload", "resumed"))
    assert sorted(off) == [0, 1, 2, 3, 4] and off == plain  # 0: the evaluation before
    assert any(k.startswith("eval/") for k in off[4])
    assert [resumed[3], resumed[4]] == [off[3], off[4]]  # (step 2: its evaluation first)
    rows = read_metrics(runs["offload"] / "metrics.jsonl")
    assert all(r["time/offload"] > 0 for r in rows if "time/update" in r)
    plan = json.loads((runs["offload"] / "memory_plan.json").read_text())
    assert plan["offload"] and "actor optimizer" not in plan["held"]


def decode_and_head_on(device: torch.device) -> None:
    """On `device`: the decode loop's greedy tokens, masks and stop flags equal HF generate's
    (log-probs within rounding); the response-only LM head (`keep`: only the response
    positions go through the head, packed) gives the full head's logits at those positions."""
    import proxima.rollout.hf_engine as hf_engine
    from proxima.models.forward import response_logits
    from proxima.models.tiny import build_tiny_model
    from proxima.models.tokenizers import build_char_tokenizer
    from proxima.rollout.hf_engine import HFEngine
    from proxima.rollout.types import Sampling

    tok = build_char_tokenizer("0123456789+=")
    model = build_tiny_model("llama", tok, "nano", max_positions=64, seed=5, initializer_range=0.5)
    model = model.eval().to(device)
    rows = [
        tok(p, add_special_tokens=False)["input_ids"] for p in ["12+34=", "7+8=", "5=", "64+2="]
    ]
    width = max(map(len, rows))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows], device=device)
    mask = (torch.arange(width) >= torch.tensor([[width - len(r)] for r in rows])).long()
    mask = mask.to(device)
    sampling = Sampling(10, (tok.eos_token_id,), greedy=True, logprobs=True)
    gens = {}
    real_applies = hf_engine.loop_applies
    try:
        for loop in (True, False):
            hf_engine.loop_applies = (lambda m: "") if loop else (lambda m: "HF generate")
            gens[loop] = HFEngine(model, tok.pad_token_id, len(rows), tok).generate(
                ids, mask, sampling
            )
    finally:
        hf_engine.loop_applies = real_applies
    got, want = gens[True], gens[False]
    assert got.input_ids.device.type == device.type
    assert torch.equal(got.input_ids, want.input_ids)
    assert torch.equal(got.response_mask, want.response_mask)
    assert got.stopped.tolist() == want.stopped.tolist()
    torch.testing.assert_close(got.logprobs, want.logprobs, atol=1e-5, rtol=1e-4)
    r = got.response_ids.shape[1]
    keep = got.response_mask.bool()
    with torch.no_grad():
        full = response_logits(model, got.input_ids, got.attention_mask, r)
        packed = response_logits(model, got.input_ids, got.attention_mask, r, keep=keep)
    assert packed.shape == (int(keep.sum()), full.shape[-1])
    torch.testing.assert_close(packed, full[keep], atol=1e-5, rtol=1e-4)


def test_decode_loop_and_response_only_head_on_the_gpu():
    decode_and_head_on(CUDA)
