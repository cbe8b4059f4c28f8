"""`proxima train | distill | config | sft | rm | dpo | eval | pipeline | init-model |
serve-reward | import | export | chat`."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import warnings
from pathlib import Path

import yaml

from proxima import launch
from proxima.cli.args import (
    FLAGS,
    SWITCHES,
    path_warnings,
)
from proxima.cli.args import load as load_args
from proxima.cli.signals import STACK, import_holding_signals, interrupt_on
from proxima.launch import Interrupted, signum_of


def held_out_line(summary: dict) -> str | None:
    """The run's held-out result before (or at resume) and after training: accuracy where
    both evaluations report one (rewards of 0 and 1 alone), else the mean reward."""
    start = "before" if "eval_before" in summary else "at resume"
    before = summary.get("eval_before", summary.get("eval_at_resume"))
    after = summary.get("eval_after")
    if not (before and after):
        return None
    key = "accuracy" if "accuracy" in before and "accuracy" in after else "mean_reward"
    return f"held-out {key} (greedy): {start} {before[key]:.4f} -> after {after[key]:.4f}"


def cmd_train(ns: argparse.Namespace) -> int:
    """0: trained all iterations; 128 + signal number: stopped by SIGINT / SIGTERM with a
    checkpoint to resume; 3: stopped as diverged (the result is the last good checkpoint)."""
    from proxima.recipes import train

    return _finished(train(load_args(ns, default_example=True)))


def cmd_distill(ns: argparse.Namespace) -> int:
    """`proxima train` on the built-in distillation config (`configs/distill.yaml`): the
    student (`--student`) learns from the teacher's log-probs (`--teacher`) of its own
    samples; the same exit statuses."""
    from proxima.recipes import train

    return _finished(train(load_args(ns)))


def _finished(summary: dict) -> int:
    """What a training command prints at its end, and its exit status."""
    from proxima.trainer.health import EXIT_DIVERGED

    if not launch.is_main_process():
        return 0
    line = held_out_line(summary)
    if line:
        print(line)
    print(
        f"wall time {summary['wall_seconds']:.1f} s; phases: "
        + ", ".join(f"{k} {v:.1f} s" for k, v in summary["phase_seconds"].items())
    )
    if "diverged" in summary:
        return EXIT_DIVERGED
    if "stopped" in summary:
        return summary["stopped"]["exit_status"]
    return 0


def cmd_config(ns: argparse.Namespace) -> int:
    """The resolved config (with trainer.resume_from, the checkpoint's own, and what changed
    since it), the batch plan, the role plan and, when the actor's folder is there to read
    its generation config, the scoring plan."""
    from proxima.checkpoint import check_resume
    from proxima.config import batch_plan
    from proxima.config.roles import role_plan
    from proxima.config.run import run_plan
    from proxima.models.loading import generation_config
    from proxima.rollout.engines import engine_spec
    from proxima.rollout.plan import plan_scoring
    from proxima.tasks import check_task, resumed_task_config

    cfg = load_args(ns, default_example=True)
    check_task(cfg)  # as `train` refuses a path its task would not use
    if cfg.task.name and cfg.trainer.resume_from:  # as `train` resumes a task run
        cfg = resumed_task_config(cfg)
    check_resume(cfg)
    for line in path_warnings(cfg):
        print(f"warning: {line}", file=sys.stderr)
    print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
    print(batch_plan(cfg))
    print(role_plan(cfg).describe())
    print(run_plan(cfg).describe())
    if cfg.model.actor_path and Path(cfg.model.actor_path, "config.json").is_file():
        engine = engine_spec(cfg.rollout.name)
        print(plan_scoring(cfg, engine, generation_config(cfg.model.actor_path)).describe())
    return 0


def _check_init_flags(ns: argparse.Namespace) -> None:
    """init-model's flags, each mistake named by its flag before anything is built."""
    from proxima.config import ConfigError
    from proxima.recipes.common import writable_folder

    sources = "--alphabet CHARS (a character tokenizer) or --text-file FILE (a byte-level BPE)"
    if not ns.alphabet and not ns.text_file:
        raise ConfigError(f"init-model needs a tokenizer source: {sources}.")
    if ns.alphabet and ns.text_file:
        raise ConfigError(f"init-model got both --alphabet and --text-file: pass one, {sources}.")
    if ns.alphabet and ns.vocab_size is not None:
        raise ConfigError(
            "--vocab-size sizes a BPE trained with --text-file; a character tokenizer's "
            "vocabulary is its --alphabet plus the special tokens: drop --vocab-size."
        )
    if ns.vocab_size is not None and ns.vocab_size <= 0:
        raise ConfigError(f"--vocab-size must be positive, got {ns.vocab_size}.")
    if ns.max_positions <= 0:
        raise ConfigError(
            f"--max-positions must be positive (the most tokens of prompt + response the model "
            f"reads, e.g. 256), got {ns.max_positions}."
        )
    if Path(ns.out, "config.json").exists():
        raise ConfigError(
            f"--out {ns.out} already holds a model (config.json); choose another --out folder, "
            "or delete that one first."
        )
    writable_folder(ns.out, "--out")


