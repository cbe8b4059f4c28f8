"""Seconds per PPO iteration: proxima's `PPOTrainer.step()` against TRL's PPOTrainer.

    .venv-trl/bin/python benchmarks/bench_vs_trl.py --repeats 5

Needs a virtualenv with both proxima and TRL (a TRL release that still ships PPO, i.e. < 1.13;
see benchmarks/README.md). Nothing is downloaded: the policy, its character tokenizer and the
reward model are built locally, once, and both frameworks load the same folders.

Shape of one iteration, identical on both sides: 64 two-digit addition prompts ("37+48=",
6 tokens each) x 1 sample, at most 8 response tokens at temperature 1.0 (a response ends at EOS,
as in proxima), 1 PPO epoch, one mini-batch of 64 = one micro-batch of 64 (one optimizer step
per trained model), fp32, CPU, 2 torch threads, no evaluation, no saving, no logging sink.
Critic: initialised from the reward model on both sides (TRL's documented setup passes the
reward model folder as `value_model`).

Timing: proxima times `trainer.step()`; TRL has only `train()`, so a callback records the wall
clock at every `on_step_end` and one iteration is the gap between two consecutive calls. Each
framework runs `--rounds` blocks in ABBA order (proxima, TRL, TRL, proxima, ...), each block a
fresh trainer doing 1 warm-up iteration (dropped) + `--repeats` timed ones. Reported: the median
over all timed iterations of a framework.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

PROMPTS = 64  # prompts per iteration (x 1 sample)
RESPONSE = 8  # most new tokens per response
N_PROMPTS = 300  # size of the prompt file both frameworks sample from


# ---------------------------------------------------------------------------- shared models


def build_assets(root: Path) -> tuple[Path, Path, Path]:
    """Policy folder, reward-model folder and prompt file (JSONL), built with proxima."""
    from proxima.models import build_tiny_reward_model, init_model, load_tokenizer

    policy = init_model(
        root / "policy", arch="llama", size="tiny", alphabet="0123456789+=", max_positions=64
    )
    tok = load_tokenizer(policy)
    rm = build_tiny_reward_model("llama", tok, size="tiny", seed=1, max_positions=64)
    rm_dir = root / "reward"
    rm.save_pretrained(rm_dir)
    tok.save_pretrained(rm_dir)
    rng = random.Random(0)
    prompts = root / "prompts.jsonl"
    with prompts.open("w") as f:
        for _ in range(N_PROMPTS):
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            f.write(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    return policy, rm_dir, prompts


def response_tokens(response_ids: torch.Tensor, eos_id: int) -> int:
    """Tokens of [B, R] responses up to and including the first EOS (proxima's rule)."""
    from proxima.rollout.generate import response_mask_after_stop

    mask, _ = response_mask_after_stop(response_ids, [eos_id])
    return int(mask.sum())


# ---------------------------------------------------------------------------- proxima


def bench_proxima(policy: Path, rm: Path, prompts: Path, iterations: int) -> dict:
    """Per-iteration seconds, response tokens and phase seconds of proxima's PPO step."""
    from proxima.config import load_config
    from proxima.trainer.ppo import PPOTrainer
    from proxima.trainer.setup import load_prompts, load_roles

    cpu = torch.device("cpu")
    cfg = load_config(
        None,
        [
            f"model.actor_path={policy}",
            f"reward.model_path={rm}",
            "model.critic_init=reward_model",
            "model.dtype=float32",
            "model.device=cpu",
            f"data.train_path={prompts}",
            f"data.train_batch_size={PROMPTS}",
            "rollout.n=1",
            f"rollout.max_response_length={RESPONSE}",
            "rollout.temperature=1.0",
            f"rollout.micro_batch_size={PROMPTS}",
            f"reward.batch_size={PROMPTS}",
            "algorithm.adv_estimator=gae",
            "algorithm.kl_ctrl.kl_coef=0.05",
            "actor.ppo_epochs=1",
            "critic.ppo_epochs=1",
            f"actor.ppo_mini_batch_size={PROMPTS}",
            f"critic.ppo_mini_batch_size={PROMPTS}",
            f"actor.ppo_micro_batch_size={PROMPTS}",
            f"critic.ppo_micro_batch_size={PROMPTS}",
            # TRL's PPO loop does not clip gradients; neither does proxima here
            "actor.optim.grad_clip=0",
            "critic.optim.grad_clip=0",
            "actor.optim.lr=3e-6",
            "critic.optim.lr=3e-6",
            f"trainer.iterations={iterations}",
            "trainer.tensorboard=false",
        ],
    )
    roles = load_roles(cfg, cpu)
    trainer = PPOTrainer(cfg, roles, load_prompts(cfg, str(prompts), roles.tokenizer), cpu)
    eos = roles.tokenizer.eos_token_id
    seconds, tokens, widths, phases = [], [], [], {}
    for _ in range(iterations):
        start = time.perf_counter()
        _, ro = trainer.step()
        seconds.append(time.perf_counter() - start)
        tokens.append(response_tokens(ro.gen.response_ids, eos))
        widths.append(ro.gen.response_mask.shape[1])
        for k, v in trainer.timer.last.items():
            phases.setdefault(k, []).append(v)
    return {"seconds": seconds, "tokens": tokens, "widths": widths, "phases": phases}


# ---------------------------------------------------------------------------- TRL


def _import_trl_ppo():
    """TRL's PPOTrainer/PPOConfig: top level in older releases, `trl.experimental.ppo` later."""
    try:
        from trl.experimental.ppo import PPOConfig, PPOTrainer
    except ImportError:
        from trl import PPOConfig, PPOTrainer
    return PPOConfig, PPOTrainer


def _trl_dataset(prompts: Path, tokenizer):
    """The prompt file as TRL expects it: one `input_ids` column, tokenized as proxima does."""
    from datasets import Dataset

    from proxima.data.prompts import tokenize_text

    rows = [json.loads(line) for line in prompts.read_text().splitlines()]
    return Dataset.from_dict({"input_ids": [tokenize_text(r["prompt"], tokenizer) for r in rows]})


def _record_generate(policy, eos_id: int, tokens: list[int], widths: list[int]) -> None:
    """Wrap `policy.generate` (an instance attribute, no TRL code touched) to count tokens."""
    original = policy.generate

    def generate(*args, **kwargs):
        out = original(*args, **kwargs)
        response = out.sequences[:, kwargs["input_ids"].shape[1] :]
        tokens.append(response_tokens(response, eos_id))
        widths.append(response.shape[1])
        return out

    policy.generate = generate


class _NoGC:
    """Stands in for the `gc` module inside TRL's PPO module (diagnostic run only)."""

    @staticmethod
    def collect(*args, **kwargs) -> int:
        return 0


def bench_trl(
    policy: Path, rm: Path, prompts: Path, iterations: int, workdir: Path, skip_gc: bool = False
) -> dict:
    """Per-iteration seconds and response tokens of TRL's PPOTrainer.train().

    skip_gc: replace the two full `gc.collect()` calls TRL's loop makes per iteration by a
    no-op (a diagnostic that isolates the rest of the loop; TRL as shipped keeps them).
    """
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        TrainerCallback,
    )
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    PPOConfig, PPOTrainer = _import_trl_ppo()
    tok = AutoTokenizer.from_pretrained(policy)
    args = PPOConfig(
        output_dir=str(workdir / "trl_out"),
        per_device_train_batch_size=PROMPTS,
        gradient_accumulation_steps=1,
        num_mini_batches=1,
        local_rollout_forward_batch_size=PROMPTS,
        num_ppo_epochs=1,
        response_length=RESPONSE,
        stop_token="eos",
        temperature=1.0,
        total_episodes=PROMPTS * iterations,
        kl_coef=0.05,
        learning_rate=3e-6,
        lr_scheduler_type="constant",
        optim="adamw_torch",  # proxima's optimizer: torch.optim.AdamW, not the fused kernel
        num_sample_generations=0,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=42,
    )
    model = AutoModelForCausalLM.from_pretrained(policy, dtype=torch.float32)
    reward = AutoModelForSequenceClassification.from_pretrained(rm, dtype=torch.float32)
    value = AutoModelForSequenceClassification.from_pretrained(rm, dtype=torch.float32)
    tokens: list[int] = []
    widths: list[int] = []
    _record_generate(model, tok.eos_token_id, tokens, widths)
    stamps: list[float] = []

    class Clock(TrainerCallback):
        def on_train_begin(self, *a, **k):
            stamps.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            stamps.append(time.perf_counter())

    trainer = PPOTrainer(
        args=args,
        processing_class=tok,
        model=model,
        ref_model=None,  # TRL copies the policy
        reward_model=reward,
        train_dataset=_trl_dataset(prompts, tok),
        value_model=value,
        callbacks=[Clock()],
    )
    for cb in (PrinterCallback, ProgressCallback):  # no console output inside the timed loop
        trainer.remove_callback(cb)
    module = sys.modules[PPOTrainer.__module__]
    saved_gc = module.gc
    module.gc = _NoGC if skip_gc else saved_gc
    try:
        trainer.train()
    finally:
        module.gc = saved_gc
    seconds = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return {"seconds": seconds, "tokens": tokens, "widths": widths}


