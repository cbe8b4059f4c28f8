"""Asynchronous rollouts with bounded staleness (`rollout.max_staleness`): the batch
trained at iteration i is sampled from the weights of iteration i - k (the staleness
accounting is exact, critic warm-up included), by worker processes (forked, or spawned as
for a GPU actor) bit for bit as in the trainer's process, the old log-probs are the
trainer's own at its current weights, the engine's feed the truncated importance weights
(on by default), the batches sampled ahead travel in the trainer's state, a failed
iteration replays exactly, a worker's failure is named, and the config refuses what cannot
work."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from proxima.algos import truncated_is_weights
from proxima.config import ConfigError, load_config
from proxima.rng import seed_everything
from proxima.rollout.collect import Rollout, rollout_from_state, rollout_state
from proxima.rollout.engines import engine_spec
from proxima.rollout.experience import sequence_logprobs
from proxima.rollout.plan import plan_scoring
from proxima.rollout.types import Generation
from proxima.trainer.context import Clock
from proxima.trainer.device import check_rollout_devices
from proxima.trainer.samplers import OnPolicy
from proxima.trainer.workers import (
    IN_FLIGHT,
    PartialRollouts,
    RolloutWorkerError,
    WeightBox,
    Workers,
    start_method,
)
from tests.trainer.nano import REWARD, nano_files, nano_trainer

HF = engine_spec("hf")

ASYNC = "rollout.max_staleness=1"
IN_PROCESS = "rollout.workers=0"
CUDA = torch.device("cuda")
CUDA_COUNT = torch.cuda.device_count()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return nano_files(tmp_path_factory.mktemp("async"))


def _spy_update(trainer) -> list:
    """Record the Experience of every update (before it changes the weights), with the
    actor's own log-probs of it at that moment."""
    seen, update = [], trainer.update

    def spy(exp):
        mine = sequence_logprobs(trainer.roles.actor, _as_gen(exp), 0.7, 4)
        seen.append((exp, mine))
        return update(exp)

    trainer.update = spy
    return seen


def _as_gen(exp) -> Generation:
    return Generation(
        input_ids=exp.input_ids,
        attention_mask=exp.attention_mask,
        response_mask=exp.response_mask,
        stopped=exp.stopped,
    )


def _comparable(metrics: dict) -> dict:
    return {
        k: v
        for k, v in metrics.items()
        if not k.startswith(("time/", "tokens_per_s", "rollout/wait"))
    }


def _run(files, iterations: int, *extra: str) -> tuple[list[dict], list]:
    trainer = nano_trainer(files, "trainer.iterations=6", *extra)
    try:
        got = [trainer.step() for _ in range(iterations)]
    finally:
        trainer.close()
    return [_comparable(m) for m, _ in got], [ro for _, ro in got]


@pytest.mark.parametrize("k", [1, 2])
def test_each_batch_comes_from_the_weights_of_k_iterations_before(files, k):
    torch.set_num_threads(1)
    trainer = nano_trainer(files, f"rollout.max_staleness={k}", IN_PROCESS, "trainer.iterations=8")
    for i in range(5):
        metrics, ro = trainer.step()
        assert ro.versions.tolist() == [max(i - k, 0)] * 8, i
        assert metrics["rollout/staleness_max"] == min(i, k)
        # sampled ahead: the next k batches, from the weights of this iteration and before
        assert sorted(trainer.sampler.ready) == list(range(i + 1, i + k + 1))
        assert trainer.policy_version == i + 1
    trainer.close()


@pytest.mark.parametrize("k", [1, 2])
def test_worker_processes_sample_what_the_trainers_process_samples(files, k):
    # one thread each side: the same float sums, so the same batches bit for bit
    torch.set_num_threads(1)
    staleness = f"rollout.max_staleness={k}"
    here, ros_here = _run(files, 5, staleness, IN_PROCESS)
    there, ros_there = _run(files, 5, staleness, "rollout.workers=1", "rollout.worker_threads=1")
    assert there == here
    for a, b in zip(ros_here, ros_there, strict=True):
        assert a.responses == b.responses
        assert torch.equal(a.gen.logprobs, b.gen.logprobs)
        assert torch.equal(a.versions, b.versions)
    assert here[1] != here[4]  # the comparison is not between constants
    # two workers share the batches out (j mod 2): the same batches again
    two, _ = _run(files, 5, staleness, "rollout.workers=2", "rollout.worker_threads=1")
    assert two == here


