"""The CPU levers, measured on their own before they are built into a trainer:

1. bfloat16 against float32: the matmuls of one W2 layer, and a forward + backward of a
   W1-sized Llama under autocast (as `model.mixed_precision=bf16` computes);
2. torch.compile (dynamic shapes, as a trainer with varying lengths needs) against eager: a
   W2 Llama's forward + backward on a micro-batch of 16 x 64 tokens and its no-grad forward
   on 64 x 64 (the scoring pass), and what compiling costs;
3. where an eager forward + backward spends its time (torch.profiler, top ops).

    .venv/bin/python -m benchmarks.bench_cpu_levers [--threads 2] [--repeats 5] [--skip-compile]
    .venv/bin/python -m benchmarks.bench_cpu_levers --smoke   # 1 repeat, no compile: seconds

bfloat16 pays where the CPU has native bf16 dot products (AVX512-BF16, AMX) or on a GPU;
without them PyTorch converts and the matmuls get slower, not faster. Run this before picking
a precision for a CPU machine. Nothing is downloaded; the models are built from a config.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from benchmarks.common.timing import median_seconds
from benchmarks.common.workloads import WORKLOADS, llama_config


def cpu_flags() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            line = next(x for x in f if x.startswith("flags"))
    except (OSError, StopIteration):
        return []
    wanted = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    return [f for f in wanted if f in line.split()]


def matmuls(repeats: int) -> list[dict]:
    """[1024 tokens x 512] against a [2048 x 512] weight (W2's MLP up-projection at a
    micro-batch of 16 x 64 tokens): forward, gradient of the input, gradient of the weight."""
    x, w = torch.randn(1024, 512), torch.randn(2048, 512)
    g = torch.randn(1024, 2048)
    shapes = {
        "forward x @ w.T": lambda a, b, c: a @ b.t(),
        "grad input g @ w": lambda a, b, c: c @ b,
        "grad weight g.T @ x": lambda a, b, c: c.t() @ a,
    }
    xb, wb, gb = x.bfloat16(), w.bfloat16(), g.bfloat16()
    rows = []
    for name, fn in shapes.items():
        fp32 = median_seconds(lambda fn=fn: fn(x, w, g), repeats)
        bf16 = median_seconds(lambda fn=fn: fn(xb, wb, gb), repeats)
        rows.append({"what": name, "fp32_s": fp32, "bf16_s": bf16})
    return rows


def llama(workload: str) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(llama_config(WORKLOADS[workload], max_positions=128))


def batch(rows: int) -> dict:
    """rows x 64 tokens (16 prompt + 48 response) as proxima's forward passes them."""
    ids = torch.randint(3, 1024, (rows, 64))
    mask = torch.ones_like(ids)
    return {
        "input_ids": ids,
        "attention_mask": mask,
        "position_ids": mask.cumsum(-1) - 1,
        "use_cache": False,
        "logits_to_keep": 49,
    }


def train_step(model, inputs: dict, bf16: bool = False) -> None:
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
        logits = model(**inputs).logits
        loss = torch.log_softmax(logits.float(), -1).mean()
    loss.backward()
    model.zero_grad(set_to_none=True)


def model_step(repeats: int) -> dict:
    """Forward + backward of a W1 Llama (hidden 256, 4 layers) on 16 x 64 tokens."""
    model, inputs = llama("W1"), batch(16)
    fp32 = median_seconds(lambda: train_step(model, inputs), repeats)
    bf16 = median_seconds(lambda: train_step(model, inputs, bf16=True), max(1, repeats // 2))
    return {"what": "W1 Llama forward+backward, 16 x 64 tokens", "fp32_s": fp32, "bf16_s": bf16}


def compiled(repeats: int) -> list[dict]:
    """Eager against torch.compile(dynamic=True) on a W2 Llama, alternating, float32."""
    model = llama("W2")
    fast = torch.compile(model, dynamic=True)
    small, big = batch(16), batch(64)

    @torch.no_grad()
    def forward(m) -> None:
        m(**big)

    start = time.perf_counter()
    train_step(fast, small)
    forward(fast)
    compile_s = time.perf_counter() - start
    rows = []
    for what, fn, inputs in (
        ("W2 forward+backward, 16 x 64", train_step, small),
        ("W2 no-grad forward, 64 x 64", lambda m, _: forward(m), big),
    ):
        eager, comp = [], []
        for _ in range(2):  # alternate, so drift hits both
            eager.append(median_seconds(lambda fn=fn, i=inputs: fn(model, i), repeats))
            comp.append(median_seconds(lambda fn=fn, i=inputs: fn(fast, i), repeats))
        rows.append({"what": what, "eager_s": min(eager), "compiled_s": min(comp)})
    return [{"what": "compile (first forward+backward and forward)", "seconds": compile_s}, *rows]


def profile(top: int = 6) -> list[dict]:
    """Share of self CPU time by op in one eager W2 forward + backward, 16 x 64 tokens."""
    from torch.profiler import profile as torch_profile

    model, inputs = llama("W2"), batch(16)
    train_step(model, inputs)
    with torch_profile() as prof:
        train_step(model, inputs)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    ranked = sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:top]
    return [{"op": e.key, "share": e.self_cpu_time_total / total} for e in ranked]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--skip-compile", action="store_true", help="skip the torch.compile part")
    p.add_argument("--smoke", action="store_true", help="1 thread, 1 repeat, no torch.compile")
    args = p.parse_args()
    if args.smoke:
        args.threads, args.repeats, args.skip_compile = 1, 1, True
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.backends.cpu.get_cpu_capability()}, "
          f"flags: {' '.join(cpu_flags()) or '-'}, {args.threads} threads")  # fmt: skip
    rows = [*matmuls(args.repeats), model_step(args.repeats)]
    print("\n| what | float32 s | bfloat16 s | bf16 / fp32 |\n|---|---|---|---|")
    for r in rows:
        ratio = r["bf16_s"] / r["fp32_s"]
        print(f"| {r['what']} | {r['fp32_s']:.4f} | {r['bf16_s']:.4f} | {ratio:.1f}x |")
    out = {"bf16": rows}
    if not args.skip_compile:
        comp = compiled(args.repeats)
        print(f"\ntorch.compile(dynamic=True): compiling took {comp[0]['seconds']:.0f} s")
        print("| what | eager s | compiled s | eager / compiled |\n|---|---|---|---|")
        for r in comp[1:]:
            ratio = r["eager_s"] / r["compiled_s"]
            print(f"| {r['what']} | {r['eager_s']:.3f} | {r['compiled_s']:.3f} | {ratio:.2f}x |")
        out["compile"] = comp
    ops = profile()
    print("\neager W2 forward+backward, share of CPU time: " + ", ".join(
        f"{o['op']} {o['share']:.1%}" for o in ops))  # fmt: skip
    out["profile"] = ops
    print(json.dumps(out))


if __name__ == "__main__":
    main()
