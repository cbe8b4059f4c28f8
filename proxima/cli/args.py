"""The command line's config arguments: `[CONFIG.yaml] [key=value ...]` and the flags of
`sft`, `rm`, `dpo`, `eval` and `distill` as overrides, the built-in config a command starts from, a
resumed run's saved config as its base, and the paths `proxima config` checks."""

from __future__ import annotations

import argparse
from importlib import resources
from pathlib import Path

from proxima import launch
from proxima.plugins import split_spec

DEFAULT_EXAMPLE = "arithmetic.yaml"
PIPELINE_EXAMPLE = "pipeline.yaml"  # `proxima pipeline`'s base config: the preference task
DISTILL_EXAMPLE = "distill.yaml"  # `proxima distill`'s base config: on-policy distillation


def default_config_path() -> Path:
    return Path(str(resources.files("proxima") / "configs" / DEFAULT_EXAMPLE))


def builtin_config(name: str) -> str:
    """`name` itself when it is a file; else a config shipped with proxima by that name
    (`dapo` or `dapo.yaml`: proxima/configs/dapo.yaml), when there is one."""
    if Path(name).is_file():
        return name
    shipped = default_config_path().parent / (name if name.endswith(".yaml") else name + ".yaml")
    return str(shipped) if "/" not in name and shipped.is_file() else name


# Flags of `sft`, `rm`, `dpo`, `eval` and `distill`: short names of config keys, nothing more
# (no defaults of their own): `proxima rm --lr 1e-5` is `proxima rm rm.lr=1e-5`.
FLAGS: dict[str, dict[str, str]] = {
    "sft": {
        "--model": "model.actor_path",
        "--data": "data.sft_path",
        "--out": "sft.out",
        "--steps": "sft.steps",
        "--lr": "sft.lr",
        "--batch-size": "sft.batch_size",
        "--max-length": "sft.max_length",
        "--prompt-key": "data.prompt_key",
        "--response-key": "data.response_key",
        "--seed": "trainer.seed",
        "--device": "model.device",
        "--threads": "trainer.threads",
    },
    "rm": {
        "--model": "model.actor_path",
        "--data": "rm.train_path",
        "--eval-data": "rm.eval_path",
        "--out": "rm.out",
        "--steps": "rm.steps",
        "--lr": "rm.lr",
        "--batch-size": "rm.batch_size",
        "--max-length": "rm.max_length",
        "--overlong": "rm.overlong",
        "--prompt-key": "data.prompt_key",
        "--chosen-key": "rm.chosen_key",
        "--rejected-key": "rm.rejected_key",
        "--margin-key": "rm.margin_key",
        "--seed": "trainer.seed",
        "--device": "model.device",
        "--threads": "trainer.threads",
    },
    "dpo": {
        "--model": "model.actor_path",
        "--data": "dpo.train_path",
        "--eval-data": "dpo.eval_path",
        "--out": "dpo.out",
        "--epochs": "dpo.epochs",
        "--lr": "dpo.lr",
        "--beta": "dpo.beta",
        "--loss-type": "dpo.loss_type",
        "--batch-size": "dpo.batch_size",
        "--max-length": "dpo.max_length",
        "--overlong": "dpo.overlong",
        "--prompt-key": "data.prompt_key",
        "--chosen-key": "dpo.chosen_key",
        "--rejected-key": "dpo.rejected_key",
        "--seed": "trainer.seed",
        "--device": "model.device",
        "--threads": "trainer.threads",
    },
    "eval": {
        "--model": "model.actor_path",
        "--data": "data.eval_path",
        "--reward": "reward.function",
        "--reward-model": "reward.model_path",
        "--prompt-key": "data.prompt_key",
        "--max-new-tokens": "rollout.max_response_length",
        "--temperature": "rollout.temperature",
        "--max-prompts": "eval.max_prompts",
        "--sampled": "eval.sampled",
        "--out": "eval.out",
        "--device": "model.device",
        "--threads": "trainer.threads",
    },
    "distill": {
        "--teacher": "model.teacher_path",
        "--student": "model.actor_path",
        "--data": "data.train_path",
        "--eval-data": "data.eval_path",
        "--reward": "reward.function",
        "--iterations": "trainer.iterations",
        "--lr": "actor.optim.lr",
        "--coef": "algorithm.distill_coef",
        "--output-dir": "trainer.output_dir",
        "--seed": "trainer.seed",
        "--device": "model.device",
        "--threads": "trainer.threads",
    },
}
SWITCHES = {"--sampled"}  # flags that take no value: they set their key to true


def check_order(args: list[str], command: str) -> None:
    """Only the first argument may be a YAML file: a later one would be read as an override
    without `=`, so say where it belongs."""
    from proxima.config import ConfigError

    for arg in args[1:]:
        if "=" in arg:
            continue
        if Path(arg).suffix.lower() not in (".yaml", ".yml") and not Path(arg).is_file():
            raise ConfigError(
                f"`{arg}` is not of the form section.key=value (only the first argument may "
                f"be a YAML config file: `proxima {command} [CONFIG.yaml] [key=value ...]`)."
            )
        if "=" not in args[0]:
            raise ConfigError(
                f"`{arg}`: a command reads one YAML file, and `{args[0]}` is it; merge the "
                "two files, or give the second one's keys as key=value overrides."
            )
        overrides = " ".join(a for a in args if "=" in a)
        raise ConfigError(
            f"`{arg}` comes after the key=value overrides: the YAML file must come first, "
            f"e.g. `proxima {command} {arg} {overrides}`."
        )


def split_config_args(
    args: list[str], default_example: bool, command: str = "train"
) -> tuple[str | None, list[str]]:
    """`[CONFIG.yaml] [key=value ...]`.

    Without a YAML file `proxima train` starts from the built-in default example, unless the
    overrides name your own model (`model.actor_path=...`) or a checkpoint to resume (then
    its saved config is the base, see `resume_base`): then, as for every other command
    but `pipeline` and `distill`, from the plain defaults. `proxima pipeline` always starts
    from its built-in config unless given a YAML file; `proxima distill` from its own
    (`distill.yaml`) unless given one or resuming a checkpoint.
    """
    check_order(args, command)
    resumes = any(a.startswith("trainer.resume_from=") for a in args)
    if command == "pipeline" and resumes and args and "=" not in args[0]:
        from proxima.config import ConfigError

        raise ConfigError(
            f"`proxima pipeline trainer.resume_from=RUN` goes on with RUN's own config (its "
            f"pipeline.json), so `{args[0]}` would not be read: drop it, and give only the "
            "keys to change (e.g. trainer.threads=1)."
        )
    if args and "=" not in args[0]:
        return builtin_config(args[0]), args[1:]
    if command == "pipeline" and not resumes:
        return builtin_config(PIPELINE_EXAMPLE), args  # its tiny-model settings suit yours
    if command == "distill" and not resumes:
        return builtin_config(DISTILL_EXAMPLE), args
    named = any(a.startswith(("model.actor_path=", "trainer.resume_from=")) for a in args)
    if not default_example or named:
        return None, args
    return str(default_config_path()), args


def resume_base(path: str | None, overrides: list[str], command: str = "train") -> dict | None:
    """`proxima train trainer.resume_from=X [key=value ...]` continues X's own config (and
    `proxima config` shows it); `proxima pipeline` that of the pipeline run folder X."""
    if path is not None:
        return None
    resume = [a.split("=", 1)[1] for a in overrides if a.startswith("trainer.resume_from=")]
    if not resume:
        return None
    if command == "pipeline":  # the pipeline run folder's own
        from proxima.recipes.pipeline import saved_pipeline_config

        return saved_pipeline_config(resume[-1])
    from proxima.checkpoint import find_checkpoint, read_meta

    return read_meta(find_checkpoint(resume[-1]))["config"]


def load(ns: argparse.Namespace, default_example: bool = False):
    """The command's config: YAML and/or `key=value` overrides, the command's flags as
    overrides after them; validated for the command."""
    from proxima.config import load_config

    overrides = list(ns.args)
    for flag, key in FLAGS.get(ns.command, {}).items():
        value = getattr(ns, flag[2:].replace("-", "_"))
        if value is not None and value is not False:
            overrides.append(f"{key}={'true' if flag in SWITCHES else value}")
    path, overrides = split_config_args(overrides, default_example, ns.command)
    trains = ns.command in ("train", "distill")
    resumes = trains or ns.command in ("config", "pipeline")
    base = resume_base(path, overrides, ns.command) if resumes else None
    saved = "the pipeline run's" if ns.command == "pipeline" else "the checkpoint's"
    label = path or (f"{saved} saved config" if base else "defaults")
    if (trains or base) and launch.is_main_process():
        print(f"config: {label}" + (f" with {' '.join(overrides)}" if overrides else ""))
    cfg = load_config(path, overrides, base=base, command=ns.command)
    if ns.command == "config":  # checks only: `path_warnings` reads each GGUF file's header
        return cfg
    from proxima.models.gguf import resolve_gguf_paths

    return resolve_gguf_paths(cfg)  # a .gguf model path: its imported folder


# The paths `proxima config` checks: a run reads each one that is set.
PATH_KEYS = (
    "model.actor_path",
    "model.reference_path",
    "model.teacher_path",
    "model.critic_path",
    "data.train_path",
    "data.eval_path",
    "data.sft_path",
    "reward.model_path",
)


def path_warnings(cfg) -> list[str]:
    """A line per set path that does not exist (and for an actor folder that is not a
    policy): `proxima config` still prints the config, since a path may be created later."""
    lines = []
    for key in PATH_KEYS:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        for path in value if isinstance(value, list) else [value]:  # data: one file or several
            if path and not Path(path).exists():
                lines.append(f"`{key}`: {path} does not exist")
    spec = cfg.reward.function
    if ":" in spec:  # a spec without one is named by the config check
        file, _, is_file = split_spec(spec, "`reward.function`")
        if is_file and not Path(file).is_file():
            lines.append(f"`reward.function`: {file} does not exist (the file of {spec})")
    from proxima.models.folders import policy_folder_problem
    from proxima.models.gguf import gguf_keys, gguf_problem

    gguf_paths = gguf_keys(cfg)
    for key, path in gguf_paths.items():
        problem = gguf_problem(path) if Path(path).exists() else None
        if problem:
            lines.append(f"`{key}`: {problem}")
    actor = cfg.model.actor_path
    problem = policy_folder_problem(actor) if actor and actor not in gguf_paths.values() else None
    if problem:
        lines.append(f"`model.actor_path`: {actor} {problem}")
    return lines
