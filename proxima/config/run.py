"""The run plan: how a run samples and where it runs, decided once from the config
(`run_plan(cfg)`: built on first use, then kept with that config, as `roles.role_plan`) and
printed at start-up after the role plan.

The trainer, the samplers, the memory plan and validation read it instead of the flags it
comes from, as torchtitan's `ParallelDims` answers every "is X enabled?" question of a run:

- episodes: `env` (an environment class, `rollout.env.cls`), `agent` (the user's agent
  program, `rollout.agent.fn`) or `` (one response per sample); `multi_turn` for either;
- sampling ahead: `ahead` batches (`rollout.max_staleness`), by `workers` worker processes
  (0: in the trainer's process, also whenever nothing is sampled ahead) with
  `worker_threads` threads each, started as `worker_start` says;
- offload (`model.offload`): `none`, `trained`, or `auto` (the memory plan decides, from
  the free device memory), and why it cannot act where it cannot (`offload_blocked`);
- the engine (`rollout.name`) and whether it serves the actor module itself;
- the processes of the job (`launch.world_size`), and whether the reference's log-probs
  enter the update (`actor.use_kl_loss`).
"""

from __future__ import annotations

from dataclasses import dataclass

from proxima.config.choices import ENGINES_SERVING_ACTOR
from proxima.config.schema import Config
from proxima.launch import world_size


@dataclass(frozen=True)
class RunPlan:
    episodes: str  # "env" | "agent" | "" (single responses)
    ahead: int  # batches sampled ahead (rollout.max_staleness); 0 = on-policy
    workers: int  # rollout worker processes in use; 0 = none (in the trainer's process)
    worker_threads: int
    worker_start: str  # rollout.worker_start: auto | fork | spawn
    offload: str  # model.offload: none | auto | trained
    offload_blocked: str  # why offload cannot act in this run ("" when it can)
    engine: str  # rollout.name
    serves_actor: bool  # the engine generates with the actor module itself (hf)
    world_size: int  # processes in the job (torchrun), 1 without it
    reference_in_update: bool  # the reference's log-probs enter the actor's loss

    @property
    def multi_turn(self) -> bool:
        """Each sample is an episode of several turns (an environment or an agent)."""
        return bool(self.episodes)

    @property
    def offload_acts(self) -> bool:
        """`model.offload` may move anything in this run (auto still asks the memory plan)."""
        return self.offload != "none" and not self.offload_blocked

    def describe(self) -> str:
        """The lines start-up and `proxima config` print."""
        episodes = {
            "env": "multi-turn episodes against rollout.env.cls",
            "agent": "multi-turn episodes played by rollout.agent.fn",
            "": "one response per sample",
        }[self.episodes]
        if not self.ahead:
            sampling = "on-policy (each batch from the current weights)"
        elif self.workers:
            start = {"auto": "spawned on CUDA, else forked"}.get(
                self.worker_start, self.worker_start
            )
            sampling = (
                f"{self.ahead} batch(es) ahead, in {self.workers} worker process(es) of "
                f"{self.worker_threads} thread(s) ({start})"
            )
        else:
            sampling = f"{self.ahead} batch(es) ahead, in the trainer's process"
        serves = "serves the actor itself" if self.serves_actor else "holds its own weights"
        return (
            f"run plan:\n  rollout  : {episodes}; {sampling}\n"
            f"  engine   : {self.engine} ({serves}); {self.world_size} process(es)\n"
            f"  offload  : {self._describe_offload()}"
        )

    def _describe_offload(self) -> str:
        if self.offload == "none":
            return "none"
        if self.offload_blocked:
            return f"{self.offload}, never acts here: {self.offload_blocked}"
        if self.offload == "trained":
            where = " (the reference stays for the update)" if self.reference_in_update else ""
            return "trained: the parts a phase does not use wait on the CPU" + where
        return "auto: the memory plan decides, from the free device memory"


def worker_problem(cfg: Config) -> str:
    """Why rollout worker processes cannot sample this run ("" when they can): a worker
    serves a copy of the whole actor with the hf engine and samples whole batches."""
    r = cfg.rollout
    if r.name not in ENGINES_SERVING_ACTOR:
        return f"rollout.name={r.name} (a worker process serves the actor with the hf engine)"
    if r.agent.fn:
        return "rollout.agent (its OpenAI endpoint serves the trainer's engine)"
    if cfg.algorithm.filter_groups:
        return (
            "algorithm.filter_groups (DAPO's dynamic sampling draws a varying number of "
            "batches, decided over all ranks)"
        )
    if cfg.trainer.strategy == "fsdp2":
        return "trainer.strategy=fsdp2 (it shards the actor; a worker serves all of it)"
    return ""


def offload_problem(cfg: Config) -> str:
    """Why `model.offload` cannot apply to this run ("" when it can): FSDP2 offloads with
    its own CPUOffloadPolicy, and sampling ahead overlaps the phases offload moves between.
    `model.offload=auto` does not offload such a run; `trained` is refused."""
    if cfg.trainer.strategy == "fsdp2":
        return (
            "trainer.strategy=fsdp2 shards the model states instead (its CPUOffloadPolicy "
            "keeps shards on the CPU: fsdp.offload_frozen for the reference)"
        )
    if cfg.rollout.max_staleness:
        return (
            "rollout.max_staleness > 0 samples while the trainer trains: the phases overlap, "
            "so nothing waits between them"
        )
    return ""


def _offload_blocked(cfg: Config) -> str:
    """`offload_problem`, and for auto also a run on the CPU or without the memory plan
    that decides (`trainer.memory.plan_memory`)."""
    problem = offload_problem(cfg)
    if problem or cfg.model.offload != "auto":
        return problem
    if cfg.model.device == "cpu":
        return "model.device=cpu has no GPU memory to free"
    if cfg.trainer.memory_check == "off":
        return "trainer.memory_check=off skips the memory plan, which decides auto"
    return ""


def plan_run(cfg: Config) -> RunPlan:
    """The run plan of `cfg`, built anew (`run_plan` builds it once per config)."""
    r = cfg.rollout
    return RunPlan(
        episodes=r.episodes,
        ahead=r.max_staleness,
        workers=r.workers if r.max_staleness else 0,
        worker_threads=r.worker_threads,
        worker_start=r.worker_start,
        offload=cfg.model.offload,
        offload_blocked=_offload_blocked(cfg),
        engine=r.name,
        serves_actor=r.name in ENGINES_SERVING_ACTOR,
        world_size=world_size(),
        reference_in_update=cfg.actor.use_kl_loss,  # a KL loss implies a reference
    )


def run_plan(cfg: Config) -> RunPlan:
    """The run plan of `cfg`: built on first use and kept with the config (beside its
    fields, as the role plan is: `replace` makes a new config, with a new plan)."""
    plan = cfg.__dict__.get(_KEPT)
    if plan is None:
        plan = plan_run(cfg)
        object.__setattr__(cfg, _KEPT, plan)  # the frozen dataclass's own escape hatch
    return plan


_KEPT = "_run_plan"
