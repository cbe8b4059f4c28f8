"""Run outputs: metrics (jsonl, TensorBoard and the trackers of `proxima.trackers`),
samples, console lines, plots, progress bars.

Only the main process writes: other ranks build ``RunLogger(..., enabled=False)``.
``metrics.jsonl`` holds one ``{"step": ..., **metrics}`` object per line; non-finite values
are written as ``NaN``/``Infinity`` (Python's json reads them back) so a diverging run
stays visible in the file. It is always written: resume, plots and tests read it. A tracker
that fails during the run (a server gone) is said once and switched off; the run goes on.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import threading
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from proxima.trackers import Tracker

EVAL_PREFIX = "eval/"  # eval/<key> is overlaid on the panel of <key> in plot_metrics


def _to_float(value: Any) -> float:
    """Python float from a float, int, 0-d tensor or numpy scalar."""
    return float(value.item() if hasattr(value, "item") else value)


class RunLogger:
    """Append metrics and samples to ``run_dir``; mirror scalars to TensorBoard
    (``tensorboard``) and to ``trackers`` (opened by ``proxima.trackers.open_trackers``),
    which also get the config (``log_config``) and the run's end (``finish``)."""

    def __init__(
        self,
        run_dir: str | Path,
        tensorboard: bool = True,
        enabled: bool = True,
        trackers: Sequence[Tracker] = (),
    ):
        self.run_dir = Path(run_dir)
        self.enabled = enabled
        self._files: dict[str, Any] = {}
        self.trackers: list[Tracker] = []
        self.last_step = 0
        self._status = "finished"
        if not enabled:
            return
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            writer = _open_tensorboard(self.run_dir / "tb")
            if writer is not None:
                self.trackers.append(TensorBoardTracker(writer))
        self.trackers += list(trackers)

    def _each(self, call: str, *args: Any) -> None:
        """`tracker.call(*args)` for each tracker; one that raises is said and dropped."""
        for tracker in list(self.trackers):
            try:
                getattr(tracker, call)(*args)
            except Exception as err:  # noqa: BLE001 - metrics.jsonl keeps everything
                self.trackers.remove(tracker)
                where = f" ({tracker.location})" if getattr(tracker, "location", "") else ""
                warnings.warn(
                    f"trainer.loggers: {tracker.name}{where} failed in {call} "
                    f"({type(err).__name__}: {err}); it is off for the rest of the run "
                    "(metrics.jsonl keeps every metric).",
                    stacklevel=3,
                )

    def _append(self, name: str, record: Mapping[str, Any]) -> None:
        """One whole line, written through (a crash must not lose the last lines); a write
        that fails (a full disk) takes its partial line back, so every line stays whole,
        and names the file."""
        path = self.run_dir / name
        if name not in self._files:  # append: a resumed run continues the same files
            self._files[name] = path.open("ab", buffering=0)
        f = self._files[name]
        line = memoryview((json.dumps(record, ensure_ascii=False) + "\n").encode())
        start = f.tell()
        try:
            while line:
                line = line[f.write(line) :]
        except OSError as err:
            with contextlib.suppress(OSError):
                f.truncate(start)
            raise OSError(
                err.errno,
                f"cannot write {path} ({err.strerror or err}); its earlier lines are whole",
            ) from err

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Record scalar ``metrics`` for ``step`` (tensors and numpy scalars are accepted)."""
        if not self.enabled:
            return
        values = {k: _to_float(v) for k, v in metrics.items()}
        self._append("metrics.jsonl", {"step": int(step), **values})
        self.last_step = max(self.last_step, int(step))
        self._each("log", int(step), values)

    def log_config(self, config: Mapping[str, Any]) -> None:
        """The resolved config, to each tracker (the run folder has it as config.json)."""
        if self.enabled:
            self._each("log_config", config)

    def finish(self, summary: Mapping[str, Any], images: Sequence[str | Path] = ()) -> None:
        """The run's end to each tracker: the summary, the pictures that exist (curves.png),
        and how it ended (summary's failed / stopped) for ``close``."""
        if not self.enabled:
            return
        self._status = "failed" if "failed" in summary or "diverged" in summary else "finished"
        if "stopped" in summary:
            self._status = "stopped"
        self._each("log_summary", summary)
        for image in images:
            if Path(image).is_file():
                self._each("log_image", Path(image), self.last_step)

    def log_samples(
        self,
        step: int,
        prompts: Sequence[str],
        responses: Sequence[str],
        scores: Sequence[float] | Any,
        extra: Mapping[str, Sequence[Any]] | None = None,
    ) -> None:
        """Append one line per sample: step, prompt, response, score and ``extra`` columns."""
        if not self.enabled:
            return
        scores = scores.tolist() if hasattr(scores, "tolist") else list(scores)
        extra = dict(extra or {})
        lengths = {"prompts": len(prompts), "responses": len(responses), "scores": len(scores)}
        lengths.update({k: len(v) for k, v in extra.items()})
        if len(set(lengths.values())) > 1:
            raise ValueError(f"log_samples needs equal lengths, got {lengths}.")
        for i in range(len(prompts)):
            record = {"step": int(step), "prompt": prompts[i], "response": responses[i]}
            record["score"] = float(scores[i])
            record.update({k: _jsonable(v[i]) for k, v in extra.items()})
            self._append("samples.jsonl", record)

    def close(self, status: str | None = None) -> None:
        """Close the files and end each tracker's run: ``status`` (finished | failed |
        stopped), else what ``finish`` saw. A second call does nothing."""
        for f in self._files.values():
            f.close()
        self._files.clear()
        self._each("close", status or self._status)
        self.trackers.clear()

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, exc_type: object, *exc: object) -> None:
        self.close("failed" if exc_type is not None else None)