# ---------------------------------------------------------------------------- report


def merge(blocks: list[dict]) -> dict:
    """Concatenate the blocks of one framework, dropping each block's warm-up iteration."""
    out: dict = {"seconds": [], "tokens": [], "widths": [], "phases": {}}
    for b in blocks:
        for key in ("seconds", "tokens", "widths"):
            out[key] += b[key][1:]
        for k, v in b.get("phases", {}).items():
            out["phases"].setdefault(k, []).extend(v[1:])
    return out


def summarise(name: str, run: dict) -> dict:
    """Median seconds and mean response tokens over the timed iterations."""
    sec, tok, wid = run["seconds"], run["tokens"], run["widths"]
    s = statistics.median(sec)
    slots = PROMPTS * statistics.median(wid)
    return {
        "name": name,
        "s": s,
        "spread": (min(sec), max(sec)),
        "tokens": statistics.mean(tok),
        "slots": slots,
        "tok_s": statistics.mean(tok) / s,
        "slot_s": slots / s,
    }


def print_table(rows: list[dict], timed: int, rounds: int) -> None:
    print(
        f"\nPPO iteration, {PROMPTS} prompts x 1 sample, <= {RESPONSE} new tokens, 1 epoch, "
        f"mini = micro = {PROMPTS}; median of {timed} timed iterations per framework "
        f"({rounds} blocks, each after 1 warm-up iteration)"
    )
    head = f"| {'framework':20s} | s / iter | min - max     | resp. tokens | tokens/s | slots/s |"
    print(head)
    print("|" + "|".join("-" * (len(c)) for c in head.split("|")[1:-1]) + "|")
    for r in rows:
        print(
            f"| {r['name']:20s} | {r['s']:8.3f} | {r['spread'][0]:.3f} - {r['spread'][1]:.3f} "
            f"| {r['tokens']:12.1f} | {r['tok_s']:8.0f} | {r['slot_s']:7.0f} |"
        )
    for r in rows[1:]:
        print(f"ratio {r['name']} / proxima (s per iteration): {r['s'] / rows[0]['s']:.2f}x")


