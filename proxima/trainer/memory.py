"""The memory plan: the peak memory of a PPO run per role and phase, predicted from the config
and the models' config.json files before any model loads, and a run that would not fit
stopped before it starts (`trainer.memory_check`).

What is counted, per process:

- weights of every loaded role (actor, reference, teacher, critic, reward models; the LoRA
  reference is the actor with its adapters off, a shared-backbone critic a head on the
  actor), counted exactly from a model built on the meta device; gradients and AdamW's two
  states of what is trained (the adapters only under LoRA), in the parameter's dtype;
- activations kept for the backward pass of one training micro-batch, with or without
  `model.gradient_checkpointing`: measured by running the model's forward and the loss's
  log-softmax on fake tensors (no memory, no compute) and summing the tensors autograd saves;
- the logits of a scoring or training micro-batch (rows x response x vocabulary floats) and
  their log-softmax temporaries; the KV cache of a generation call; the vLLM engine's
  weights and KV-cache reservation;
- under torchrun: DDP keeps full copies per process, FSDP2 a shard of weights, gradients and
  optimizer state;
- under `model.offload` (`trainer.offload`), each phase holds only what it uses: the held
  optimizer states, value-model, reference, teacher and reward-model weights move into the
  phases that need them, and the reward models' forward becomes a phase of its own (`offloaded`).
  `model.offload=auto` offloads when the plan without it does not fit the free device
  memory and offloading lowers the peak; the plan says so in a note (and, when it does not
  offload, what offloading would make of each phase).

On a CPU the plan adds the process's resident memory at planning time (interpreter, torch,
transformers, data) as its baseline: its figures are then those of the process's peak
resident set (VmHWM). On a GPU the figures are device memory.
"""

from __future__ import annotations

import json
import shutil
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from proxima import allocator, launch
from proxima.config import Config, ConfigError
from proxima.config.roles import role_plan
from proxima.config.run import offload_problem, run_plan
from proxima.models import DTYPES
from proxima.models.packing import shared_mask_form
from proxima.rollout.engines import engine_spec
from proxima.trainer.host_memory import cpu_available, device_available, resident_bytes
from proxima.trainer.model_sizes import (
    CHUNK_ELEMENTS,
    Shape,
    forward_bytes,
    hf_config,
    kv_cache_bytes,
    logits_bytes,
    model_shape,
    saved_activation_bytes,
)
from proxima.trainer.offload import resident
from proxima.types import SORTED

if TYPE_CHECKING:
    from proxima.rollout.plan import ScoringPlan

GiB, MiB = 2**30, 2**20
# allocator slack, autograd's engine and the optimizer's step temporaries on top of the
# counted tensors (CPU), measured with benchmarks/bench_memory_plan.py
RUNTIME_OVERHEAD = 64 * MiB
# a spawned process's CUDA context (its kernels loaded lazily): about this much on a GPU
CUDA_CONTEXT = 512 * MiB