def test_spawned_workers_sample_what_forked_workers_and_the_trainers_process_sample(files):
    # a spawned worker (the CUDA layout, here on the CPU) builds its own tokenizer, actor
    # and reward source from the config and takes the weights from the box's shared host
    # tensors, published after it started: the same batches, bit for bit
    torch.set_num_threads(1)
    one = ("rollout.workers=1", "rollout.worker_threads=1")
    here, ros_here = _run(files, 4, ASYNC, IN_PROCESS)
    forked, _ = _run(files, 4, ASYNC, *one, "rollout.worker_start=fork")
    spawned, ros_spawned = _run(files, 4, ASYNC, *one, "rollout.worker_start=spawn")
    assert spawned == forked == here
    for a, b in zip(ros_here, ros_spawned, strict=True):
        assert a.responses == b.responses
        assert torch.equal(a.gen.logprobs, b.gen.logprobs)
        assert torch.equal(a.versions, b.versions)
    assert here[1] != here[3]  # the weights changed between the batches compared


def test_a_ctrl_c_while_a_spawned_worker_imports_leaves_it_to_the_trainer(files):
    # the trainer decides when to stop; a spawned worker spends seconds importing before it
    # can ignore SIGINT itself, so it starts with it ignored (the trainer's handler stays)
    trainer = nano_trainer(files, ASYNC, "rollout.worker_start=spawn")
    before = signal.getsignal(signal.SIGINT)
    try:
        trainer.sampler.backend.start(0)
        assert signal.getsignal(signal.SIGINT) is before
        proc = trainer.sampler.backend.workers.procs[0]
        os.kill(proc.pid, signal.SIGINT)
        proc.join(timeout=0.5)
        assert proc.is_alive()
    finally:
        trainer.close()


def test_how_workers_start_and_where_they_run(files):
    workers = nano_trainer(files, ASYNC).sampler.backend.workers
    assert (workers.method, workers.devices) == ("fork", [torch.device("cpu")])  # auto, CPU
    spawned = nano_trainer(files, ASYNC, "rollout.worker_start=spawn", "rollout.devices=[cpu]")
    assert spawned.sampler.backend.workers.method == "spawn"
    assert start_method(spawned.cfg.replace({"rollout.worker_start": "auto"}), CUDA) == "spawn"
    gpus = spawned.cfg.replace({"rollout.worker_start": "auto", "rollout.devices": ["cuda:1"]})
    assert start_method(gpus, torch.device("cpu")) == "spawn"


def test_what_workers_refuse_when_they_are_built(files):
    cfg = nano_trainer(files, ASYNC).cfg

    def context(device, strategy="none", start="auto"):
        return SimpleNamespace(
            cfg=cfg.replace({"rollout.worker_start": start}),
            device=torch.device(device),
            dist=SimpleNamespace(strategy=strategy, local_rank=0),
        )

    # model.device=auto resolved to a GPU: fork is refused there, auto spawns
    with pytest.raises(ConfigError, match="actor is on cuda:0 and rollout.worker_start=fork"):
        Workers(context("cuda:0", start="fork"), 1, 1, 1, OnPolicy)
    assert Workers(context("cuda:0"), 1, 1, 1, OnPolicy).method == "spawn"
    with pytest.raises(ConfigError, match="FSDP2 shards the actor.*rollout.workers=0"):
        Workers(context("cpu", strategy="fsdp2"), 1, 1, 1, OnPolicy)


def test_max_staleness_0_is_the_synchronous_sampler(files):
    trainer = nano_trainer(files, "rollout.max_staleness=0")
    assert trainer.sampler is trainer.on_policy
    assert trainer.cfg.rollout.workers == 0
    # workers would only sample what the trainer samples next, from its current weights
    with pytest.raises(ConfigError, match="rollout.workers=3` starts .* rollout.max_staleness=0"):
        nano_trainer(files, "rollout.max_staleness=0", "rollout.workers=3")


def test_the_pending_batch_is_the_next_iterations_batch(files):
    trainer = nano_trainer(files, ASYNC, IN_PROCESS)
    trainer.step()
    ahead = trainer.sampler.ready[1][0]
    _, ro = trainer.step()
    assert ro is ahead  # iteration 1 trains exactly what iteration 0 sampled ahead


