"""Rollout engines on the same batch: tokens per second of `hf` and `vllm`, and how far each
engine's log-probs are from the trainer's scoring pass (the trust metric
rollout/logprob_diff_*). Needs vLLM (`make bench-vllm` runs it in .venv-vllm).

    python -m benchmarks.bench_rollout_engines [--size small] [--batch 64] [--new-tokens 64]
                                               [--threads 1] [--repeats 3]
    python -m benchmarks.bench_rollout_engines --smoke   # tiny sizes; hf alone without vLLM

A tiny Llama built locally (vLLM's CPU kernels need a head size >= 32: `small` has 32),
float32 on both sides, prompts of random tokens, sampling at temperature 1 with a stop id
the model can never emit, so every response has the full length. Medians over --repeats
timed calls after one warm-up call per engine (vLLM's first call builds its kernels).
Print-out: median seconds and tokens/s per engine, the vLLM/hf ratio, vLLM's start and
weight-push times.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import tempfile
import time
from dataclasses import replace

import torch

from proxima.config import Config
from proxima.models import build_char_tokenizer, build_tiny_model
from proxima.models.saving import export_weights
from proxima.rollout.experience import sequence_logprobs
from proxima.rollout.hf_engine import HFEngine
from proxima.rollout.types import Sampling

ALPHABET = "0123456789+="


def _time(engine, ids, mask, sampling, repeats: int):
    engine.generate(ids, mask, sampling)  # warm-up
    times, gen = [], None
    for i in range(repeats):
        torch.manual_seed(i)
        start = time.perf_counter()
        gen = engine.generate(ids, mask, sampling)
        times.append(time.perf_counter() - start)
    return statistics.median(times), gen


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="small")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument(
        "--threads", type=int, default=1, help="CPU threads of each engine (torch; vLLM's binding)"
    )
    p.add_argument("--smoke", action="store_true", help="tiny sizes, 1 repeat")
    args = p.parse_args()
    if args.smoke:
        args.size, args.batch, args.prompt_len, args.new_tokens, args.repeats = "tiny", 4, 4, 4, 1
    # the same cores for both: torch's threads for hf, vLLM's OpenMP binding for vllm (on a
    # busy machine two spinning OpenMP threads per engine made single calls 10x slower)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}")
    tok = build_char_tokenizer(ALPHABET)
    model = build_tiny_model("llama", tok, args.size, max_positions=256, seed=0).eval()
    ids = torch.randint(4, len(tok), (args.batch, args.prompt_len))
    mask = torch.ones_like(ids)
    # no stop: every response has the full length (hf: an id outside the vocabulary, and no
    # EOS in the generation config, which the hf engine also stops at; vLLM rejects such
    # ids, and stops on nothing when given no stop id)
    model.generation_config.eos_token_id = None
    sampling = Sampling(args.new_tokens, (len(tok) + 10,), temperature=1.0, logprobs=True)
    tokens = args.batch * args.new_tokens
    rows = {}
    hf = HFEngine(model, tok.pad_token_id, args.batch)
    rows["hf"] = _time(hf, ids, mask, sampling, args.repeats)
    sampling = replace(sampling, stop_ids=())
    if importlib.util.find_spec("vllm") is None:
        if not args.smoke:
            raise SystemExit("vLLM is not installed here: run it in .venv-vllm (make bench-vllm)")
        print("smoke: vLLM is not installed here, so only the hf engine runs")
    else:
        rows["vllm"] = _vllm_rows(model, tok, ids, mask, sampling, args)
    report(model, rows, tokens, args)


def _vllm_rows(model, tok, ids, mask, sampling, args):
    """vLLM's engine started on the model's weights, then timed like hf's: (median s,
    last generation), its start and weight-push seconds printed."""
    with tempfile.TemporaryDirectory() as folder:
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        from proxima.rollout.vllm_engine import VLLMEngine

        cfg = Config().replace(
            {
                "model.actor_path": folder,
                "model.dtype": "float32",
                "data.max_prompt_length": args.prompt_len,
                "rollout.max_response_length": args.new_tokens,
                "rollout.name": "vllm",
            }
        )
        start = time.perf_counter()
        vllm = VLLMEngine(cfg, tok, torch.device("cpu"))
        built = time.perf_counter() - start
        start = time.perf_counter()
        vllm.update_weights(export_weights(model), version=0)
        pushed = time.perf_counter() - start
        print(f"vllm engine start {built:.1f} s, weight push {pushed * 1000:.0f} ms")
        return _time(vllm, ids, mask, sampling, args.repeats)


def report(model, rows: dict, tokens: int, args) -> None:
    """Per engine: median seconds, tokens/s and how far its log-probs are from the trainer's."""
    for name, (_, gen) in rows.items():
        assert int(gen.response_mask.sum()) == tokens, f"{name} stopped early"
    n_params = sum(t.numel() for t in model.parameters()) / 1e6
    print(
        f"llama {args.size} ({n_params:.2f} M params, float32), batch {args.batch}, prompt "
        f"{args.prompt_len}, {args.new_tokens} new tokens, {args.threads} thread(s), median of "
        f"{args.repeats}:"
    )
    for name, (seconds, gen) in rows.items():
        want = sequence_logprobs(model, gen, 1.0, args.batch)
        diff = (gen.logprobs - want).abs()[gen.response_mask.bool()]
        print(
            f"  {name:5s}: {seconds:.3f} s  {tokens / seconds:9.0f} tokens/s   "
            f"|engine - trainer log-prob| mean {diff.mean():.2e}, max {diff.max():.2e}"
        )
    if "vllm" in rows:
        print(f"  vllm / hf speed: {rows['hf'][0] / rows['vllm'][0]:.2f}x")


if __name__ == "__main__":
    main()
