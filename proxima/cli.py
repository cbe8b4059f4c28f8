"""`proxima train | config | sft | rm | eval | init-model`."""

from __future__ import annotations

import argparse
import json
import os
import sys
from importlib import resources
from pathlib import Path

import yaml

DEFAULT_EXAMPLE = "arithmetic.yaml"


def default_config_path() -> Path:
    return Path(str(resources.files("proxima") / "configs" / DEFAULT_EXAMPLE))


def _split_config_args(args: list[str]) -> tuple[str | None, list[str]]:
    """`[CONFIG.yaml] [key=value ...]`.

    Without a YAML file the built-in default example is the base, unless the overrides name
    your own model (`model.actor_path=...`) or a checkpoint to resume (then its saved config
    is the base, see `_resume_base`): then the plain defaults are.
    """
    if args and "=" not in args[0]:
        return args[0], args[1:]
    if any(a.startswith(("model.actor_path=", "trainer.resume_from=")) for a in args):
        return None, args
    return str(default_config_path()), args


def _resume_base(path: str | None, overrides: list[str]) -> dict | None:
    """`proxima train trainer.resume_from=X [key=value ...]` continues X's own config."""
    if path is not None:
        return None
    resume = [a.split("=", 1)[1] for a in overrides if a.startswith("trainer.resume_from=")]
    if not resume:
        return None
    from proxima.checkpoint import find_checkpoint, read_meta

    return read_meta(find_checkpoint(resume[-1]))["config"]


def cmd_train(ns: argparse.Namespace) -> int:
    from proxima.config import load_config
    from proxima.trainer.run import train

    path, overrides = _split_config_args(ns.args)
    base = _resume_base(path, overrides)
    label = path or ("the checkpoint's saved config" if base else "defaults")
    print(f"config: {label}" + (f" with {' '.join(overrides)}" if overrides else ""))
    summary = train(load_config(path, overrides, base=base))
    before, after = summary.get("eval_before"), summary.get("eval_after")
    if before and after:
        key = "accuracy" if "accuracy" in before else "mean_reward"
        print(f"held-out {key} (greedy): before {before[key]:.4f} -> after {after[key]:.4f}")
    print(
        f"wall time {summary['wall_seconds']:.1f} s; phases: "
        + ", ".join(f"{k} {v:.1f} s" for k, v in summary["phase_seconds"].items())
    )
    return 0


def cmd_config(ns: argparse.Namespace) -> int:
    from proxima.config import batch_plan, load_config

    path, overrides = _split_config_args(ns.args)
    cfg = load_config(path, overrides)
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    print(batch_plan(cfg))
    return 0


def cmd_init_model(ns: argparse.Namespace) -> int:
    from proxima.models import init_model

    if not ns.alphabet and not ns.text_file:
        raise ValueError(
            "init-model needs --alphabet STR (character tokenizer) or "
            "--text-file FILE (BPE tokenizer trained on it)."
        )
    out = init_model(
        ns.out,
        arch=ns.arch,
        size=ns.size,
        alphabet=ns.alphabet,
        text_file=ns.text_file,
        vocab_size=ns.vocab_size,
        max_positions=ns.max_positions,
        seed=ns.seed,
    )
    print(f"saved a {ns.size} {ns.arch} model and its tokenizer to {out}")
    return 0


def _fresh_out(path: str) -> Path:
    """An --out folder that holds no model yet: nothing already written is overwritten."""
    out = Path(path)
    if (out / "config.json").exists():
        raise FileExistsError(f"{out} already holds a model (config.json); choose another --out.")
    return out


def cmd_sft(ns: argparse.Namespace) -> int:
    from proxima.config import Config
    from proxima.models import load_causal_lm, load_tokenizer
    from proxima.trainer.run import seed_everything
    from proxima.trainer.setup import load_sft, resolve_device
    from proxima.trainer.sft import sft_train

    out = _fresh_out(ns.out)
    seed_everything(ns.seed)
    device = resolve_device(ns.device)
    cfg = Config()
    cfg.data.prompt_key, cfg.data.response_key = ns.prompt_key, ns.response_key
    tok = load_tokenizer(ns.model)
    model = load_causal_lm(ns.model, device=device)
    data = load_sft(cfg, ns.data, tok, ns.max_length)
    losses = sft_train(
        model,
        tok,
        data,
        steps=ns.steps,
        lr=ns.lr,
        batch_size=ns.batch_size,
        seed=ns.seed,
        device=device,
    )
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print(f"sft: {ns.steps} steps, final loss {losses[-1]:.4f}; saved to {out}")
    return 0