def test_critic_warmup_leaves_the_policy_version_and_the_staleness_at_zero(files):
    # iteration 0 only warms the critic up: the policy stays version 0, so the batch that
    # iteration 1 trains (sampled during 0) is not stale; iteration 1 updates the actor, so
    # the batch of iteration 2 (sampled during 1, from version 0) is one version behind
    trainer = nano_trainer(files, ASYNC, IN_PROCESS, "critic.warmup_iterations=1")
    got = [trainer.step()[0] for _ in range(3)]
    assert [m["rollout/staleness_max"] for m in got] == [0.0, 0.0, 1.0]
    assert trainer.policy_version == 2


def test_old_logprobs_are_the_trainers_and_the_correction_weights_the_gap(files):
    trainer = nano_trainer(files, ASYNC, IN_PROCESS)
    assert trainer.cfg.algorithm.rollout_correction == "token"  # on by default
    assert trainer.plan.old_logprobs == "actor"
    seen = _spy_update(trainer)
    trainer.step()
    trainer.step()
    cap = trainer.cfg.algorithm.rollout_correction_cap
    for k, (exp, mine) in enumerate(seen):
        # PPO's old log-probs: the trainer's pass at its current (pre-update) weights
        assert torch.allclose(exp.old_logprobs, mine, atol=1e-6), k
        want, _ = truncated_is_weights(
            exp.old_logprobs, exp.rollout_logprobs, exp.response_mask, cap=cap, level="token"
        )
        assert torch.equal(exp.is_weights, want), k
    mask = seen[0][0].response_mask.bool()
    # iteration 0: sampled and trained at version 0 (float32 hf engine): weights ~ 1
    assert (seen[0][0].is_weights[mask] - 1).abs().max() < 1e-4
    # iteration 1: sampled at version 0, trained at version 1: the weights correct the gap
    mask = seen[1][0].response_mask.bool()
    gap = (seen[1][0].old_logprobs - seen[1][0].rollout_logprobs)[mask]
    assert gap.abs().max() > 1e-3
    assert (seen[1][0].is_weights[mask] - 1).abs().max() > 1e-3


def test_synchronous_runs_record_no_staleness_and_keep_nothing(files):
    trainer = nano_trainer(files)
    metrics, ro = trainer.step()
    assert trainer.sampler is trainer.on_policy  # no batch kept between iterations
    assert not any(k.startswith("rollout/staleness") for k in metrics)
    assert ro.versions.tolist() == [0] * 8
    assert trainer.state_dict()["sampler"] == {}  # nothing gathered either


@pytest.mark.parametrize("workers", ["0", "1"])
def test_the_batches_sampled_ahead_round_trip_through_the_state(files, tmp_path, workers):
    trainer = nano_trainer(files, "rollout.max_staleness=2", f"rollout.workers={workers}")
    trainer.step()
    path = tmp_path / "state.pt"
    torch.save(trainer.state_dict(), path)  # waits for the batches in flight
    state = torch.load(path, weights_only=True)
    assert len(state["sampler"]["ready"]) == 1  # one entry per rank
    mine = state["sampler"]["ready"][0]
    assert sorted(mine) == [1, 2]  # the next two iterations' batches
    for j in (1, 2):
        back = rollout_from_state(mine[j]["rollout"], "cpu")
        ro, stats = trainer.sampler.ready[j]
        assert back.prompts == ro.prompts and back.responses == ro.responses
        assert back.columns == ro.columns
        for name in ("input_ids", "attention_mask", "response_mask", "stopped", "logprobs"):
            assert torch.equal(getattr(back.gen, name), getattr(ro.gen, name)), name
        for name in ("group_ids", "scores", "versions"):
            assert torch.equal(getattr(back, name), getattr(ro, name)), name
        assert mine[j]["stats"] == stats
        assert rollout_state(back).keys() == mine[j]["rollout"].keys()
    trainer.close()
    fresh = nano_trainer(files, "rollout.max_staleness=2", IN_PROCESS)
    fresh.load_state_dict(state)
    assert torch.equal(
        fresh.sampler.ready[1][0].gen.input_ids, trainer.sampler.ready[1][0].gen.input_ids
    )
    # another number of processes than the checkpoint's: its rows are not this rank's
    fresh.load_state_dict({**state, "sampler": {"ready": [mine, mine]}})
    assert fresh.sampler.ready == {}  # the next iterations sample their own batches
    # rollouts of other fields than this code's: sampled again, never misread
    other = {j: {**got, "rollout": {**got["rollout"], "other": None}} for j, got in mine.items()}
    fresh.load_state_dict({**state, "sampler": {"ready": [other]}})
    assert fresh.sampler.ready == {}


