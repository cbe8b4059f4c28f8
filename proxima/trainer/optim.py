"""AdamW with linear warm-up then constant or cosine decay, one per trained role."""

from __future__ import annotations

import math
import warnings

import torch

from proxima.config import OptimConfig
from proxima.models.saving import load_role, read_role_weights
from proxima.trainer.dist import (
    Dist,
    full_optimizer_state,
    full_state_dict,
    load_full_optimizer_state,
    load_full_state_dict,
    unwrap,
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


def _trainable(*modules: torch.nn.Module | None) -> list[torch.nn.Parameter]:
    return [p for m in modules if m is not None for p in m.parameters() if p.requires_grad]


def build_optimizer(
    model: torch.nn.Module,
    cfg: OptimConfig,
    total_steps: int,
    head: torch.nn.Module | None = None,
    head_lr: float = 0.0,
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over the model's trainable parameters; a `head` kept outside the model (a
    shared-backbone value head) is a second parameter group at `head_lr`, on the same
    schedule."""
    groups = [{"params": _trainable(model)}]
    if head is not None:
        groups.append({"params": _trainable(head), "lr": head_lr})
    opt = torch.optim.AdamW(
        groups, lr=cfg.lr, betas=tuple(cfg.betas), eps=cfg.eps, weight_decay=cfg.weight_decay
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s, total_steps, cfg))
    return opt, sched


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
    return build_optimizer(model, cfg, steps)


class NonFiniteWeightsError(ValueError):
    """An optimizer step with a finite gradient made weights inf or nan (a learning rate far
    too high); the model cannot be used any more. `role` names it (set by TrainedRole)."""

    role = "model"


def first_non_finite(model: torch.nn.Module, head: torch.nn.Module | None = None) -> str | None:
    """Name of the first trainable parameter holding inf or nan, or None (one device sync)."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if head is not None:
        named += [(f"value_head.{n}", p) for n, p in head.named_parameters() if p.requires_grad]
    if not named:
        return None
    finite = torch.stack([torch.isfinite(p).all() for _, p in named])
    if bool(finite.all()):
        return None
    return named[int((~finite).nonzero()[0])][0]


def _clip_joint(model: torch.nn.Module, head: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """clip_grad_norm_ over the model and a head kept outside it, as one vector (their
    norms are combined first: a DDP model's and a plain head's gradients are not stacked)."""
    norms = [
        torch.nn.utils.clip_grad_norm_(_trainable(m), float("inf")).float().cpu()
        for m in (model, head)
    ]
    total = torch.linalg.vector_norm(torch.stack(norms))
    if math.isfinite(float(total)) and float(total) > max_norm:
        scale = max_norm / (float(total) + 1e-6)
        for p in _trainable(model, head):
            if p.grad is not None:
                p.grad.mul_(scale)
    return total


def optimizer_step(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    sched,
    grad_clip: float,
    head: torch.nn.Module | None = None,
) -> tuple[float, bool]:
    """Clip and step, for every training loop (PPO, SFT, reward model). A step whose
    gradient is not finite is skipped, and does not advance the learning-rate schedule
    either: it did not happen. A step that makes the weights non-finite raises
    NonFiniteWeightsError (the gradient was fine, the step size was not). Returns
    (gradient norm before clipping, stepped). `head`: parameters outside the model that
    the optimizer also steps (clipped together with the model's)."""
    max_norm = grad_clip if grad_clip > 0 else float("inf")
    if head is None:
        norm = torch.nn.utils.clip_grad_norm_(_trainable(model), max_norm)
    else:
        norm = _clip_joint(model, head, max_norm)
    ok = bool(torch.isfinite(norm))
    if ok:
        lr = opt.param_groups[0]["lr"]
        opt.step()
        sched.step()
        bad = first_non_finite(model, head)
        if bad is not None:
            opt.zero_grad(set_to_none=True)
            raise NonFiniteWeightsError(
                f"parameter {bad} is not finite after an optimizer step at learning rate "
                f"{lr:g} with a finite gradient norm {float(norm):.4g}; lower the learning rate"
            )
    opt.zero_grad(set_to_none=True)
    return float(norm), ok


class TrainedRole:
    """A model PPO trains (actor or critic) with its optimizer, schedule and config section.

    `state_dict()` / `load_state_dict()` follow torch's protocol; the weights themselves are
    saved as Hugging Face folders (`proxima.models.saving`).
    """

    def __init__(
        self,
        name: str,
        model: torch.nn.Module,
        cfg,
        total_steps: int,
        dist: Dist | None = None,
        head: torch.nn.Module | None = None,
        head_lr: float = 0.0,
    ) -> None:
        """`head`, `head_lr`: a shared-backbone value head trained with the model (outside
        it: its gradients are averaged over the processes here, not by DDP)."""
        self.name, self.model, self.cfg = name, model, cfg  # model: wrapped by DDP / FSDP2
        self.dist = dist or Dist()
        self.head, self.head_lr = head, head_lr
        self.optimizer, self.scheduler = build_optimizer(
            model, cfg.optim, total_steps, head, head_lr
        )

    @property
    def unwrapped(self) -> torch.nn.Module:
        """The model itself (inside a DDP wrapper; FSDP2 shards in place)."""
        return unwrap(self.model)

    def full_state_dict(self) -> dict[str, torch.Tensor] | None:
        """None where the model's own state dict is whole (one process, DDP); gathered from
        the shards on rank 0 under FSDP2 (every rank must call it)."""
        if self.dist.strategy != "fsdp2":
            return None
        return full_state_dict(self.model, self.dist)

    def load_weights(self, folder, name: str) -> None:
        """The weights `save_role` wrote, in place; under FSDP2 every rank reads the whole
        folder and keeps its shard."""
        if self.dist.strategy == "fsdp2":
            load_full_state_dict(self.model, read_role_weights(folder, name))
        else:
            load_role(self.unwrapped, folder, name)

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]

    def average_head_grads(self) -> None:
        """The head's gradients averaged over the processes: what DDP does for the model's
        (the head is outside it). Called by `step()`."""
        world = self.dist.world_size
        if self.head is not None and world > 1:
            for p in _trainable(self.head):
                if p.grad is not None:
                    p.grad = (self.dist.all_reduce_sum(p.grad) / world).to(p.grad.dtype)

    def step(self) -> tuple[float, bool]:
        self.average_head_grads()
        try:
            return optimizer_step(
                self.model, self.optimizer, self.scheduler, self.cfg.optim.grad_clip, self.head
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
        (a resumed run may change the lr, betas, eps, weight decay; the same config leaves
        every value as saved)."""
        ocfg = self.cfg.optim
        if self.dist.strategy == "fsdp2":
            load_full_optimizer_state(self.model, self.optimizer, state["optimizer"])
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        base_lrs = [ocfg.lr] + ([self.head_lr] if self.head is not None else [])
        for group, lr in zip(self.optimizer.param_groups, base_lrs, strict=True):
            group.update(
                betas=tuple(ocfg.betas),
                eps=ocfg.eps,
                weight_decay=ocfg.weight_decay,
                initial_lr=lr,
            )
        if self.scheduler.base_lrs != base_lrs:  # the lr changed since the checkpoint:
            # recompute lr = base_lr * factor(step) at the restored step, the scheduler's way
            self.scheduler.base_lrs = base_lrs
            self.scheduler.last_epoch -= 1
            with warnings.catch_warnings():  # "step() before optimizer.step()": not a new step
                warnings.simplefilter("ignore", UserWarning)
                self.scheduler.step()
