"""The checkpoint schedule, the phase display, orphaned checkpoint folders."""

from __future__ import annotations

import os
import subprocess
import sys

from proxima.checkpoint import remove_orphans
from proxima.config import Config
from proxima.recipes.common import remove_orphans_near
from proxima.trainer.progress import PhaseWatch, SaveSchedule


def test_save_schedule_by_iterations_and_by_minutes():
    now = [0.0]
    cfg = Config().replace({"trainer.iterations": 10, "trainer.save_every": 4})
    by_count = SaveSchedule(cfg.trainer, clock=lambda: now[0])
    assert [i for i in range(1, 11) if by_count.due(i)] == [4, 8, 10]  # and the last one
    timed = SaveSchedule(
        cfg.replace({"trainer.save_every": 0, "trainer.save_every_minutes": 2.0}).trainer,
        clock=lambda: now[0],
    )
    now[0] = 119.0
    assert not timed.due(1)
    now[0] = 120.0  # 2 minutes since the start
    assert timed.due(2)
    timed.saved()
    now[0] = 200.0
    assert not timed.due(3) and timed.due(10)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_orphaned_checkpoint_folders_are_removed(tmp_path):
    dead, alive = _dead_pid(), os.getpid()
    root = tmp_path / "run" / "checkpoints"
    for name in (f".iter_5.tmp-{dead}", f".iter_6.tmp-{alive}", "iter_4"):
        (root / name).mkdir(parents=True)
    assert remove_orphans(root) == [root / f".iter_5.tmp-{dead}"]
    assert sorted(p.name for p in root.iterdir()) == [f".iter_6.tmp-{alive}", "iter_4"]
    # at the start of a run: in the runs at trainer.output_dir and its -N siblings only
    for run in ("run-2", "run-x", "other"):
        (tmp_path / run / "checkpoints" / f".iter_1.tmp-{dead}").mkdir(parents=True)
    remove_orphans_near(tmp_path / "run")
    assert not (tmp_path / "run-2" / "checkpoints" / f".iter_1.tmp-{dead}").exists()
    assert (tmp_path / "run-x" / "checkpoints" / f".iter_1.tmp-{dead}").exists()
    assert (tmp_path / "other" / "checkpoints" / f".iter_1.tmp-{dead}").exists()


class FakeBar:
    def __init__(self) -> None:
        self.postfix: list[str] = []
        self.lines: list[str] = []

    def set_postfix_str(self, text: str, refresh: bool = True) -> None:
        self.postfix.append(text)

    def write(self, line: str) -> None:
        self.lines.append(line)


def test_phase_watch_shows_the_running_phase_and_names_a_slow_one():
    import time

    bar = FakeBar()
    watch = PhaseWatch(bar, lambda: 7, slow_s=0.05)
    watch.start("generate")
    watch.end("generate", 0.01)
    watch.start("reward")
    time.sleep(0.3)  # a slow reward function
    watch.end("reward", 0.3)
    watch.close()
    assert bar.postfix == ["generate...", "generate 0.0s", "reward...", "reward 0.3s"]
    assert bar.lines == [
        "iteration 7: phase `reward` has been running for more than 0.05 s (its time is "
        "logged as time/reward)"
    ]