def cmd_rm(ns: argparse.Namespace) -> int:
    import torch

    from proxima.data import load_records
    from proxima.data.preferences import PreferenceDataset
    from proxima.models import init_reward_model, load_tokenizer, quiet_transformers
    from proxima.trainer.rm import CURVES, rm_train
    from proxima.trainer.run import seed_everything
    from proxima.trainer.setup import resolve_device

    out = _fresh_out(ns.out)
    seed_everything(ns.seed)
    if ns.threads:
        torch.set_num_threads(ns.threads)
    device = resolve_device(ns.device)
    tok = load_tokenizer(ns.model)
    opts = {
        "prompt_key": ns.prompt_key,
        "chosen_key": ns.chosen_key,
        "rejected_key": ns.rejected_key,
        "margin_key": ns.margin_key or None,
        "max_length": ns.max_length,
        "overlong": ns.overlong,
    }
    train = PreferenceDataset(load_records(ns.data), tok, **opts)
    held = PreferenceDataset(load_records(ns.eval_data), tok, **opts) if ns.eval_data else None
    model = init_reward_model(ns.model, device=device, seed=ns.seed, pad_token_id=tok.pad_token_id)
    res = rm_train(
        model,
        tok,
        train,
        steps=ns.steps,
        lr=ns.lr,
        batch_size=ns.batch_size,
        seed=ns.seed,
        eval_dataset=held,
        device=device,
    )
    with quiet_transformers():
        model.save_pretrained(out)
        tok.save_pretrained(out)
    evals = {k: v for k, v in res.items() if k not in CURVES}
    summary = {"args": {k: v for k, v in vars(ns).items() if k != "fn"}, "pairs": len(train)}
    summary.update(dropped=train.num_dropped, eval_pairs=len(held) if held else 0, **evals)
    summary["curves"] = {k: res[k] for k in CURVES}
    (out / "rm_summary.json").write_text(json.dumps(summary, indent=2))
    for name in ("train", "eval"):
        if f"{name}_before" in res:
            before, after = res[f"{name}_before"], res[f"{name}_after"]
            print(
                f"{name} preference accuracy: before {before['accuracy']:.4f} -> after "
                f"{after['accuracy']:.4f} (mean margin {after['margin']:.4f}, {after['n']} pairs)"
            )
    print(f"rm: {ns.steps} steps, final loss {res['loss'][-1]:.4f}; saved to {out}")
    return 0