@dataclass
class MemoryPlan:
    """Bytes per role (weights, gradients, optimizer state), what is held through the whole
    run (`held`: the baseline, every role's weights and optimizer state, a vLLM engine),
    what each phase adds on top of it, and what is available."""

    device: str
    baseline: int  # the process's resident memory at planning time (CPU), else 0
    roles: dict[str, dict[str, int]] = field(default_factory=dict)
    held: dict[str, int] = field(default_factory=dict)
    phases: dict[str, dict[str, int]] = field(default_factory=dict)  # phase -> part -> bytes
    processes: int = 1  # processes on this machine sharing its memory
    available: int | None = None  # bytes free for this run on this machine
    notes: list[str] = field(default_factory=list)
    offload: bool = False  # model.offload applies (trained, or auto's choice)

    def phase_total(self, phase: str) -> int:
        """The process's peak during `phase`: what is held plus the phase's own parts."""
        return sum(self.held.values()) + sum(self.phases[phase].values())

    @property
    def peak_phase(self) -> str:
        return max(self.phases, key=self.phase_total)

    @property
    def peak(self) -> int:
        return self.phase_total(self.peak_phase)

    @property
    def needed(self) -> int:
        """Bytes the run adds on this machine: the peak above the baseline, times the
        processes that share the machine."""
        return (self.peak - self.baseline) * self.processes

    def describe(self) -> str:
        """The few lines start-up prints under the batch plan."""
        per = ", per process" if self.processes > 1 else ""
        lines = [f"memory plan ({self.device}{per}; predicted before loading):"]
        for role, parts in self.roles.items():
            lines.append(f"  {role:14s}: " + ", ".join(f"{k} {_gib(v)}" for k, v in parts.items()))
        held = ", ".join(f"{k} {_gib(v)}" for k, v in _largest(self.held, 4))
        lines.append(f"  {'held':14s}: {_gib(sum(self.held.values()))} ({held})")
        for phase, parts in self.phases.items():
            adds = ", ".join(f"{k} {_gib(v)}" for k, v in _largest(parts, 3))
            adds = f"+ {adds}" if adds else "no pass: the engine's log-probs, no other model"
            lines.append(f"  {phase:14s}: {_gib(self.phase_total(phase))} ({adds})")
        total = f"  {'peak':14s}: {_gib(self.peak)} in {self.peak_phase}"
        if self.available is not None:
            total += f"; {_gib(self.available)} available"
        lines.append(total)
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        out = asdict(self)
        out.update(peak=self.peak, peak_phase=self.peak_phase, needed=self.needed)
        out["phase_totals"] = {p: self.phase_total(p) for p in self.phases}
        return out

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2))


def _largest(parts: dict[str, int], n: int) -> list[tuple[str, int]]:
    return sorted(((k, v) for k, v in parts.items() if v), key=lambda kv: -kv[1])[:n]


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


# --------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class _Role:
    name: str
    folder: str
    kind: str
    shape: Shape
    trained: bool
    section: object = None  # its ActorConfig / CriticConfig when trained


def _roles(cfg: Config) -> list[_Role]:
    """Every model the run loads, with its own weights (the role plan's: the LoRA reference
    and a shared-backbone critic have none)."""
    m, lora, plan = cfg.model, cfg.model.lora_rank > 0, role_plan(cfg)
    dtype = DTYPES[m.dtype]
    frozen = torch.bfloat16 if m.mixed_precision == "bf16" else dtype
    out = [
        _Role(
            "actor",
            m.actor_path,
            "causal_lm",
            model_shape(m.actor_path, "causal_lm", dtype, "lora" if lora else "all", cfg),
            True,
            cfg.actor,
        )
    ]
    if plan.reference == "folder":
        shape = model_shape(plan.reference_folder, "causal_lm", frozen, "none", cfg)
        out.append(_Role("reference", plan.reference_folder, "causal_lm", shape, False))
    if plan.has_teacher:
        shape = model_shape(plan.teacher_folder, "causal_lm", frozen, "none", cfg)
        out.append(_Role("teacher", plan.teacher_folder, "causal_lm", shape, False))
    if plan.critic_model:
        mode = "lora" if plan.critic_lora else "all"
        shape = model_shape(plan.critic_folder, "value", dtype, mode, cfg)
        out.append(_Role("critic", plan.critic_folder, "value", shape, True, cfg.critic))
    for i, folder in enumerate(plan.reward_model_folders):
        shape = model_shape(folder, "reward", frozen, "none", cfg)
        out.append(_Role("reward" if i == 0 else f"reward{i}", folder, "reward", shape, False))
    return out


def _place(cfg: Config, world: int) -> tuple[str, int]:
    """(strategy, shards): data parallelism under torchrun and over how many processes
    FSDP2 shards the model states."""
    strategy = cfg.trainer.strategy
    if strategy == "auto":
        strategy = "ddp" if world > 1 else "none"
    return strategy, (world if strategy == "fsdp2" else 1)


