"""What start-up prints and the docs show: the batch plan, where the KL goes, and the
table of every key with its default and help (`python -m proxima.config`). The role plan
(`roles.RolePlan.describe`) is printed after the batch plan."""

from __future__ import annotations

import dataclasses
from typing import Any

from proxima.config.roles import trained_sections
from proxima.config.run import worker_problem
from proxima.config.schema import Config
from proxima.config.sections import set_names


def batch_plan(cfg: Config, world: int = 1, mix: dict[str, float] | None = None) -> str:
    """Human-readable batch plan, printed at start-up: one unit (sequences), every count,
    global and per process, for each role trained with steps of its own (a value head
    trains in the actor's); with several prompt files, the mix (`mix`: each set's prompts
    per batch, once the files are read)."""
    rollout = cfg.rollout_batch_size
    lines = [
        f"batch plan: {cfg.data.train_batch_size} prompts x {cfg.rollout.n} samples = "
        f"{rollout} sequences per iteration"
        + (f" ({rollout // world} per process, {world} processes)" if world > 1 else "")
    ]
    lines += data_plan(cfg, mix)
    packed = ", packed" if cfg.model.packing is not False else ""
    for role, sec in trained_sections(cfg).items():
        mini = sec.ppo_mini_batch_size
        n_mini = rollout // mini
        n_micro = mini // world // sec.ppo_micro_batch_size
        per = f" ({mini // world} per process)" if world > 1 else ""
        tokens = "tokens in packed rows" if cfg.model.packing is not False else "padded tokens"
        order = ", sorted by length" if sec.ppo_max_tokens_per_micro == -1 else ""  # SORTED
        lines.append(
            f"  {role:6s}: {sec.ppo_epochs} epoch(s) x {n_mini} mini-batch(es) of "
            f"{mini}{per} = {cfg.steps_per_iteration(sec)} optimizer step(s) per "
            f"iteration; "
            + (
                f"micro-batches of at most {sec.ppo_max_tokens_per_micro} {tokens}"
                if sec.ppo_max_tokens_per_micro > 0
                else f"{n_micro} micro-batch(es) of {sec.ppo_micro_batch_size}{packed}{order}"
            )
        )
    lines += packing_plan(cfg)
    lines += kl_plan(cfg)
    lines += async_plan(cfg)
    lines.append(
        f"  total : {cfg.trainer.iterations} iterations, "
        f"{cfg.trainer.iterations * rollout} sequences"
    )
    return "\n".join(lines)


def data_plan(cfg: Config, mix: dict[str, float] | None = None) -> list[str]:
    """Several prompt files: how a batch mixes them (each set's prompts per batch on
    average, from `mix` or else the weights)."""
    files, d = cfg.data.train_files(), cfg.data
    if len(files) < 2:
        return []
    if mix is not None:
        total = sum(mix.values())
        parts = [f"{n} {v / total:.0%} ({v:.3g})" for n, v in mix.items()]
        return [f"  data  : {len(mix)} prompt sets, prompts per batch: {', '.join(parts)}"]
    if d.train_weights:
        total = sum(d.train_weights)
        names = set_names(files)
        shares = [f"{n} {w / total:.0%}" for n, w in zip(names, d.train_weights, strict=True)]
        return [f"  data  : {len(files)} prompt sets mixed in every batch: {', '.join(shares)}"]
    return [f"  data  : {len(files)} prompt sets mixed in proportion to their sizes"]


def packing_plan(cfg: Config) -> list[str]:
    """How the forward passes lay out their sequences (`model.packing`; unset until the
    models are tried, `trainer.roles.check_packing`)."""
    if cfg.model.packing is False:
        return ["  layout: padded rows in every forward pass (model.packing=false)"]
    shared = (
        f"; a prompt once for its {cfg.rollout.n} samples where that computes less"
        if cfg.rollout.n > 1
        else ""
    )
    which = "" if cfg.model.packing else " where every model takes them (tried at start-up)"
    return [
        f"  layout: packed rows{which}: the scoring passes, the reward models and "
        "the updates lay their sequences end to end in rows as wide as their longest, "
        f"positions from 0 and attention within each sequence{shared}"
    ]


def kl_plan(cfg: Config) -> list[str]:
    """Where the KL penalty goes, when the KL loss makes that a choice (printed at start-up)."""
    if not cfg.actor.use_kl_loss:
        return []
    if cfg.kl_in_reward:
        return [
            "  KL    : in the reward (algorithm.use_kl_in_reward=true) AND in the actor loss "
            "(actor.use_kl_loss=true): counted twice, as set"
        ]
    if cfg.algorithm.use_kl_in_reward is None:
        return [
            "  KL    : in the actor loss only: actor.use_kl_loss=true turns the in-reward KL "
            "off (as verl); set algorithm.use_kl_in_reward=true to have both"
        ]
    return ["  KL    : in the actor loss only (algorithm.use_kl_in_reward=false)"]


def async_plan(cfg: Config) -> list[str]:
    """Asynchronous rollouts (`rollout.max_staleness`): how deep the pipeline is, what it
    holds, who samples it and the overlap to expect of that."""
    r, iterations = cfg.rollout, cfg.trainer.iterations
    k = r.max_staleness
    if not k:
        return []
    deep = min(k, iterations)  # never a batch past the run's last
    lines = [
        f"  ahead : rollout.max_staleness={k}: batch i is sampled from the weights of "
        f"iteration i - {k}; up to {deep} batch(es) ({deep * cfg.rollout_batch_size} "
        "sequences) sampled ahead and held"
        + (
            f" (k >= the run's {iterations} iterations: every batch from the first weights)"
            if k >= iterations
            else ""
        )
    ]
    if r.workers:
        busy = min(r.workers, deep)  # a batch to sample for each, at most
        lines.append(
            f"          {r.workers} rollout worker process(es) sample while the trainer "
            f"trains: an iteration takes about max(update, sampling / {busy}) instead of "
            "update + sampling"
            + (f"; only {busy} of them have a batch to sample" if busy < r.workers else "")
        )
    else:
        why = worker_problem(cfg)
        lines.append(
            "          sampled in the trainer's process (rollout.workers=0"
            + (f"; workers do not go with {why}" if why else "")
            + "): sampling and training alternate, nothing overlaps, the batches are "
            "only older"
        )
    return lines


def fixed_keys() -> tuple[str, ...]:
    """The keys a run resumes only with unchanged (fields declared `fixed` in the schema)."""
    fields, out = [("", Config())], []
    while fields:
        prefix, node = fields.pop(0)
        for f in dataclasses.fields(node):
            value = getattr(node, f.name)
            if dataclasses.is_dataclass(value):
                fields.append((prefix + f.name + ".", value))
            elif f.metadata.get("fixed"):
                out.append(prefix + f.name)
    return tuple(out)


def describe_fields(node: Any = None, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(dotted key, default, help) for every leaf field: the configuration reference."""
    node = Config() if node is None else node
    rows = []
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            rows.extend(describe_fields(value, prefix + f.name + "."))
        else:
            rows.append((prefix + f.name, value, f.metadata.get("help", "")))
    return rows


def keys_markdown() -> str:
    """Every key, default and help as one markdown table (docs/config.md has one per section)."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for key, default, help_text in describe_fields():
        rows.append(f"| `{key}` | `{default!r}` | {help_text.replace('|', chr(92) + '|')} |")
    return "\n".join(rows)