def print_phases(phases: dict[str, list[float]]) -> None:
    parts = ", ".join(f"{k} {statistics.median(v):.3f}" for k, v in phases.items())
    print(f"proxima phases (median s): {parts}")


def print_gc_cost() -> None:
    """What one full collection costs in this process: TRL's loop makes two per iteration."""
    import gc

    times = []
    for _ in range(3):
        start = time.perf_counter()
        gc.collect()
        times.append(time.perf_counter() - start)
    print(
        f"one full gc.collect() here: {statistics.median(times):.3f} s "
        f"({len(gc.get_objects()):,} tracked objects)"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5, help="timed iterations per framework")
    p.add_argument("--rounds", type=int, default=2, help="blocks per framework, ABBA order")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = p.parse_args()
    if args.repeats < 1 or args.rounds < 1:
        raise ValueError(
            f"--repeats and --rounds must be >= 1, got {args.repeats} and {args.rounds}; "
            "pass e.g. --repeats 5 --rounds 2"
        )
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import transformers
    import trl

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()

    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}"
        f", {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores"
    )
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        policy, rm, prompts = build_assets(root)
        n = args.repeats + 1
        names = ["proxima", "trl", "trl-no-gc"]
        runs: dict[str, list[dict]] = {k: [] for k in names}
        # ABBA order (A B C, C B A, ...) cancels a linear drift of the machine's load
        for r in range(args.rounds):
            for name in names if r % 2 == 0 else names[::-1]:
                if name == "proxima":
                    runs[name].append(bench_proxima(policy, rm, prompts, n))
                else:
                    skip = name == "trl-no-gc"
                    workdir = root / f"{name}{r}"
                    runs[name].append(bench_trl(policy, rm, prompts, n, workdir, skip))
    merged = {k: merge(v) for k, v in runs.items()}
    prox = merged["proxima"]
    rows = [
        summarise("proxima", prox),
        summarise(f"TRL {trl.__version__} PPO", merged["trl"]),
        summarise("TRL, no gc (diag.)", merged["trl-no-gc"]),
    ]
    print_table(rows, len(prox["seconds"]), args.rounds)
    print_phases(prox["phases"])
    print_gc_cost()
    print(
        f"response width (generated positions): proxima {sorted(set(prox['widths']))}, "
        f"TRL {sorted(set(merged['trl']['widths'] + merged['trl-no-gc']['widths']))}"
    )


if __name__ == "__main__":
    main()