def plan_memory(
    cfg: Config,
    device: torch.device,
    world: int = 1,
    prompt_length: int | None = None,
    baseline: int | None = None,
    scoring: ScoringPlan | None = None,
) -> MemoryPlan:
    """The run's memory plan per process on `device`, from the config and the models'
    config.json files (nothing loads). prompt_length: the longest prompt of the data
    (default data.max_prompt_length); baseline: the process's memory before loading
    (default on a CPU: its resident memory now); scoring: the run's scoring plan, whose
    engine log-probs spare the actor's scoring pass (default: the pass is counted)."""
    cpu = device.type != "cuda"
    roles = _roles(cfg)  # imports the models' code, as loading them will
    if baseline is None:
        baseline = resident_bytes() if cpu else 0
    processes = launch.local_world_size(world) if cpu else 1
    plan = MemoryPlan(str(device), baseline, processes=processes)
    strategy, shards = _place(cfg, world)
    held = {"baseline": baseline, "runtime": RUNTIME_OVERHEAD if cpu else 0}
    grads: dict[str, int] = {}
    for r in roles:
        weights = r.shape.weight_bytes // shards
        frozen_shards = r.name in ("reference", "teacher") and strategy == "fsdp2"
        if frozen_shards and cfg.fsdp.offload_frozen and not cpu:
            weights = 0  # its shards are on the CPU
        parts = {"weights": weights}
        if r.trained:
            train_bytes = r.shape.trainable * r.shape.dtype_bytes // shards
            grads[r.name] = train_bytes * (2 if strategy == "ddp" else 1)  # + DDP's buckets
            parts["grads"] = grads[r.name]
            parts["optimizer"] = 2 * train_bytes  # AdamW's exp_avg and exp_avg_sq
            held[f"{r.name} optimizer"] = parts["optimizer"]
        held[f"{r.name} weights"] = weights
        plan.roles[r.name] = parts
    if cpu and allocator.active() == "system malloc" and sys.platform.startswith("linux"):
        fix = (
            "unset PROXIMA_ALLOCATOR to run on the tcmalloc installed"
            if allocator.find_tcmalloc()
            else "`apt install libtcmalloc-minimal4` and the `proxima` command runs on tcmalloc"
        )
        plan.notes.append(
            "glibc's malloc keeps memory PyTorch frees: the measured peak can exceed this "
            f"plan (1.5x at SmolLM2 with LoRA); {fix} (docs/real-models.md)"
        )
    if role_plan(cfg).critic_on_actor:
        plan.notes.append("critic: a value head on the actor (counted with the actor)")
    if role_plan(cfg).reference == "adapters off":
        plan.notes.append("reference: the actor with its adapters off (no weights of its own)")
    held.update(_engine_bytes(cfg, roles[0].shape, device))
    lengths = _lengths(cfg, prompt_length)
    plan.phases["generate"] = _generate(cfg, roles[0], lengths, world)
    if run_plan(cfg).workers:  # trainer.workers
        generate = sum(plan.phases["generate"].values())
        held.update(_worker_bytes(cfg, roles[0].shape.weight_bytes, generate, device, plan))
    plan.held = held
    actor_scored = _actor_scored(cfg, scoring)
    scored = [r for r in roles if actor_scored or r.name != "actor"]  # phase 3's passes
    plan.phases["score"] = _score(cfg, scored, lengths, world)
    for r in roles:
        if r.trained:
            phase = _update(cfg, r, lengths, world, grads[r.name], plan.notes)
            plan.phases[f"update {r.name}"] = phase
    if cpu:
        plan.available = cpu_available()
    else:
        plan.available = device_available(device)[0]
    return _choose_offload(cfg, plan, scored, lengths, world)


