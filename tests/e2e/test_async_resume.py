"""Resume of one-step asynchronous rollouts (`rollout.asynchronous`) equals an uninterrupted
run: the batch sampled during iteration 2 from the weights before its update (which no
checkpoint holds) travels in the trainer's state, so run B, resumed from A's iter_2, logs the
very same metrics for steps 3-4 (staleness included) and ends with the very same weights."""

from __future__ import annotations

import pytest

from .test_resume import _assert_same_weights, _metrics, _run_a_and_b

pytestmark = pytest.mark.slow


def test_async_resume_equals_uninterrupted_run(tmp_path, make_model, fast_overrides):
    extra = ("trainer.threads=1", "rollout.asynchronous=true")
    run_a, run_b = _run_a_and_b(tmp_path, make_model, fast_overrides, *extra)
    a, b = _metrics(run_a), _metrics(run_b)
    assert sorted(a) == [1, 2, 3, 4] and sorted(b) == [3, 4]
    assert a[1]["rollout/staleness_max"] == 0.0  # the first batch: sampled and trained now
    for step in (3, 4):
        assert a[step]["rollout/staleness_mean"] == a[step]["rollout/staleness_max"] == 1.0
        assert "rollout/is_weight_mean" in b[step]  # the correction, on by default
        assert b[step] == a[step], step  # every metric, bit for bit
    assert a[3] != a[4]
    for role in ("actor", "critic"):
        _assert_same_weights(run_a / role, run_b / role)
