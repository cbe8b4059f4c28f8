"""Experiment trackers (trainer.loggers): the names a config accepts, the start-up checks (a
missing package, a dead MLflow server, W&B without a key or a network), and what W&B and
MLflow wrote, read back from their own files: W&B's offline run file (with wandb's record
type) and MLflow's store (with MlflowClient). The W&B and MLflow tests skip where their
package is not installed (`pip install 'proxima[wandb,mlflow]'`)."""

from __future__ import annotations

import json
import socket
import struct
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

import proxima.trackers as trk
from proxima.cli import main
from proxima.config import ConfigError, load_config
from proxima.logging import RunLogger, plot_metrics
from proxima.trackers import check_mlflow_server, check_trackers, open_trackers, selected

STEPS = {1: {"score": 0.25, "kl": 0.5, "eval/pass@1": 1.0}, 2: {"score": 0.75, "kl": 0.125}}


def _cfg(*overrides: str):
    return load_config(overrides=list(overrides), command="config")


def _dead_port() -> int:
    """A loopback port nothing listens on (bound, then closed: connections are refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def no_tracker_env(monkeypatch, tmp_path):
    isolate_tracker_env(monkeypatch, tmp_path)


def isolate_tracker_env(monkeypatch, tmp_path: Path) -> None:
    """No API key, no mode, no server from the machine: the tests decide; W&B's own folders
    (settings, cache) in tmp_path."""
    for var in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL", "WANDB_RUN_ID"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home"))
    monkeypatch.setenv("WANDB_SILENT", "true")


# --------------------------------------------------------------------------- config


def test_loggers_default_alias_and_implicit_jsonl():
    assert _cfg().trainer.loggers == ["jsonl", "tensorboard"]
    assert selected(_cfg()) == ["jsonl", "tensorboard"]
    # trainer.tensorboard=false (older configs) leaves tensorboard out
    assert selected(_cfg("trainer.tensorboard=false")) == ["jsonl"]
    # jsonl is always written, listed or not; each name once
    assert selected(_cfg("trainer.loggers=[mlflow, wandb, mlflow]")) == ["jsonl", "mlflow", "wandb"]


def test_unknown_logger_lists_the_valid_ones():
    with pytest.raises(ConfigError) as err:
        _cfg("trainer.loggers=[jsonl, wandbb]")
    assert "`trainer.loggers`: unknown logger 'wandbb'" in str(err.value)
    assert "jsonl, tensorboard, wandb, mlflow" in str(err.value)


# --------------------------------------------------------------------------- start-up


@pytest.mark.parametrize("tracker", ["wandb", "mlflow"])
def test_missing_package_names_the_pip_command(monkeypatch, no_tracker_env, tracker):
    monkeypatch.setitem(sys.modules, tracker, None)  # `import wandb` now fails
    with pytest.raises(ConfigError) as err:
        check_trackers(_cfg(f"trainer.loggers=[jsonl, {tracker}]"))
    msg = str(err.value)
    assert f"the package {tracker} cannot be imported" in msg
    assert f"pip install 'proxima[{tracker}]'" in msg
    check_trackers(_cfg())  # the default loggers need neither


@pytest.mark.parametrize("problem", ["no wandb package", "dead mlflow server"])
def test_train_stops_before_anything_loads(tmp_path, monkeypatch, capsys, no_tracker_env, problem):
    """`proxima train` with a tracker that cannot work: exit status 2, the fix said, no run
    folder (the model folder does not even exist: nothing was loaded)."""
    if problem == "no wandb package":
        monkeypatch.setitem(sys.modules, "wandb", None)
        loggers, expected = "[wandb]", "pip install 'proxima[wandb]'"
    else:
        pytest.importorskip("mlflow")
        monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{_dead_port()}")
        loggers, expected = "[mlflow]", "(MLFLOW_TRACKING_URI) does not answer"
    out = tmp_path / "run"
    args = [
        "train",
        "task.name=",
        f"model.actor_path={tmp_path / 'no-model'}",
        f"data.train_path={tmp_path / 'no-prompts.jsonl'}",
        "reward.function=rewards.py:fn",
        f"trainer.output_dir={out}",
        f"trainer.loggers={loggers}",
    ]
    assert main(args) == 2
    assert expected in capsys.readouterr().err
    assert not out.exists()


def test_dead_mlflow_server_is_an_error_at_start_up():
    uri = f"http://127.0.0.1:{_dead_port()}"
    with pytest.raises(ConfigError) as err:
        check_mlflow_server(uri, timeout=2)
    assert f"MLflow tracking server {uri} (MLFLOW_TRACKING_URI) does not answer" in str(err.value)
    check_mlflow_server("sqlite:///x.db")  # not a server: nothing to ask


def test_dead_mlflow_server_stops_check_trackers(monkeypatch, no_tracker_env):
    pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{_dead_port()}")
    with pytest.raises(ConfigError, match="does not answer"):
        check_trackers(_cfg("trainer.loggers=[mlflow]"))


def test_a_server_that_answers_passes():
    class Health(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
            self.wfile.write(b"OK")

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Health)
    thread = threading.Thread(target=server.handle_request, daemon=True)
    thread.start()
    try:
        check_mlflow_server(f"http://127.0.0.1:{server.server_port}", timeout=5)
    finally:
        thread.join(5)
        server.server_close()


def test_wandb_mode(monkeypatch, no_tracker_env):
    assert trk.wandb_mode()[0] == "offline"  # no key
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{_dead_port()}")
    with pytest.warns(UserWarning, match="does not answer.*logging offline.*wandb sync"):
        assert trk.wandb_mode()[0] == "offline"  # a key, but its server is not there
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert trk.wandb_mode() == ("disabled", "WANDB_MODE")  # the user's choice wins


# --------------------------------------------------------------------------- read back


def _wandb_records(path: Path):
    """The records of a W&B run file (LevelDB's log framing, a 7-byte `:W&B` header;
    wandb's Go core writes it, wandb's protobuf `Record` decodes each record)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B"
    pos, buf = 7, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if left < 7 or (kind == 0 and length == 0):  # the padding of a block
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        buf = chunk if kind in (1, 2) else buf + chunk  # full, first | middle, last
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            yield record


