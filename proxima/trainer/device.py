"""Where a run computes: the device a config names (checked, with the key that named it),
the dtype of its frozen roles, the autocast context of its forward passes, and the devices
of spawned rollout workers."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from proxima.config import Config, ConfigError
from proxima.config.run import run_plan
from proxima.models import DTYPES


def frozen_dtype(cfg: Config) -> torch.dtype:
    """Dtype of the frozen roles (reference, reward model): bfloat16 under mixed precision
    (autocast computes in it anyway; half the memory), else model.dtype."""
    return torch.bfloat16 if cfg.model.mixed_precision == "bf16" else DTYPES[cfg.model.dtype]


def autocast(cfg: Config, device: torch.device):
    """The context of every forward pass (generation with the hf engine, scoring, reward
    model, updates, evaluation): bfloat16 autocast under model.mixed_precision=bf16, with
    the weights and optimizer state staying float32; else nothing."""
    if cfg.model.mixed_precision == "bf16":
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def resolve_device(name: str, local_rank: int = 0, key: str = "model.device") -> torch.device:
    """`model.device` (or the config `key` that names it): auto (CUDA when visible), cpu,
    cuda or cuda:N. Under torchrun, `cuda` and auto mean this process's GPU, cuda:LOCAL_RANK."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:  # not a device string torch knows
        device = None
    mps = device is not None and device.type == "mps" and torch.backends.mps.is_available()
    if device is None or (device.type not in ("cpu", "cuda") and not mps):
        raise ValueError(
            f"`{key}`={name} is not a device this machine has for proxima: use "
            "auto (CUDA when visible, else the CPU), cpu, cuda or cuda:N."
        )
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"`{key}`={name} but no CUDA device is visible. Use {key}=cpu (or auto).")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    return device


def check_rollout_devices(cfg: Config) -> None:
    """`rollout.devices` (rollout workers spawned onto them) exist on this machine: checked
    at start-up, before any model loads."""
    if not run_plan(cfg).workers:
        return
    count = torch.cuda.device_count()
    for name in cfg.rollout.devices:
        device = torch.device(name)
        if device.type == "cuda" and (device.index or 0) >= count:
            seen = f"{count} CUDA device(s): cuda:0 to cuda:{count - 1}" if count else "none"
            raise ConfigError(
                f"`rollout.devices` names {name}, but this machine has {seen}. Fix: list the "
                "devices that exist (CUDA_VISIBLE_DEVICES renumbers them from 0), or leave "
                "rollout.devices empty: the workers share the trainer's device."
            )
