"""Token-budget micro-batches against fixed ones, and packed rows (`model.packing`) within the
same budgets: one actor update (PPO loss, backward) of a mini-batch whose prompts and
responses vary in length, as sampled responses that stop at EOS do.

    .venv/bin/python -m benchmarks.bench_token_budget [--rows 64] [--repeats 5] [--threads 2]
        [--budgets 2048 1024 512]
    .venv/bin/python -m benchmarks.bench_token_budget --smoke   # 16 rows of a 2-layer model

The actor is W2's Llama (hidden 512, 8 layers, 8 heads, MLP 2048) with a 32,000-token
vocabulary; prompts of 16-128 tokens, responses of 1-128 (a quarter hit the limit). Fixed:
micro-batches of 8 rows padded to the batch's longest prompt and response. Token budget:
`actor.ppo_max_tokens_per_micro` = the fixed micro-batch's padded size (8 x 256 tokens), so a
micro-batch never holds more padded tokens than a fixed one (`--budgets`: those budgets
instead). Sorted (the default, `*.max_tokens_per_micro=-1`): micro-batches of 8 rows sorted
by length, each trimmed. Packed: the same with several sequences laid end to end in a row
(positions restarting, attention kept within each sequence). The gradients are the same
(tests/trainer/test_token_micro_batches.py, tests/models/test_packing.py); the median seconds
of `--repeats` updates of each, interleaved, are printed with the padded tokens each computes.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import LlamaForCausalLM

from benchmarks.common.workloads import WORKLOADS, llama_config
from proxima.config import ActorConfig, OptimConfig
from proxima.models.packing import pack
from proxima.trainer.optim import TrainedRole
from proxima.trainer.update import PolicyObjective, run_epochs, token_micro_batches
from proxima.types import SORTED, Experience

VOCAB, MAX_P, MAX_R = 32000, 128, 128


def ragged(rows: int, seed: int = 0) -> Experience:
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(16, MAX_P + 1, (rows,), generator=g)
    # responses: geometric-like lengths (mean ~40), a quarter truncated at the limit
    response = (torch.empty(rows).exponential_(1 / 40.0, generator=g).long() + 1).clamp(max=MAX_R)
    response[torch.randperm(rows, generator=g)[: rows // 4]] = MAX_R
    ids = torch.randint(3, VOCAB, (rows, MAX_P + MAX_R), generator=g)
    attn = torch.zeros_like(ids)
    for i in range(rows):
        attn[i, MAX_P - int(prompt[i]) : MAX_P + int(response[i])] = 1
    ids = ids * attn
    mask = attn[:, MAX_P:].clone()
    noise = lambda: torch.randn(mask.shape, generator=g) * mask  # noqa: E731
    return Experience(
        input_ids=ids,
        attention_mask=attn,
        response_mask=mask,
        old_logprobs=noise() - 10.0 * mask,
        advantages=noise(),
        group_ids=torch.arange(rows),
    )


def update_seconds(model, exp: Experience, budget: int, packed: bool = False) -> float:
    sec = ActorConfig(
        optim=OptimConfig(lr=0.0),
        ppo_mini_batch_size=exp.batch_size,
        ppo_micro_batch_size=8,
        ppo_max_tokens_per_micro=budget,
        shuffle=False,
    )
    role = TrainedRole("actor", model, sec, total_steps=1)
    start = time.perf_counter()
    objective = PolicyObjective(sec, 1.0, packed=packed)
    run_epochs(role, exp, objective, generator=torch.Generator().manual_seed(0))
    return time.perf_counter() - start


def _packed_size(mb: Experience) -> int:
    """Positions a micro-batch's packed rows compute (`models.packing.pack`)."""
    return pack(mb.input_ids, mb.attention_mask).input_ids.numel()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--budgets", type=int, nargs="+", default=[8 * (MAX_P + MAX_R)])
    p.add_argument("--smoke", action="store_true", help="16 rows, 1 repeat, w3smoke's model")
    a = p.parse_args()
    if a.smoke:
        a.rows, a.repeats, a.threads = 16, 1, 1
    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    w = WORKLOADS["w3smoke" if a.smoke else "W3"]  # W2's layers, a 32,000-token vocabulary
    model = LlamaForCausalLM(llama_config(w, MAX_P + MAX_R, tie_word_embeddings=False))
    exp = ragged(a.rows)
    fixed_tokens = exp.batch_size * exp.input_ids.shape[1]
    real = int(exp.attention_mask.sum())
    update_seconds(model, exp, 0)  # warm-up
    update_seconds(model, exp, a.budgets[0], packed=True)
    budgets = [SORTED, *a.budgets]
    cells = [(0, False)] + [(b, packed) for b in budgets for packed in (False, True)]
    times: dict[tuple[int, bool], list[float]] = {c: [] for c in cells}
    for _ in range(a.repeats):
        for budget, packed in times:
            times[budget, packed].append(update_seconds(model, exp, budget, packed))
    fixed = statistics.median(times[0, False])
    print(f"{a.rows} rows, {real} real tokens")
    print(f"| micro-batches | padded tokens | median s (of {a.repeats}) | speed-up |")
    print("|---|---|---|---|")
    print(f"| fixed, 8 rows | {fixed_tokens} | {fixed:.2f} | 1.00x |")
    for budget, packed in cells[1:]:
        micros = token_micro_batches(exp, budget, packed=packed, rows=8)
        padded = sum(_packed_size(m) if packed else m.input_ids.numel() for m in micros)
        med = statistics.median(times[budget, packed])
        how = "packed rows" if packed else "padded rows"
        limit = "8 rows sorted by length" if budget == SORTED else f"budget {budget}"
        name = f"{how}, {limit} ({len(micros)} micro-batches)"
        print(f"| {name} | {padded} | {med:.2f} | {fixed / med:.2f}x |")
    print(f"all runs: {times}")


if __name__ == "__main__":
    main()
