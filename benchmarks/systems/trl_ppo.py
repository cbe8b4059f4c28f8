"""TRL's cell: `PPOTrainer.train()` of TRL 1.x, timed from outside (its code untouched)."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from benchmarks.common.assets import load_prompt_ids
from benchmarks.common.timing import sync
from benchmarks.common.workloads import KL_COEF, LR, MINI_BATCHES, SEED, TEMPERATURE, Workload
from benchmarks.systems.lengths import joined, lengths, tokens_before_eos


def _import_trl_ppo():
    """TRL's PPOTrainer/PPOConfig: `trl.experimental.ppo` in 1.x, top level in older releases."""
    try:
        from trl.experimental.ppo import PPOConfig, PPOTrainer
    except ImportError:
        from trl import PPOConfig, PPOTrainer
    return PPOConfig, PPOTrainer


class _TimedGC:
    """Stands in for the `gc` module inside TRL's PPO module: still collects, and times it."""

    def __init__(self, real, sink) -> None:
        self.real, self.sink = real, sink

    def collect(self, *args, **kwargs) -> int:
        start = time.perf_counter()
        n = self.real.collect(*args, **kwargs)
        self.sink(start, time.perf_counter() - start)
        return n

    def __getattr__(self, name):
        return getattr(self.real, name)


class _Stopwatch:
    """The clocks `trl_cell` reads around TRL's calls: one record per iteration (`recs[-1]` is
    the current one) and the callbacks' stamps between iterations."""

    def __init__(self, device: str, eos_id: int) -> None:
        self.device, self.eos_id = device, eos_id
        self.recs: list[dict] = [self._new()]
        self.stamps: list[float] = []

    @staticmethod
    def _new() -> dict:
        return {"gen": 0.0, "score_fwd": 0.0, "gc": [], "tokens": 0, "steps": 0, "lengths": []}

    def _now(self) -> float:
        sync(self.device)
        return time.perf_counter()

    def wrap_generate(self, policy) -> None:
        """Time the policy's `generate` and note its sampled tokens and lengths."""
        import torch

        original = policy.generate

        def generate(*args, **kwargs):
            start = time.perf_counter()
            out = original(*args, **kwargs)
            rec = self.recs[-1]
            end = self._now()
            rec["gen"] += end - start
            rec["gen_end"] = end
            response = out.sequences[:, kwargs["input_ids"].shape[1] :]
            rec["tokens"] += tokens_before_eos(response, self.eos_id)
            is_eos = (response == self.eos_id).long()
            mask = (torch.cumsum(is_eos, dim=1) - is_eos) == 0  # up to and including 1st EOS
            rec["lengths"].append(lengths(kwargs["attention_mask"], mask, kwargs["input_ids"]))
            return out

        policy.generate = generate

    def timed(self, fn):
        """`fn` (TRL's forward helpers): a gradient-enabled call marks the start of training,
        a no-grad one adds to the scoring forwards."""
        import torch

        def wrapper(*args, **kwargs):
            grad, start = torch.is_grad_enabled(), time.perf_counter()
            if grad:
                self.recs[-1].setdefault("train_start", start)
            out = fn(*args, **kwargs)
            if not grad:
                self.recs[-1]["score_fwd"] += self._now() - start
            return out

        return wrapper

    def wrap_step(self, optimizer) -> None:
        """Count the optimizer's steps; the last one of an iteration ends its training."""
        original = optimizer.step

        def step(*args, **kwargs):
            out = original(*args, **kwargs)
            self.recs[-1]["train_end"] = self._now()
            self.recs[-1]["steps"] += 1
            return out

        optimizer.step = step

    def clock(self):
        """A trainer callback that stamps the start of training and the end of every step."""
        from transformers import TrainerCallback

        watch = self

        class Clock(TrainerCallback):
            def on_train_begin(self, *args, **kwargs):
                watch.stamps.append(watch._now())

            def on_step_end(self, *args, **kwargs):
                watch.stamps.append(watch._now())
                watch.recs.append(watch._new())

        return Clock()


def trl_config(spec: dict, w: Workload, iterations: int, workdir: Path):
    """TRL's PPOConfig for the workload: the batch, epochs, sampling, KL and optimizer every
    system shares, no logging or saving inside the timed loop."""
    PPOConfig, _ = _import_trl_ppo()
    return PPOConfig(
        output_dir=str(workdir / "trl_out"),
        per_device_train_batch_size=w.sequences,
        gradient_accumulation_steps=1,
        num_mini_batches=MINI_BATCHES,
        local_rollout_forward_batch_size=w.sequences,
        num_ppo_epochs=spec["epochs"],
        response_length=w.response,
        temperature=TEMPERATURE,
        # W3: a response ends at its first EOS (TRL pads after it; generation stops when
        # every row has one); W1/W2 suppress EOS, so no stop token
        stop_token="eos" if w.stop_at_eos else None,
        total_episodes=w.sequences * iterations,
        kl_coef=KL_COEF,
        learning_rate=LR,
        lr_scheduler_type="constant",
        optim="adamw_torch",  # torch.optim.AdamW, as proxima and the floor use
        num_sample_generations=0,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        use_cpu=not spec["device"].startswith("cuda"),
        bf16=spec["bf16"],
        fp16=False,
        seed=SEED,
    )