def cmd_init_model(ns: argparse.Namespace) -> int:
    from proxima.models import init_model

    _check_init_flags(ns)
    out = init_model(
        ns.out,
        arch=ns.arch,
        size=ns.size,
        alphabet=ns.alphabet,
        text_file=ns.text_file,
        vocab_size=ns.vocab_size or 512,
        max_positions=ns.max_positions,
        seed=ns.seed,
    )
    print(f"saved a {ns.size} {ns.arch} model and its tokenizer to {out}")
    return 0


def cmd_sft(ns: argparse.Namespace) -> int:
    from proxima.recipes.sft import sft

    sft(load_args(ns))
    return 0


def cmd_rm(ns: argparse.Namespace) -> int:
    from proxima.recipes.rm import reward_model

    reward_model(load_args(ns))
    return 0


def cmd_dpo(ns: argparse.Namespace) -> int:
    from proxima.recipes.dpo import dpo

    dpo(load_args(ns))
    return 0


def cmd_eval(ns: argparse.Namespace) -> int:
    from proxima.recipes.evaluation import evaluate_policy

    evaluate_policy(load_args(ns))
    return 0


def cmd_pipeline(ns: argparse.Namespace) -> int:
    from proxima.recipes.pipeline import pipeline

    pipeline(load_args(ns))
    return 0


def cmd_serve_reward(ns: argparse.Namespace) -> int:
    """Serve a reward function over HTTP until Ctrl-C (proxima/rewards/server.py)."""
    from proxima.rewards.server import serve

    serve(ns.function, host=ns.host, port=ns.port, workers=ns.workers)
    return 0


def cmd_import(ns: argparse.Namespace) -> int:
    from proxima.recipes.chat import import_model

    import_model(ns.file, ns.out, ns.dtype)
    return 0


def cmd_export(ns: argparse.Namespace) -> int:
    from proxima.recipes.chat import export_model

    export_model(ns.model, ns.gguf, ns.type)
    return 0


def cmd_chat(ns: argparse.Namespace) -> int:
    from proxima.recipes.chat import chat

    return chat(ns.model, ns.prompt, ns.system, ns.max_new_tokens, ns.temperature, ns.seed)