def _choose_offload(cfg: Config, plan: MemoryPlan, scored, lengths, world: int) -> MemoryPlan:
    """model.offload: trained -> the offloaded plan; auto -> it when the plan does not fit
    the free device memory and offloading lowers its peak, else the plan with a note of
    what offloading would give; none, a CPU device, or a run offload does not apply to ->
    the plan."""
    mode = cfg.model.offload
    if mode == "none" or offload_problem(cfg):
        return plan
    if not plan.device.startswith("cuda"):
        if mode == "trained":  # model.device=auto without a GPU
            plan.notes.append("model.offload=trained: nothing to move on the CPU (no GPU)")
        return plan
    off = offloaded(cfg, plan, scored, lengths, world)
    if mode == "trained":
        off.notes.append(f"model.offload=trained: peak {_gib(plan.peak)} without offloading")
        return off
    if plan.available is not None and plan.needed > plan.available and off.peak < plan.peak:
        off.notes.append(
            f"model.offload=auto: offloading, since the peak without it, {_gib(plan.peak)} "
            f"in {plan.peak_phase}, does not fit"
        )
        return off
    phases = ", ".join(f"{p} {_gib(off.phase_total(p))}" for p in off.phases)
    plan.notes.append(f"model.offload=trained would hold: {phases}")
    return plan


def _worker_bytes(
    cfg: Config, weights: int, generate: int, device: torch.device, plan: MemoryPlan
) -> dict[str, int]:
    """What the rollout workers (`trainer.workers`) hold of this process's memory. On a CPU:
    the shared box and each forked worker's copy of the actor's weights. On a GPU: each
    spawned worker placed on this device (`rollout.devices`, default the actor's) with its
    copy of the weights, its generation (the generate phase's parts, at any moment of the
    trainer's phases) and its CUDA context; the box is in host memory."""
    r = cfg.rollout
    if device.type != "cuda":
        plan.notes.append(
            f"rollout workers: the actor's weights in shared memory and in each of the "
            f"{r.workers} worker(s); each also generates (as the generate phase) and, as a "
            "fork, keeps the pages the trainer rewrites after it started"
        )
        return {"rollout workers": (1 + r.workers) * weights}
    names = r.devices or ["cuda"]
    here = sum(_is_device(names[i % len(names)], device) for i in range(r.workers))
    plan.notes.append(
        f"rollout workers: {here} of the {r.workers} spawned worker(s) on {device}, each "
        "with its own copy of the actor's weights, its generation and a CUDA context "
        f"(~{CUDA_CONTEXT // MiB} MiB); the weights reach them through "
        f"{weights / MiB:.1f} MiB of host shared memory"
    )
    return {"rollout workers": here * (weights + generate + CUDA_CONTEXT)} if here else {}


def _is_device(name: str, device: torch.device) -> bool:
    """A `rollout.devices` entry is `device` (cuda without an index: this process's GPU)."""
    d = torch.device(name)
    return d.type == device.type and (d.index is None or d.index == device.index)


def _offload_part(key: str) -> str | None:
    """The `trainer.offload` part a held entry belongs to; None for what stays on the
    device (the actor's weights, the engine's memory)."""
    role, _, what = key.rpartition(" ")
    if what == "optimizer":
        return key
    if what != "weights" or role == "actor":
        return None
    parts = {"critic": "critic weights", "reference": "reference", "teacher": "teacher"}
    return parts.get(role, "reward models")


def offloaded(cfg: Config, plan: MemoryPlan, scored, lengths, world: int) -> MemoryPlan:
    """`plan` under model.offload: what moves leaves `held` and joins each phase that needs
    it (`trainer.offload.resident`); the reward models' forward (of the `scored` roles,
    phase 3's passes) is the phase `reward`, the other scoring passes stay in `score`."""
    needs = resident(run_plan(cfg).reference_in_update)
    moving = {k: v for k, v in plan.held.items() if _offload_part(k)}
    phases = {"generate": plan.phases["generate"]}
    rewards = [r for r in scored if r.kind == "reward"]
    if rewards:
        phases["reward"] = _score(cfg, rewards, lengths, world)
    phases["score"] = _score(cfg, [r for r in scored if r.kind != "reward"], lengths, world)
    phases.update({k: v for k, v in plan.phases.items() if k.startswith("update")})
    for name, parts in phases.items():
        need = needs[name.split()[0]]
        phases[name] = {**{k: v for k, v in moving.items() if _offload_part(k) in need}, **parts}
    held = {k: v for k, v in plan.held.items() if k not in moving}
    return replace(plan, held=held, phases=phases, notes=list(plan.notes), offload=True)


