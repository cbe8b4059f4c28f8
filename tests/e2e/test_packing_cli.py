"""`model.packing` end to end, unset (packed where every model takes it, the default) against
false: the run prints the layout and tries its models at start-up, and its first iteration
(scoring with a reference and a value model, token budgets, the actor's and the critic's
updates) logs the padded run's metrics."""

from __future__ import annotations

import json
import math

import pytest

from proxima.cli import main
from proxima.logging import read_metrics

pytestmark = pytest.mark.slow

BUDGETS = (
    "actor.ppo_max_tokens_per_micro=40",
    "critic.ppo_max_tokens_per_micro=40",
    "rollout.max_tokens_per_micro=40",
    "trainer.threads=1",
)


def test_a_packed_run_logs_the_padded_runs_metrics(fast_overrides, make_model, tmp_path, capsys):
    model = make_model()
    rows = {}
    for packing in ("false", "unset"):  # unset: packed where every model takes it
        out = tmp_path / packing
        chosen = [] if packing == "unset" else [f"model.packing={packing}"]
        argv = fast_overrides(model, out, 1, *BUDGETS, *chosen)
        assert main(["train", *argv]) == 0
        rows[packing] = read_metrics(out / "metrics.jsonl")[0]
    printed = capsys.readouterr()
    assert "layout: packed rows: the scoring passes" in printed.out + printed.err
    assert json.loads((tmp_path / "unset/config.json").read_text())["model"]["packing"] is True
    padded, packed = rows["false"], rows["unset"]
    compared = [
        k
        for k, v in padded.items()
        if isinstance(v, float) and not k.startswith("time/") and k != "tokens_per_s"
    ]
    assert {"actor/pg_loss", "critic/vf_loss", "kl", "actor/entropy"} <= set(compared)
    for key in compared:
        assert math.isclose(packed[key], padded[key], rel_tol=1e-4, abs_tol=1e-5), key
