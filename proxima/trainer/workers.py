"""Rollout worker processes beside the trainer (`rollout.max_staleness` >= 1 with
`rollout.workers` >= 1): each generates and scores whole batches while the trainer trains,
from the weights the trainer publishes into shared memory.

Workers start at the first rollout, as `rollout.worker_start` says (`start_method`):
- fork (an actor on the CPU): the trainer process forked; the worker reads the fork's copy
  of the trainer's rollout context (`RolloutContext.for_worker`: the tokenizer, the actor,
  the reward source, a task's environment, the `hf` engine serving its own copy of the
  actor) and nothing else of the trainer's;
- spawn (an actor on a GPU: a CUDA process cannot be forked): a fresh process that builds
  its context from the run's resolved config with the trainer's builders
  (`context.spawned_context`: tokenizer, actor module, reward source, engine; never the
  optimizers, the reference or a critic model) on its device (`rollout.devices`, default
  the actor's: the workers share its GPU).
Either runs one request after the other: (batch index, prompts, the weights it must be
sampled from, its seed).

The box lives in host shared memory whatever the devices: a publish from a GPU actor is
one device-to-host copy, a take into a GPU worker one host-to-device copy. A spawned worker
receives the box's tensors through torch's multiprocessing reductions, which pass their
shared memory itself (not a copy), so later publishes reach it.

Which weights, exactly: batch j (trained at iteration j) is sampled from the weights the
trainer had at the start of iteration j - k (k = max_staleness; never before the first
iteration this pipeline ran). The trainer publishes the weights of iteration m into the
shared `WeightBox` only once every batch that needs those of m - 1 has taken them, so the
box always holds what the next batch needs, and a batch's samples depend only on those
weights, its prompts and its seed: the same as sampling it in the trainer's process
(`samplers.Ahead` with `rollout.workers=0`), which the tests compare bit for bit.

A worker ignores SIGINT and SIGTERM (Ctrl-C reaches the whole process group: the trainer
decides when to stop, and closes its workers) and dies with the trainer (PR_SET_PDEATHSIG).
Requests and results travel as pickled bytes over pipes (a result's tensors on the host):
no tensor is shared but the box. Neither side can wait on the other in a send: a worker
sends its results from a thread while its loop reads the next request, and the trainer
holds back a worker's requests beyond `IN_FLIGHT` (sent as its results arrive), so the
results waiting in a worker number at most `IN_FLIGHT` whatever the staleness.
"""

from __future__ import annotations

import atexit
import ctypes
import functools
import multiprocessing as mp
import os
import pickle
import queue
import select
import signal
import threading
import time
import traceback
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from proxima.config import ConfigError
from proxima.rng import seed_everything
from proxima.trainer.context import RolloutContext, spawned_context
from proxima.trainer.device import resolve_device

POLL_S = 0.5  # how often a wait checks that the other side is alive
IN_FLIGHT = 2  # requests sent to a worker at once: the one it samples, and the next
CLOSE_S = 1.0  # how long a closing worker has to exit before it is killed
PR_SET_PDEATHSIG = 1


class RolloutWorkerError(RuntimeError):
    """A rollout worker process died, or its batch raised (the worker's traceback said)."""


class WeightBox:
    """The actor's state in shared memory, with the trainer's iteration it is of (`index`)
    and the policy version the samples are stamped with."""

    def __init__(self, module: torch.nn.Module, ctx) -> None:
        self.tensors = {  # on the host whatever the actor's device (spawned workers map it)
            name: t.detach().to("cpu", copy=True).share_memory_()
            for name, t in module.state_dict().items()
        }
        self.index = ctx.Value("q", -1, lock=False)
        self.version = ctx.Value("q", 0, lock=False)

    def publish(self, module: torch.nn.Module, index: int, version: int) -> None:
        """Copy `module`'s state in (from a GPU: one device-to-host copy, finished before
        `index` is set)."""
        self.index.value = -1  # being written: a worker copying now copies again
        with torch.no_grad():
            for name, t in module.state_dict().items():
                self.tensors[name].copy_(t)
        self.version.value = version
        self.index.value = index  # last: a worker waiting for `index` reads complete weights

    def take(self, module: torch.nn.Module) -> tuple[int, int]:
        """Copy the weights into `module`'s own tensors (on a GPU: one host-to-device copy,
        finished before `index` is read again), again if they were rewritten meanwhile;
        (their iteration, their policy version)."""
        while True:
            index = int(self.index.value)
            if index < 0:
                time.sleep(0.001)
                continue
            with torch.no_grad():
                for name, t in module.state_dict().items():
                    t.copy_(self.tensors[name])
            version = int(self.version.value)
            if self.index.value == index:
                return index, version


