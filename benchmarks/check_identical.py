"""Behaviour check for refactors: the metrics of seven short runs, recorded before a change
and compared after it, bit for bit (same machine, same threads).

The runs: the default example (`proxima train`, its task preparation and SFT warm start
included), the same with the shared-backbone critic (`critic.shared_backbone=true
model.critic_init=actor`), the default example under `torchrun --nproc_per_node 2` (DDP,
1 thread per process, micro-batches of 64), the default example sampling one batch ahead
(`rollout.max_staleness=1`), the DAPO recipe (`proxima train dapo`: dynamic sampling), the
same with two reward sources (`reward.sources`, one standardised) and the multi-turn
calculator (`proxima train tools`), the last four shortened to 20 iterations
(`--iterations` sets the others). `--set KEY=VALUE ...` adds overrides to every run, e.g. a
shorter warm start on a busy machine (`--set task.sft_steps=100`: the same for before and
after). Every metric but the wall-clock ones (`time/*`, `tokens_per_s`,
`reward/<source>/seconds`) is kept, with the evaluations and the warm start's validation
history from summary.json.

    python -m benchmarks.check_identical record runs/identical/before.json
    # ... change the code ...
    python -m benchmarks.check_identical record runs/identical/after.json
    python -m benchmarks.check_identical compare runs/identical/before.json \
        runs/identical/after.json
    python -m benchmarks.check_identical --smoke   # one shrunk run recorded and compared

`compare` prints every value that differs (run, iteration, key, before, after) and exits 1
when any does; `--allow KEY` names a metric whose change is expected (it is printed, not
counted). It also prints each run's seconds per phase (summary.json's phase_seconds and
wall_seconds), before and after: `record --repeats N` runs each N times, checks that the N
runs give the same metrics, and keeps the median seconds (a timing is only worth comparing
from a quiet machine). A run takes about a minute on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common.runs import SMOKE_TASK
from benchmarks.common.timing import repo_env

WALL_CLOCK = ("time/", "tokens_per_s")
WALL_CLOCK_END = "/seconds"  # a reward source's time in its calls (reward/<name>/seconds)

SHORT = "trainer.iterations=20"  # after --iterations' own override, so it wins
SOURCES = (
    "reward.sources=[{name: exact, function: 'proxima.tasks.arithmetic:reward'}, "
    "{name: sevens, function: 'tests.e2e.rewards_fixture:fn', weight: 0.5, normalize: true}]"
)
# name: (built-in config, None for the default example; overrides; processes)
RUNS = {
    "default": (None, [], 1),
    "shared": (None, ["critic.shared_backbone=true", "model.critic_init=actor"], 1),
    # 64 sequences per process: a micro-batch of 128 would not divide them
    "ddp": (
        None,
        ["trainer.threads=1", "actor.ppo_micro_batch_size=64", "critic.ppo_micro_batch_size=64"],
        2,
    ),
    "async": (None, ["rollout.max_staleness=1", SHORT], 1),
    "dapo": ("dapo", [SHORT], 1),
    # dynamic sampling beside several reward sources, one standardised: per-source metrics
    "dapo_sources": ("dapo", [SHORT, SOURCES], 1),
    "tools": ("tools", [SHORT], 1),
}


def _command(nproc: int, config: str | None, overrides: list[str]) -> list[str]:
    args = ["-m", "proxima", "train", *([config] if config else []), *overrides]
    if nproc == 1:
        return [sys.executable, *args]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    return [*torchrun, f"--nproc_per_node={nproc}", *args]


def _observed(run_dir: Path) -> dict:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    metrics = [
        {k: v for k, v in r.items() if not (k.startswith(WALL_CLOCK) or k.endswith(WALL_CLOCK_END))}
        for r in rows
    ]
    summary = json.loads((run_dir / "summary.json").read_text())
    task = summary.get("task", {})
    seconds = {**summary.get("phase_seconds", {}), "wall": summary.get("wall_seconds")}
    return {
        "seconds": seconds,
        "metrics": metrics,
        "eval_before": summary.get("eval_before"),
        "eval_after": summary.get("eval_after"),
        "sft_val_accuracy": task.get("sft_val_accuracy"),
        "sft_final_loss": task.get("sft_final_loss"),
    }


def _run(name: str, iterations: int, tmp: str, index: int, common: list[str]) -> dict:
    config, extra, nproc = RUNS[name]
    run_dir = Path(tmp) / f"{name}-{index}"
    overrides = [
        f"trainer.iterations={iterations}",
        f"trainer.output_dir={run_dir}",
        "trainer.tensorboard=false",
        *extra,
        *common,
    ]
    proc = subprocess.run(
        _command(nproc, config, overrides), cwd=tmp, env=repo_env(), capture_output=True, text=True
    )
    if proc.returncode != 0:
        sys.exit(f"run {name} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return _observed(run_dir)


def record(
    out: Path, iterations: int, only: list[str], repeats: int = 1, common: list[str] = ()
) -> None:
    """Run `only` (each `repeats` times, which must agree; `common`: overrides added to each)
    and write their observations to `out`, with the median seconds (other runs already there
    stay)."""
    result = json.loads(out.read_text()) if out.is_file() else {}
    with tempfile.TemporaryDirectory(prefix="proxima-identical-") as tmp:
        for name in only:
            runs = [_run(name, iterations, tmp, i, list(common)) for i in range(repeats)]
            first = {k: v for k, v in runs[0].items() if k != "seconds"}
            for other in runs[1:]:
                if {k: v for k, v in other.items() if k != "seconds"} != first:
                    sys.exit(f"run {name}: {repeats} runs of the same config differ")
            phases = runs[0]["seconds"].keys()
            first["seconds"] = {p: statistics.median(r["seconds"][p] for r in runs) for p in phases}
            result[name] = first
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=1, sort_keys=True))
            wall = first["seconds"]["wall"]
            print(f"{name}: {len(first['metrics'])} rows, median {wall:.1f} s -> {out}")


def _timings(before: dict, after: dict) -> None:
    for name in sorted(before.keys() & after.keys()):
        b, a = before[name].get("seconds", {}), after[name].get("seconds", {})
        phases = [p for p in b if p in a]
        if not phases:
            continue
        cells = ", ".join(f"{p} {b[p]:.1f} -> {a[p]:.1f}" for p in phases)
        print(f"  seconds, {name}: {cells}")


def _diffs(before, after, where: str):
    if isinstance(before, dict) and isinstance(after, dict):
        for key in sorted(before.keys() | after.keys()):
            yield from _diffs(
                before.get(key, "<absent>"), after.get(key, "<absent>"), f"{where}.{key}"
            )
    elif isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        for i, (b, a) in enumerate(zip(before, after, strict=True)):
            yield from _diffs(b, a, f"{where}[{i}]")
    elif before != after:
        yield where, before, after


def compare(before_path: Path, after_path: Path, allow: list[str]) -> int:
    before = json.loads(before_path.read_text())
    after = json.loads(after_path.read_text())
    counted = expected = 0
    for name in sorted(before.keys() | after.keys()):
        b_run, a_run = dict(before.get(name, {})), dict(after.get(name, {}))
        b_run.pop("seconds", None), a_run.pop("seconds", None)
        for where, b, a in _diffs(b_run, a_run, name):
            key = where.rsplit(".", 1)[-1]
            if key in allow:
                expected += 1
                print(f"  allowed  {where}: {b!r} -> {a!r}")
                continue
            counted += 1
            print(f"  DIFFERS  {where}: {b!r} -> {a!r}")
    _timings(before, after)
    values = sum(len(r) for run in before.values() for r in run["metrics"])
    verdict = "bit-identical" if counted == 0 else f"{counted} values differ"
    print(f"{verdict} ({values} metric values compared; {expected} allowed changes)")
    return 1 if counted else 0


def smoke() -> int:
    """The default example shrunk to seconds, recorded and compared with itself."""
    with tempfile.TemporaryDirectory(prefix="proxima-identical-smoke-") as tmp:
        out = Path(tmp) / "smoke.json"
        record(out, 1, ["default"], common=SMOKE_TASK)
        return compare(out, out, [])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="one shrunk run, recorded and compared")
    sub = p.add_subparsers(dest="cmd")
    rec = sub.add_parser("record", help="run the runs and write their metrics")
    rec.add_argument("out", type=Path)
    rec.add_argument("--iterations", type=int, default=50)
    rec.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    rec.add_argument("--repeats", type=int, default=1, help="runs of each (median seconds)")
    rec.add_argument("--set", nargs="*", default=[], help="KEY=VALUE overrides of every run")
    cmp_ = sub.add_parser("compare", help="compare two recordings")
    cmp_.add_argument("before", type=Path)
    cmp_.add_argument("after", type=Path)
    cmp_.add_argument("--allow", nargs="*", default=[], help="metric keys expected to change")
    args = p.parse_args()
    if args.smoke:
        return smoke()
    if args.cmd is None:
        p.error("record or compare (or --smoke)")
    if args.cmd == "record":
        record(args.out, args.iterations, args.runs, args.repeats, args.set)
        return 0
    return compare(args.before, args.after, args.allow)


if __name__ == "__main__":
    sys.exit(main())