def write_atomic(path: str | Path, text: str) -> None:
    """``path`` holds ``text`` whole or keeps what it held: written beside it, then renamed
    (a full disk leaves no empty or cut file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except OSError as err:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise OSError(err.errno, f"cannot write {path} ({err.strerror or err})") from err


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


_TB_WARNED = False


def _open_tensorboard(folder: Path) -> Any:
    global _TB_WARNED
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception as exc:  # tensorboard missing or broken: metrics.jsonl still works
        if not _TB_WARNED:
            warnings.warn(
                f"TensorBoard unavailable ({exc}); metrics go to metrics.jsonl only. "
                "`pip install tensorboard` to enable it.",
                stacklevel=3,
            )
            _TB_WARNED = True
        return None
    _quiet_writer_threads()
    return SummaryWriter(log_dir=str(folder))


def _quiet_writer_threads() -> None:
    """TensorBoard writes from a thread of its own, which keeps a failed write's error (a full
    disk) for the writer's next call and also lets Python print it with a traceback. The
    next call raises it here, where `RunLogger` names it and turns TensorBoard off, so that
    thread's print is left out; every other thread's error prints as before."""
    previous = threading.excepthook
    if getattr(previous, "quiets_tensorboard", False):
        return

    def hook(args: Any) -> None:
        thread_class = type(args.thread).__name__ if args.thread is not None else ""
        if thread_class == "_AsyncWriterThread" and isinstance(args.exc_value, OSError):
            return
        previous(args)

    hook.quiets_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class TensorBoardTracker(Tracker):
    """Scalars to ``<run>/tb``; the config and summary as text, pictures as images."""

    name = "tensorboard"

    def __init__(self, writer: Any):
        self.writer = writer
        self.location = getattr(writer, "log_dir", "")

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_config(self, config: Mapping[str, Any]) -> None:
        self.writer.add_text("config", _as_markdown(config))

    def log_summary(self, summary: Mapping[str, Any]) -> None:
        self.writer.add_text("summary", _as_markdown(summary))

    def log_image(self, path: Path, step: int) -> None:
        import matplotlib.image

        pixels = matplotlib.image.imread(str(path))  # H x W x C floats in [0, 1]
        self.writer.add_image(path.stem, pixels, step, dataformats="HWC")
        self.writer.flush()

    def close(self, status: str = "finished") -> None:
        self.writer.close()


def _as_markdown(tree: Mapping[str, Any]) -> str:
    """JSON in a code block (TensorBoard's text panel renders markdown)."""
    text = json.dumps(tree, indent=2, default=str)
    return "\n".join("    " + line for line in text.splitlines())


def _fmt(value: Any) -> str:
    if isinstance(value, bool) or (isinstance(value, int)):
        return str(int(value))
    value = _to_float(value)
    if math.isfinite(value) and value == int(value) and abs(value) < 1e6:
        return str(int(value))
    return f"{value:.4g}"  # 3-4 significant digits: 0.4123 -> 0.4123, 0.01234 -> 0.01234


def format_line(
    step: int,
    total: int | None,
    metrics: Mapping[str, Any],
    keys: Sequence[str] | Mapping[str, str],
) -> str:
    """One console line, e.g. ``it 12/200 | score 0.41 | kl 0.012``.

    ``keys`` lists the metrics to show, in order; a mapping ``{metric: label}`` shows a
    shorter label (``{"response_length": "len"}``). Missing metrics are skipped.
    """
    labels = dict(keys) if isinstance(keys, Mapping) else {k: k for k in keys}
    parts = [f"it {step}/{total}" if total is not None else f"it {step}"]
    parts += [f"{label} {_fmt(metrics[k])}" for k, label in labels.items() if k in metrics]
    return " | ".join(parts)


def read_metrics(metrics_jsonl: str | Path) -> list[dict[str, Any]]:
    """Rows of a metrics.jsonl; rows of one step are merged (for a key, the later wins)."""
    by_step: dict[int, dict[str, Any]] = {}
    with Path(metrics_jsonl).open(encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                by_step.setdefault(row["step"], {}).update(row)
    return [by_step[s] for s in sorted(by_step)]


def _series(rows: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the rows that have ``key``: sparse keys keep their own steps."""
    pairs = [(r["step"], r[key]) for r in rows if r.get(key) is not None]
    return [p[0] for p in pairs], [float(p[1]) for p in pairs]


Panel = str | tuple[str, Sequence[str]]  # a metric, or (title, metrics) drawn together


def plot_metrics(metrics_jsonl: str | Path, out_png: str | Path, keys: Sequence[Panel]) -> Path:
    """Draw one small panel per entry of ``keys`` found in ``metrics_jsonl`` (x = step) into
    ``out_png``: a metric, or ``(title, [metrics])`` drawn in one panel (several metrics of
    one scale, e.g. the drift/* shares).

    ``eval/<key>`` rows, logged on some steps only, are overlaid as markers on ``<key>``.
    """
    import matplotlib

    matplotlib.use("Agg")  # no display needed (servers, CI)
    import matplotlib.pyplot as plt

    rows = read_metrics(metrics_jsonl)
    logged = {k for r in rows for k in r}
    panels = [(k, [k]) if isinstance(k, str) else (k[0], list(k[1])) for k in keys]
    present = [(title, [k for k in ks if k in logged]) for title, ks in panels]
    present = [(title, ks) for title, ks in present if ks]
    if not present:
        raise ValueError(
            f"none of {list(keys)} is in {metrics_jsonl}; keys found: {sorted(logged - {'step'})}."
        )
    ncols = min(3, len(present))
    nrows = math.ceil(len(present) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4 * ncols, 2.8 * nrows), squeeze=False)
    for ax, (title, ks) in zip(axes.flat, present, strict=False):
        for key in ks:
            _plot_series(ax, rows, key, grouped=len(ks) > 1)
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("step", fontsize=8)
        ax.tick_params(labelsize=7)
        if len(ks) > 1 or any(EVAL_PREFIX + k in logged for k in ks):
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(present) :]:
        ax.set_visible(False)
    fig.tight_layout()
    out = Path(out_png)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _plot_series(ax: Any, rows: list[dict[str, Any]], key: str, grouped: bool) -> None:
    """``key`` as a line and its ``eval/<key>`` as markers: alone in its panel, labelled
    train and eval (orange); in a group, labelled by name, the markers in the line's colour."""
    steps, values = _series(rows, key)
    label = key if grouped else "train"
    (line,) = ax.plot(steps, values, marker="o" if len(steps) < 30 else None, ms=3, label=label)
    eval_steps, eval_values = _series(rows, EVAL_PREFIX + key)
    if eval_steps:
        color = line.get_color() if grouped else "tab:orange"
        label = EVAL_PREFIX + key if grouped else "eval"
        ax.plot(eval_steps, eval_values, "s--", ms=4, color=color, label=label)


def plot_pass_at_k(runs: dict[str, dict], out_png: str | Path) -> Path:
    """pass@k against k, one line per evaluation (e.g. before and after training): `runs`
    maps a label to an `evaluate_k` result ({"pass@1": ..., "pass@2": ...})."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4.5, 3.2))
    for label, res in runs.items():
        ks = sorted(int(k.split("@")[1]) for k in res if k.startswith("pass@"))
        ax.plot(ks, [res[f"pass@{k}"] for k in ks], marker="o", ms=3, label=label)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("k (samples per prompt)", fontsize=8)
    ax.set_ylabel("pass@k", fontsize=8)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    ax.tick_params(labelsize=7)
    fig.tight_layout()
    out = Path(out_png)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _smooth(values: list[float], window: int) -> list[float]:
    """Trailing moving average (the first points average what there is)."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot_overoptimization(
    metrics: list[dict[str, Any]],
    evaluations: list[dict[str, Any]],
    out_png: str | Path,
    gold_key: str = "reward/gold",
    proxy_key: str = "reward/rm",
) -> Path:
    """Gao et al.'s figure (arXiv:2210.10760, fig. 1): gold and proxy scores against
    sqrt(KL to the initial policy). Both scores in standard deviations of the initial
    policy's held-out samples, from its mean (`evaluations[0]`): the held-out evaluations of
    the checkpoints as markers, the training iterations (`metrics`: gold_key, proxy_key and
    `kl`, smoothed) as thin lines. Right panel: the same scores against the iteration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = evaluations[0]
    z = {
        "gold": lambda v: (v - base["gold_mean"]) / max(base["gold_std"], 1e-8),
        "proxy": lambda v: (v - base["proxy_mean"]) / max(base["proxy_std"], 1e-8),
    }
    rows = [r for r in metrics if all(r.get(k) is not None for k in (gold_key, proxy_key, "kl"))]
    window = max(1, len(rows) // 20)
    fig, (ax, ax_it) = plt.subplots(1, 2, figsize=(10, 3.8))
    for name, key, color in (("gold", gold_key, "tab:green"), ("proxy", proxy_key, "tab:blue")):
        train_x = _smooth([math.sqrt(max(r["kl"], 0.0)) for r in rows], window)
        train_y = _smooth([z[name](r[key]) for r in rows], window)
        ax.plot(train_x, train_y, color=color, alpha=0.35, lw=1, label=f"{name}, training samples")
        ax_it.plot([r["step"] for r in rows], train_y, color=color, alpha=0.35, lw=1)
        ev_x = [math.sqrt(max(e["kl"], 0.0)) for e in evaluations]
        ev_y = [z[name](e[f"{name}_mean"]) for e in evaluations]
        ax.plot(ev_x, ev_y, "o-", color=color, ms=4, label=f"{name}, held-out")
        ax_it.plot([e["iteration"] for e in evaluations], ev_y, "o-", color=color, ms=4, label=name)
    ax.set_xlabel("sqrt(KL(policy || SFT policy)), nats^0.5 per response", fontsize=8)
    ax_it.set_xlabel("PPO iteration", fontsize=8)
    for a in (ax, ax_it):
        a.set_ylabel("score - SFT mean, in SFT std", fontsize=8)
        a.axhline(0.0, color="grey", lw=0.5)
        a.grid(alpha=0.3)
        a.tick_params(labelsize=7)
        a.legend(fontsize=7)
    ax.set_title("gold and proxy (reward model) scores against KL", fontsize=9)
    ax_it.set_title("the same against PPO iterations", fontsize=9)
    fig.tight_layout()
    out = Path(out_png)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def progress(
    iterable: Iterable[Any] | None = None,
    total: int | None = None,
    desc: str = "",
    disable: bool | None = None,
) -> Any:
    """A tqdm bar; hidden when stderr is not a terminal (logs, CI) unless ``disable=False``."""
    from tqdm import tqdm

    if disable is None:
        disable = not sys.stderr.isatty()
    return tqdm(iterable, total=total, desc=desc, disable=disable, dynamic_ncols=True)


# where the bar is hidden (stderr is a log file, not a terminal): a line at the first step
# and then every this many seconds, so that a log shows the run is alive and where it is
LINE_EVERY_S = 30.0


class StepProgress:
    """The steps of `sft`, `rm` and `dpo`: a tqdm bar on a terminal; in a log file, where the
    bar is hidden, a line (`<desc> step 3/40 | loss 0.6931 | 12 s`) at the first step, then
    every `line_every_s` seconds, and at the last step."""

    def __init__(self, total: int, desc: str, line_every_s: float | None = None) -> None:
        self.bar = progress(total=total, desc=desc)
        self.total, self.desc = total, desc
        self.line_every_s = LINE_EVERY_S if line_every_s is None else line_every_s
        self.start, self.said = time.monotonic(), None

    def update(self, step: int, **shown: str) -> None:
        self.bar.update(1)
        self.bar.set_postfix(**shown)
        now = time.monotonic()
        due = self.said is None or now - self.said >= self.line_every_s or step == self.total
        if self.bar.disable and due:
            self.said = now
            shown_parts = (f"{k} {v}" for k, v in shown.items())
            parts = [f"{self.desc} step {step}/{self.total}", *shown_parts]
            print(" | ".join([*parts, f"{now - self.start:.0f} s"]), flush=True)

    def close(self) -> None:
        self.bar.close()