def _lengths(cfg: Config, prompt_length: int | None) -> tuple[int, int]:
    """(prompt, after the prompt) in tokens: the longest a batch is padded to."""
    prompt = prompt_length or cfg.data.max_prompt_length
    return prompt, cfg.rollout.after_prompt_tokens


def _compute_bytes(cfg: Config, generation: bool = False) -> int:
    """Bytes per element of activations (bfloat16 under autocast; in generation only with
    rollout.autocast)."""
    if cfg.model.mixed_precision == "bf16" and (cfg.rollout.autocast or not generation):
        return 2
    return torch.empty(0, dtype=DTYPES[cfg.model.dtype]).element_size()


def _engine_bytes(cfg: Config, actor: Shape, device: torch.device) -> dict[str, int]:
    """The rollout engine's own memory (`rollout.engines`: vLLM's copy of the weights and
    its KV-cache reservation, or on a GPU its share of the device; none for hf)."""
    total = (device_available(device)[1] or 0) if device.type == "cuda" else None
    engine = engine_spec(cfg.rollout.name)
    return engine.held_memory(cfg, actor.params, actor.dtype_bytes, total)


def _generate(cfg: Config, actor: _Role, lengths: tuple[int, int], world: int) -> dict:
    """A generation call of an engine that serves the trainer's actor (hf): its KV cache
    over the whole length, the prefill's forward and the decode step's logits (vLLM's are in
    its reservation)."""
    if not run_plan(cfg).serves_actor:
        return {}
    prompt, after = lengths
    rows = min(cfg.rollout.micro_batch_size, max(1, cfg.rollout_batch_size // world))
    if cfg.data.eval_path:
        rows = max(rows, cfg.eval.batch_size)
    width = _compute_bytes(cfg, generation=True)
    return {
        "kv cache": kv_cache_bytes(rows, prompt + after, actor.shape, width),
        "forward": forward_bytes(rows, prompt, actor.shape, width),
        "logits": 4 * rows * actor.shape.vocab * 4,
    }


def _score(cfg: Config, roles: list[_Role], lengths: tuple[int, int], world: int) -> dict:
    """The largest scoring forward pass without autograd: an actor or reference pass
    (logits of rollout.micro_batch_size rows), the critic's, the reward model's. Under a
    token budget (rollout. / reward.max_tokens_per_micro) a pass holds at most the budget's
    tokens, and at most as many response positions."""
    prompt, after = lengths
    per_process = max(1, cfg.rollout_batch_size // world)
    width, bf16 = _compute_bytes(cfg), cfg.model.mixed_precision == "bf16"
    best: dict[str, int] = {}
    for r in roles:
        rows, budget = cfg.rollout.micro_batch_size, cfg.rollout.max_tokens_per_micro
        if r.kind == "reward":
            rows, budget = cfg.reward.batch_size, cfg.reward.max_tokens_per_micro
        rows, length, response = min(rows, per_process), prompt + after, after
        if budget > 0:  # as one row of the budget's tokens (SORTED: the fixed rows)
            length = min(budget, per_process * (prompt + after))
            rows, response = 1, min(budget, per_process * after)
        # the layers' intermediates are freed before the logits are made: one or the other
        part = ("forward", forward_bytes(rows, length, r.shape, width))
        if r.kind == "causal_lm":
            logits = logits_bytes(rows, response, r.shape.vocab, bf16)
            part = max(part, ("logits", logits), key=_size)
        if part[1] > sum(best.values()):
            best = {f"{r.name} {part[0]}": part[1]}
    return best


def _actor_scored(cfg: Config, scoring: ScoringPlan | None) -> bool:
    """Whether phase 3 runs the actor: for the old log-probs, or as the LoRA reference (the
    actor with its adapters off); not where the engine's own log-probs are the old ones."""
    if scoring is None or scoring.old_logprobs == "actor":
        return True
    return bool(scoring.kl) and role_plan(cfg).reference == "adapters off"


def _size(part: tuple[str, int]) -> int:
    return part[1]


def _update(
    cfg: Config, role: _Role, lengths: tuple[int, int], world: int, grads: int, notes: list
) -> dict:
    """One training micro-batch of a trained role: its gradients, the activations autograd
    keeps, and the backward pass's temporaries (the logits' gradient, one layer's)."""
    prompt, after = lengths
    length = prompt + after
    sec = role.section
    rows = sec.ppo_micro_batch_size
    if sec.ppo_max_tokens_per_micro > 0:
        rows = max(1, sec.ppo_max_tokens_per_micro // length)
    rows = min(rows, max(1, sec.ppo_mini_batch_size // world))
    m = cfg.model
    bf16 = m.mixed_precision == "bf16"
    trace = dict(rows=rows, length=length, response=after, bf16=bf16)
    prompts = _shared_prompts(cfg, role, rows)
    if prompts:  # one packed row: each prompt once, then every answer in full
        trace.update(rows=1, length=prompts * prompt + rows * after, response=rows * after)
        notes.append(
            f"{role.name} update: packed rows with each prompt once for its samples "
            f"({prompts} prompts, {rows} answers a micro-batch)"
        )
    if role.kind == "causal_lm":
        trace["temperature"] = cfg.rollout.temperature
    width = _compute_bytes(cfg)
    layer = forward_bytes(trace["rows"], trace["length"], role.shape, width)
    try:
        full = saved_activation_bytes(role.folder, role.kind, **trace)
        kept = full
        if m.gradient_checkpointing:
            kept = saved_activation_bytes(role.folder, role.kind, checkpointing=True, **trace)
    except Exception as err:  # noqa: BLE001 - an architecture the trace cannot run
        notes.append(f"{role.name}: activations from a formula (the trace failed: {err!r:.80})")
        full = role.shape.layers * layer + 3 * rows * (after + 1) * role.shape.vocab * 4
        kept = role.shape.layers * rows * length * role.shape.hidden * width
        kept = kept if m.gradient_checkpointing else full
    parts = {"grads": grads, "activations": kept}
    if m.gradient_checkpointing:
        layer += (full - kept) // max(1, role.shape.layers)  # one layer recomputed
    parts["backward"] = layer
    if role.kind == "causal_lm":
        logits = rows * (after + 1) * role.shape.vocab * 4
        parts["backward"] += 2 * logits
        # the entropy's statistics, without autograd, one chunk at a time
        parts["entropy"] = 3 * min(rows * after, max(1, CHUNK_ELEMENTS // role.shape.vocab))
        parts["entropy"] *= role.shape.vocab * 4
        if cfg.actor.use_kl_loss:  # the reference's logits of the micro-batch
            parts["reference logits"] = logits_bytes(rows, after, role.shape.vocab, bf16)
    return parts


def _shared_prompts(cfg: Config, role: _Role, rows: int) -> int:
    """Prompts in an update micro-batch whose samples share one copy of them
    (`model.packing`, `models.packing.pack_shared`), or 0 where the plan cannot count on
    it: micro-batches sorted by length hold a prompt's samples together when the mini-batch
    holds all of them (every row of the process's batch), and the model's attention must
    take the 4D mask (no sliding window)."""
    m, sec, n = cfg.model, role.section, cfg.rollout.n
    whole = sec.ppo_mini_batch_size >= cfg.rollout_batch_size
    if not (m.packing is not False and n > 1 and whole and sec.ppo_max_tokens_per_micro == SORTED):
        return 0
    if shared_mask_form(hf_config(role.folder, role.kind), torch.float32) is None:
        return 0
    return -(-rows // n)


# --------------------------------------------------------------------------- the check

MICRO = "actor.ppo_micro_batch_size / critic.ppo_micro_batch_size (or *.ppo_max_tokens_per_micro)"
LORA = "model.lora_rank=16 (only adapters trained; the reference is the actor without them)"
FIXES = {  # what lowers each part of a phase, by the part's name
    "activations": (MICRO, "model.gradient_checkpointing=true"),
    "backward": (MICRO,),
    "logits": (
        "rollout.micro_batch_size or rollout.max_tokens_per_micro (scoring)",
        "actor.ppo_micro_batch_size",
    ),
    "kv cache": ("rollout.micro_batch_size (rows per generation)", "rollout.max_response_length"),
    "optimizer": (LORA, "critic.shared_backbone=true (no value model of its own)"),
    "weights": (LORA, "model.mixed_precision=bf16 (frozen roles in bfloat16)"),
    "vllm": ("VLLM_CPU_KVCACHE_SPACE / rollout.vllm.gpu_memory_utilization", "rollout.name=hf"),
    "forward": ("reward.batch_size or reward.max_tokens_per_micro", "rollout.micro_batch_size"),
}


def check_memory(plan: MemoryPlan, mode: str = "error") -> str | None:
    """Stop a run whose predicted peak does not fit what the machine has free
    (`trainer.memory_check`: error raises ConfigError, warn returns the message to print,
    off checks nothing)."""
    if mode == "off" or plan.available is None or plan.needed <= plan.available:
        return None
    parts = {**plan.held, **plan.phases[plan.peak_phase]}
    parts.pop("baseline")
    top = ", ".join(f"{k} {_gib(v)}" for k, v in _largest(parts, 4))
    fixes = []
    for part, _ in _largest(parts, len(parts)):
        for key, keys in FIXES.items():
            fixes += [k for k in keys if key in part and k not in fixes]
    where = "free on this machine (MemAvailable, or the cgroup's limit)"
    if plan.device.startswith("cuda"):
        where = f"free on {plan.device} (torch.cuda.mem_get_info)"
    procs = f" x {plan.processes} processes" if plan.processes > 1 else ""
    message = (
        f"the memory plan predicts a peak of {_gib(plan.peak)} in {plan.peak_phase} "
        f"({top}): {_gib(plan.needed)} more{procs} than this process holds now, but "
        f"{_gib(plan.available)} are {where}. Fix: lower what dominates: "
        + "; ".join(fixes[:5])
        + ". Or trainer.memory_check=warn to start anyway."
    )
    if mode == "warn":
        return message
    raise ConfigError(message)


# --------------------------------------------------------------------------- the disk


def disk_need(cfg: Config) -> dict[str, int]:
    """Bytes the end of a run writes, from the models' config.json (nothing loads):
    ``models``, each trained model's full weights (actor/, the critic's; merged under LoRA),
    and ``checkpoint``, the same weights again with AdamW's two states (state.pt)."""
    trained = [r for r in _roles(cfg) if r.trained]
    models = sum(r.shape.weight_bytes for r in trained)
    optimizer = sum(2 * r.shape.trainable * r.shape.dtype_bytes for r in trained)
    return {"models": models, "checkpoint": models + optimizer}


def disk_problem(cfg: Config, folder: str | Path) -> str | None:
    """Why the disk under `folder` (trainer.output_dir, or its nearest existing parent)
    cannot hold what the end of the run writes, or None."""
    where = Path(folder).resolve()
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    need = disk_need(cfg)
    total = need["models"] + need["checkpoint"]
    if free >= total:
        return None
    return (
        f"the end of the run writes about {_gib(total)} to {folder} (the trained models "
        f"{_gib(need['models'])}, and a checkpoint of them with their AdamW state "
        f"{_gib(need['checkpoint'])}; trainer.keep_checkpoints={cfg.trainer.keep_checkpoints} "
        f"keeps that many), but {_gib(free)} is free on its disk: free space there, or set "
        "trainer.output_dir to a larger disk."
    )
