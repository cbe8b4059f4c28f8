"""Asynchronous rollouts (`rollout.max_staleness=1`) under `torchrun --nproc_per_node 2`
(gloo, CPU): each rank's worker process samples its share of the next batch ahead, two
processes with spawned workers give the metrics of one with a forked worker (staleness and
the rollout correction's included), and a resumed job replays the run (each rank's batches
sampled ahead are in the checkpoint; FSDP2 samples in the trainer's processes)."""

from __future__ import annotations

import pytest

from proxima.cli import main
from tests.distributed.conftest import torchrun
from tests.distributed.test_train import _close, _metrics

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ASYNC = ("rollout.max_staleness=1", "trainer.threads=1")


def test_two_processes_give_the_metrics_of_one(make_model, fast_overrides, tmp_path):
    # greedy (top_k=1): no randomness in the rollout, so 1 and 2 processes see the same rows
    model = make_model("llama")
    extra = (*ASYNC, "rollout.top_k=1", "actor.ppo_micro_batch_size=2")
    extra += ("critic.ppo_micro_batch_size=2", "algorithm.rollout_rejection=token")
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(["train", *fast_overrides(model, one, 3, *extra)]) == 0
    # the ranks' workers spawned (the start of a GPU run's), the one process's forked
    spawned = (*extra, "rollout.worker_start=spawn")
    torchrun(["-m", "proxima", "train", *fast_overrides(model, two, 3, *spawned)])
    a, b = _metrics(one), _metrics(two)
    _close(a, b)
    assert [b[s]["rollout/staleness_max"] for s in (1, 2, 3)] == [0.0, 1.0, 1.0]
    assert "rollout/rejected_seq_frac" in b[3] and "rollout/kl_k3" in b[3]  # over both ranks


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_resume_under_torchrun_replays_the_run(make_model, fast_overrides, tmp_path, strategy):
    model = make_model("llama")
    a, b = tmp_path / "a", tmp_path / "b"
    base = [*ASYNC, "trainer.save_every=2", "trainer.keep_checkpoints=0"]
    base += [f"trainer.strategy={strategy}", f"rollout.workers={int(strategy == 'ddp')}"]
    torchrun(["-m", "proxima", "train", *fast_overrides(model, a, 4, *base)])
    resume = f"trainer.resume_from={a / 'checkpoints' / 'iter_2'}"
    torchrun(["-m", "proxima", "train", *fast_overrides(model, b, 4, *base, resume)])
    first, again = _metrics(a), _metrics(b)
    assert sorted(again) == [3, 4]
    _close({k: first[k] for k in (3, 4)}, again)
    assert again[3]["rollout/staleness_mean"] == 1.0
    # one process reads the 2-rank checkpoint: no batch of its own kept, it samples one
    one = fast_overrides(model, tmp_path / "c", 4, *ASYNC, resume)
    assert main(["train", *one]) == 0
    assert _metrics(tmp_path / "c")[3]["rollout/staleness_max"] == 0.0