def trl_records(stamps: list[float], recs: list[dict]) -> list[dict]:
    """One record per iteration from the callbacks' clock stamps and what the wrapped calls
    noted in between (see `trl_cell`)."""
    records = []
    for i, (t0, t1) in enumerate(zip(stamps, stamps[1:], strict=False)):
        r = recs[i]
        gc_total = sum(d for _, d in r["gc"])
        gc_in_score = sum(d for s, d in r["gc"] if r["gen_end"] <= s < r["train_start"])
        phases = {
            "gen": r["gen"],
            "score": r["train_start"] - r["gen_end"] - gc_in_score,
            "train": r["train_end"] - r["train_start"],
            "gc": gc_total,
            "score_forwards": r["score_fwd"],
        }
        records.append(
            {
                "seconds": t1 - t0,
                "phases": phases,
                "tokens": r["tokens"],
                "lengths": joined(r["lengths"]),
                "steps": {"policy+value": r["steps"]},  # one optimizer over both models
            }
        )
    return records


def trl_cell(spec: dict, w: Workload, a: dict, iterations: int, workdir: Path) -> list[dict]:
    """TRL's train() for `iterations` iterations, timed from outside (no TRL code changed).

    One iteration = the gap between two consecutive `on_step_end` callbacks (the first one
    starts at `on_train_begin`); inside it: `gen` = the policy's `generate` (wrapped instance
    attribute), `train` = from the first gradient-enabled `forward` of the PPO epochs to the end
    of the last `optimizer.step()`, `gc` = TRL's two `gc.collect()` calls (one in the rollout,
    one after the previous `on_step_end`), `score` = from the end of `generate` to the start of
    training, less the gc inside it (log-probs from the generation scores, reference forward,
    value forward, reward forward, rewards and GAE; the forwards alone are `score_forwards`).
    The rest (data loading, metrics with their `.item()` calls, logging, scheduler) is `other`.
    """
    import torch
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
    )
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    _, PPOTrainer = _import_trl_ppo()
    bf16 = spec["bf16"]
    # TRL 1.12's PPOTrainer builds its own `Accelerator(gradient_accumulation_steps=...)`, and
    # transformers 5 does not export `bf16=True` to accelerate's environment, so the flag alone
    # trains in fp32 (checked: `accelerator.mixed_precision` is "no"). The environment variable
    # is what `accelerate launch --mixed_precision bf16` sets; the cell reports the mode used.
    os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16" if bf16 else "no"
    args = trl_config(spec, w, iterations, workdir)
    tok = AutoTokenizer.from_pretrained(a["actor"])
    tok.padding_side = "left"  # prompts of different lengths: TRL generates after left padding
    policy = AutoModelForCausalLM.from_pretrained(a["actor"], dtype=torch.float32)
    reward = AutoModelForSequenceClassification.from_pretrained(a["reward"], dtype=torch.float32)
    value = AutoModelForSequenceClassification.from_pretrained(a["reward"], dtype=torch.float32)
    # each prompt w.samples times (TRL samples once per row; it shuffles the rows)
    ids = [row for row in load_prompt_ids(spec["prompt_file"]) for _ in range(w.samples)]

    watch = _Stopwatch(spec["device"], tok.eos_token_id)
    watch.wrap_generate(policy)  # an instance attribute: TRL's code is untouched

    trainer = PPOTrainer(
        args=args,
        processing_class=tok,
        model=policy,
        ref_model=None,  # TRL deep-copies the policy: a separate reference model
        reward_model=reward,
        train_dataset=Dataset.from_dict({"input_ids": ids}),
        value_model=value,
        callbacks=[watch.clock()],
    )
    for cb in (PrinterCallback, ProgressCallback):  # no console output inside the timed loop
        trainer.remove_callback(cb)
    watch.wrap_step(trainer.optimizer)
    module = sys.modules[PPOTrainer.__module__]
    saved = {k: getattr(module, k) for k in ("gc", "forward", "get_reward")}
    module.gc = _TimedGC(saved["gc"], lambda s, d: watch.recs[-1]["gc"].append((s, d)))
    module.forward = watch.timed(saved["forward"])
    module.get_reward = watch.timed(saved["get_reward"])
    try:
        trainer.train()
    finally:
        for k, v in saved.items():
            setattr(module, k, v)
    records = trl_records(watch.stamps, watch.recs)
    # bf16: accelerate wraps the trained model's forward in autocast (keeps `_original_forward`)
    mode = str(trainer.accelerator.mixed_precision)
    if hasattr(trainer.model, "_original_forward"):
        mode += ", forward autocast"
    for r in records:
        r["mixed_precision"] = mode
    return records
