"""Several processes, one run: torchrun's environment, the process group, the collectives the
trainer needs, and DDP / FSDP2 wrapping of the trained models. PyTorch's own engines only
(`torch.distributed`, DistributedDataParallel, `fully_shard`); nothing here does math.

One process (plain `proxima train`) gets a `Dist` of world size 1 whose collectives return
their input, so the trainer has one code path. Under `torchrun --nproc_per_node N -m proxima
train ...` every rank holds its share of the global batch (`data.train_batch_size` and
`ppo_mini_batch_size` are global; `ppo_micro_batch_size` is per process, as in verl).
"""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as tdist
from torch import nn

from proxima import launch
from proxima.models.critic import PolicyValue
from proxima.models.loading import DTYPES
from proxima.models.unwrap import unwrap

T = TypeVar("T")

T = TypeVar("T")


@dataclass(frozen=True)
class Dist:
    """This process's place in the job. `strategy` is none, ddp or fsdp2 (auto resolved)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    strategy: str = "none"

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def active(self) -> bool:
        """A process group exists (world size > 1)."""
        return self.world_size > 1

    # ------------------------------------------------------------------ collectives

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in float64 (counts and moments: exact whatever the order)."""
        out = t.detach().to(torch.float64).clone()
        if self.active:
            tdist.all_reduce(out)
        return out

    def all_gather_object(self, obj: T) -> list[T]:
        if not self.active:
            return [obj]
        out: list[Any] = [None] * self.world_size
        tdist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj: T) -> T:
        """Rank 0's `obj` on every rank."""
        if not self.active:
            return obj
        box = [obj if self.is_main else None]
        tdist.broadcast_object_list(box, src=0)
        return box[0]

    def gather_rows(self, t: torch.Tensor, pad_value: float = 0) -> torch.Tensor:
        """Concatenate every rank's rows [B_r, ...] in rank order -> [sum B_r, ...]. Rows may
        differ in number and, for [B, T] tensors, in width T: narrower ones are padded on
        the right with `pad_value` to the widest."""
        if not self.active:
            return t
        shapes = self.all_gather_object(tuple(t.shape))
        width = max(s[1] for s in shapes) if t.dim() > 1 else None
        if width is not None and t.shape[1] < width:
            pad = [0, 0] * (t.dim() - 2) + [0, width - t.shape[1]]
            t = nn.functional.pad(t, pad, value=pad_value)
        parts = self.all_gather_object(t.detach().cpu())
        return torch.cat(parts).to(t.device)

    def any(self, flag: bool) -> bool:
        """True on every rank when `flag` is true on any rank."""
        if not self.active:
            return bool(flag)
        return bool(self.all_reduce_sum(torch.tensor(float(bool(flag)))) > 0)

    def barrier(self) -> None:
        if self.active:
            tdist.barrier()

    def agree(self, fn: Callable[[], T], what: str) -> T:
        """Run `fn` on every rank; if it raises on any rank, raise on every rank (the first
        failing rank's exception, its rank named) instead of leaving the others waiting in
        the next collective."""
        try:
            result, error = fn(), None
        except Exception as err:  # noqa: BLE001 - re-raised below, on every rank
            result, error = None, err
        if not self.active:
            if error is not None:
                raise error
            return result
        errors = self.all_gather_object(None if error is None else _portable(error))
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if not failed:
            return result
        if error is not None:
            raise error
        rank, first = failed[0]
        first.args = (f"{what} failed on rank {rank}: {first}", *first.args[1:])
        raise first


def _portable(error: Exception) -> Exception:
    """`error` if it pickles (to send it to the other ranks), else a RuntimeError saying it."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(f"{type(error).__name__}: {error}")


def resolve_strategy(strategy: str, world_size: int) -> str:
    """`trainer.strategy` for this job: one process trains unwrapped whatever it says (so a
    checkpoint of a torchrun job resumes in one process); auto is ddp for several."""
    if world_size == 1:
        return "none"
    if strategy == "auto":
        return "ddp"
    if strategy == "none" and world_size > 1:
        raise ValueError(
            f"`trainer.strategy=none` but this job has {world_size} processes (torchrun): "
            "use trainer.strategy=ddp or fsdp2 (or auto), or run a single process."
        )
    return strategy


def backend_for(spec: str, device_type: str) -> str:
    """`trainer.dist_backend`: auto (gloo on CPU, nccl on CUDA), a backend name, or a
    device map like `cpu:gloo,cuda:nccl`."""
    if spec == "auto":
        return "nccl" if device_type == "cuda" else "gloo"
    if ":" in spec:
        pairs = dict(item.split(":", 1) for item in spec.split(","))
        if device_type not in pairs:
            raise ValueError(
                f"`trainer.dist_backend`={spec!r} names no backend for device type "
                f"{device_type!r}; add `{device_type}:gloo` (CPU) or `{device_type}:nccl`."
            )
        return pairs[device_type]
    return spec


def init(strategy: str, backend: str, timeout_s: float, device: torch.device) -> Dist:
    """The process group of a torchrun job (once per process), or a one-process `Dist`."""
    rank, world, local = launch.world()
    strategy = resolve_strategy(strategy, world)
    if world > 1 and not tdist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        tdist.init_process_group(
            backend=backend_for(backend, device.type),
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    return Dist(rank=rank, world_size=world, local_rank=local, strategy=strategy)


def shutdown(finished: bool = False) -> bool:
    """Tear down the process group; True when there was one. `finished`: every rank
    returned normally, so they meet at a barrier first. Even then a rank's interpreter can
    abort while it finalises ("terminate called without an active exception", a C++
    thread of the gloo backend destroyed while joinable; seen twice in CI's 2-process
    runs, after everything was written), so `proxima.cli.run` ends such a process with
    `exit_now` rather than through the interpreter's finalisation."""
    if not tdist.is_initialized():
        return False
    if finished:
        try:
            tdist.barrier()
        except Exception:  # noqa: BLE001 - tearing down anyway
            pass
    tdist.destroy_process_group()
    return True