def test_config_defaults_and_refusals(files):
    base = [
        f"model.actor_path={files['model']}",
        f"data.train_path={files['prompts']}",
        f"reward.function={REWARD}:fn",
    ]
    assert load_config(None, base).algorithm.rollout_correction == ""
    assert load_config(None, [*base, ASYNC]).algorithm.rollout_correction == "token"
    # a correction the user set, off included, stays as set
    off = load_config(None, [*base, ASYNC, "algorithm.rollout_correction="])
    assert off.algorithm.rollout_correction == ""
    seq = load_config(None, [*base, ASYNC, "algorithm.rollout_correction=sequence"])
    assert seq.algorithm.rollout_correction == "sequence"
    # a rejection alone leaves the importance weights on: verl combines the two
    rs = load_config(None, [*base, ASYNC, "algorithm.rollout_rejection=token"]).algorithm
    assert (rs.rollout_correction, rs.rollout_rejection) == ("token", "token")
    # auto recomputes even where the engine's log-probs would otherwise be exact
    plan = plan_scoring(off, HF)
    assert plan.old_logprobs == "actor" and "max_staleness" in plan.why
    assert plan_scoring(load_config(None, base), HF).old_logprobs == "engine"
    for cfg in (off, seq):  # named for the stale weights, whatever the correction
        with pytest.raises(ConfigError, match="rollout.old_logprobs=engine.*max_staleness"):
            plan_scoring(cfg.replace({"rollout.old_logprobs": "engine"}), HF)
    # unset, the workers fill the pipeline: one per batch it holds, at most 4, none where
    # workers cannot sample the run; a number the user set stays
    for extra, workers in (
        ((ASYNC,), 1),
        (("rollout.max_staleness=2",), 2),
        (("rollout.max_staleness=100000",), 4),
        (("rollout.max_staleness=100000", "trainer.iterations=3"), 3),
        (("rollout.max_staleness=2", "rollout.workers=1"), 1),
        (("rollout.max_staleness=2", IN_PROCESS), 0),
        (("rollout.max_staleness=2", "rollout.name=vllm"), 0),
        (("rollout.max_staleness=2", "algorithm.filter_groups=true", "rollout.n=2"), 0),
    ):
        assert load_config(None, [*base, *extra]).rollout.workers == workers, extra
    with pytest.raises(ConfigError, match="`rollout.asynchronous` is gone: use rollout.max_st"):
        load_config(None, [*base, "rollout.asynchronous=true"])
    for bad, why in (
        ("rollout.name=vllm", "rollout.name=vllm"),
        ("algorithm.filter_groups=true", "algorithm.filter_groups"),
    ):
        with pytest.raises(ConfigError, match=f"rollout.workers=1` does not go with {why}"):
            load_config(None, [*base, ASYNC, bad, "rollout.n=2", "rollout.workers=1"])
        load_config(None, [*base, ASYNC, bad, "rollout.n=2", IN_PROCESS])  # in-process: fine
    with pytest.raises(ConfigError, match="rollout.max_staleness` must be >= 0"):
        load_config(None, [*base, "rollout.max_staleness=-1"])
    with pytest.raises(ConfigError, match="rollout.worker_start` must be one of auto, fork, sp"):
        load_config(None, [*base, ASYNC, "rollout.worker_start=thread"])
    with pytest.raises(ConfigError, match="rollout.devices` must be a list of devices .*'gpu1'"):
        load_config(None, [*base, ASYNC, "rollout.devices=[cuda:1, gpu1]"])
    for where in ("model.device=cuda", "rollout.devices=[cuda:0]"):
        with pytest.raises(ConfigError, match="worker_start=fork` with cuda.*worker_start=spawn"):
            load_config(None, [*base, ASYNC, "rollout.worker_start=fork", where])
    # whether the devices exist: at start-up, before any model loads
    far = load_config(None, [*base, ASYNC, f"rollout.devices=[cuda:{CUDA_COUNT}]"])
    with pytest.raises(ConfigError, match=f"names cuda:{CUDA_COUNT}, but this machine has"):
        check_rollout_devices(far)
    check_rollout_devices(load_config(None, [*base, ASYNC, "rollout.devices=[cpu]"]))


