"""A LoRA actor's weight push into vLLM: the merged copy (whole weights, `update_weights`)
against base + adapter (`update_adapter`: the adapter alone once the base is loaded). Needs
vLLM (run it in .venv-vllm).

    OMP_NUM_THREADS=1 taskset -c 1 python -m benchmarks.bench_lora_push \\
        [--hidden 512] [--layers 12] [--rank 8] [--pushes 7]
    python -m benchmarks.bench_lora_push --smoke   # hidden 64, 2 layers, 2 pushes

A Llama built locally (~41 M parameters at the defaults, head size 64, float32, all linear
layers of the backbone adapted at --rank), its adapters moved before every push as an update
would. Each way runs in a process of its own (one vLLM engine per process, and the memory
figures are that process's). Push time: the median over --pushes pushes after the first
(the first of the adapter way also loads the base; it is printed on its own), each followed
by one short greedy generation, not timed, that checks the push served. Memory a push adds:
the process's peak resident size during the push (VmHWM, reset before each push through
/proc/self/clear_refs) minus its resident size just before (VmRSS, after glibc's malloc_trim
handed back what the previous push freed), the largest over the pushes.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from benchmarks.common.timing import repo_env, reset_peak, status_bytes

ALPHABET = "0123456789+="


def _trim() -> None:
    """Hand freed heap memory back to the system, so the resident size before a push does
    not count memory the previous push freed (which the next one would reuse unseen)."""
    import ctypes

    ctypes.CDLL("libc.so.6").malloc_trim(0)


def _one_way(args) -> dict:
    from proxima.config import Config
    from proxima.models import build_char_tokenizer, build_tiny_model
    from proxima.models.lora import add_lora
    from proxima.models.saving import export_weights
    from proxima.rollout.engines import sync_weights
    from proxima.rollout.types import Sampling
    from proxima.rollout.vllm_engine import VLLMEngine

    torch.set_num_threads(1)
    tok = build_char_tokenizer(ALPHABET)
    model = build_tiny_model(
        "llama",
        tok,
        "small",
        max_positions=64,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
        intermediate_size=3 * args.hidden,
    ).eval()
    folder = tempfile.mkdtemp(prefix="bench-lora-push-")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    settings = {
        "model.actor_path": folder,
        "model.dtype": "float32",
        "model.lora_rank": args.rank,
        "model.lora_alpha": 2.0 * args.rank,
        "data.max_prompt_length": 16,
        "rollout.max_response_length": 8,
        "rollout.name": "vllm",
    }
    cfg = Config().replace(settings)
    actor = add_lora(model, cfg.model, "CAUSAL_LM").eval()
    adapters = [p for n, p in actor.named_parameters() if "lora_B" in n]
    # the merged way: an engine without LoRA support, fed the merged copy as full weights
    engine_cfg = cfg if args.way == "adapter" else cfg.replace({"model.lora_rank": 0})
    engine = VLLMEngine(engine_cfg, tok, torch.device("cpu"))
    ids = torch.tensor([tok("12+34=", add_special_tokens=False)["input_ids"]])
    greedy = Sampling(4, (tok.eos_token_id,), greedy=True)
    times, added = [], []
    for version in range(args.pushes + 1):
        with torch.no_grad():
            for p in adapters:
                p.normal_(0.0, 0.02)
        gc.collect()
        _trim()
        rss = status_bytes("VmRSS") // 1024
        reset_peak()
        start = time.perf_counter()
        if args.way == "adapter":
            sync_weights(engine, actor, version)
            assert engine.adapter is not None
        else:
            engine.update_weights(export_weights(actor), version)
        seconds = time.perf_counter() - start
        peak = status_bytes("VmHWM") // 1024
        times.append(seconds)
        added.append((peak - rss) / 1024)
        engine.generate(ids, torch.ones_like(ids), greedy)  # the push is served
    engine.close()
    params = sum(p.numel() for p in model.parameters())
    adapter = sum(p.numel() for n, p in actor.named_parameters() if "lora_" in n)
    return {
        "way": args.way,
        "params_m": (params - adapter) / 1e6,
        "adapter_m": adapter / 1e6,
        "first_s": times[0],
        "median_s": statistics.median(times[1:]),
        "pushes": args.pushes,
        "added_mib_max": max(added[1:]),
        "added_mib_first": added[0],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512, help="a multiple of 64 (head size 64)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--pushes", type=int, default=7, help="timed pushes after the first (>= 5)")
    p.add_argument("--way", choices=["merged", "adapter"], help=argparse.SUPPRESS)
    p.add_argument("--smoke", action="store_true", help="hidden 64, 2 layers, 2 pushes")
    args = p.parse_args()
    if args.smoke:
        if importlib.util.find_spec("vllm") is None:
            print("smoke: skipped, vLLM is not installed here (run it in .venv-vllm)")
            return
        args.hidden, args.layers, args.pushes = 64, 2, 2
    if args.way:
        print(json.dumps(_one_way(args)))
        return
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", str(min(os.sched_getaffinity(0))))
    rows = []
    for way in ("merged", "adapter"):
        argv = [sys.executable, "-m", "benchmarks.bench_lora_push", "--way", way]
        argv += ["--hidden", str(args.hidden), "--layers", str(args.layers)]
        argv += ["--rank", str(args.rank), "--pushes", str(args.pushes)]
        out = subprocess.run(argv, capture_output=True, text=True, check=False, env=repo_env())
        if out.returncode:
            sys.exit(f"the {way} run failed:\n{out.stderr[-3000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    first = rows[0]
    print(
        f"llama {first['params_m']:.1f} M params (hidden {args.hidden}, {args.layers} layers, "
        f"float32), LoRA rank {args.rank} on every linear layer ({first['adapter_m']:.2f} M "
        f"adapter params); median of {args.pushes} pushes after the first:"
    )
    for r in rows:
        print(
            f"  {r['way']:7s}: push {r['median_s'] * 1000:7.1f} ms (first {r['first_s'] * 1000:.1f}"
            f" ms), memory a push adds {r['added_mib_max']:6.1f} MiB (first "
            f"{r['added_mib_first']:.1f} MiB)"
        )
    merged, adapter = rows
    print(
        f"  adapter / merged: {merged['median_s'] / adapter['median_s']:.1f}x faster, "
        f"{merged['added_mib_max'] - adapter['added_mib_max']:.0f} MiB less added per push"
    )


if __name__ == "__main__":
    main()
