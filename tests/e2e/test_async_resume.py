"""Resume of asynchronous rollouts (`rollout.max_staleness=2`, a worker process) equals an
uninterrupted run: the batches sampled ahead from weights older than the checkpoint's (which
no checkpoint holds) travel in the trainer's state, the next are sampled again from the
checkpoint's weights with the same prompts and seeds, so run B, resumed from A's iter_2, logs
the very same metrics for steps 3-4 (staleness included) and ends with the same weights."""

from __future__ import annotations

import pytest

from .test_resume import _assert_same_weights, _metrics, _run_a_and_b

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("workers", ["0", "1"])
def test_async_resume_equals_uninterrupted_run(tmp_path, make_model, fast_overrides, workers):
    extra = ("trainer.threads=1", "rollout.max_staleness=2", f"rollout.workers={workers}")
    run_a, run_b = _run_a_and_b(tmp_path, make_model, fast_overrides, *extra)
    a, b = _metrics(run_a), _metrics(run_b)
    assert sorted(a) == [1, 2, 3, 4] and sorted(b) == [3, 4]
    assert [a[s]["rollout/staleness_max"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 2.0, 2.0]
    for step in (3, 4):
        assert "rollout/is_weight_mean" in b[step]  # the correction, on by default
        same = {k for k in a[step] if not k.startswith(("time/", "tokens_per_s"))}
        assert {k: b[step][k] for k in same} == {k: a[step][k] for k in same}, step
    assert a[3] != a[4]
    for role in ("actor", "critic"):
        _assert_same_weights(run_a / role, run_b / role)