def cmd_eval(ns: argparse.Namespace) -> int:
    from proxima.config import Config
    from proxima.models import load_causal_lm, load_tokenizer
    from proxima.trainer.evaluate import evaluate
    from proxima.trainer.setup import build_reward, load_prompts, resolve_device

    cfg = Config()
    cfg.model.actor_path = ns.model
    cfg.reward.function, cfg.reward.model_path = ns.reward or "", ns.reward_model or ""
    cfg.data.prompt_key = ns.prompt_key
    cfg.rollout.max_response_length = ns.max_new_tokens
    cfg.rollout.temperature = ns.temperature
    device = resolve_device(ns.device)
    tok = load_tokenizer(ns.model)
    items = list(load_prompts(cfg, ns.data, tok))[: ns.max_prompts or None]
    actor = load_causal_lm(ns.model, device=device, trainable=False)
    reward = build_reward(cfg, tok, device)
    results = {"greedy": evaluate(actor, tok, items, reward, cfg.rollout, device, greedy=True)}
    if ns.sampled:
        results["sampled"] = evaluate(actor, tok, items, reward, cfg.rollout, device, greedy=False)
    for mode, res in results.items():
        acc = f", accuracy {res['accuracy']:.2%}" if "accuracy" in res else ""
        print(f"{mode}: mean reward {res['mean_reward']:.4f}{acc} on {res['n']} prompts")
    if ns.out:
        Path(ns.out).write_text(json.dumps(results, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="proxima", description="PPO for RLHF on Hugging Face models")
    sub = p.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="PPO training (no arguments: the built-in default example)")
    t.add_argument("args", nargs="*", help="[CONFIG.yaml] [section.key=value ...]")
    t.set_defaults(fn=cmd_train)
    c = sub.add_parser("config", help="print the resolved config and batch plan, then exit")
    c.add_argument("args", nargs="*", help="[CONFIG.yaml] [section.key=value ...]")
    c.set_defaults(fn=cmd_config)
    i = sub.add_parser("init-model", help="build a tiny model + tokenizer as a HF folder")
    i.add_argument("--out", required=True)
    i.add_argument("--arch", default="llama", choices=["llama", "qwen2", "gpt2", "gpt_neox"])
    i.add_argument("--size", default="tiny", choices=["nano", "tiny", "small"])
    i.add_argument("--alphabet", help="characters of a character-level tokenizer")
    i.add_argument("--text-file", help="train a byte-level BPE tokenizer on this file")
    i.add_argument("--vocab-size", type=int, default=512)
    i.add_argument("--max-positions", type=int, default=256)
    i.add_argument("--seed", type=int, default=0)
    i.set_defaults(fn=cmd_init_model)
    s = sub.add_parser("sft", help="supervised fine-tuning on prompt/response records")
    s.add_argument("--model", required=True)
    s.add_argument("--data", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--steps", type=int, default=200)
    s.add_argument("--lr", type=float, default=1e-4)
    s.add_argument("--batch-size", type=int, default=16)
    s.add_argument("--max-length", type=int, default=512)
    s.add_argument("--prompt-key", default="prompt")
    s.add_argument("--response-key", default="response")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--device", default="auto")
    s.set_defaults(fn=cmd_sft)
    r = sub.add_parser("rm", help="train a reward model on prompt/chosen/rejected pairs")
    r.add_argument("--model", required=True, help="causal-LM (e.g. SFT) or reward-model folder")
    r.add_argument("--data", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--eval-data", help="held-out pairs, evaluated before and after")
    r.add_argument("--steps", type=int, default=200)
    r.add_argument("--lr", type=float, default=1e-5)
    r.add_argument("--batch-size", type=int, default=16, help="pairs per step")
    r.add_argument("--max-length", type=int, default=512, help="tokens of prompt + response")
    r.add_argument("--overlong", default="error", choices=["error", "drop"])
    r.add_argument("--prompt-key", default="prompt")
    r.add_argument("--chosen-key", default="chosen")
    r.add_argument("--rejected-key", default="rejected")
    r.add_argument("--margin-key", default="", help="optional numeric margin column")
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--device", default="auto")
    r.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = default)")
    r.set_defaults(fn=cmd_rm)
    e = sub.add_parser("eval", help="mean reward (and accuracy for 0/1 rewards) on prompts")
    e.add_argument("--model", required=True)
    e.add_argument("--data", required=True)
    e.add_argument("--reward", help="reward function path.py:fn or module:fn")
    e.add_argument("--reward-model", help="reward model folder")
    e.add_argument("--prompt-key", default="prompt")
    e.add_argument("--max-new-tokens", type=int, default=128)
    e.add_argument("--temperature", type=float, default=1.0)
    e.add_argument("--max-prompts", type=int, default=0)
    e.add_argument("--sampled", action="store_true", help="also evaluate with sampling")
    e.add_argument("--out", help="write the results as JSON here")
    e.add_argument("--device", default="auto")
    e.set_defaults(fn=cmd_eval)
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # "Writing model shards" bars on every save
    if ns.command == "eval" and bool(ns.reward) == bool(ns.reward_model):
        print(
            "error: give exactly one of --reward (path.py:fn) and --reward-model (folder)",
            file=sys.stderr,
        )
        return 2
    try:
        return ns.fn(ns)
    except (ValueError, OSError, RuntimeError) as err:
        if os.environ.get("PROXIMA_DEBUG"):
            raise
        print(f"error: {err}", file=sys.stderr)
        print("(set PROXIMA_DEBUG=1 for the full traceback)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
