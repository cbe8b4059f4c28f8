"""Offload between phases (`model.offload`): what a phase of the iteration does not use
waits in CPU memory, as verl, OpenRLHF and ROLL offload the trained models.

The actor's weights stay on the device (every phase uses them). The rest is a `Part`: the
trained roles' AdamW state with their gradients (used only by the update), a value model's
weights (scoring and the update), the reference (scoring; the update too under
actor.use_kl_loss), on-policy distillation's teacher (scoring) and the reward models (the
reward phase and evaluations). Before each phase, `Offload.enter` puts what the phase
needs on the device and the rest on the CPU (`RESIDENT`); a phase it does not name changes
nothing. Every parameter keeps its
identity (its `.data` is swapped; an optimizer state entry or a gradient is replaced by its
copy), so the optimizer's keys, DDP's parameters and the trainer's references stay valid,
and a round trip is exact bit for bit.

The CPU copies live in buffers allocated once (`CPUStore`), pinned when the device is a
GPU, so each move is one asynchronous copy and no iteration allocates pinned memory
again; each `enter` waits for its copies, so its seconds are the moves' own. On a CPU
device the moves still run (CPU to CPU copies, nothing gained): that is how the tests
check the round trips without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from proxima.config import Config
from proxima.config.run import run_plan
from proxima.rewards import ModelReward

# the parts each phase needs on the device (`PPOTrainer.step`'s phases, plus an
# evaluation between iterations); `reference` joins the update under actor.use_kl_loss
RESIDENT: dict[str, frozenset[str]] = {
    "generate": frozenset(),
    "reward": frozenset({"reward models"}),
    "score": frozenset({"critic weights", "reference", "teacher"}),
    "update": frozenset({"actor optimizer", "critic optimizer", "critic weights"}),
    "evaluate": frozenset({"reward models"}),
}


def resident(reference_in_update: bool) -> dict[str, frozenset[str]]:
    """`RESIDENT`, with the reference among the update's parts when the update uses it
    (actor.use_kl_loss)."""
    if not reference_in_update:
        return dict(RESIDENT)
    return {**RESIDENT, "update": RESIDENT["update"] | {"reference"}}


def wants_offload(cfg: Config, device: torch.device) -> bool:
    """model.offload=trained on a GPU (auto is the memory plan's decision,
    `trainer.memory.plan_memory`)."""
    return run_plan(cfg).offload == "trained" and device.type == "cuda"


def reward_models(reward) -> list[torch.nn.Module]:
    """The models of a reward source: a reward model's, or those of `reward.sources`."""
    sources = [part.source for part in getattr(reward, "parts", [])] or [reward]
    return [s.model for s in sources if isinstance(s, ModelReward)]


class CPUStore:
    """CPU buffers by key, allocated at the first offload of each tensor and reused at every
    later one (pinned when `pin`: asynchronous copies from and to a GPU)."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.buffers: dict[tuple, torch.Tensor] = {}

    def offload(self, key: tuple, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` copied into its CPU buffer (non-blocking); the buffer."""
        buf = self.buffers.get(key)
        if buf is None or buf.shape != tensor.shape or buf.dtype != tensor.dtype:
            buf = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=self.pin)
            self.buffers[key] = buf
        return buf.copy_(tensor, non_blocking=True)