def _model_commands(sub) -> None:
    """import, export and chat: models in and out of GGUF, and a model tried by hand."""
    i = sub.add_parser(
        "import",
        help="write a GGUF file (llama.cpp's format) as a Hugging Face folder",
        description="Dequantise a GGUF file into a plain Hugging Face folder (safetensors, "
        "tokenizer, chat template, generation config) that later runs load fast. A model "
        "path may also name the .gguf file itself: it is then imported once into a cache.",
    )
    i.add_argument("file", help="the .gguf file")
    i.add_argument("--out", required=True, help="the folder to write (must not hold a model)")
    i.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    i.set_defaults(fn=cmd_import)
    e = sub.add_parser(
        "export",
        help="write a trained model as a GGUF file for llama.cpp / Ollama",
        description="Write a llama-architecture model folder, or a run folder's actor, as a "
        "GGUF file: 2-d weights in f16 (default) or f32, norms in f32, the tokenizer and chat "
        "template as metadata.",
    )
    e.add_argument("model", help="a model folder or a run folder (its actor/)")
    e.add_argument("--gguf", required=True, help="the .gguf file to write")
    e.add_argument("--type", default="f16", choices=["f16", "f32"])
    e.set_defaults(fn=cmd_export)
    c = sub.add_parser(
        "chat",
        help="answer a prompt with a model (or chat on standard input), with its chat template",
    )
    c.add_argument("model", help="a model folder, a run folder (its actor/) or a .gguf file")
    c.add_argument("--prompt", help="answer this prompt and exit (default: read prompts)")
    c.add_argument("--system", help="the system message (default: the template's own)")
    c.add_argument("--max-new-tokens", type=int, default=256)
    c.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    c.add_argument("--seed", type=int, default=0)
    c.set_defaults(fn=cmd_chat)


def _config_command(sub, name: str, help_text: str, fn) -> argparse.ArgumentParser:
    """A subcommand that takes `[CONFIG.yaml] [section.key=value ...]` and its flags."""
    p = sub.add_parser(name, help=help_text)
    p.add_argument("args", nargs="*", help="[CONFIG.yaml] [section.key=value ...]")
    for flag, key in FLAGS.get(name, {}).items():
        if flag in SWITCHES:
            p.add_argument(flag, action="store_true", help=f"sets {key}=true")
        else:
            p.add_argument(flag, metavar=key.rsplit(".", 1)[-1].upper(), help=f"= {key}")
    p.set_defaults(fn=fn)
    return p


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="proxima", description="PPO for RLHF on Hugging Face models")
    sub = p.add_subparsers(dest="command", required=True)
    _config_command(
        sub, "train", "PPO training (no arguments: the built-in default example)", cmd_train
    )
    _config_command(
        sub,
        "distill",
        "on-policy distillation: the student (--student) learns from a teacher's (--teacher) "
        "log-probs of its own samples (docs/distillation.md)",
        cmd_distill,
    )
    _config_command(
        sub, "config", "print the resolved config and batch plan, then exit", cmd_config
    )
    _config_command(sub, "sft", "supervised fine-tuning on prompt/response records", cmd_sft)
    _config_command(sub, "rm", "train a reward model on prompt/chosen/rejected pairs", cmd_rm)
    _config_command(
        sub, "dpo", "DPO: train the policy directly on prompt/chosen/rejected pairs", cmd_dpo
    )
    _config_command(sub, "eval", "mean reward (and accuracy for 0/1 rewards) on prompts", cmd_eval)
    _config_command(
        sub,
        "pipeline",
        "preferences -> reward model -> PPO, judged by a gold scorer (no arguments: the "
        "built-in preference task)",
        cmd_pipeline,
    )
    i = sub.add_parser("init-model", help="build a tiny model + tokenizer as a HF folder")
    i.add_argument("--out", required=True)
    i.add_argument("--arch", default="llama", choices=["llama", "qwen2", "gpt2", "gpt_neox"])
    i.add_argument("--size", default="tiny", choices=["nano", "tiny", "small"])
    i.add_argument("--alphabet", help="characters of a character-level tokenizer")
    i.add_argument("--text-file", help="train a byte-level BPE tokenizer on this file")
    i.add_argument(
        "--vocab-size",
        type=int,
        help="BPE vocabulary to train with --text-file (default 512); a character "
        "tokenizer's is its alphabet",
    )
    i.add_argument("--max-positions", type=int, default=256)
    i.add_argument("--seed", type=int, default=0)
    i.set_defaults(fn=cmd_init_model)
    s = sub.add_parser(
        "serve-reward",
        help="serve a reward function over HTTP (POST /score, GET /health)",
        description="Serve a reward function to `url` reward sources: POST /score with "
        '{"prompts": [...], "responses": [...], "columns": {...}} answers {"scores": [...]}.',
    )
    s.add_argument("function", help="the reward function: path/to/file.py:fn or package.mod:fn")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: all)")
    s.add_argument("--port", type=_port, default=8000, help="port to listen on (0: any free one)")
    s.add_argument("--workers", type=int, default=4, help="requests scored at once (threads)")
    s.set_defaults(fn=cmd_serve_reward)
    _model_commands(sub)
    return p


