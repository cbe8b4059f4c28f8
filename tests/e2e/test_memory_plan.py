"""The memory plan at start-up: printed with the batch plan and written to the run folder;
a run that will not fit stops before any model loads, naming the figures and the keys."""

from __future__ import annotations

import json

import pytest

import proxima.trainer.memory as memory
import proxima.trainer.roles as roles
from proxima.cli import main

pytestmark = pytest.mark.slow


def _no_loading(*args, **kwargs):
    raise AssertionError("a model was loaded")


def test_a_run_that_cannot_fit_stops_before_loading(
    tmp_path, make_model, fast_overrides, monkeypatch, capsys
):
    monkeypatch.setattr(memory, "cpu_available", lambda: 2**20)  # 1 MiB free
    monkeypatch.setattr(roles, "load_causal_lm", _no_loading)
    out = tmp_path / "run"
    assert main(["train", *fast_overrides(make_model(), out, 1)]) == 2
    err = capsys.readouterr().err
    assert "the memory plan predicts a peak of" in err and "1 MiB are free" in err
    assert "actor.ppo_micro_batch_size" in err and "trainer.memory_check=warn" in err
    assert not out.exists()  # nothing written


def test_the_plan_is_printed_and_written(tmp_path, make_model, fast_overrides, monkeypatch, capsys):
    monkeypatch.setattr(memory, "cpu_available", lambda: 2**20)
    out = tmp_path / "run"
    overrides = fast_overrides(make_model(), out, 1, "trainer.memory_check=warn")
    assert main(["train", *overrides]) == 0
    printed = capsys.readouterr().out
    assert "warning: the memory plan predicts" in printed
    assert "warning: the end of the run writes" not in printed  # the disk has room
    assert "memory plan (cpu" in printed and "update actor" in printed
    plan = json.loads((out / "memory_plan.json").read_text())
    assert plan["peak"] > plan["baseline"] > 0 and plan["available"] == 2**20
    assert set(plan["phases"]) == {"generate", "score", "update actor", "update critic"}
    assert plan["roles"]["actor"]["optimizer"] == 2 * plan["roles"]["actor"]["weights"]


def test_a_disk_too_small_for_the_end_of_the_run_is_said_before_loading(
    tmp_path, make_model, fast_overrides, monkeypatch, capsys
):
    monkeypatch.setattr(memory.shutil, "disk_usage", lambda path: type("u", (), {"free": 1}))
    monkeypatch.setattr(roles, "load_causal_lm", _no_loading)
    with pytest.raises(AssertionError, match="a model was loaded"):
        main(["train", *fast_overrides(make_model(), tmp_path / "run", 1)])
    printed = capsys.readouterr().out
    assert "warning: the end of the run writes about" in printed
    assert "0 MiB is free on its disk" in printed and "trainer.output_dir" in printed
