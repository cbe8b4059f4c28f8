"""Experiment trackers besides metrics.jsonl: Weights & Biases and MLflow (`trainer.loggers`;
TensorBoard is `logging.TensorBoardTracker`). Each is a `Tracker`: the run's metrics per step,
the resolved config, the summary and the pictures of its end (curves.png, pass_at_k.png).

`check_trackers` runs at start-up, before any model loads: a selected tracker's package is
importable, a remote MLflow server (MLFLOW_TRACKING_URI) answers. `open_trackers` opens them
in the run folder (main process only) and keeps their run ids in `<run>/trackers.json`:
the same folder opened again continues the same W&B / MLflow runs, and a run resumed from a
checkpoint (trainer.resume_from) continues the checkpoint's runs where their store is shared
(W&B online, an MLflow server); with the local stores it starts new runs, tagged with the
run it resumes.

W&B runs offline (files in `<run>/wandb`, `wandb sync` uploads them) unless an API key is
set (WANDB_API_KEY or `wandb login`) and its server answers; WANDB_MODE, when set, decides.
MLflow writes to `sqlite:///<run>/mlflow.db` (artifacts in `<run>/mlartifacts`) unless
MLFLOW_TRACKING_URI is set.
"""

from __future__ import annotations

import importlib
import json
import netrc
import os
import re
import socket
import time
import urllib.error
import urllib.request
import uuid
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from proxima.config import Config, ConfigError

IDS_FILE = "trackers.json"  # the tracker runs of a run folder: {"wandb": {...}, "mlflow": {...}}
EXTRAS = {  # tracker (its pip extra's name too) -> the modules it needs
    "wandb": ("wandb",),
    "mlflow": ("mlflow",),
}
LOCAL_MLFLOW_MODULES = ("sqlalchemy", "alembic")  # the sqlite store in the run folder
HEALTH_TIMEOUT_S = 5.0  # a remote MLflow server must answer /health within this
WANDB_PROBE_TIMEOUT_S = 3.0  # W&B's server, with an API key set; else offline
MLFLOW_PARAM_CHARS = 500  # the shortest limit of MLflow's versions (6000 in recent ones)
MLFLOW_BATCH = 100  # params per log_batch call: MLflow's limit


class Tracker:
    """What a tracker receives; each method does nothing unless overridden."""

    name = "tracker"

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Scalars of one step."""

    def log_config(self, config: Mapping[str, Any]) -> None:
        """The resolved config (nested sections)."""

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        """The run's summary (what summary.json holds) at its end."""

    def log_image(self, path: Path, step: int) -> None:
        """A picture of the run's end (curves.png, pass_at_k.png), shown at `step`."""

    def close(self, status: str = "finished") -> None:
        """End the tracker's run: finished | failed | stopped."""


def selected(cfg: Config) -> list[str]:
    """trainer.loggers as it acts: jsonl first (always written: resume, plots and tests read
    metrics.jsonl), tensorboard left out when trainer.tensorboard is false, each name once."""
    names = ["jsonl", *cfg.trainer.loggers]
    if not cfg.trainer.tensorboard:
        names = [n for n in names if n != "tensorboard"]
    return list(dict.fromkeys(names))


# --------------------------------------------------------------------------- start-up


def _missing(tracker: str, module: str, err: BaseException) -> ConfigError:
    return ConfigError(
        f"`trainer.loggers` has {tracker}, but the package {module} cannot be imported "
        f"({type(err).__name__}: {err}). Install it with `pip install 'proxima[{tracker}]'`, "
        f"or remove {tracker} from trainer.loggers."
    )


def _import(tracker: str, module: str) -> Any:
    try:
        return importlib.import_module(module)
    except Exception as err:  # noqa: BLE001 - missing or broken: both are said the same way
        raise _missing(tracker, module, err) from None