@pytest.mark.parametrize("workers", ["0", "1"])
def test_a_failed_iteration_keeps_the_batches_ahead_and_replays_exactly(files, workers):
    torch.set_num_threads(1)
    extra = ("rollout.max_staleness=2", f"rollout.workers={workers}")
    seed_everything(0)
    want, _ = _run(files, 3, *extra)
    seed_everything(0)
    b = nano_trainer(files, "trainer.iterations=6", *extra)
    assert _comparable(b.step()[0]) == want[0]
    update = b.update

    def fail(exp):
        raise RuntimeError("boom")

    b.update = fail
    with pytest.raises(RuntimeError, match="boom"):
        b.step()
    assert b.undo_iteration()
    assert 1 in b.sampler.ready  # the batch that iteration 1 trains is next again
    b.update = update
    assert [_comparable(b.step()[0]) for _ in range(2)] == want[1:]
    b.close()


def test_a_batch_that_raises_in_its_worker_raises_in_the_trainer(files, monkeypatch):
    trainer = nano_trainer(files, ASYNC)

    def boom(self, items):
        raise ValueError("the reward server is down")

    monkeypatch.setattr(OnPolicy, "produce", boom)  # the worker is forked with it
    with pytest.raises(
        RolloutWorkerError,
        match="batch 1 raised in its rollout worker: ValueError: the reward server is down",
    ):
        trainer.step()
    trainer.close()


def test_a_worker_that_dies_is_named(files):
    trainer = nano_trainer(files, ASYNC)
    trainer.step()
    proc = trainer.sampler.backend.workers.procs[0]
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    with pytest.raises(
        RolloutWorkerError, match=r"rollout worker 0 \(pid \d+\) died with exit code -9"
    ):
        for _ in range(3):
            trainer.step()
    trainer.close()


def test_sampling_ahead_scores_each_micro_batch_while_the_next_is_generated(files):
    # 8 prompts in micro-batches of 2: four parts a batch, and the first iteration samples
    # two batches (its own and the next). Part k + 1 of a batch is generated only once the
    # score of part k has started: this waits forever unless scoring overlaps generation
    trainer = nano_trainer(files, ASYNC, IN_PROCESS, "rollout.micro_batch_size=2")
    rounds, reward = trainer.on_policy, trainer.on_policy.reward
    scored, generate = [], rounds.generate
    started = [threading.Event() for _ in range(8)]

    def score(ro):
        started[len(scored)].set()
        scored.append(list(ro.responses))
        return reward(ro)

    def gen(items=None, greedy=False):
        part = len(gen.calls)
        gen.calls.append(part)
        if part % 4:
            assert started[part - 1].wait(timeout=30), (
                f"part {part - 1} not scored during part {part}"
            )
        return generate(items, greedy)

    gen.calls = []
    rounds.reward, rounds.generate = score, gen
    _, ro = trainer.step()
    assert gen.calls == list(range(8)) and [len(s) for s in scored] == [2] * 8
    assert [r for part in scored[:4] for r in part] == ro.responses
    # the scores are the reward function's of the whole batch
    assert torch.equal(ro.scores, reward(ro)[0])
    trainer.close()


