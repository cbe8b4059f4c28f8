"""Run logging: metrics.jsonl, samples.jsonl, TensorBoard, console lines, plots."""

import json
import math
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch

import proxima.logging as plog
from proxima.logging import (
    RunLogger,
    StepProgress,
    format_line,
    plot_metrics,
    progress,
    read_metrics,
)


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_metrics_lines_and_tensorboard(tmp_path):
    with RunLogger(tmp_path / "run") as logger:
        logger.log(1, {"score": 0.5, "kl": torch.tensor(0.25)})
        logger.log(2, {"score": 0.75})
    assert read_jsonl(tmp_path / "run" / "metrics.jsonl") == [
        {"step": 1, "score": 0.5, "kl": 0.25},
        {"step": 2, "score": 0.75},
    ]
    assert list((tmp_path / "run" / "tb").glob("events.out.tfevents.*"))


def test_lines_are_flushed_before_close_and_appended_on_resume(tmp_path):
    logger = RunLogger(tmp_path, tensorboard=False)
    logger.log(1, {"loss": math.nan})
    # Readable while the run is still going (a crash must not lose it); NaN stays visible.
    assert math.isnan(read_jsonl(tmp_path / "metrics.jsonl")[0]["loss"])
    logger.close()
    again = RunLogger(tmp_path, tensorboard=False)
    again.log(2, {"loss": 1.0})
    again.close()
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == [1, 2]


def test_samples(tmp_path):
    with RunLogger(tmp_path, tensorboard=False) as logger:
        logger.log_samples(
            3,
            ["p1", "p2"],
            ["r1", "r2"],
            torch.tensor([1.0, 0.5]),
            extra={"answer": ["a", "b"], "length": torch.tensor([4, 2])},
        )
    assert read_jsonl(tmp_path / "samples.jsonl") == [
        {"step": 3, "prompt": "p1", "response": "r1", "score": 1.0, "answer": "a", "length": 4},
        {"step": 3, "prompt": "p2", "response": "r2", "score": 0.5, "answer": "b", "length": 2},
    ]
    with RunLogger(tmp_path, tensorboard=False) as logger, pytest.raises(ValueError, match="equal"):
        logger.log_samples(3, ["p1", "p2"], ["r1"], [1.0, 2.0])


def test_disabled_logger_writes_nothing(tmp_path):
    run = tmp_path / "rank1"
    logger = RunLogger(run, enabled=False)
    logger.log(1, {"score": 1.0})
    logger.log_samples(1, ["p"], ["r"], [1.0])
    logger.close()
    assert not run.exists()


def test_missing_tensorboard_warns_once(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import now fails
    monkeypatch.setattr(plog, "_TB_WARNED", False)
    with pytest.warns(UserWarning, match="TensorBoard unavailable"):
        RunLogger(tmp_path / "a").close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = RunLogger(tmp_path / "b")
        second.log(1, {"x": 1.0})  # still logs to jsonl
        second.close()
    assert read_jsonl(tmp_path / "b" / "metrics.jsonl") == [{"step": 1, "x": 1.0}]


def test_format_line_exact():
    metrics = {"score": 0.41234, "kl": 0.0123456, "response_length": 5.2, "lr": 1e-5, "n": 8}
    keys = {"score": "score", "kl": "kl", "response_length": "len", "absent": "x", "lr": "lr"}
    # 4 significant digits: 0.41234 -> 0.4123, 0.0123456 -> 0.01235; absent keys skipped.
    assert format_line(12, 200, metrics, keys) == (
        "it 12/200 | score 0.4123 | kl 0.01235 | len 5.2 | lr 1e-05"
    )
    assert format_line(3, None, metrics, ["n", "kl"]) == "it 3 | n 8 | kl 0.01235"


def test_plot_with_sparse_eval_points(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "score": s / 10, "kl": 0.01 * s} for s in range(1, 11)]
    rows[4]["eval/score"] = 0.3  # eval only on steps 5 and 10
    rows[9]["eval/score"] = 0.8
    rows.append({"step": 10, "score": 2.0})  # step 10 logged again after a resume
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")

    merged = read_metrics(path)
    assert len(merged) == 10 and merged[-1]["score"] == 2.0 and merged[-1]["eval/score"] == 0.8
    assert plog._series(merged, "eval/score") == ([5, 10], [0.3, 0.8])

    out = plot_metrics(path, tmp_path / "plots" / "m.png", ["score", "kl", "not_logged"])
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000

    with pytest.raises(ValueError, match=r"none of \['x'\].*keys found: \['eval/score', 'kl'"):
        plot_metrics(path, tmp_path / "x.png", ["x"])


def test_progress_disabled_off_tty_and_forced(monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)  # as in CI or a log file
    bar = progress(range(3), desc="gen")
    assert list(bar) == [0, 1, 2]
    assert bar.disable
    forced = progress(total=2, disable=False)
    assert not forced.disable
    forced.close()