def _finished_records(path: Path, timeout: float = 60.0) -> list:
    """The records of a run file once its `exit` record is there: wandb's core process
    writes the file after `finish()` returns."""
    deadline = time.monotonic() + timeout
    while True:
        records = list(_wandb_records(path))
        if any(r.WhichOneof("record_type") == "exit" for r in records):
            return records
        assert time.monotonic() < deadline, f"{path} has no exit record after {timeout} s"
        time.sleep(0.2)


def read_wandb_run(run_dir: Path) -> dict:
    """{"ids", "history": {step: row}, "summary", "config"} of the offline W&B runs in
    `run_dir` (several when the folder was opened again: one W&B run resumed); nested keys
    read a/b (an image's `curves/_type`)."""
    out: dict = {"ids": set(), "history": {}, "summary": {}, "config": {}}
    files = sorted(Path(run_dir).glob("wandb/offline-run-*/run-*.wandb"))
    assert files, f"no W&B run file in {run_dir}"
    for path in files:
        for r in _finished_records(path):
            kind = r.WhichOneof("record_type")

            def items(updates):
                return {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in updates}

            if kind == "run":
                out["ids"].add(r.run.run_id)
                out["config"].update(items(r.run.config.update))
            elif kind == "config":
                out["config"].update(items(r.config.update))
            elif kind == "history":
                row = items(r.history.item)
                out["history"].setdefault(row["_step"], {}).update(row)
            elif kind == "summary":
                out["summary"].update(items(r.summary.update))
    return out


def _log_a_run(run_dir: Path, trackers, steps=STEPS, config=None, summary=None) -> None:
    config = config or {"actor": {"optim": {"lr": 1e-3}}, "trainer": {"loggers": ["mlflow"]}}
    with RunLogger(run_dir, tensorboard=False, trackers=trackers) as logger:
        logger.log_config(config)
        for step, metrics in steps.items():
            logger.log(step, metrics)
        plot_metrics(run_dir / "metrics.jsonl", run_dir / "curves.png", ["score", "kl"])
        summary = summary or {"iterations": max(steps), "eval_after": {"accuracy": 0.5}}
        (run_dir / "summary.json").write_text(json.dumps(summary))
        logger.finish(summary, [run_dir / "curves.png", run_dir / "pass_at_k.png"])


def test_wandb_offline_run_reads_back(tmp_path, no_tracker_env):
    pytest.importorskip("wandb")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = _cfg("trainer.loggers=[wandb]", "trainer.project=proj")
    _log_a_run(run_dir, open_trackers(cfg, run_dir))
    ids = json.loads((run_dir / "trackers.json").read_text())["wandb"]
    assert ids["mode"] == "offline" and ids["project"] == "proj"
    run = read_wandb_run(run_dir)
    assert run["ids"] == {ids["id"]}
    for step, metrics in STEPS.items():
        assert {k: run["history"][step][k] for k in metrics} == metrics
    assert run["config"]["actor"] == {"optim": {"lr": 1e-3}}
    assert run["summary"]["iterations"] == 2
    assert run["summary"]["eval_after/accuracy"] == 0.5
    assert run["history"][2]["curves/_type"] == "image-file"  # the picture, at the last step

    # the same folder opened again (resume="allow"): the same W&B run goes on
    _log_a_run(run_dir, open_trackers(cfg, run_dir), steps={3: {"score": 1.0}})
    again = read_wandb_run(run_dir)
    assert again["ids"] == {ids["id"]}
    assert again["history"][3]["score"] == 1.0