def restore(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of an offloaded tensor on `device` (a new tensor even on the CPU, so the
    buffer is never aliased: the next offload overwrites it)."""
    return torch.empty_like(tensor, device=device).copy_(tensor, non_blocking=True)


def offload_parameters(params: Iterable[torch.nn.Parameter], store: CPUStore) -> None:
    """Each parameter's data into `store` (its `.data` becomes the CPU buffer)."""
    for p in params:
        p.data = store.offload(("param", id(p)), p.data)


def restore_parameters(params: Iterable[torch.nn.Parameter], device: torch.device) -> None:
    """Each offloaded parameter's data back on `device`."""
    for p in params:
        p.data = restore(p.data, device)


def offload_gradients(params: Iterable[torch.nn.Parameter], store: CPUStore) -> dict:
    """The parameters' gradients into `store`, each `.grad` set to None (a CPU gradient
    cannot be assigned to a parameter on the GPU); returns them by parameter, for
    `restore_gradients`."""
    stashed = {}
    for p in params:
        if p.grad is not None:
            stashed[p] = store.offload(("grad", id(p)), p.grad)
            p.grad = None
    return stashed


def restore_gradients(stashed: dict, device: torch.device) -> None:
    """Gradients `offload_gradients` stashed back on their parameters, on `device`."""
    for p, grad in stashed.items():
        p.grad = restore(grad, device)


def offload_optimizer(optimizer: torch.optim.Optimizer, store: CPUStore, device) -> None:
    """Every state tensor of `optimizer` on `device` into `store` (AdamW's exp_avg and
    exp_avg_sq; its step count too where it lives on `device`: on a GPU it is a CPU
    scalar and stays)."""
    for p, state in optimizer.state.items():
        for name, value in state.items():
            if torch.is_tensor(value) and value.device.type == device.type:
                state[name] = store.offload(("state", id(p), name), value)


def restore_optimizer(optimizer: torch.optim.Optimizer, store: CPUStore, device) -> None:
    """The state tensors `offload_optimizer` moved, back on `device`."""
    for p, state in optimizer.state.items():
        for name, value in state.items():
            buf = store.buffers.get(("state", id(p), name))
            if value is buf:
                state[name] = restore(value, device)


class Part:
    """Something that can wait on the CPU: `offload()` and `restore()`, each a no-op when
    it is already there."""

    def __init__(self, offload: Callable[[], None], restore: Callable[[], None]) -> None:
        self._offload, self._restore = offload, restore
        self.on_device = True

    def offload(self) -> None:
        if self.on_device:
            self._offload()
            self.on_device = False

    def restore(self) -> None:
        if not self.on_device:
            self._restore()
            self.on_device = True


class Offload:
    """The parts of one trainer and the phases that need them (`RESIDENT`, the reference
    added to the update's when it is used there). `release`: give the memory freed back to
    the driver after each move (for an engine that allocates outside torch, vLLM); else it
    stays in torch's cache, where the next restore finds it without a cudaMalloc."""

    def __init__(
        self, device: torch.device, reference_in_update: bool = False, release: bool = False
    ) -> None:
        self.device, self.release = device, release
        self.store = CPUStore(pin=device.type == "cuda")
        self.parts: dict[str, Part] = {}
        self.resident = resident(reference_in_update)

    def add_weights(self, name: str, modules: Iterable[torch.nn.Module]) -> None:
        """The parameters of `modules` (a value model, the frozen reference, teacher and
        reward models) as part `name`; nothing when they have none (the LoRA reference is the
        actor with its adapters off)."""
        params = list(dict.fromkeys(p for m in modules for p in m.parameters()))
        if params:
            self.parts[name] = Part(
                lambda: offload_parameters(params, self.store),
                lambda: restore_parameters(params, self.device),
            )

    def add_optimizer(self, name: str, optimizer: torch.optim.Optimizer) -> None:
        """An optimizer's state and its parameters' gradients as part `name`."""
        params = [p for group in optimizer.param_groups for p in group["params"]]
        stashed: dict = {}

        def out() -> None:
            stashed.update(offload_gradients(params, self.store))
            offload_optimizer(optimizer, self.store, self.device)

        def back() -> None:
            restore_optimizer(optimizer, self.store, self.device)
            restore_gradients(stashed, self.device)
            stashed.clear()

        self.parts[name] = Part(out, back)

    def enter(self, phase: str) -> None:
        """Before `phase`: the parts it needs on the device, the others on the CPU (the
        optimizers' first when leaving, last when coming back: their gradients belong to
        weights that must be where they are); waits for the copies, when there were any.
        With `release`, the memory freed goes back to the driver (`empty_cache`)."""
        need = self.resident.get(phase)
        if need is None:
            return
        order = sorted(self.parts, key=lambda name: "optimizer" in name)
        leaving = [n for n in reversed(order) if n not in need and self.parts[n].on_device]
        arriving = [n for n in order if n in need and not self.parts[n].on_device]
        for name in leaving:
            self.parts[name].offload()
        for name in arriving:
            self.parts[name].restore()
        if self.device.type == "cuda" and (leaving or arriving):
            torch.cuda.synchronize(self.device)
            if leaving and self.release:
                torch.cuda.empty_cache()

    def where(self) -> dict[str, bool]:
        """Each part's name: True when it is on the device now."""
        return {name: part.on_device for name, part in self.parts.items()}