class _FullDisk:
    """A file that takes `room` more bytes, then fails as a full disk does (part written)."""

    def __init__(self, f, room: int):
        self.f, self.room = f, room

    def write(self, data) -> int:
        if len(data) > self.room:
            self.f.write(bytes(data[: self.room]))
            self.room = 0
            raise OSError(28, "No space left on device")
        self.room -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)


def test_step_progress_says_where_it_is_in_a_log_file(monkeypatch, capsys):
    """Off a terminal (stderr captured, as in a log file) the bar is hidden and a line says the
    step and what it is given: at the first step, every `line_every_s` and at the last."""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    bar = StepProgress(4, "rm", line_every_s=3600)
    for step in range(1, 5):
        bar.update(step, loss=f"{1 / step:.4f}", acc="0.50")
    bar.close()
    lines = capsys.readouterr().out.splitlines()
    assert [line.rsplit(" | ", 1)[0] for line in lines] == [
        "rm step 1/4 | loss 1.0000 | acc 0.50",
        "rm step 4/4 | loss 0.2500 | acc 0.50",
    ]
    assert all(line.endswith(" s") for line in lines)
    monkeypatch.setattr(plog, "LINE_EVERY_S", 0.0)  # the default, read when the bar is made
    bar = StepProgress(3, "dpo")
    for step in range(1, 4):
        bar.update(step)
    assert [line.split(" | ")[0] for line in capsys.readouterr().out.splitlines()] == [
        "dpo step 1/3",
        "dpo step 2/3",
        "dpo step 3/3",
    ]


def test_a_full_disk_leaves_whole_lines_and_names_the_file(tmp_path):
    logger = RunLogger(tmp_path, tensorboard=False)
    logger.log(1, {"a": 1.0})
    file = tmp_path / "metrics.jsonl"
    logger._files["metrics.jsonl"] = _FullDisk(logger._files["metrics.jsonl"], room=5)
    with pytest.raises(OSError, match=f"cannot write {file} \\(No space left on device\\); its"):
        logger.log(2, {"a": 2.0})
    logger.close()
    assert file.read_text() == '{"step": 1, "a": 1.0}\n'  # the cut line taken back


def test_write_atomic_keeps_the_old_file_when_the_write_fails(tmp_path, monkeypatch):
    from proxima.logging import write_atomic

    path = tmp_path / "summary.json"
    write_atomic(path, '{"old": 1}')
    real = Path.write_text

    def full(self, text, *args, **kwargs):
        real(self, text[:3], *args, **kwargs)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(OSError, match=f"cannot write {path} \\(No space left on device\\)"):
        write_atomic(path, '{"new": 2}')
    assert path.read_text() == '{"old": 1}' and [p.name for p in tmp_path.iterdir()] == [path.name]


def test_a_full_disk_under_tensorboard_is_named_once_without_a_thread_traceback(
    tmp_path, monkeypatch
):
    """TensorBoard's writer thread fails (a full disk): no traceback from that thread; the
    main thread's warning names TensorBoard's folder and the cause, TensorBoard is off, and
    metrics.jsonl keeps every line. Other threads' errors still reach the hook."""
    printed = []  # what Python's thread hook would print
    monkeypatch.setattr(threading, "excepthook", lambda args: printed.append(args.exc_value))
    logger = RunLogger(tmp_path / "run")
    tb = logger.trackers[0]
    records = tb.writer.file_writer.event_writer._async_writer._writer

    def full(data):
        raise OSError(28, "No space left on device")

    records.write = full
    with pytest.warns(UserWarning) as caught:
        logger.log(1, {"score": 0.5})
    message = str(caught[0].message)
    assert f"tensorboard ({tmp_path / 'run' / 'tb'}) failed in log" in message
    assert "No space left on device" in message and "it is off for the rest" in message
    assert logger.trackers == []
    logger.log(2, {"score": 0.75})  # metrics.jsonl goes on
    assert [r["step"] for r in read_jsonl(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
    assert printed == []
    other = threading.Thread(target=lambda: 1 / 0)
    other.start()
    other.join()
    assert [type(e) for e in printed] == [ZeroDivisionError]


def test_plot_draws_a_group_of_metrics_in_one_panel(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "score": 0.1 * s, "drift/repetition": 0.01 * s} for s in range(1, 6)]
    rows[0]["drift/distinct_2"] = 0.9  # sparse, and drift/dominated never logged
    rows[4]["eval/drift/repetition"] = 0.3
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    group = ("drift (0-1)", ["drift/repetition", "drift/dominated", "drift/distinct_2"])
    plot_metrics(path, tmp_path / "m.png", ["score", group, ("absent", ["x", "y"])])
    axes = [ax for ax in figures[0].axes if ax.get_visible()]
    assert [ax.get_title() for ax in axes] == ["score", "drift (0-1)"]
    labels = [t.get_text() for t in axes[1].get_legend().get_texts()]
    assert labels == ["drift/repetition", "eval/drift/repetition", "drift/distinct_2"]