def mlflow_uri(run_dir: Path | None) -> str:
    """The tracking URI: MLFLOW_TRACKING_URI, else a sqlite store in the run folder."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if uri or run_dir is None:
        return uri
    return f"sqlite:///{Path(run_dir).resolve()}/mlflow.db"


def check_mlflow_server(uri: str, timeout: float = HEALTH_TIMEOUT_S) -> None:
    """A http(s) tracking URI must answer (any HTTP status is an answer: the server runs)."""
    if urlparse(uri).scheme not in ("http", "https"):
        return
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout):
            pass
    except urllib.error.HTTPError:
        return  # it answered (401, 404, ...): MLflow's client says more if it matters
    except (urllib.error.URLError, OSError) as err:
        reason = getattr(err, "reason", err)
        raise ConfigError(
            f"`trainer.loggers` has mlflow, and the MLflow tracking server {uri} "
            f"(MLFLOW_TRACKING_URI) does not answer within {timeout:g} s ({reason}). Start it "
            "(`mlflow server --host 127.0.0.1 --port PORT`), fix MLFLOW_TRACKING_URI, or unset "
            "it to log into the run folder (sqlite:///RUN/mlflow.db)."
        ) from None


def check_trackers(cfg: Config) -> None:
    """Before any model loads: each selected tracker's package imports; MLflow's server,
    when MLFLOW_TRACKING_URI names one, answers."""
    names = selected(cfg)
    for tracker, modules in EXTRAS.items():
        if tracker in names:
            for module in modules:
                _import(tracker, module)
    if "mlflow" in names:
        uri = mlflow_uri(None)
        if not uri or uri.startswith("sqlite:"):
            for module in LOCAL_MLFLOW_MODULES:
                _import("mlflow", module)
        check_mlflow_server(uri)


# --------------------------------------------------------------------------- run ids


def read_ids(run_dir: Path) -> dict[str, Any]:
    """The tracker runs recorded in a run folder (empty when none)."""
    try:
        return json.loads((Path(run_dir) / IDS_FILE).read_text())
    except (OSError, ValueError):
        return {}


def _write_ids(run_dir: Path, name: str, ids: dict[str, Any]) -> None:
    data = read_ids(run_dir)
    data[name] = ids
    (Path(run_dir) / IDS_FILE).write_text(json.dumps(data, indent=2))


def open_trackers(cfg: Config, run_dir: Path, resumed_run: Path | None = None) -> list[Tracker]:
    """The selected W&B / MLflow trackers, opened in `run_dir` (call on the main process).
    `resumed_run`: the run folder of the checkpoint this run resumes. A tracker that cannot
    start is a RuntimeError naming it."""
    names = selected(cfg)
    name = cfg.trainer.run_name or Path(run_dir).name
    out: list[Tracker] = []
    for tracker, cls in (("wandb", WandbTracker), ("mlflow", MlflowTracker)):
        if tracker not in names:
            continue
        try:
            out.append(cls(run_dir, cfg.trainer.project, name, resumed_run))
        except BaseException as err:
            for opened in out:
                opened.close("failed")
            if not isinstance(err, Exception):
                raise
            raise RuntimeError(
                f"trainer.loggers: {tracker} could not start its run in {run_dir} "
                f"({type(err).__name__}: {err})."
            ) from err
    return out


def flatten(tree: Mapping[str, Any], prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        if isinstance(value, Mapping):
            flat.update(flatten(value, f"{prefix}{key}{sep}", sep))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _leaves(summary: Mapping[str, Any]) -> dict[str, Any]:
    """The leaves of a summary without its config (logged as the config), keyed a/b/c."""
    return flatten({k: v for k, v in summary.items() if k != "config"}, sep="/")


def _status(status: str) -> str:
    return {"finished": "FINISHED", "failed": "FAILED", "stopped": "KILLED"}.get(status, "FINISHED")


# --------------------------------------------------------------------------- W&B


def _wandb_key() -> bool:
    """An API key is configured: WANDB_API_KEY, or netrc's entry for W&B's host."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host or "") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _reachable(url: str, timeout: float) -> str | None:
    """None when a TCP connection to `url`'s host opens within `timeout`; else why not."""
    parsed = urlparse(url)
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        with socket.create_connection((parsed.hostname or "", port), timeout=timeout):
            return None
    except OSError as err:
        return str(err) or type(err).__name__


def wandb_mode() -> tuple[str, str]:
    """(mode, why): WANDB_MODE when set; online with an API key whose server answers;
    offline otherwise."""
    if os.environ.get("WANDB_MODE"):
        return os.environ["WANDB_MODE"], "WANDB_MODE"
    if not _wandb_key():
        return "offline", "no W&B API key (WANDB_API_KEY or `wandb login`)"
    url = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    problem = _reachable(url, WANDB_PROBE_TIMEOUT_S)
    if problem is not None:
        warnings.warn(
            f"W&B: an API key is set but {url} does not answer ({problem}); logging offline "
            "into the run folder: upload later with `wandb sync RUN/wandb/offline-run-*`.",
            stacklevel=2,
        )
        return "offline", f"{url} does not answer"
    return "online", "API key"