def exit_now(status: int) -> None:
    """End the process with `status` after Python's exit handlers and flushed output, but
    without the interpreter's finalisation, where a torn-down gloo backend's threads can
    abort the process (exit -6) after a run that succeeded."""
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing more to say
            pass
    os._exit(int(status or 0))


# --------------------------------------------------------------------------- models


def wrap_trained(model: nn.Module, dist: Dist, device: torch.device, fsdp=None) -> nn.Module:
    """The module the update runs through: DDP around the model, or the model sharded in
    place by FSDP2 (`fully_shard` on every decoder layer, then the root), or the model
    itself for one process."""
    if dist.strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [device.index] if device.type == "cuda" else None
        # some parameters of the actor with a value head sit out a backward: the head the
        # ptx loss's, the policy the critic's warm-up (DDP then finds them each forward)
        unused = isinstance(model, PolicyValue)
        return DDP(model, device_ids=ids, find_unused_parameters=unused)
    if dist.strategy == "fsdp2":
        shard(model, fsdp, trainable=True)
        return model
    return model


def shard(model: nn.Module, fsdp, trainable: bool) -> None:
    """FSDP2 in place: every transformer layer its own unit, then the root; a mixed-
    precision policy from `fsdp.param_dtype` / `fsdp.reduce_dtype`; frozen models may be
    offloaded to the CPU (`fsdp.offload_frozen`)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    # FSDP2 warns that a module returned a view (HF heads slice their outputs); proxima does
    # no in-place op on model outputs, and tests/distributed/test_parity.py checks the gradients
    warnings.filterwarnings("ignore", message=".*returned a view tensor.*", category=UserWarning)

    mp = MixedPrecisionPolicy(
        param_dtype=DTYPES[fsdp.param_dtype], reduce_dtype=DTYPES[fsdp.reduce_dtype]
    )
    kwargs: dict[str, Any] = {"mp_policy": mp, "reshard_after_forward": fsdp.reshard_after_forward}
    if not trainable and fsdp.offload_frozen:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    if isinstance(model, PolicyValue):
        # its `generate` runs the policy inside it: gather the root's parameters (embeddings,
        # LM head, value head) around the whole call, as a forward through the root would
        from torch.distributed.fsdp import register_fsdp_forward_method

        register_fsdp_forward_method(model, "generate")


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks of a Hugging Face model (the `nn.ModuleList` with the
    most parameters), the units FSDP2 shards one at a time."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) > 0]
    if not lists:
        return []
    return list(max(lists, key=lambda m: sum(p.numel() for p in m.parameters())))


@contextmanager
def grad_sync(model: nn.Module, enabled: bool):
    """Gradient all-reduce on this backward or not: only the last backward of a mini-batch
    synchronises (DDP `no_sync`, FSDP2 `set_requires_gradient_sync`; one process: nothing)."""
    if not enabled and hasattr(model, "no_sync"):
        with model.no_sync():
            yield
    elif not enabled and hasattr(model, "set_requires_gradient_sync"):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def _full_options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def full_state_dict(model: nn.Module, dist: Dist) -> dict[str, torch.Tensor] | None:
    """The whole model's state dict on the CPU (rank 0; None elsewhere): gathered from the
    shards under FSDP2 (every rank must call it), as is otherwise."""
    if dist.strategy != "fsdp2":
        return unwrap(model).state_dict() if dist.is_main else None
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    state = get_model_state_dict(model, options=_full_options(cpu_offload=True))
    return state if dist.is_main else None


def load_full_state_dict(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Whole weights (every rank holds them) into an FSDP2-sharded model: each rank keeps
    its shard. Weights tied to another (a tied LM head) may be absent."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict

    result = set_model_state_dict(model, weights, options=_full_options(strict=False))
    tied = {n for n, p in model.named_parameters(remove_duplicate=False)} - {
        n for n, _ in model.named_parameters()
    }
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise ValueError(
            f"the saved weights do not fit this run's model (missing {missing[:5]}, "
            f"unexpected {list(result.unexpected_keys)[:5]}): resume with the model.* "
            "settings the checkpoint was written with."
        )


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """An FSDP2 model's optimizer state, whole, on rank 0's CPU (keyed by parameter name)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_full_options(cpu_offload=True))


def load_full_optimizer_state(
    model: nn.Module, optimizer: torch.optim.Optimizer, state: dict
) -> None:
    """`full_optimizer_state` (every rank holds it) back into each rank's shards."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=_full_options())
