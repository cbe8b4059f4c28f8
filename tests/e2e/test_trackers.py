"""`proxima train` with trainer.loggers=[jsonl, wandb, mlflow] on a nano model: the metrics
W&B (offline) and MLflow (the sqlite store in the run folder) received equal metrics.jsonl's,
and both have the config, the summary and curves.png; a run resumed from it logs to new
tracker runs that name it. Skipped without the packages."""

from __future__ import annotations

import json
import math

import pytest

from proxima.cli import main
from proxima.logging import read_metrics
from tests.test_trackers import isolate_tracker_env, read_wandb_run

pytestmark = pytest.mark.slow


def test_train_logs_to_wandb_and_mlflow(fast_overrides, make_model, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    from mlflow.tracking import MlflowClient

    isolate_tracker_env(monkeypatch, tmp_path)
    out, model = tmp_path / "run", make_model()
    extra = ("trainer.loggers=[jsonl, wandb, mlflow]", "trainer.project=e2e")
    assert main(["train", *fast_overrides(model, out, 2, *extra)]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    scores = [(r["step"], r["score"]) for r in rows]
    assert [s for s, _ in scores] == [1, 2] and all(math.isfinite(v) for _, v in scores)
    ids = json.loads((out / "trackers.json").read_text())

    wb = read_wandb_run(out)
    assert wb["ids"] == {ids["wandb"]["id"]}
    assert [(s, wb["history"][s]["score"]) for s, _ in scores] == scores
    assert wb["history"][2]["kl"] == rows[1]["kl"]
    assert wb["config"]["trainer"]["loggers"] == ["jsonl", "wandb", "mlflow"]
    assert wb["summary"]["iterations"] == 2
    assert wb["history"][2]["curves/_type"] == "image-file"

    client = MlflowClient(ids["mlflow"]["tracking_uri"])
    run_id = ids["mlflow"]["run_id"]
    history = client.get_metric_history(run_id, "score")
    assert [(m.step, m.value) for m in history] == scores
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "run"
    assert run.data.params["trainer.project"] == "e2e"
    assert {"config.json", "summary.json", "curves.png"} <= {
        a.path for a in client.list_artifacts(run_id)
    }

    # resumed into a new folder, with the stores in the run folders: new tracker runs that
    # name the run they resume, the iteration after the checkpoint's logged in both
    again = tmp_path / "resumed"
    resume = f"trainer.resume_from={out}"
    assert main(["train", *fast_overrides(model, again, 3, resume, *extra)]) == 0
    ids2 = json.loads((again / "trackers.json").read_text())
    assert ids2["wandb"]["id"] != ids["wandb"]["id"]
    wb2 = read_wandb_run(again)
    assert wb2["config"]["resumed_from"] == str(out)
    third = read_metrics(again / "metrics.jsonl")[-1]
    assert third["step"] == 3 and wb2["history"][3]["score"] == third["score"]
    client2 = MlflowClient(ids2["mlflow"]["tracking_uri"])
    run2 = client2.get_run(ids2["mlflow"]["run_id"])
    assert run2.data.tags["proxima.resumed_from"] == str(out)
    history = client2.get_metric_history(run2.info.run_id, "score")
    assert [(m.step, m.value) for m in history] == [(3, third["score"])]
