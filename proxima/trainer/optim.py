"""AdamW with linear warm-up then constant or cosine decay, one per trained role (a group
per part with settings of its own: the actor and its value head)."""

from __future__ import annotations

import math
import warnings

import torch

from proxima.config import OptimConfig
from proxima.models.critic import load_module, read_module, save_module
from proxima.models.unwrap import unwrap
from proxima.trainer.dist import (
    Dist,
    full_optimizer_state,
    full_state_dict,
    load_full_optimizer_state,
    load_full_state_dict,
)


def lr_factor(step: int, total_steps: int, cfg: OptimConfig) -> float:
    """Multiplier of cfg.lr at optimizer step `step` (0-based)."""
    if cfg.warmup_steps and step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    span = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / span)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine


ParamGroup = tuple[str, list[torch.nn.Parameter], OptimConfig]  # name, params, settings


def trainable(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def build_optimizer(
    groups: list[ParamGroup], total_steps: int
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW with one parameter group per `groups` entry (its own lr, betas, eps, weight
    decay) and one schedule per group (its own warm-up and decay over `total_steps`)."""
    first = groups[0][2]
    opt = torch.optim.AdamW(
        [
            {
                "params": params,
                "lr": o.lr,
                "betas": tuple(o.betas),
                "eps": o.eps,
                "weight_decay": o.weight_decay,
            }
            for _, params, o in groups
        ],
        lr=first.lr,
    )
    factors = [lambda s, o=o: lr_factor(s, total_steps, o) for _, _, o in groups]
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, factors)


def finetune_optimizer(model: torch.nn.Module, lr: float, steps: int, warmup_steps: int = 0):
    """The SFT and reward-model schedule: AdamW (betas 0.9, 0.99, no weight decay), linear
    warm-up, then cosine to 10% of lr over `steps`."""
    cfg = OptimConfig(
        lr=lr,
        schedule="cosine",
        betas=[0.9, 0.99],
        warmup_steps=warmup_steps,
        weight_decay=0.0,
        min_lr_ratio=0.1,
    )
    return build_optimizer([("model", trainable(model), cfg)], steps)


class NonFiniteWeightsError(ValueError):
    """An optimizer step with a finite gradient made weights inf or nan (a learning rate far
    too high); the model cannot be used any more. `role` names it (set by TrainedRole)."""

    role = "model"


def first_non_finite(model: torch.nn.Module) -> str | None:
    """Name of the first trainable parameter holding inf or nan, or None (one device sync)."""
    named = [(n, p) for n, p in unwrap(model).named_parameters() if p.requires_grad]
    if not named:
        return None
    finite = torch.stack([torch.isfinite(p).all() for _, p in named])
    if bool(finite.all()):
        return None
    return named[int((~finite).nonzero()[0])][0]


def clip_gradients(opt: torch.optim.Optimizer, max_norm: float) -> torch.Tensor:
    """Scale the gradients of every parameter the optimizer steps to a global norm of at
    most `max_norm`; returns the norm before. With several parameter groups (the actor and
    its value head) the norm is over all of them, as one vector: the norm of each group's
    norm."""
    groups = [g["params"] for g in opt.param_groups]
    if len(groups) == 1:
        return torch.nn.utils.clip_grad_norm_(groups[0], max_norm)
    norms = [
        torch.nn.utils.clip_grad_norm_(params, float("inf")).float().cpu() for params in groups
    ]
    total = torch.linalg.vector_norm(torch.stack(norms))
    if math.isfinite(float(total)) and float(total) > max_norm:
        scale = max_norm / (float(total) + 1e-6)
        for params in groups:
            for p in params:
                if p.grad is not None:
                    p.grad.mul_(scale)
    return total


def optimizer_step(
    model: torch.nn.Module, opt: torch.optim.Optimizer, sched, grad_clip: float
) -> tuple[float, bool]:
    """Clip and step, for every training loop (PPO, SFT, reward model). A step whose
    gradient is not finite is skipped, and does not advance the learning-rate schedule
    either: it did not happen. A step that makes the weights non-finite raises
    NonFiniteWeightsError (the gradient was fine, the step size was not). Returns
    (gradient norm before clipping, stepped)."""
    norm = clip_gradients(opt, grad_clip if grad_clip > 0 else float("inf"))
    ok = bool(torch.isfinite(norm))
    if ok:
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        bad = first_non_finite(model)
        if bad is not None:
            opt.zero_grad(set_to_none=True)
            raise NonFiniteWeightsError(
                f"parameter {bad} is not finite after an optimizer step at learning rate "
                f"{lr:g} with a finite gradient norm {float(norm):.4g}; lower the learning rate"
            )
    opt.zero_grad(set_to_none=True)
    return float(norm), ok


class TrainedRole:
    """A module PPO trains (the actor, maybe with its value head; a value model) with its
    optimizer, schedule and config section (epochs, mini- and micro-batch sizes, shuffle).

    `state_dict()` / `load_state_dict()` follow torch's protocol; the weights themselves are
    saved as Hugging Face folders (`models.critic.save_module`).
    """

    def __init__(
        self,
        name: str,
        model: torch.nn.Module,
        cfg,
        total_steps: int,
        dist: Dist | None = None,
        groups: list[ParamGroup] | None = None,
    ) -> None:
        """`groups`: the optimizer's parameter groups, each with its own settings (default:
        one, every trainable parameter at `cfg.optim`)."""
        self.name, self.model, self.cfg = name, model, cfg  # model: wrapped by DDP / FSDP2
        self.dist = dist or Dist()
        self.groups = groups or [(name, trainable(model), cfg.optim)]
        self.optimizer, self.scheduler = build_optimizer(self.groups, total_steps)

    @property
    def unwrapped(self) -> torch.nn.Module:
        """The module itself (inside a DDP wrapper; FSDP2 shards in place)."""
        return unwrap(self.model)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """None where the module's own state dict is whole (one process, DDP); gathered from
        the shards on rank 0 under FSDP2 (every rank must call it)."""
        if self.dist.strategy != "fsdp2":
            return None
        return full_state_dict(self.model, self.dist)

    def save(self, folder, tokenizer) -> None:
        """The module's folders (`save_module`); every rank calls it (FSDP2 gathers the
        shards), rank 0 writes."""
        state = self.full_state_dict()
        if self.dist.is_main:
            save_module(self.unwrapped, tokenizer, folder, self.name, state)

    def load(self, folder) -> None:
        """The weights `save` wrote, in place; under FSDP2 every rank reads the whole folder
        and keeps its shard."""
        if self.dist.strategy == "fsdp2":
            load_full_state_dict(self.model, read_module(self.unwrapped, folder, self.name))
        else:
            load_module(self.unwrapped, folder, self.name)

    def lrs(self) -> dict[str, float]:
        """The current learning rate of each parameter group, by group name."""
        return {
            name: group["lr"]
            for (name, _, _), group in zip(self.groups, self.optimizer.param_groups, strict=True)
        }

    def step(self) -> tuple[float, bool]:
        try:
            return optimizer_step(
                self.model, self.optimizer, self.scheduler, self.cfg.optim.grad_clip
            )
        except NonFiniteWeightsError as err:
            err.role = self.name
            raise

    def state_dict(self) -> dict:
        """Optimizer and schedule; under FSDP2 the optimizer state is gathered whole onto
        rank 0 (every rank must call it), so any number of processes can read it back."""
        if self.dist.strategy == "fsdp2":
            optimizer = full_optimizer_state(self.model, self.optimizer)
        else:
            optimizer = self.optimizer.state_dict()
        return {"optimizer": optimizer, "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore optimizer + schedule position, then apply this config's hyper-parameters
        to each group (a resumed run may change the lr, betas, eps, weight decay; the same
        config leaves every value as saved)."""
        if self.dist.strategy == "fsdp2":
            load_full_optimizer_state(self.model, self.optimizer, state["optimizer"])
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        base_lrs = [o.lr for _, _, o in self.groups]
        for group, (_, _, o) in zip(self.optimizer.param_groups, self.groups, strict=True):
            group.update(
                betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, initial_lr=o.lr
            )
        if self.scheduler.base_lrs != base_lrs:  # the lr changed since the checkpoint:
            # recompute lr = base_lr * factor(step) at the restored step, the scheduler's way
            self.scheduler.base_lrs = base_lrs
            self.scheduler.last_epoch -= 1
            with warnings.catch_warnings():  # "step() before optimizer.step()": not a new step
                warnings.simplefilter("ignore", UserWarning)
                self.scheduler.step()