@dataclass
class Request:
    """What a worker samples: a batch's prompts, from exactly (or, with partial rollouts, at
    least) the weights of one trainer iteration, under the batch's seed."""

    batch: int  # the iteration that trains it
    items: list  # its prompts (this rank's share)
    weights: int  # the trainer iteration whose weights sample it
    seed: int


def _die_with_parent() -> None:
    """Linux: SIGKILL when the trainer exits, whatever the way (kill -9 included)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the closed pipe ends it instead
        pass


class PartialRollouts:
    """`rollout.partial_rollouts` in a worker: before each decode step, the newest weights
    of the box when they are newer than the ones generating (the KV cache stays), and the
    policy version of every step of every micro-batch, to stamp each sample with its first
    token's version and measure the mean over its tokens."""

    def __init__(self, box: WeightBox, context: RolloutContext, index: int) -> None:
        self.box, self.context, self.index = box, context, index
        self.steps: list[tuple[int, list[int]]] = []  # (rows, the version of each step)

    def __call__(self, step: int, rows: int) -> None:
        if step == 0:
            self.steps.append((rows, []))
        clock = self.context.clock
        if self.box.index.value > self.index:
            self.index, clock.policy_version = self.box.take(self.context.actor)
        self.steps[-1][1].append(clock.policy_version)

    def stamp(self, ro):
        """`ro` with each row's first-token version, and the mean version of its tokens."""
        if not self.steps:  # HF generate, where the decode loop does not apply: no step seen
            return ro, float(ro.versions.float().mean())
        first, total, tokens = [], 0.0, 0.0
        lengths = ro.gen.response_mask.sum(1).tolist()
        row = 0
        for rows, versions in self.steps:
            for length in lengths[row : row + rows]:
                first.append(versions[0])
                total += sum(versions[: int(length)])
                tokens += length
            row += rows
        self.steps = []
        versions = torch.tensor(first, dtype=torch.long)
        return replace(ro, versions=versions), total / max(tokens, 1.0)


