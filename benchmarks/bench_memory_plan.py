"""The memory plan's predicted peak against the measured one (CPU: the process's VmHWM).

Each case is one `python -m proxima train` in a fresh process, run on one core; the
predicted peak is read from the run folder's memory_plan.json, the measured one is the
process's high-water mark of resident memory (VmHWM from /proc/self/status) at exit.

Cases: the default example (3 iterations), and three workloads with a reward model and a
critic started from it (GAE), 64 prompts x 1 sample, 4 mini-batches of 16: W1 (Llama hidden
256, 4 layers, 4 heads, intermediate 1024, vocabulary 1,024, prompts of 16 tokens, responses
of 48), W2 (hidden 512, 8 layers, 8 heads, intermediate 2048, otherwise as W1) and W3 (W2's
size with a 32,000-token vocabulary, prompts of 16 to 128 tokens, responses of 128), one
iteration each (their peak is in an update, which holds every optimizer state from the second
mini-batch on). W2 and W3 run once more with `model.gradient_checkpointing=true` (W3 then two
iterations: its peak moves to scoring, which holds the optimizer state from the second
iteration on); W3 also runs with token budgets of 4,096 tokens for every pass (two
iterations).

    taskset -c 0 python -m benchmarks.bench_memory_plan            # every case
    taskset -c 0 python -m benchmarks.bench_memory_plan --cases W1 W3
    python -m benchmarks.bench_memory_plan --smoke     # the smoke workload's case only

The assets (models, tokenizers, prompts) are built locally under --root on first use (the
W3 tokenizer, a 32,000-token BPE, takes a minute) and reused.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from benchmarks.common.assets import cached_assets
from benchmarks.common.runs import scratch_folder
from benchmarks.common.timing import thread_env
from benchmarks.common.workloads import TEMPERATURE, WORKLOADS

REPO = Path(__file__).resolve().parents[1]
# W3 at its longest: bench_vs_trl's W3 (32,000-token vocabulary, prompts of 16-128 tokens)
# with EOS suppressed, so every response has 128 tokens (the plan's worst case)
W3 = replace(WORKLOADS["W3"], stop_at_eos=False)


def build(root: Path, names: list[str]) -> dict:
    """The models and prompt files of workloads `names` under root (built once)."""
    return cached_assets(root, names, table={**WORKLOADS, "W3": W3})


def workload_overrides(name: str, info: dict) -> list[str]:
    """bench_vs_trl's proxima cell (fp32, one epoch) of workload `name` as CLI overrides."""
    wl = W3 if name == "W3" else WORKLOADS[name]
    a = info["workloads"][name]
    mb = wl.mini_batch
    prompt = wl.prompt_lengths[1]
    args = [
        f"model.actor_path={a['actor']}",
        f"reward.model_path={a['reward']}",
        "model.critic_init=reward_model",
        "model.device=cpu",
        f"data.train_path={a['prompt_file']}",
        f"data.train_batch_size={wl.prompts}",
        f"data.max_prompt_length={prompt}",
        "rollout.n=1",
        f"rollout.max_response_length={wl.response}",
        f"rollout.temperature={TEMPERATURE}",
        f"rollout.micro_batch_size={wl.prompts}",
        f"reward.batch_size={wl.prompts}",
        "algorithm.adv_estimator=gae",
        "trainer.iterations=1",
        "trainer.threads=1",
        "trainer.loggers=[jsonl]",
        "trainer.tensorboard=false",
        "trainer.save_every_minutes=0",
        "eval.every=0",
    ]
    for role in ("actor", "critic"):
        args += [f"{role}.ppo_mini_batch_size={mb}", f"{role}.ppo_micro_batch_size={mb}"]
    return args


CHILD = """
import sys
from pathlib import Path
from proxima.cli import main
code = main(sys.argv[1:])
hwm = [l for l in Path('/proc/self/status').read_text().splitlines() if l.startswith('VmHWM')]
print('@@vmhwm', int(hwm[0].split()[1]) * 1024, flush=True)
sys.exit(code)
"""


def run_case(args: list[str], out: Path) -> dict:
    """One `proxima train` in a fresh process writing into `out` (emptied first): its
    memory plan and its measured peak."""
    shutil.rmtree(out, ignore_errors=True)
    env = thread_env(1)
    args = [*args, f"trainer.output_dir={out}"]
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, "train", *args], env=env, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(proc.stdout[-3000:] + proc.stderr[-3000:])
    hwm = int(next(x for x in proc.stdout.splitlines() if x.startswith("@@vmhwm")).split()[1])
    plan = json.loads(next(out.rglob("memory_plan.json")).read_text())
    return {"predicted": plan["peak"], "measured": hwm, "plan": plan}


TOKENS = [
    f"{key}.{k}_tokens_per_micro=4096"
    for key, k in (
        ("actor", "ppo_max"),
        ("critic", "ppo_max"),
        ("rollout", "max"),
        ("reward", "max"),
    )
]
CASES = {  # name -> (workload or None for the default example, extra overrides)
    "default": (None, ["trainer.iterations=3", "trainer.threads=1"]),
    "smoke": ("smoke", []),  # the smallest workload: the path, not a figure
    "W1": ("W1", []),
    "W2": ("W2", []),
    "W2+ckpt": ("W2", ["model.gradient_checkpointing=true"]),
    "W3": ("W3", []),
    # its peak is in scoring, which holds the optimizer state from the second iteration on
    "W3+ckpt": ("W3", ["model.gradient_checkpointing=true", "trainer.iterations=2"]),
    # token-budget micro-batches of 4,096 tokens for the update, scoring and the reward model
    "W3+tokens": ("W3", [*TOKENS, "trainer.iterations=2"]),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--cases", nargs="+", default=[c for c in CASES if c != "smoke"], choices=list(CASES)
    )
    parser.add_argument("--root", default="/tmp/proxima-bench-memory", type=Path)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--smoke", action="store_true", help="the smoke case only (seconds)")
    args = parser.parse_args()
    if args.smoke:  # a folder of its own: a shared --root would rebuild what it lists
        args.cases, args.root = ["smoke"], scratch_folder("proxima-bench-memory-smoke-")
    names = sorted({CASES[c][0] for c in args.cases if CASES[c][0]})
    info = build(args.root, names) if names else {}
    print("| case | predicted peak | phase | measured peak (VmHWM) | predicted / measured |")
    print("|---|---|---|---|---|")
    results = {}
    for case in args.cases:
        workload, extra = CASES[case]
        out = args.root / "runs" / case
        base = workload_overrides(workload, info) if workload else []
        res = run_case(base + extra, out)
        results[case] = res
        gib = 2**30
        print(
            f"| {case} | {res['predicted'] / gib:.2f} GiB | {res['plan']['peak_phase']} | "
            f"{res['measured'] / gib:.2f} GiB | {res['predicted'] / res['measured']:.2f} |",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
