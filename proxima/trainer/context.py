"""The rollout context: everything phases 1-2 read, as one typed object (`RolloutContext`)
built by one builder (`rollout_context`). The samplers (`trainer.samplers`) and the rollout
workers (`trainer.workers`) read it, never the trainer, so phases 1-2 run the same wherever
a context is: in the trainer's process (the trainer builds it from its own parts), in a
forked worker (`RolloutContext.for_worker`: the same parts, nothing of the trainer's
collectives, console or loader) and in a spawned worker (`spawned_context`: the parts built
anew on the worker's device).

`Clock` is where the run is (its iteration, the policy and weight versions): the trainer
advances it, the samplers read it, a worker keeps its own. `PhaseTimer` times the phases.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace

import torch

from proxima.algos import ADVANTAGE_ESTIMATORS
from proxima.config import Config
from proxima.config.run import RunPlan, run_plan
from proxima.rollout.contract import RolloutEngine
from proxima.rollout.engines import build_engine, spec_of, sync_weights
from proxima.trainer.device import autocast
from proxima.trainer.dist import Dist
from proxima.trainer.roles import Roles, load_rollout_roles


class PhaseTimer:
    """Wall seconds per phase, for this iteration (`last`, summed over the phase's runs
    since `new_iteration`: dynamic sampling generates several times) and summed over the
    run. A `listener` (e.g. progress.PhaseWatch) is told when a phase starts and ends, to show
    it while it runs. With a `residency` (model.offload: `trainer.offload.Offload`), what a
    phase needs is moved onto the device before it starts, timed as the phase `offload`."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.last: dict[str, float] = {}
        self.current = ""  # the phase running now, or the one that raised
        self.listener = None  # .start(name), .end(name, seconds)
        self.residency = None  # .enter(name)

    def new_iteration(self) -> None:
        self.last = {}

    @contextmanager
    def __call__(self, name: str):
        if self.residency is not None:
            with self.clock("offload"):
                self.residency.enter(name)
        with self.clock(name):
            yield

    @contextmanager
    def clock(self, name: str):
        """Time `name` (and tell the listener), nothing moved."""
        self.current = name
        if self.listener is not None:
            self.listener.start(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            self.last[name] = self.last.get(name, 0.0) + seconds
            self.total[name] += seconds
            if self.listener is not None:
                self.listener.end(name, seconds)


@dataclass
class Clock:
    """Where the run is. `iteration`: the iterations completed; `policy_version`: the actor
    updates over the whole run, each sample stamped with it (`Rollout.versions`) and its
    staleness measured against it; `weight_version`: +1 whenever the actor's weights change
    (an update, a load), so the engine is pushed new weights only then."""

    iteration: int = 0
    policy_version: int = 0
    weight_version: int = 0


@dataclass(frozen=True, kw_only=True)
class RolloutContext:
    """What phases 1-2 read, and nothing else: no optimizer, reference or critic model."""

    cfg: Config  # the resolved config: the rollout, reward, algorithm and trainer sections
    run: RunPlan  # single responses or episodes, sampling ahead (`config.run`)
    device: torch.device
    tokenizer: object  # the policy's
    actor: torch.nn.Module  # the module the engine samples from, its weights published
    reward: object  # the reward source (`proxima.rewards`)
    engine: RolloutEngine
    loader: object | None  # the prompt loader; None in a worker (prompts come with a request)
    dist: Dist  # this process's place in the job; a worker's takes part in no collective
    timer: PhaseTimer
    clock: Clock
    needs: tuple[str, ...]  # the estimator's `needs` (some are sampling's: `samplers.PREPARE`)
    generation_values: bool  # the engine returns the values (the scoring plan takes them)

    def precision(self, generation: bool = False):
        """Mixed-precision context (model.mixed_precision) of forward passes; for generation
        only around the hf engine (vLLM has its own dtype) and with rollout.autocast."""
        if generation and not (self.cfg.rollout.autocast and spec_of(self.engine).serves_actor):
            return nullcontext()
        return autocast(self.cfg, self.device)

    def sync_engine(self) -> None:
        """Push the actor's weights into the engine if it holds older ones (after an actor
        update, after a load, before the first rollout)."""
        sync_weights(self.engine, self.actor, self.clock.weight_version)

    def synced_engine(self) -> RolloutEngine:
        """The engine, holding the actor's current weights (training, evaluation)."""
        self.sync_engine()
        return self.engine

    def for_worker(self) -> RolloutContext:
        """This context in a forked worker: its own clock (from the trainer's at the fork),
        timer (the console is the trainer's) and no collective (the process group is the
        trainer's); no loader. The parts are the fork's copies of the trainer's."""
        clock = replace(self.clock)
        return replace(self, loader=None, dist=Dist(), timer=PhaseTimer(), clock=clock)


def rollout_context(
    cfg: Config,
    roles: Roles,
    engine: RolloutEngine,
    device: torch.device,
    *,
    generation_values: bool,
    dist: Dist | None = None,
    loader=None,
    clock: Clock | None = None,
    timer: PhaseTimer | None = None,
) -> RolloutContext:
    """The context of `roles`' actor, tokenizer and reward source served by `engine`; the
    rest as given (a trainer's own) or new (a worker's)."""
    return RolloutContext(
        cfg=cfg,
        run=run_plan(cfg),
        device=device,
        tokenizer=roles.tokenizer,
        actor=roles.actor,
        reward=roles.reward,
        engine=engine,
        loader=loader,
        dist=dist or Dist(),
        timer=timer or PhaseTimer(),
        clock=clock or Clock(),
        needs=ADVANTAGE_ESTIMATORS[cfg.algorithm.adv_estimator].needs,
        generation_values=generation_values,
    )


def spawned_context(cfg: Config, device: torch.device, generation_values: bool) -> RolloutContext:
    """A spawned worker's context on `device` (rollout.worker_start=spawn): the tokenizer,
    the actor module and the reward source built by the trainer's builders
    (`roles.load_rollout_roles`), served by a new hf engine. The actor's weights (and so the
    policy version) come from the shared `WeightBox`."""
    roles = load_rollout_roles(cfg, device)
    engine = build_engine(cfg, roles.actor, roles.tokenizer, device)
    return rollout_context(cfg, roles, engine, device, generation_values=generation_values)