def test_mlflow_local_store_reads_back(tmp_path, no_tracker_env):
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    from mlflow.tracking import MlflowClient

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = _cfg("trainer.loggers=[mlflow]", "trainer.project=proj", "trainer.run_name=first")
    _log_a_run(run_dir, open_trackers(cfg, run_dir))
    ids = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    assert ids["tracking_uri"] == f"sqlite:///{run_dir.resolve()}/mlflow.db"
    client = MlflowClient(ids["tracking_uri"])
    run = client.get_run(ids["run_id"])
    assert run.info.run_name == "first" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "proj"
    for key in ("score", "kl", "eval/pass@1"):
        history = client.get_metric_history(ids["run_id"], trk.mlflow_key(key))
        expected = [(s, m[key]) for s, m in STEPS.items() if key in m]
        assert [(m.step, m.value) for m in history] == expected
    assert trk.mlflow_key("eval/pass@1") == "eval/pass_at_1"
    assert run.data.params["actor.optim.lr"] == "0.001"
    assert run.data.params["trainer.loggers"] == "['mlflow']"
    artifacts = {a.path for a in client.list_artifacts(ids["run_id"])}
    assert artifacts == {"config.json", "summary.json", "curves.png"}  # no pass_at_k.png made
    assert (run_dir / "mlartifacts").is_dir()  # artifacts stay in the run folder

    # the same folder opened again: the same MLflow run goes on
    _log_a_run(run_dir, open_trackers(cfg, run_dir), steps={3: {"score": 1.0}})
    history = client.get_metric_history(ids["run_id"], "score")
    assert [m.step for m in history] == [1, 2, 3]
    assert len(client.search_runs([run.info.experiment_id])) == 1


def test_mlflow_resume_continues_the_run_on_a_shared_store(tmp_path, monkeypatch, no_tracker_env):
    """A run resumed into a new folder continues the checkpoint's MLflow run when both log
    to the same tracking URI (a server; here a shared sqlite file), a failed run says so."""
    pytest.importorskip("mlflow")
    pytest.importorskip("sqlalchemy")
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'shared.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)  # MLflow puts a new experiment's artifacts in ./mlruns
    first, second = tmp_path / "run", tmp_path / "run-2"
    first.mkdir()
    second.mkdir()
    cfg = _cfg("trainer.loggers=[mlflow]")
    _log_a_run(first, open_trackers(cfg, first))
    _log_a_run(
        second,
        open_trackers(cfg, second, resumed_run=first),
        steps={3: {"score": 1.0}},
        config={"actor": {"optim": {"lr": 5e-4}}},  # changed: MLflow keeps the first value
        summary={"failed": {"iteration": 3}},
    )
    run_id = json.loads((first / "trackers.json").read_text())["mlflow"]["run_id"]
    assert json.loads((second / "trackers.json").read_text())["mlflow"]["run_id"] == run_id
    client = MlflowClient(uri)
    assert [m.step for m in client.get_metric_history(run_id, "score")] == [1, 2, 3]
    run = client.get_run(run_id)
    assert run.info.status == "FAILED"
    assert run.data.params["actor.optim.lr"] == "0.001"


def test_a_tracker_that_fails_is_dropped_and_the_run_goes_on(tmp_path):
    class Broken(trk.Tracker):
        name = "broken"

        def log(self, step, metrics):
            raise ConnectionError("server gone")

    with RunLogger(tmp_path, tensorboard=False, trackers=[Broken()]) as logger:
        with pytest.warns(UserWarning, match="broken failed in log.*server gone"):
            logger.log(1, {"score": 1.0})
        assert logger.trackers == []
        logger.log(2, {"score": 2.0})
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2


def test_a_tracker_that_cannot_start_is_named(tmp_path, monkeypatch):
    class Refuses(trk.Tracker):
        def __init__(self, *args):
            raise PermissionError("no write access")

    monkeypatch.setattr(trk, "MlflowTracker", Refuses)
    with pytest.raises(RuntimeError, match="mlflow could not start.*no write access"):
        open_trackers(_cfg("trainer.loggers=[mlflow]"), tmp_path)