def test_partial_rollouts_take_newer_weights_between_decode_steps():
    ctx = mp.get_context("fork")
    model = torch.nn.Linear(2, 2)
    box = WeightBox(model, ctx)
    box.publish(model, index=3, version=5)

    # what the hook reads of the worker's context
    t = SimpleNamespace(actor=torch.nn.Linear(2, 2), clock=Clock(policy_version=5))
    hook = PartialRollouts(box, t, index=3)
    hook(0, 2)  # a micro-batch of two rows starts: nothing newer
    newer = torch.nn.Linear(2, 2)
    box.publish(newer, index=4, version=6)  # an update lands during the generation
    hook(1, 2)
    assert torch.equal(t.actor.weight, newer.weight)  # taken before step 1
    hook(2, 2)
    hook(0, 1)  # the next micro-batch, one row, from the new weights
    assert [v for _, v in hook.steps] == [[5, 6, 6], [6]]
    # rows of 3, 1 and 1 tokens: first-token versions, and the mean over all 5 tokens
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 0, 0]])
    gen = Generation(
        input_ids=mask,
        attention_mask=mask,
        response_mask=mask,
        stopped=torch.ones(3, dtype=torch.bool),
    )
    ro = Rollout(
        gen=gen, prompts=["a"] * 3, responses=["b"] * 3, columns={}, group_ids=torch.arange(3)
    )
    stamped, mean = hook.stamp(ro)
    assert stamped.versions.tolist() == [5, 5, 6]
    assert mean == pytest.approx((5 + 6 + 6 + 5 + 6) / 5)


def test_a_run_with_partial_rollouts_keeps_the_staleness_bound(files):
    trainer = nano_trainer(
        files, "rollout.max_staleness=2", "rollout.partial_rollouts=true", "trainer.iterations=6"
    )
    for i in range(5):
        metrics, ro = trainer.step()
        # the first token of every sample: from weights at most 2 versions older
        assert metrics["rollout/staleness_max"] <= min(i, 2)
        assert 0 <= metrics["rollout/token_staleness_mean"] <= metrics["rollout/staleness_max"]
    trainer.close()
    with pytest.raises(ConfigError, match="partial_rollouts=true` lets rollout worker"):
        nano_trainer(files, "rollout.partial_rollouts=true")


def test_one_worker_several_batches_ahead_whose_results_fill_the_pipe(files):
    # k = 3 and one worker: it finishes batches that the trainer takes later, each larger
    # than a pipe's 64 KiB (128 rows of 28 tokens); the trainer must read them while it
    # waits to publish, or both wait on each other forever (the alarm fails the test)
    def expire(*_):
        raise TimeoutError("the trainer and its worker wait on each other")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(300)
    trainer = nano_trainer(
        files,
        "rollout.max_staleness=3",
        "rollout.workers=1",
        "trainer.iterations=5",
        "data.train_batch_size=16",
        "rollout.n=8",
        "rollout.max_response_length=24",
        "actor.ppo_mini_batch_size=128",
        "actor.ppo_micro_batch_size=64",
        "critic.ppo_mini_batch_size=128",
        "critic.ppo_micro_batch_size=64",
    )
    try:
        for i in range(5):
            metrics, ro = trainer.step()
            assert ro.versions.tolist() == [max(i - 3, 0)] * 128
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        trainer.close()


@pytest.mark.parametrize("workers", ["0", "1"])
def test_a_staleness_beyond_the_run_samples_only_the_batches_it_trains(files, workers, capsys):
    # k = 100000 on a run of 4 iterations: every batch comes from the first weights, none
    # past the last is sampled, and a worker holds at most IN_FLIGHT requests at once (the
    # alarm fails the test if the trainer and the worker wait on each other)
    def expire(*_):
        raise TimeoutError("the trainer and its worker wait on each other")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(300)
    trainer = nano_trainer(
        files, "rollout.max_staleness=100000", f"rollout.workers={workers}", "trainer.iterations=4"
    )
    try:
        for _ in range(4):
            _, ro = trainer.step()
            assert ro.versions.tolist() == [0] * 8
            assert trainer.sampler.drawn == 4  # batches 0-3: the run's
            if workers == "1":
                assert trainer.sampler.backend.workers.flying[0] <= IN_FLIGHT
        assert trainer.sampler.ready == {}
        said = "sampling batches 1-4 ahead in the trainer's process"
        assert (said in capsys.readouterr().err) == (workers == "0")  # the wait, named
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
        trainer.close()


def test_closing_with_requests_in_flight_ends_the_workers_at_once(files):
    # the trainer stops (a signal, an error) while its worker samples and holds more
    # requests: close neither waits for them nor leaves the worker behind
    trainer = nano_trainer(files, "rollout.max_staleness=3", "trainer.iterations=8")
    trainer.step()
    workers = trainer.sampler.backend.workers
    procs = list(workers.procs)
    assert workers.sent  # batches still to sample
    start = time.monotonic()
    trainer.close()
    assert time.monotonic() - start < 10
    assert not any(p.is_alive() for p in procs)
