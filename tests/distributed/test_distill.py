"""On-policy distillation under `torchrun --nproc_per_node 2` (gloo, CPU): each rank scores
its own rows with its own copy of the teacher (DDP) or with the teacher sharded like the
reference (FSDP2), the teacher's log-probs are gathered with the batch, and greedy runs give
one process's metrics, the reverse KL to the teacher included."""

from __future__ import annotations

import pytest

from proxima.cli import main
from tests.distributed.conftest import torchrun
from tests.distributed.test_train import _close, _metrics

pytestmark = [pytest.mark.dist, pytest.mark.slow]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_two_processes_distil_as_one(make_model, fast_overrides, tmp_path, strategy):
    student, teacher = make_model("llama"), make_model("llama", seed=1)
    one, two = tmp_path / "one", tmp_path / "two"

    def argv(out, *extra):
        distill = ["algorithm.adv_estimator=distill", f"model.teacher_path={teacher}"]
        greedy = ["rollout.top_k=1", "trainer.threads=1", "actor.ppo_micro_batch_size=2"]
        greedy.append("rollout.logprob_diff_warn=0")  # top_k=1 truncates: expected
        return ["train", *fast_overrides(student, out, 3, *distill, *greedy, *extra)]

    assert main(argv(one)) == 0
    torchrun(["-m", "proxima", *argv(two, f"trainer.strategy={strategy}")])
    first = _metrics(one)
    assert all(m["teacher/reverse_kl_std"] > 0 for m in first.values())  # a teacher term
    _close(first, _metrics(two))
