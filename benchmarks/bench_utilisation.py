"""How close a PPO iteration comes to what this machine can do: its fp32 matmul peak at a
model's shapes, its memory bandwidth, and each phase of bench_vs_trl.py's cells against them.

    .venv/bin/python -m benchmarks.bench_utilisation --threads 1 2 --out runs/limits.json
    .venv/bin/python -m benchmarks.bench_utilisation --limits runs/limits.json \\
        --cells runs/bench_vs_trl.jsonl          # the table for measured cells

The limits (measured once, in this process, for each --threads):
- matmul: `torch.mm` in fp32 at the W-real model's shapes (SmolLM2-135M: hidden 576, 3 KV
  heads of 64, intermediate 1536, a 49,152-token LM head) with as many rows as a training
  micro-batch has tokens (16 sequences x 108 tokens), and a 2048^3 square for reference;
  GFLOP/s = 2 m k n / seconds, the median of --repeats timed products after a warm-up. The
  peak is the best of the model's shapes (what its phases could reach at best).
- bandwidth: `torch.sum` over a 1 GiB fp32 tensor (bytes read / second) and `copy_` between
  two 512 MiB tensors (bytes read + written / second). The decode bound uses the read rate.

The table (needs both): for each cell of --cells, its model FLOPs per phase (the model math
the phase needs, `model_flops` in benchmarks/common/flops.py: score = reference + reward
model + critic forwards; train = actor and critic forward + backward per epoch) over the
phase's seconds, as a share of the matmul peak at the cell's thread count; and generation
against its bounds: every decode step must read each weight once and the unfinished
sequences' keys and values (the bandwidth bound, at the measured read bandwidth) and compute
one token of each unfinished sequence (the roofline takes, step by step, whichever of the
two is slower), the prompts' forward (prefill) at the matmul peak added to both. With 64
rows a decode step of a 135M model computes more than it reads: the roofline is the bound
that holds.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

from benchmarks.common.timing import median_seconds
from benchmarks.common.workloads import WORKLOADS

ROWS = 16 * 108  # a training micro-batch of W-real: 16 sequences of about 108 tokens
_W = WORKLOADS["W-real"]
_H, _KV, _I, _V = _W.hidden, _W.kv_heads * _W.head_dim, _W.intermediate, _W.vocab
# (m, k, n) of W-real's linear layers at ROWS rows: q / o, k / v, gate / up, down, LM head
SHAPES = {
    f"q, o ({_H} x {_H})": (ROWS, _H, _H),
    f"k, v ({_H} x {_KV})": (ROWS, _H, _KV),
    f"gate, up ({_H} x {_I})": (ROWS, _H, _I),
    f"down ({_I} x {_H})": (ROWS, _I, _H),
    f"LM head ({_H} x {_V})": (ROWS, _H, _V),
    "square 2048^3": (2048, 2048, 2048),
    # a decode step of 64 rows (16 prompts x 4 samples)
    "decode gate, up (64 rows)": (64, _H, _I),
    "decode down (64 rows)": (64, _I, _H),
    "decode LM head (64 rows)": (64, _H, _V),
}
MODEL_SHAPES = [k for k in SHAPES if not k.startswith(("square", "decode"))]
DECODE_SHAPES = [k for k in SHAPES if k.startswith("decode")]


def measure(threads: int, repeats: int, scale: int = 1) -> dict:
    """The limits at `threads` threads; `scale` > 1 divides every size by it (a smoke run)."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    matmul = {}
    for name, shape in SHAPES.items():
        m, k, n = (max(1, x // scale) for x in shape)
        a, b = torch.randn(m, k), torch.randn(k, n)
        out = torch.empty(m, n)
        sec = median_seconds(lambda a=a, b=b, out=out: torch.mm(a, b, out=out), repeats)
        matmul[name] = round(2 * m * k * n / sec / 1e9, 2)
    big = torch.ones(2**28 // scale)  # 1 GiB of fp32
    read = 4 * big.numel() / median_seconds(lambda: big.sum(), repeats) / 1e9
    src, dst = torch.ones(2**27 // scale), torch.empty(2**27 // scale)
    copy = 2 * 4 * src.numel() / median_seconds(lambda: dst.copy_(src), repeats) / 1e9
    return {
        "threads": threads,
        "matmul_gflops": matmul,
        "peak_gflops": max(matmul[k] for k in MODEL_SHAPES),
        "decode_gflops": max(matmul[k] for k in DECODE_SHAPES),
        "read_gb_s": round(read, 2),
        "copy_gb_s": round(copy, 2),
    }


def generation_bounds(math: dict, lim: dict) -> tuple[float, float, float]:
    """Seconds a generation call needs at least: reading what each decode step must read at
    the measured bandwidth; the roofline (each step's reading or computing, whichever takes
    longer, at the bandwidth and the matmul peak); the same with the decode steps' matrix
    products at the rate BLAS gives at their shapes (64 rows). The prompts' forward at the
    peak added to each."""
    bw, peak = lim["read_gb_s"] * 1e9, lim["peak_gflops"] * 1e9
    gemm = lim.get("decode_gflops", lim["peak_gflops"]) * 1e9
    prefill = math["prefill"] / peak
    reading = sum(b for b, _ in math["decode"]) / bw
    roofline = sum(max(b / bw, f / peak) for b, f in math["decode"])
    at_shapes = sum(max(b / bw, f / gemm) for b, f in math["decode"])
    return prefill + reading, prefill + roofline, prefill + at_shapes


def table(limits: dict, cells: list[dict]) -> str:
    by_threads = {x["threads"]: x for x in limits["measured"]}
    lines = [
        "| workload | system | precision | threads | score s | score GFLOP/s | score / peak "
        "| train s | train GFLOP/s | train / peak | generate s | tokens/s | bandwidth bound s "
        "| roofline s | roofline / generate | at decode GEMM rate s |",
        "|" + "---|" * 16,
    ]
    for c in cells:
        if "error" in c or "model_math" not in c:
            continue
        lim = by_threads.get(c["threads"])
        if lim is None:
            raise SystemExit(
                f"no limits measured at {c['threads']} threads: --threads {c['threads']}"
            )
        peak, ph, gf = lim["peak_gflops"], c["phases"], c["gflops_per_s"]
        reading, roofline, at_shapes = generation_bounds(c["model_math"], lim)
        lines.append(
            f"| {c['workload']} | {c['system']} | {c['precision']} | {c['threads']} "
            f"| {ph['score']:.2f} | {gf['score']:.1f} | {100 * gf['score'] / peak:.0f}% "
            f"| {ph['train']:.2f} | {gf['train']:.1f} | {100 * gf['train'] / peak:.0f}% "
            f"| {ph['gen']:.2f} | {c['tokens_per_iter'] / ph['gen']:.0f} | {reading:.2f} "
            f"| {roofline:.2f} | {100 * roofline / ph['gen']:.0f}% | {at_shapes:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", help="write the measured limits to this JSON file")
    p.add_argument("--limits", help="read the limits from this file instead of measuring")
    p.add_argument("--cells", help="bench_vs_trl.py's JSON lines: print the utilisation table")
    p.add_argument("--smoke", action="store_true", help="1 thread, 1 repeat, sizes / 16")
    args = p.parse_args()
    scale = 16 if args.smoke else 1
    if args.smoke:
        args.threads, args.repeats = [1], 1
    if args.limits:
        limits = json.loads(Path(args.limits).read_text())
    else:
        import torch

        limits = {
            "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}",
            "measured": [measure(t, args.repeats, scale) for t in args.threads],
        }
        for x in limits["measured"]:
            print(json.dumps(x), flush=True)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(limits, indent=1))
    print(
        "\n| threads | " + " | ".join(SHAPES) + " | peak (model shapes) | decode GEMM "
        "| read GB/s | copy GB/s |"
    )
    print("|" + "---|" * (len(SHAPES) + 5))
    for x in limits["measured"]:
        row = " | ".join(f"{x['matmul_gflops'][k]:.1f}" for k in SHAPES)
        peak, read, copy = x["peak_gflops"], x["read_gb_s"], x["copy_gb_s"]
        decode = x.get("decode_gflops", float("nan"))
        print(f"| {x['threads']} | {row} | {peak:.1f} | {decode:.1f} | {read} | {copy} |")
    if args.cells:
        rows = [json.loads(line) for line in Path(args.cells).read_text().splitlines() if line]
        print("\n" + table(limits, rows))


if __name__ == "__main__":
    sys.exit(main())