@contextmanager
def _signals_ignored():
    """SIGINT and SIGTERM ignored while a worker starts (main thread only): a spawned
    process inherits the ignoring through exec and Python keeps it, so a Ctrl-C during its
    seconds of imports does not kill it (`_serve` then ignores them itself)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def _serve(build, sampler, box: WeightBox, conn, started, slot: int, threads: int, parent: int):
    """A worker's loop: requests in, produced batches out. `build()`: the worker's rollout
    context (`RolloutContext.for_worker` of the trainer's, or `spawned_context`), which
    `sampler` (the on-policy round's class) samples with."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _die_with_parent()
    if os.getppid() != parent:  # the trainer was gone before the line above ran
        os._exit(0)
    torch.set_num_threads(threads)
    ctx = build()
    rounds = sampler(ctx)
    partial = ctx.cfg.rollout.partial_rollouts
    outbox: queue.Queue = queue.Queue()
    threading.Thread(target=_send_results, args=(conn, outbox), daemon=True).start()
    while True:
        try:
            request = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):  # the trainer closed the pipe
            return
        if request is None:
            return
        while box.index.value < request.weights if partial else box.index.value != request.weights:
            time.sleep(0.001)
            if os.getppid() != parent:
                return
        index, ctx.clock.policy_version = box.take(ctx.actor)
        started[slot] = request.batch
        ctx.timer.new_iteration()
        seed_everything(request.seed)
        if partial:
            ctx.engine.on_step = PartialRollouts(box, ctx, index)
        try:
            ro, penalty = rounds.produce(request.items)
            seconds = dict(ctx.timer.last)
            if partial:  # the mean version of the tokens travels with the phase seconds
                ro, seconds["token_version"] = ctx.engine.on_step.stamp(ro)
            penalty = None if penalty is None else penalty.cpu()
            out = (request.batch, (ro.to("cpu"), penalty, seconds), None)
        except Exception as err:  # noqa: BLE001 - sent to the trainer, raised there
            out = (request.batch, None, f"{type(err).__name__}: {err}\n{traceback.format_exc()}")
        outbox.put(pickle.dumps(out))


def _send_results(conn, outbox: queue.Queue) -> None:
    """A worker's results to the trainer, in their order. A thread: a result may wait in a
    full pipe until the trainer reads, and meanwhile the worker reads the trainer's next
    request (a trainer sending it would otherwise wait on a worker waiting on the trainer)."""
    while True:
        data = outbox.get()
        try:
            conn.send_bytes(data)
        except OSError:  # the trainer closed the pipe: it wants no more
            return


def start_method(cfg, device: torch.device) -> str:
    """How the rollout workers start (`rollout.worker_start`): auto is spawn when the
    trainer's actor (on `device`) or a `rollout.devices` entry is on CUDA, else fork."""
    r = cfg.rollout
    if r.worker_start != "auto":
        return r.worker_start
    cuda = device.type == "cuda" or any(d.startswith("cuda") for d in r.devices)
    return "spawn" if cuda else "fork"


class Workers:
    """`rollout.workers` processes started at `start`: forked from the trainer, or spawned
    (each building its own actor copy on its `rollout.devices` entry), each sampling with
    a `sampler` (the on-policy round's class) on its own context; batch j goes to worker
    j mod N."""

    def __init__(
        self, context: RolloutContext, count: int, threads: int, staleness: int, sampler
    ) -> None:
        ctx = self.context = context
        self.method = start_method(ctx.cfg, ctx.device)
        where = ""
        if ctx.dist.strategy == "fsdp2":
            where = (
                "FSDP2 shards the actor, and a worker serves a copy of the whole of it "
                "(gathered from the shards at every publish: not built)"
            )
        elif self.method == "fork" and ctx.device.type != "cpu":
            where = (
                f"the actor is on {ctx.device} and rollout.worker_start=fork: a CUDA "
                "process cannot be forked (rollout.worker_start=spawn or auto spawns them)"
            )
        if where:
            raise ConfigError(
                f"`rollout.workers={count}` starts rollout worker processes, but {where}. "
                "Or use rollout.workers=0: the batches are sampled ahead in the trainer's "
                "process, with the same staleness."
            )
        names = ctx.cfg.rollout.devices
        self.devices = (
            [resolve_device(d, ctx.dist.local_rank, "rollout.devices") for d in names]
            if names
            else [ctx.device]
        )
        self.sampler, self.count, self.threads, self.k = sampler, count, threads, staleness
        self.procs: list = []
        self.conns: list = []
        self.sent: dict[int, int] = {}  # batch -> worker, until its result is received
        self.waiting = [deque() for _ in range(count)]  # requests held back, per worker
        self.flying = [0] * count  # requests sent to each worker, their results not received
        self.inbox: dict[int, tuple] = {}  # batch -> its result, received, not yet taken
        self.box: WeightBox | None = None

    def start(self, index: int) -> None:
        """Start the workers, the box holding the trainer's weights of iteration `index`. A
        spawned worker gets the box's shared host tensors themselves (torch's reductions
        pass their memory, not a copy) and builds its context (`spawned_context`)."""
        rollout = self.context
        mp_ctx = mp.get_context(self.method)
        self.box = WeightBox(rollout.actor, mp_ctx)
        self.box.publish(rollout.actor, index, rollout.clock.policy_version)
        self.started = mp_ctx.Array("q", [-1] * self.count, lock=False)
        for slot in range(self.count):
            mine, theirs = mp_ctx.Pipe()
            if self.method == "fork":
                build = rollout.for_worker
            else:
                device = self.devices[slot % len(self.devices)]
                build = functools.partial(
                    spawned_context, rollout.cfg, device, rollout.generation_values
                )
            args = (build, self.sampler, self.box, theirs, self.started, slot, self.threads)
            proc = mp_ctx.Process(
                target=_serve, args=(*args, os.getpid()), name=f"rollout-worker-{slot}"
            )
            proc.daemon = True
            with _signals_ignored():
                proc.start()
            theirs.close()
            self.procs.append(proc)
            self.conns.append(mine)
        atexit.register(self.close)  # before multiprocessing's own, which would wait on them

    def publish(self, index: int) -> None:
        """Put the trainer's weights of iteration `index` into the box, once every batch that
        needs those of `index - 1` has taken them (with partial rollouts, at once: every
        batch takes the newest)."""
        if self.box.index.value >= index:
            return
        last = index - 1 + self.k  # the last batch sampled from the weights of index - 1
        for batch, slot in list(self.sent.items()):
            if batch <= last and not self.context.cfg.rollout.partial_rollouts:
                self._wait(slot, lambda s=slot, b=batch: self.started[s] >= b)
        self.box.publish(self.context.actor, index, self.context.clock.policy_version)

    def submit(self, request: Request) -> None:
        """Queue `request` for its worker, sent now if it holds fewer than `IN_FLIGHT`."""
        slot = request.batch % self.count
        self._alive(slot)
        self.waiting[slot].append(request)
        self.sent[request.batch] = slot
        self._send(slot)

    def _send(self, slot: int) -> None:
        while self.waiting[slot] and self.flying[slot] < IN_FLIGHT:
            request = self.waiting[slot].popleft()
            try:
                self.conns[slot].send_bytes(pickle.dumps(request))
            except OSError:  # it died since
                self.procs[slot].join()
                self._alive(slot)
                raise
            self.flying[slot] += 1

    def pending(self, batch: int) -> bool:
        """`batch` was sent and not yet received (in flight, or waiting in the inbox)."""
        return batch in self.sent or batch in self.inbox

    def receive(self, batch: int):
        """((rollout, penalty, phase seconds) or None, error text or None) of `batch`."""
        while batch not in self.inbox:
            slot = self.sent[batch]
            if self.conns[slot].poll(POLL_S):
                self._collect()
            else:
                self._alive(slot)
        return self.inbox.pop(batch)

    def _collect(self) -> None:
        """Every result that has arrived, into the inbox, and the requests held back that
        their workers now have room for."""
        for slot, conn in enumerate(self.conns):
            while conn.poll():
                got, out, error = pickle.loads(conn.recv_bytes())
                self.inbox[got] = (out, error)
                del self.sent[got]
                self.flying[slot] -= 1
            self._send(slot)

    def _wait(self, slot: int, ready) -> None:
        while not ready():
            self._alive(slot)
            self._collect()
            time.sleep(0.001)

    def _alive(self, slot: int) -> None:
        proc = self.procs[slot]
        if not proc.is_alive():
            raise RolloutWorkerError(
                f"rollout worker {slot} (pid {proc.pid}) died with exit code {proc.exitcode}; "
                "the lines above may say why (out of memory: fewer rollout.workers, or a "
                "smaller rollout.micro_batch_size)"
            )

    def close(self) -> None:
        """Stop the workers, never waiting on one for long (a signal's stop comes here):
        asked where their pipe has room, given `CLOSE_S` to exit, then killed (they ignore
        SIGTERM, and hold nothing that a run keeps)."""
        atexit.unregister(self.close)
        for conn in self.conns:
            try:
                if select.select([], [conn], [], 0)[1]:  # a full pipe would block the send
                    conn.send_bytes(pickle.dumps(None))
            except OSError:
                pass
        deadline = time.monotonic() + CLOSE_S
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []
