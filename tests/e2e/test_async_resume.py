"""Resume of asynchronous rollouts (`rollout.max_staleness=2`, a worker process) equals an
uninterrupted run: the batches sampled ahead from weights older than the checkpoint's (which
no checkpoint holds) travel in the trainer's state, the next are sampled again from the
checkpoint's weights with the same prompts and seeds, so run B, resumed from A's iter_2, logs
the very same metrics for steps 3-4 (staleness included) and ends with the same weights."""

from __future__ import annotations

import pytest

from proxima.cli import main
from tests.helpers import assert_same_weights, run_metrics

from .test_resume import _run_a_and_b

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("workers", ["0", "1"])
def test_async_resume_equals_uninterrupted_run(tmp_path, make_model, fast_overrides, workers):
    extra = ("trainer.threads=1", "rollout.max_staleness=2", f"rollout.workers={workers}")
    run_a, run_b = _run_a_and_b(tmp_path, make_model, fast_overrides, *extra)
    a, b = run_metrics(run_a), run_metrics(run_b)
    assert sorted(a) == [1, 2, 3, 4] and sorted(b) == [3, 4]
    assert [a[s]["rollout/staleness_max"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 2.0, 2.0]
    for step in (3, 4):
        assert "rollout/is_weight_mean" in b[step]  # the correction, on by default
        same = set(a[step])
        assert {k: b[step][k] for k in same} == {k: a[step][k] for k in same}, step
    assert a[3] != a[4]
    for role in ("actor", "critic"):
        assert_same_weights(run_a / role, run_b / role)


def test_a_resume_may_change_the_number_of_workers(tmp_path, make_model, fast_overrides):
    """The batches are the same whatever samples them, so rollout.workers may change at a
    resume: A sampled with one worker, B resumes A's iter_2 sampling in its own process."""
    init = make_model("llama")
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    common = ("trainer.threads=1", "rollout.max_staleness=2")
    a_args = fast_overrides(init, run_a, 4, "trainer.save_every=2", *common, "rollout.workers=1")
    assert main(["train", *a_args]) == 0
    resume = f"trainer.resume_from={run_a / 'checkpoints' / 'iter_2'}"
    assert (
        main(["train", *fast_overrides(init, run_b, 4, resume, *common, "rollout.workers=0")]) == 0
    )
    a, b = run_metrics(run_a), run_metrics(run_b)
    for step in (3, 4):
        same = set(a[step])
        assert {k: b[step][k] for k in same} == {k: a[step][k] for k in same}, step
    assert_same_weights(run_a / "actor", run_b / "actor")