def _port(text: str) -> int:
    """A TCP port number, 0-65535 (0: any free one)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port: give 0-65535 (0: any free one)")
    return port


def _where() -> str:
    """`[rank N] ` in front of an error of a multi-process job; nothing for one process, or
    when the environment itself is what is wrong."""
    try:
        rank, world, _ = launch.world()
    except launch.LaunchEnvironmentError:
        return ""
    return f"[rank {rank}] " if world > 1 else ""


# set by `main` when it tore down a process group: `run` then ends the process with
# `dist.exit_now`, past the interpreter's finalisation
_ENDED_GROUP: list[bool] = []


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns, extra = parser.parse_known_args(argv)
    # `key=value` overrides may also follow the flags (argparse leaves them over)
    unknown = [a for a in extra if a.startswith("-") or "=" not in a]
    if unknown or (extra and not hasattr(ns, "args")):
        parser.error(f"unrecognized arguments: {' '.join(unknown or extra)}")
    if extra:
        ns.args = [*ns.args, *extra]
    previous = {s: interrupt_on(s) for s in (signal.SIGINT, signal.SIGTERM)}
    finished = False
    try:
        held = import_holding_signals(STACK)
        if held is not None:  # said like a signal at any other point of the start-up
            raise Interrupted(f"{signal.Signals(held).name} received", held)
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # "Writing model shards" bars on every save
        status = ns.fn(ns)
        finished = True
        return status
    except KeyboardInterrupt as err:  # a signal outside the training loop, or a second one
        print(f"\naborted: {str(err) or 'interrupted'}", file=sys.stderr)
        return 128 + signum_of(err)
    except (ValueError, OSError, RuntimeError) as err:
        if os.environ.get("PROXIMA_DEBUG"):
            raise
        print(f"error: {_where()}{err}", file=sys.stderr)
        print("(set PROXIMA_DEBUG=1 for the full traceback)", file=sys.stderr)
        return 2
    finally:
        for signum, handler in previous.items():
            if handler is not None:
                signal.signal(signum, handler)
        from proxima.trainer.dist import shutdown

        if shutdown(finished):
            _ENDED_GROUP.append(True)


def run() -> None:
    """The `proxima` command: on tcmalloc where it is installed (`proxima.allocator`), then
    `main` with the command line."""
    from proxima.allocator import preload

    preload()
    if not os.environ.get("PROXIMA_DEBUG"):
        warnings.formatwarning = _warning_line
    status = main()
    if _ENDED_GROUP:
        from proxima.trainer.dist import exit_now

        exit_now(status)
    sys.exit(status)


def _warning_line(message, category, filename, lineno, line=None) -> str:
    """A warning as the command's user reads it: `warning: <message>`, its kind when it has
    a name of its own, not the source line that raised it (PROXIMA_DEBUG=1 shows that)."""
    kind = "" if category in (UserWarning, Warning) else f" ({category.__name__})"
    return f"warning: {message}{kind}\n"