class WandbTracker(Tracker):
    """A W&B run: id kept in trackers.json, resume="allow", files in `<run>/wandb`."""

    name = "wandb"

    def __init__(self, run_dir: Path, project: str, name: str, resumed_run: Path | None):
        import wandb

        self.wandb = wandb
        mode, self.why = wandb_mode()
        mine = read_ids(run_dir).get("wandb", {})
        theirs = read_ids(resumed_run).get("wandb", {}) if resumed_run is not None else {}
        run_id = mine.get("id")
        if run_id is None and theirs.get("mode") == "online" == mode:
            run_id = theirs.get("id")  # one W&B run across the resume
        run_id = run_id or os.environ.get("WANDB_RUN_ID") or uuid.uuid4().hex[:12]
        self.run = wandb.init(
            project=project,
            name=name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            mode=mode,
            settings=wandb.Settings(console="off"),
        )
        if resumed_run is not None:
            self.run.config.update({"resumed_from": str(resumed_run)}, allow_val_change=True)
        _write_ids(run_dir, "wandb", {"id": run_id, "project": project, "mode": mode})

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log(dict(metrics), step=int(step))

    def log_config(self, config: Mapping[str, Any]) -> None:
        self.run.config.update(dict(config), allow_val_change=True)

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        self.run.summary.update(_leaves(summary))

    def log_image(self, path: Path, step: int) -> None:
        self.run.log({path.stem: self.wandb.Image(str(path))}, step=int(step))

    def close(self, status: str = "finished") -> None:
        self.run.finish(exit_code=1 if status == "failed" else 0)


# --------------------------------------------------------------------------- MLflow

_MLFLOW_BAD = re.compile(r"[^\w\-. :/]")  # MLflow names: alphanumerics, _ - . space : /


def mlflow_key(key: str) -> str:
    """A metric or param name MLflow accepts: eval/pass@1 -> eval/pass_at_1."""
    return _MLFLOW_BAD.sub("_", key.replace("@", "_at_"))


class MlflowTracker(Tracker):
    """An MLflow run in experiment `project`; its id kept in trackers.json."""

    name = "mlflow"

    def __init__(self, run_dir: Path, project: str, name: str, resumed_run: Path | None):
        from mlflow.tracking import MlflowClient

        self.uri = mlflow_uri(run_dir)
        self.client = MlflowClient(self.uri)
        mine = read_ids(run_dir).get("mlflow", {})
        theirs = read_ids(resumed_run).get("mlflow", {}) if resumed_run is not None else {}
        run_id = mine.get("run_id") if mine.get("tracking_uri") == self.uri else None
        if run_id is None and theirs.get("tracking_uri") == self.uri:
            run_id = theirs.get("run_id")  # a shared server: one MLflow run across the resume
        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")
        else:
            run_id = self._new_run(run_dir, project, name, resumed_run)
        self.run_id = run_id
        _write_ids(run_dir, "mlflow", {"run_id": run_id, "tracking_uri": self.uri})

    def _new_run(self, run_dir: Path, project: str, name: str, resumed_run: Path | None) -> str:
        exp = self.client.get_experiment_by_name(project)
        if exp is not None:
            exp_id = exp.experiment_id
        elif self.uri.startswith("sqlite:") and not os.environ.get("MLFLOW_TRACKING_URI"):
            location = (Path(run_dir).resolve() / "mlartifacts").as_uri()
            exp_id = self.client.create_experiment(project, artifact_location=location)
        else:
            exp_id = self.client.create_experiment(project)
        tags = {"proxima.run_dir": str(Path(run_dir).resolve())}
        if resumed_run is not None:
            tags["proxima.resumed_from"] = str(resumed_run)
        return self.client.create_run(exp_id, run_name=name, tags=tags).info.run_id

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [Metric(mlflow_key(k), float(v), now, int(step)) for k, v in metrics.items()]
        for i in range(0, len(batch), 1000):  # MLflow's limit of metrics per batch
            self.client.log_batch(self.run_id, metrics=batch[i : i + 1000])

    def log_config(self, config: Mapping[str, Any]) -> None:
        """Params: the flattened config, values cut at MLFLOW_PARAM_CHARS; a run continued
        keeps the params it has (MLflow refuses to change one); the whole config is also
        the artifact config.json."""
        from mlflow.entities import Param

        have = self.client.get_run(self.run_id).data.params
        params = [
            Param(mlflow_key(k), str(v)[:MLFLOW_PARAM_CHARS])
            for k, v in flatten(config).items()
            if mlflow_key(k) not in have
        ]
        for i in range(0, len(params), MLFLOW_BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + MLFLOW_BATCH])
        self.client.log_dict(self.run_id, dict(config), "config.json")

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        self.client.log_dict(self.run_id, dict(summary), "summary.json")

    def log_image(self, path: Path, step: int) -> None:
        self.client.log_artifact(self.run_id, str(path))

    def close(self, status: str = "finished") -> None:
        self.client.set_terminated(self.run_id, status=_status(status))
