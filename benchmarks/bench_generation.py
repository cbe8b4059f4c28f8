"""Generation and PPO-iteration speed on a tiny local model (nothing downloaded).

    python -m benchmarks.bench_generation [--arch llama] [--size tiny] [--repeats 5]

Reports medians over `--repeats` runs of:
- rollout generation with the KV cache (proxima's path) against the same HF `generate`
  without the cache (the peer, measured in the same run): tokens per second and the ratio;
- one PPO iteration of the default example's shape, split by phase.

    python -m benchmarks.bench_generation --w3 runs/bench_assets_w3 [--repeats 3]

instead times the `hf` engine's decode loop (and the loop with its prompts prefilled in one
pass instead of groups of similar length) against HF `generate` (the loop's fallback,
`loop_applies` forced off) at bench_vs_trl.py's W3 shapes: its actor (32,000-token
vocabulary, built to stop at EOS), 64 of its prompts (16-128 tokens), responses until EOS
up to 128 tokens, temperature 0.7, the two run alternately, each its own draw (the sampled
tokens are printed; greedy decoding of this actor ends every row at once, so it is not
timed). The assets are built under the folder on first use (benchmarks/common/assets.py).

`--smoke` runs the first two on a batch of 4, 4 new tokens, one repeat (not --w3: its
32,000-token tokenizer takes a minute to build).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from benchmarks.common.workloads import TEMPERATURE, WORKLOADS
from proxima.config import load_config
from proxima.models import init_model, load_causal_lm, load_tokenizer
from proxima.rollout.hf_engine import HFEngine
from proxima.rollout.types import Sampling


def _time_generation(model, ids, mask, tok, new_tokens: int, use_cache: bool) -> float:
    torch.manual_seed(0)
    start = time.perf_counter()
    if use_cache:
        # an id the model can never emit as the stop, and none from the generation config
        # (the hf engine stops at its EOS too): full length
        model.generation_config.eos_token_id = None
        sampling = Sampling(max_new_tokens=new_tokens, stop_ids=(len(tok) + 10,))
        HFEngine(model, tok.pad_token_id, len(ids)).generate(ids, mask, sampling)
    else:
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=True,
            top_k=0,
            use_cache=False,
            pad_token_id=tok.pad_token_id,
        )
    return time.perf_counter() - start


def bench_generation(folder: str, batch: int, prompt_len: int, new_tokens: int, repeats: int):
    tok = load_tokenizer(folder)
    model = load_causal_lm(folder, trainable=False)
    ids = torch.randint(4, len(tok), (batch, prompt_len))
    mask = torch.ones_like(ids)
    rows = {}
    for use_cache in (True, False):
        times = [
            _time_generation(model, ids, mask, tok, new_tokens, use_cache) for _ in range(repeats)
        ]
        rows[use_cache] = statistics.median(times)
    tokens = batch * new_tokens
    print(
        f"generation, batch {batch}, prompt {prompt_len}, {new_tokens} new tokens, "
        f"median of {repeats}:"
    )
    print(f"  KV cache (proxima) : {rows[True]:.3f} s  {tokens / rows[True]:9.0f} tokens/s")
    print(f"  no cache (peer)    : {rows[False]:.3f} s  {tokens / rows[False]:9.0f} tokens/s")
    print(f"  speed-up           : {rows[False] / rows[True]:.2f}x")


def bench_iteration(folder: str, repeats: int) -> None:
    import json

    from proxima.trainer.datasets import load_prompts
    from proxima.trainer.ppo import PPOTrainer
    from proxima.trainer.roles import load_roles

    path = f"{folder}/prompts.jsonl"
    with open(path, "w") as f:
        for a in range(300):
            f.write(json.dumps({"prompt": f"{a % 100}+{a // 3}=", "answer": "0"}) + "\n")
    cfg = load_config(
        None,
        [
            f"model.actor_path={folder}",
            f"data.train_path={path}",
            "reward.function=proxima.tasks.arithmetic:reward",
            "rollout.max_response_length=6",
            "rollout.n=2",
            "actor.ppo_epochs=2",
            "critic.ppo_epochs=2",
            "actor.ppo_micro_batch_size=64",
            "critic.ppo_micro_batch_size=64",
            f"trainer.iterations={repeats + 1}",
        ],
    )
    trainer = PPOTrainer(
        cfg,
        load_roles(cfg, torch.device("cpu")),
        load_prompts(cfg, path, load_tokenizer(folder)),
        torch.device("cpu"),
    )
    trainer.step()  # warm-up
    phases: dict[str, list[float]] = {}
    for _ in range(repeats):
        trainer.step()
        for k, v in trainer.timer.last.items():
            phases.setdefault(k, []).append(v)
    total = sum(statistics.median(v) for v in phases.values())
    print(f"PPO iteration ({cfg.rollout_batch_size} sequences), median of {repeats}: {total:.3f} s")
    for k, v in phases.items():
        med = statistics.median(v)
        print(f"  {k:10s} {med:.3f} s  ({med / total:5.1%})")


def bench_w3(root: str, repeats: int) -> None:
    """The decode loop against HF generate at W3's shapes (see the module's docstring)."""
    from pathlib import Path

    import proxima.rollout.decode as decode
    import proxima.rollout.hf_engine as hf_engine
    from benchmarks.common.assets import cached_assets, load_prompt_ids

    a = cached_assets(Path(root), ["W3"])["workloads"]["W3"]
    w = WORKLOADS["W3"]
    tok = load_tokenizer(a["actor"])
    model = load_causal_lm(a["actor"], trainable=False)
    rows = load_prompt_ids(a["prompt_file"])[: w.prompts]
    width = max(map(len, rows))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = (torch.arange(width) >= width - torch.tensor([[len(r)] for r in rows])).long()
    loop_applies, prefill = hf_engine.loop_applies, decode.PREFILL_TOKENS
    ways = {  # (why the loop does not apply, padded tokens per prefill group)
        "decode loop": (loop_applies, prefill),
        "  one prefill": (loop_applies, 1 << 40),
        "HF generate": (lambda m: "benchmark: HF generate", prefill),
    }
    print(
        f"W3 generation: {len(rows)} prompts of {min(map(len, rows))}-{width} tokens, "
        f"at most {w.response} new, median of {repeats} (alternating):"
    )
    times: dict[str, list[float]] = {k: [] for k in ways}
    tokens: dict[str, list[int]] = {k: [] for k in ways}
    for i in range(repeats):
        for name, (applies, tokens_per_prefill) in ways.items():
            hf_engine.loop_applies = applies
            decode.PREFILL_TOKENS = tokens_per_prefill
            torch.manual_seed(i)
            start = time.perf_counter()
            sampling = Sampling(
                w.response, (tok.eos_token_id,), temperature=TEMPERATURE, logprobs=True
            )
            gen = HFEngine(model, tok.pad_token_id, len(ids)).generate(ids, mask, sampling)
            times[name].append(time.perf_counter() - start)
            tokens[name].append(int(gen.response_mask.sum()))
    hf_engine.loop_applies, decode.PREFILL_TOKENS = loop_applies, prefill
    med = {k: statistics.median(v) for k, v in times.items()}
    for name in ways:
        n = statistics.median(tokens[name])
        print(f"  {name:14s}: {med[name]:6.2f} s  {n:6.0f} tokens  {n / med[name]:6.1f} tokens/s")
    print(f"  speed-up    : {med['HF generate'] / med['decode loop']:.2f}x")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--arch", default="llama")
    p.add_argument("--size", default="tiny")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--prompt-len", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--w3", metavar="ASSETS", help="the decode loop against HF generate at W3")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--smoke", action="store_true", help="the smallest sizes, 1 repeat, 1 thread")
    a = p.parse_args()
    if a.smoke:
        a.batch, a.new_tokens, a.repeats, a.threads, a.w3 = 4, 4, 1, 1, None
    torch.set_num_threads(a.threads)
    if a.w3:
        return bench_w3(a.w3, a.repeats)
    with tempfile.TemporaryDirectory() as tmp:
        folder = str(
            init_model(
                f"{tmp}/m", arch=a.arch, size=a.size, alphabet="0123456789+=", max_positions=128
            )
        )
        bench_generation(folder, a.batch, a.prompt_len, a.new_tokens, a.repeats)
        bench_iteration(folder, a.repeats)


if __name__ == "__main__":
    main()
