"""The measured peak of resident memory in each phase of a PPO run, beside the memory plan's
prediction for it (CPU, Linux): where the plan is off, and by how much.

Runs `proxima train ARGS` in this process. At the start of every phase (generate, reward,
score, advantages, update, sync, and each evaluation) the kernel's high-water mark of the
process's resident memory is reset (`/proc/self/clear_refs`, 5) and at its end read back
(VmHWM), so each phase's peak is its own; what happens between phases (loading the models,
logging, checkpoints) is `outside phases`. Writes phase_peaks.json to the run folder and
prints a table against memory_plan.json's phase totals.

    python -m benchmarks.memory_phases chat trainer.iterations=2 trainer.output_dir=/tmp/mp
    python -m benchmarks.memory_phases --smoke   # the default example shrunk to seconds
"""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from pathlib import Path

from benchmarks.common.runs import SMOKE_TASK, scratch_folder
from benchmarks.common.timing import reset_peak, status_bytes

PEAKS: dict[str, int] = {}
OUTSIDE = "outside phases"
CALLS: list[tuple[str, int, int]] = []  # each phase run: name, resident at its start, peak
MIB = 2**20


def _hwm() -> int:
    return status_bytes("VmHWM")


def _note(name: str) -> None:
    PEAKS[name] = max(PEAKS.get(name, 0), _hwm())


@contextmanager
def measured(name: str):
    _note(OUTSIDE)  # since the last phase ended: loading, logging, checkpoints
    reset_peak()
    start = status_bytes("VmRSS")
    try:
        yield
    finally:
        _note(name)
        CALLS.append((name, start, _hwm()))
        reset_peak()


def main(argv: list[str]) -> int:
    if argv[:1] == ["--smoke"]:
        folder = scratch_folder("proxima-memory-phases-smoke-")
        argv = [*SMOKE_TASK, *argv[1:], f"trainer.output_dir={folder}"]
    import proxima.recipes.ppo as recipe
    from proxima.cli import main as proxima_main
    from proxima.trainer.ppo import PhaseTimer

    timed = PhaseTimer.__call__.__wrapped__  # the generator under @contextmanager

    @contextmanager
    def phase(self, name: str):
        with measured(name):
            yield from timed(self, name)

    PhaseTimer.__call__ = phase
    evaluate = recipe.evaluate_modes

    def evaluation(*args, **kwargs):
        with measured("evaluation"):
            return evaluate(*args, **kwargs)

    recipe.evaluate_modes = evaluation
    status = proxima_main(["train", *argv])
    _note(OUTSIDE)
    run = next(
        (Path(a.split("=", 1)[1]) for a in argv if a.startswith("trainer.output_dir=")), None
    )
    plan = {}
    if run is not None and (run / "memory_plan.json").is_file():
        plan = json.loads((run / "memory_plan.json").read_text())
        (run / "phase_peaks.json").write_text(json.dumps(PEAKS, indent=2))
    totals = plan.get("phase_totals", {})
    print(f"\n{'phase':18s} {'measured MiB':>13s} {'planned MiB':>12s} {'plan/measured':>14s}")
    for name, peak in PEAKS.items():
        key = "update actor" if name == "update" else name
        p = totals.get(key)
        ratio = f"{p / peak:14.2f}" if p else f"{'-':>14s}"
        planned = f"{p / MIB:12.0f}" if p else f"{'-':>12s}"
        print(f"{name:18s} {peak / MIB:13.0f} {planned} {ratio}")
    if plan:
        print(f"plan's peak {plan['peak'] / MIB:.0f} MiB in {plan['peak_phase']}")
    print("\neach phase run: resident at its start -> its peak (MiB)")
    print(", ".join(f"{n} {a / MIB:.0f}->{b / MIB:.0f}" for n, a, b in CALLS))
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
