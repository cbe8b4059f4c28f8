"""Validation: everything a config can be checked for before anything heavy happens, each
failure a ConfigError that names the key and says what to change.

`validate` runs the checks below in a fixed order and the first failure raises: the order
decides which of several mistakes a user is told about, so a new check goes where it
belongs in that order rather than anywhere. Checks that need more than the config live
with what they check and run at start-up, before anything loads: the scoring plan
(`rollout.plan`), the critic's options (`models.critic.check_critic`), model folders and
vocabularies (`trainer.setup`). `check_sources` checks that a command's inputs
(model, data, reward) are named.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

from proxima.config.choices import (
    CRITIC_INIT,
    DTYPE_NAMES,
    ENGINES,
    HEAD_INITS,
    KL_CONTROLLERS,
    LOGGERS,
    MEMORY_CHECKS,
    MIXED_PRECISION,
    OFFLOADS,
    OLD_LOGPROBS,
    OVERLONG_MODES,
    PAIRINGS,
    PIPELINE_TASKS,
    PREFERENCE_OVERLONG,
    SCHEDULES,
    STRATEGIES,
    VLLM_DTYPES,
    WORKER_STARTS,
)
from proxima.config.roles import trained_sections
from proxima.config.run import run_plan, worker_problem
from proxima.config.schema import Config, ConfigError
from proxima.config.sections import AlgorithmConfig, ModelConfig
from proxima.launch import world_size
from proxima.plugins import split_spec

_CHOICES = {  # checked in this order, then the names proxima.algos accepts
    "model.critic_init": CRITIC_INIT,
    "critic.head_init": HEAD_INITS,
    "model.dtype": DTYPE_NAMES,
    "rollout.name": ENGINES,
    "rollout.old_logprobs": OLD_LOGPROBS,
    "rollout.worker_start": WORKER_STARTS,
    "model.mixed_precision": MIXED_PRECISION,
    "model.offload": OFFLOADS,
    "rollout.vllm.dtype": VLLM_DTYPES,
    "data.overlong_prompts": OVERLONG_MODES,
    "algorithm.kl_ctrl.type": KL_CONTROLLERS,
    "actor.optim.schedule": SCHEDULES,
    "critic.optim.schedule": SCHEDULES,
    "rm.overlong": PREFERENCE_OVERLONG,
    "dpo.overlong": PREFERENCE_OVERLONG,
    "pipeline.pairing": PAIRINGS,
    "trainer.strategy": STRATEGIES,
    "trainer.memory_check": MEMORY_CHECKS,
    "fsdp.param_dtype": DTYPE_NAMES,
    "fsdp.reduce_dtype": DTYPE_NAMES,
    "pipeline.task": PIPELINE_TASKS,
}

_DEVICE = re.compile(r"cpu|cuda(:\d+)?")  # a rollout.devices entry

_POSITIVE = (  # sizes and counts that must be > 0, checked in this order
    "data.train_batch_size",
    "rollout.n",
    "rollout.max_response_length",
    "rollout.micro_batch_size",
    "rollout.vllm.tensor_model_parallel_size",
    "actor.ppo_epochs",
    "critic.ppo_epochs",
    "data.max_prompt_length",
    "reward.batch_size",
    "eval.batch_size",
    "eval.n",
    "algorithm.max_gen_batches",
    "sft.steps",
    "sft.batch_size",
    "sft.max_length",
    "rm.steps",
    "rm.batch_size",
    "rm.max_length",
    "dpo.beta",
    "dpo.epochs",
    "dpo.batch_size",
    "dpo.max_length",
    "pipeline.heldout_size",
    "pipeline.pairs",
    "pipeline.eval_points",
    "pipeline.eval_samples",
)

_NON_NEGATIVE = (  # where 0 means off or never, checked in this order
    "trainer.save_every",
    "trainer.save_every_minutes",
    "trainer.keep_checkpoints",
    "reward.overlong_buffer_len",
    "guard.patience",
    "guard.min_entropy",
    "guard.max_kl_per_token",
    "guard.min_length_ratio",
    "guard.drift_min_distinct_ratio",
    "guard.drift_max_repetition_rise",
    "guard.drift_max_dominated_rise",
    "guard.drift_max_empty_rise",
    "guard.drift_min_entropy_ratio",
    "guard.drift_max_ref_logprob_drop",
    "algorithm.distill_clip",
    "pipeline.label_temperature",
    "pipeline.kl_budget",
    "rm.probe_size",
)


def validate(cfg: Config) -> None:
    """Raise ConfigError naming the key for anything that cannot run (any command)."""
    _check_choices(cfg)
    _check_counts(cfg)
    _check_lora(cfg.model)
    _check_lists(cfg)
    _check_data(cfg)
    _check_optim(cfg)
    _check_temperature(cfg)
    _check_mixed_precision(cfg.model)
    _check_rollout(cfg)
    _check_rollout_correction(cfg)
    _check_actor(cfg)
    _check_critic(cfg)
    _check_distill(cfg)
    _check_processes(cfg)
    _check_offload(cfg)
    _check_reward_sources(cfg)
    _check_pipeline(cfg)
    _check_dpo(cfg)


def _check_dpo(cfg: Config) -> None:
    """`proxima dpo`'s options the loss itself would refuse, named by their keys."""
    d = cfg.dpo
    if not 0 <= d.label_smoothing < 0.5:
        raise ConfigError(
            f"`dpo.label_smoothing` is cDPO's label-flip probability in [0, 0.5), got "
            f"{d.label_smoothing} (0 = plain DPO)."
        )
    if d.loss_type == "ipo" and d.label_smoothing:
        raise ConfigError(
            "`dpo.label_smoothing` smooths the sigmoid loss; ipo has none (its target is "
            "already finite): set dpo.label_smoothing=0 or dpo.loss_type=sigmoid."
        )
    for key, value in (("lr", d.lr), ("warmup_steps", d.warmup_steps)):
        if value < 0:
            raise ConfigError(f"`dpo.{key}` must be >= 0, got {value}.")
    if d.grad_clip < 0:
        raise ConfigError(f"`dpo.grad_clip` must be >= 0 (0 = no clipping), got {d.grad_clip}.")
    if d.eval_every < 0:
        raise ConfigError(
            f"`dpo.eval_every` must be >= 0 (0 = before and after training only), got "
            f"{d.eval_every}."
        )


def _check_pipeline(cfg: Config) -> None:
    p = cfg.pipeline
    if not 0 <= p.label_noise <= 0.5:
        raise ConfigError(
            f"`pipeline.label_noise` is a flip probability in [0, 0.5], got {p.label_noise} "
            "(above 0.5 the labels would mostly say the opposite of the gold)."
        )
    if p.gold and not p.prompts:
        raise ConfigError(
            "`pipeline.gold` scores your task: set `pipeline.prompts` to its prompt file too "
            "(without both the built-in task runs with its own gold)."
        )
    for key in ("heldout", "sft_data"):  # the built-in task would write its own instead
        if getattr(p, key) and not p.prompts:
            raise ConfigError(
                f"`pipeline.{key}` belongs with your prompts: set `pipeline.prompts` (and "
                "pipeline.gold) too, or drop it; without them the built-in preference task "
                "writes its own prompts, held-out prompts and demonstrations."
            )


def _get(cfg: Config, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def _algorithm_choices() -> dict[str, tuple[str, ...]]:
    """Names the math in proxima.algos accepts, checked before any model is loaded."""
    from proxima.algos import (
        ADVANTAGE_ESTIMATORS,
        AGG_MODES,
        DPO_LOSS_TYPES,
        KL_ESTIMATORS,
        POLICY_LOSSES,
    )

    return {
        "algorithm.adv_estimator": tuple(ADVANTAGE_ESTIMATORS),
        "actor.policy_loss.loss_mode": tuple(POLICY_LOSSES),
        "algorithm.kl_penalty": (*KL_ESTIMATORS, "full"),
        "actor.kl_loss_type": (*KL_ESTIMATORS, "full"),
        "actor.loss_agg_mode": AGG_MODES,
        "critic.loss_agg_mode": AGG_MODES,
        "dpo.loss_type": DPO_LOSS_TYPES,
    }


def _check_choices(cfg: Config) -> None:
    """Keys with a fixed set of values (every section)."""
    for key, choices in {**_CHOICES, **_algorithm_choices()}.items():
        if _get(cfg, key) not in choices:
            raise ConfigError(
                f"`{key}` must be one of {', '.join(choices)}; got {_get(cfg, key)!r}."
            )


def _check_counts(cfg: Config) -> None:
    """Sizes and counts: positive, at least one iteration, the others >= 0."""
    for key in _POSITIVE:
        if _get(cfg, key) <= 0:
            raise ConfigError(f"`{key}` must be positive, got {_get(cfg, key)}.")
    if cfg.trainer.iterations <= 0:
        raise ConfigError(
            f"`trainer.iterations` must be >= 1, got {cfg.trainer.iterations}: a run trains at "
            "least one iteration (use `proxima eval` to only evaluate)."
        )
    for key in _NON_NEGATIVE:
        if _get(cfg, key) < 0:
            raise ConfigError(f"`{key}` must be >= 0, got {_get(cfg, key)}.")
    if cfg.trainer.threads < 0:
        raise ConfigError(
            f"`trainer.threads` must be >= 0 (0 = torch's default, N = N CPU threads per "
            f"process), got {cfg.trainer.threads}."
        )


def _check_lora(m: ModelConfig) -> None:
    if m.lora_rank < 0:
        raise ConfigError(
            f"`model.lora_rank` must be >= 0 (0 = full fine-tuning), got {m.lora_rank}."
        )
    if m.lora_alpha <= 0:
        raise ConfigError(
            f"`model.lora_alpha` must be > 0 (e.g. 16 or 2 x rank), got {m.lora_alpha}."
        )
    if not 0 <= m.lora_dropout < 1:
        raise ConfigError(f"`model.lora_dropout` must be in [0, 1), got {m.lora_dropout}.")


def _check_lists(cfg: Config) -> None:
    """List values: their length and the type of their items."""
    for role in ("actor", "critic"):
        key, betas = f"{role}.optim.betas", _get(cfg, f"{role}.optim.betas")
        ok = len(betas) == 2 and all(
            isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas
        )
        if not ok:
            raise ConfigError(
                f"`{key}` must be two numbers in [0, 1) (Adam's beta1, beta2), like "
                f"[0.9, 0.95]; got {betas!r}."
            )
    ids = cfg.rollout.stop_token_ids
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ConfigError(
            f"`rollout.stop_token_ids` must be a list of token ids (integers >= 0), like "
            f"[13]; got {ids!r}."
        )
    weights = cfg.algorithm.gdpo_reward_weights
    if not all(isinstance(w, (int, float)) and not isinstance(w, bool) for w in weights):
        raise ConfigError(
            "`algorithm.gdpo_reward_weights` must be a list of numbers, one per reward "
            f"component (empty = equal weights), like [1.0, 0.5]; got {weights!r}."
        )
    loggers = cfg.trainer.loggers
    unknown = [n for n in loggers if n not in LOGGERS]
    if unknown:
        raise ConfigError(
            f"`trainer.loggers`: unknown logger {unknown[0]!r}; the loggers are "
            f"{', '.join(LOGGERS)} (a list, like [jsonl, wandb]; jsonl is always written)."
        )
    modules = cfg.model.lora_target_modules
    if not all(isinstance(m, str) and m for m in modules):
        raise ConfigError(
            f"`model.lora_target_modules` must be a list of module names, like "
            f"[q_proj, v_proj]; got {modules!r}."
        )


def _check_data(cfg: Config) -> None:
    """Several prompt files: a list of paths, and a mixing weight for each training file."""
    d = cfg.data
    for key in ("train_path", "eval_path"):
        value = getattr(d, key)
        if isinstance(value, list) and not all(isinstance(p, str) and p for p in value):
            raise ConfigError(
                f"`data.{key}` must be a prompt file or a list of them, like "
                f"[math.jsonl, code.jsonl]; got {value!r}."
            )
        files = getattr(d, key.replace("_path", "_files"))()
        if len(set(files)) != len(files):
            raise ConfigError(f"`data.{key}` names a file twice: {value!r}.")
    weights, files = d.train_weights, d.train_files()
    if not weights:
        return
    if not all(
        isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w) and w >= 0
        for w in weights
    ):
        raise ConfigError(
            "`data.train_weights` must be a list of numbers >= 0, one per data.train_path "
            f"file, like [0.7, 0.3]; got {weights!r}."
        )
    if len(files) < 2:
        raise ConfigError(
            "`data.train_weights` mixes several prompt files, but `data.train_path` names "
            f"{len(files)}; list the files ([a.jsonl, b.jsonl]) or leave the weights empty."
        )
    if len(weights) != len(files):
        raise ConfigError(
            f"`data.train_weights` has {len(weights)} weights for the {len(files)} files of "
            "`data.train_path`; give one weight per file, in the same order."
        )
    if not sum(weights) > 0:
        raise ConfigError(
            "`data.train_weights` are all 0: no prompt set would be sampled; give at least "
            "one set a weight above 0."
        )


def _check_optim(cfg: Config) -> None:
    """The optimizers of actor and critic, and the actor's early stopping."""
    for role in ("actor", "critic"):
        o = _get(cfg, f"{role}.optim")
        for name, value in (("lr", o.lr), ("weight_decay", o.weight_decay)):
            if value < 0:
                raise ConfigError(f"`{role}.optim.{name}` must be >= 0, got {value}.")
        if o.eps <= 0:
            raise ConfigError(f"`{role}.optim.eps` must be > 0 (e.g. 1e-8), got {o.eps}.")
        if o.grad_clip < 0:
            raise ConfigError(
                f"`{role}.optim.grad_clip` must be >= 0 (0 = no clipping), got {o.grad_clip}."
            )
        if not 0 <= o.min_lr_ratio <= 1:
            raise ConfigError(
                f"`{role}.optim.min_lr_ratio` must be in [0, 1], got {o.min_lr_ratio}."
            )
        if o.warmup_steps < 0:
            raise ConfigError(f"`{role}.optim.warmup_steps` must be >= 0, got {o.warmup_steps}.")
    if cfg.actor.target_kl < 0:
        raise ConfigError(
            f"`actor.target_kl` must be >= 0 (0 = no early stopping), got {cfg.actor.target_kl}."
        )


def _check_temperature(cfg: Config) -> None:
    if cfg.rollout.temperature <= 0:
        raise ConfigError(
            "`rollout.temperature` must be > 0 (use a small value such as 1e-3 "
            "for near-greedy sampling)."
        )


def _check_mixed_precision(m: ModelConfig) -> None:
    if m.mixed_precision != "no" and m.dtype != "float32":
        raise ConfigError(
            f"`model.mixed_precision={m.mixed_precision}` keeps float32 master weights "
            f"and autocasts the compute; `model.dtype` is {m.dtype}. Set "
            "model.dtype=float32 (or mixed_precision=no to train in that dtype)."
        )


def _check_dapo(cfg: Config) -> None:
    """DAPO's dynamic sampling and overlong punishment."""
    if cfg.algorithm.filter_groups and cfg.rollout.n < 2:
        raise ConfigError(
            "`algorithm.filter_groups` drops groups whose scores are all equal, and with "
            "`rollout.n=1` every group is one response: set rollout.n > 1 (e.g. 8)."
        )
    buffer = cfg.reward.overlong_buffer_len
    if buffer > cfg.rollout.max_response_length:
        raise ConfigError(
            f"`reward.overlong_buffer_len={buffer}` exceeds `rollout.max_response_length="
            f"{cfg.rollout.max_response_length}`: the buffer is the last part of the allowed "
            "length; e.g. a quarter of it."
        )


def _unused(section, name: str, spec_key: str, what: str, example: str) -> None:
    """A `rollout.<name>` section whose spec key is empty must keep its defaults (they apply
    to `what` only): ConfigError naming the key set."""
    default = type(section)()
    for f in dataclasses.fields(section):
        if getattr(section, f.name) != getattr(default, f.name):
            raise ConfigError(
                f"`rollout.{name}.{f.name}` is set but `rollout.{name}.{spec_key}` is empty: it "
                f"applies to {what} only. Set {example}, or remove rollout.{name}.{f.name}."
            )


def _check_env(cfg: Config) -> None:
    """Multi-turn episodes (`rollout.env`): the spec's form and the episode's limits; the
    class itself is imported and checked at start-up (`rollout.environments.check_env`)."""
    e = cfg.rollout.env
    if not e.cls:
        _unused(e, "env", "cls", "multi-turn episodes", "rollout.env.cls=path/to/file.py:Env")
        return
    split_spec(e.cls, f"`rollout.env.cls`={e.cls!r}", "class", ConfigError)
    for key, low in (("max_turns", 1), ("max_episode_tokens", 1), ("workers", 1)):
        if getattr(e, key) < low:
            raise ConfigError(f"`rollout.env.{key}` must be >= {low}, got {getattr(e, key)}.")
    if e.max_turn_tokens < 0:
        raise ConfigError(
            "`rollout.env.max_turn_tokens` must be >= 0 (0 = rollout.max_response_length), "
            f"got {e.max_turn_tokens}."
        )
    turn = e.max_turn_tokens or cfg.rollout.max_response_length
    if e.max_episode_tokens < turn:
        raise ConfigError(
            f"`rollout.env.max_episode_tokens` ({e.max_episode_tokens}) is below one action's "
            f"most tokens ({turn}, rollout.env.max_turn_tokens or else "
            "rollout.max_response_length): every episode would be cut inside its first action. "
            "Raise max_episode_tokens (it also holds the observations) or lower max_turn_tokens."
        )
    if e.timeout_s < 0:
        raise ConfigError(
            f"`rollout.env.timeout_s` must be >= 0 (0 = no limit), got {e.timeout_s}."
        )
    if not all(isinstance(s, str) and s for s in e.turn_stop):
        raise ConfigError(
            "`rollout.env.turn_stop` must be a list of non-empty strings, like ['</call>']; "
            f"got {e.turn_stop!r}."
        )
    if not e.observation_role:
        raise ConfigError("`rollout.env.observation_role` must name a chat role, e.g. tool.")


def _check_agent(cfg: Config) -> None:
    """Agent programs (`rollout.agent`): the spec's form, its limits, and no environment
    beside it; the function itself is imported at start-up (`rollout.agent.check_agent`)."""
    a = cfg.rollout.agent
    if not a.fn:
        _unused(a, "agent", "fn", "agent programs", "rollout.agent=path/to/file.py:fn")
        return
    if cfg.rollout.env.cls:
        raise ConfigError(
            "`rollout.agent` and `rollout.env` are both set: an episode is played either by "
            "proxima against an environment class or by your agent program. Keep one."
        )
    split_spec(a.fn, f"`rollout.agent.fn`={a.fn!r}", "function", ConfigError)
    if cfg.trainer.strategy == "fsdp2" and run_plan(cfg).serves_actor:
        raise ConfigError(
            "`rollout.agent` with `trainer.strategy=fsdp2` and the hf engine: every FSDP2 "
            "generation is a collective of all ranks, and each rank's agents make their own "
            "number of calls. Use trainer.strategy=ddp, or rollout.name=vllm (an engine per "
            "rank)."
        )
    for key in ("concurrency", "max_calls", "max_context_tokens"):
        if getattr(a, key) < 1:
            raise ConfigError(f"`rollout.agent.{key}` must be >= 1, got {getattr(a, key)}.")
    for key, meaning in (("timeout_s", "0 = no limit"), ("batch_wait_ms", "0 = no wait")):
        if getattr(a, key) < 0:
            raise ConfigError(
                f"`rollout.agent.{key}` must be >= 0 ({meaning}), got {getattr(a, key)}."
            )


def _check_rollout(cfg: Config) -> None:
    _check_dapo(cfg)
    _check_env(cfg)
    _check_staleness(cfg)
    _check_agent(cfg)
    _check_generation_autocast(cfg)
    if not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError("`rollout.top_p` must be in (0, 1].")
    if not 0 < cfg.rollout.vllm.gpu_memory_utilization <= 1:
        raise ConfigError(
            "`rollout.vllm.gpu_memory_utilization` must be in (0, 1] (a share of GPU memory), "
            f"got {cfg.rollout.vllm.gpu_memory_utilization}."
        )


def _check_generation_autocast(cfg: Config) -> None:
    """`rollout.autocast=true` changes something only where it applies: bfloat16 mixed
    precision and the hf engine (vLLM generates in rollout.vllm.dtype)."""
    if not cfg.rollout.autocast:
        return
    if cfg.model.mixed_precision != "bf16":
        raise ConfigError(
            "`rollout.autocast=true` generates under the bfloat16 autocast of "
            f"model.mixed_precision=bf16, but model.mixed_precision={cfg.model.mixed_precision}. "
            "Set model.mixed_precision=bf16, or leave rollout.autocast off."
        )
    if not run_plan(cfg).serves_actor:
        raise ConfigError(
            f"`rollout.autocast=true` applies to the hf engine; rollout.name={cfg.rollout.name} "
            "generates in its own dtype (rollout.vllm.dtype). Leave rollout.autocast off."
        )


def _check_staleness(cfg: Config) -> None:
    """Asynchronous rollouts: the bound and the workers, where they run, and what a worker
    process cannot do yet (it serves a copy of the actor with the hf engine)."""
    r = cfg.rollout
    for key, least in (("max_staleness", 0), ("workers", 0), ("worker_threads", 1)):
        if getattr(r, key) < least:
            raise ConfigError(f"`rollout.{key}` must be >= {least}, got {getattr(r, key)}.")
    plan = run_plan(cfg)
    if r.partial_rollouts and not plan.workers:
        raise ConfigError(
            "`rollout.partial_rollouts=true` lets rollout worker processes take newer weights "
            "mid-generation: it needs rollout.max_staleness >= 1 and rollout.workers >= 1."
        )
    if r.partial_rollouts and plan.multi_turn:
        raise ConfigError(
            "`rollout.partial_rollouts=true` applies to single-turn generation (the decode "
            "loop's steps); multi-turn episodes take the weights of their batch. Turn it off."
        )
    if r.workers and not r.max_staleness:
        raise ConfigError(
            f"`rollout.workers={r.workers}` starts rollout worker processes, which sample "
            "batches ahead while the trainer trains, but rollout.max_staleness=0 samples each "
            "batch from the current weights, after the last update: nothing could overlap. "
            "Set rollout.max_staleness=1 (or more; rollout.workers then defaults to it), or "
            "rollout.workers=0."
        )
    _check_worker_devices(cfg)
    if not plan.workers:
        return
    why = worker_problem(cfg)
    if why:
        raise ConfigError(
            f"`rollout.workers={r.workers}` does not go with {why}. Use rollout.workers=0: "
            "the batches are sampled ahead in the trainer's process, with the same staleness."
        )


def _check_worker_devices(cfg: Config) -> None:
    """`rollout.devices`: device names (cpu, cuda, cuda:N); a forked worker runs where the
    trainer's actor is, so a CUDA device (theirs or the actor's) needs spawned workers.
    Whether the devices exist is checked at start-up (`trainer.device.check_rollout_devices`)."""
    r = cfg.rollout
    bad = [d for d in r.devices if not (isinstance(d, str) and _DEVICE.fullmatch(d))]
    if bad:
        raise ConfigError(
            f"`rollout.devices` must be a list of devices (cpu, cuda or cuda:N), like "
            f"[cuda:1, cuda:2]; got {bad[0]!r}."
        )
    on_cuda = [d for d in [cfg.model.device, *r.devices] if d.startswith("cuda")]
    if r.worker_start == "fork" and on_cuda and run_plan(cfg).workers:
        raise ConfigError(
            f"`rollout.worker_start=fork` with {on_cuda[0]} (model.device or rollout.devices): "
            "a CUDA process cannot be forked. Use rollout.worker_start=spawn (or auto)."
        )


def _check_rollout_correction(cfg: Config) -> None:
    """The engine's log-probs against the trainer's: correction level and cap, warning."""
    from proxima.algos import IS_LEVELS

    if cfg.algorithm.rollout_correction not in ("", *IS_LEVELS):
        raise ConfigError(
            "`algorithm.rollout_correction` must be token, sequence or empty (off); got "
            f"{cfg.algorithm.rollout_correction!r}."
        )
    if cfg.algorithm.rollout_correction_cap < 1:
        raise ConfigError(
            "`algorithm.rollout_correction_cap` must be >= 1 (weights above it are truncated), "
            f"got {cfg.algorithm.rollout_correction_cap}; verl uses 2.0."
        )
    _check_rollout_rejection(cfg.algorithm)
    if cfg.rollout.logprob_diff_warn < 0:
        raise ConfigError("`rollout.logprob_diff_warn` must be >= 0 (0 disables the warning).")


def _check_rollout_rejection(algorithm: AlgorithmConfig) -> None:
    """The rejection level and its band [lower, upper], which must keep the on-policy
    ratio 1 (0 = verl's defaults)."""
    from proxima.algos import REJECTION_LEVELS, REJECTION_THRESHOLDS

    level = algorithm.rollout_rejection
    if level not in ("", *REJECTION_LEVELS):
        raise ConfigError(
            "`algorithm.rollout_rejection` must be token, sequence, geometric or empty (off); "
            f"got {level!r}."
        )
    upper, lower = (
        algorithm.rollout_rejection_threshold,
        algorithm.rollout_rejection_threshold_lower,
    )
    if upper and not upper > 1:
        raise ConfigError(
            "`algorithm.rollout_rejection_threshold` must be > 1 (the on-policy ratio 1 is "
            f"kept) or 0 (verl's default for the level), got {upper}."
        )
    if lower and not 0 < lower < 1:
        raise ConfigError(
            "`algorithm.rollout_rejection_threshold_lower` must be in (0, 1) (the on-policy "
            f"ratio 1 is kept) or 0 (1 / rollout_rejection_threshold), got {lower}."
        )
    if level == "geometric" and (upper or REJECTION_THRESHOLDS[level]) > 2:
        raise ConfigError(
            f"`algorithm.rollout_rejection=geometric` with threshold {upper} keeps a sequence "
            "whose tokens are on average more than twice as likely for the trainer as for "
            "the engine: the geometric mean of the ratios stays near 1 (verl uses 1.001). "
            "Use a threshold close to 1, or rollout_rejection=sequence for the product."
        )


def _check_policy_loss_options(cfg: Config) -> None:
    """An `actor.policy_loss.*` option changed from its default under a loss_mode that does
    not read it is an error (it would be silently ignored)."""
    from proxima.algos import POLICY_LOSSES

    section = cfg.actor.policy_loss
    mode = section.loss_mode
    used = set(POLICY_LOSSES[mode].options)
    for f in dataclasses.fields(section):
        if f.name == "loss_mode" or f.name in used:
            continue
        if getattr(section, f.name) != f.default:
            readers = [n for n, e in POLICY_LOSSES.items() if f.name in e.options]
            raise ConfigError(
                f"`actor.policy_loss.{f.name}` is set but `actor.policy_loss.loss_mode={mode}` "
                f"does not read it (it is an option of: {', '.join(readers) or 'no loss'}); "
                "remove it or choose one of those losses."
            )


def _check_policy_loss_values(cfg: Config) -> None:
    """The options of the chosen loss in range (each loss checks them again when called; here
    they stop the run before anything loads)."""
    section = cfg.actor.policy_loss
    rules = {
        "dro": [("dro_beta", section.dro_beta > 0, "> 0 (e.g. 0.05); dro has no default")],
        "sapo": [
            ("tau_pos", section.tau_pos > 0, "> 0"),
            ("tau_neg", section.tau_neg > 0, "> 0"),
        ],
        "clip_cov": [("clip_cov_ratio", section.clip_cov_ratio > 0, "> 0")],
        "kl_cov": [("kl_cov_ratio", 0 < section.kl_cov_ratio <= 1, "in (0, 1]")],
    }
    for name, ok, expected in rules.get(section.loss_mode, []):
        if not ok:
            raise ConfigError(
                f"`actor.policy_loss.{name}` must be {expected} with "
                f"`actor.policy_loss.loss_mode={section.loss_mode}`, got {getattr(section, name)}."
            )


def _check_token_budgets(cfg: Config) -> None:
    """A token budget per forward pass holds at least one whole row (prompt + response), as
    verl asks of its dynamic batch size: below it, every pass would be over budget."""
    row = cfg.data.max_prompt_length + cfg.rollout.after_prompt_tokens
    budgets = {
        "actor.ppo_max_tokens_per_micro": cfg.actor.ppo_max_tokens_per_micro,
        "critic.ppo_max_tokens_per_micro": cfg.critic.ppo_max_tokens_per_micro,
        "rollout.max_tokens_per_micro": cfg.rollout.max_tokens_per_micro,
        "reward.max_tokens_per_micro": cfg.reward.max_tokens_per_micro,
    }
    for key, budget in budgets.items():
        if budget < -1:
            raise ConfigError(
                f"`{key}` must be -1 (micro-batches sorted by length), 0 (in the batch's "
                f"order) or a token budget of at least one whole row ({row}), got {budget}."
            )
        if 0 < budget < row:
            raise ConfigError(
                f"`{key}` ({budget}) is below one whole row: data.max_prompt_length + "
                f"rollout.{cfg.rollout.after_prompt_key} = {row} tokens. Give it at least "
                f"{row}, or -1 / 0 for micro-batches counted in rows."
            )


def _check_actor(cfg: Config) -> None:
    _check_token_budgets(cfg)
    _check_policy_loss_options(cfg)
    _check_policy_loss_values(cfg)
    if cfg.actor.clip_ratio_c and cfg.actor.clip_ratio_c <= 1:
        raise ConfigError("`actor.clip_ratio_c` must be > 1 (dual clip) or 0 to disable it.")
    if cfg.actor.ptx_coef > 0 and not cfg.data.sft_path:
        raise ConfigError("`actor.ptx_coef` > 0 needs `data.sft_path` (prompt/response records).")


def _check_critic(cfg: Config) -> None:
    if not cfg.uses_critic and cfg.critic.warmup_iterations:
        raise ConfigError(
            "`critic.warmup_iterations` needs a critic; the estimator "
            f"`{cfg.algorithm.adv_estimator}` trains none. Set it to 0."
        )


def _check_distill(cfg: Config) -> None:
    """On-policy distillation: a teacher to learn from, a weight to learn with, and nothing
    computed that the `distill` estimator never reads (it reads no token reward)."""
    a, teacher = cfg.algorithm, cfg.model.teacher_path
    alone = a.adv_estimator == "distill"
    if alone and not teacher:
        raise ConfigError(
            "`algorithm.adv_estimator=distill` learns from a teacher's log-probs: set "
            "`model.teacher_path` (a model folder, a `proxima train` run folder or a .gguf "
            "file sharing the policy's tokenizer), e.g. `proxima distill --teacher T "
            "--student S data.train_path=prompts.jsonl`."
        )
    if teacher and a.distill_coef <= 0:
        raise ConfigError(
            f"`algorithm.distill_coef`={a.distill_coef}: the teacher's term would be "
            f"{'reversed' if a.distill_coef < 0 else 'zero'} (model.teacher_path is set). "
            "Set it > 0 (1.0 as in Tinker and verl), or unset model.teacher_path."
        )
    if not alone:
        return
    if a.use_kl_in_reward:
        raise ConfigError(
            "`algorithm.use_kl_in_reward=true` puts a KL penalty into the token rewards, which "
            "`adv_estimator=distill` does not read (its advantage is the teacher's log-ratio "
            "alone). For a KL to the reference use actor.use_kl_loss=true; or leave "
            "use_kl_in_reward unset."
        )
    if a.filter_groups:
        raise ConfigError(
            "`algorithm.filter_groups` drops groups by their scores, which "
            "`adv_estimator=distill` does not train on: set algorithm.filter_groups=false."
        )


def _check_reward_sources(cfg: Config) -> None:
    """Each `reward.sources` entry (config.sources)."""
    if cfg.reward.sources:
        from proxima.config.sources import reward_sources

        reward_sources(cfg)


def _check_processes(cfg: Config) -> None:
    """What a multi-process (torchrun) job supports, and batch sizes that split over it."""
    if cfg.trainer.strategy == "fsdp2" and cfg.model.lora_rank:
        raise ConfigError(
            "`trainer.strategy=fsdp2` with `model.lora_rank` > 0 is not supported yet: use "
            "trainer.strategy=ddp for LoRA (its adapters are small), or model.lora_rank=0."
        )
    world = world_size()
    _check_batch_sizes(cfg, world)


def _check_offload(cfg: Config) -> None:
    if cfg.model.offload != "trained":
        return
    if cfg.model.device == "cpu":
        raise ConfigError(
            "`model.offload=trained` moves state between the GPU and CPU memory, and "
            "`model.device=cpu` has no GPU: set model.offload=none (or auto), or "
            "model.device=cuda."
        )
    problem = run_plan(cfg).offload_blocked
    if problem:
        raise ConfigError(
            f"`model.offload=trained` does not combine with {problem}: set "
            "model.offload=none (or auto)."
        )


def _check_batch_sizes(cfg: Config, world: int) -> None:
    """Sizes in sequences; train_batch_size and ppo_mini_batch_size are global (all
    processes together), ppo_micro_batch_size is per process (verl's convention)."""
    rollout = cfg.rollout_batch_size
    if cfg.data.train_batch_size % world:
        raise ConfigError(
            f"`data.train_batch_size`={cfg.data.train_batch_size} is global: it must split "
            f"evenly over the {world} processes. Pick a multiple of {world}."
        )
    for role, sec in trained_sections(cfg).items():
        mini, micro = sec.ppo_mini_batch_size, sec.ppo_micro_batch_size
        if mini <= 0 or micro <= 0:
            raise ConfigError(
                f"`{role}.ppo_mini_batch_size` and `{role}.ppo_micro_batch_size` "
                f"must be positive, got {mini} and {micro}."
            )
        if rollout % mini:
            raise ConfigError(
                f"`{role}.ppo_mini_batch_size`={mini} does not divide the {rollout} sequences "
                f"of an iteration (data.train_batch_size={cfg.data.train_batch_size} x rollout.n="
                f"{cfg.rollout.n}). Pick a divisor of {rollout}."
            )
        if mini % world:
            raise ConfigError(
                f"`{role}.ppo_mini_batch_size`={mini} is global: it must split evenly over the "
                f"{world} processes. Pick a multiple of {world}."
            )
        if (mini // world) % micro:
            per = f" ({mini} / {world} processes)" if world > 1 else ""
            raise ConfigError(
                f"`{role}.ppo_micro_batch_size`={micro} does not divide the per-process "
                f"`{role}.ppo_mini_batch_size`={mini // world}{per}. Pick a divisor of "
                f"{mini // world} (micro-batches are counted per process)."
            )


# --------------------------------------------------------------------------- sources


def _require(cfg: Config, key: str, what: str) -> None:
    if not _get(cfg, key):
        raise ConfigError(f"`{key}` is empty. Set it to {what}.")


def _require_one_reward(cfg: Config, flags: bool = False) -> None:
    if cfg.reward.sources:  # each entry checked by validate (_check_reward_sources)
        return
    distill = cfg.algorithm.adv_estimator == "distill"
    if distill and cfg.data.eval_path and not (cfg.reward.function or cfg.reward.model_path):
        raise ConfigError(
            "`data.eval_path`: held-out prompts are scored by the reward source, and none is "
            "set. Set `reward.function` (under adv_estimator=distill it is scored and logged, "
            "never trained on), or unset data.eval_path."
        )
    episodes = run_plan(cfg).multi_turn
    if (episodes or distill) and not (cfg.reward.function and cfg.reward.model_path):
        return  # the environment's, the agent's or the teacher's signal, at most one score
    if bool(cfg.reward.function) == bool(cfg.reward.model_path):
        fn, rm = (" (--reward)", " (--reward-model)") if flags else ("", "")
        key = "rollout.env" if cfg.rollout.env.cls else "rollout.agent"
        extra = f" (with {key}: at most one, the episode's final score)"
        raise ConfigError(
            f"Set exactly one of `reward.function`{fn} (path.py:fn or module:fn) "
            f"and `reward.model_path`{rm} (a reward model folder)"
            + (extra if episodes else "")
            + "."
        )


def check_sources(cfg: Config, command: str = "train") -> None:
    """The model, data and reward a command reads must be named (a built-in task names
    them when it is prepared, before training starts)."""
    model = "a Hugging Face model folder"
    if command == "train":
        if cfg.task.name and not cfg.model.actor_path:
            raise ConfigError(
                f"`task.name`={cfg.task.name!r} is not prepared yet: run it with "
                "`proxima train` or proxima.recipes.train(cfg), which prepare the task first."
            )
        _require(cfg, "model.actor_path", model + ", or set `task.name=arithmetic` for the example")
        _require(cfg, "data.train_path", "a prompt file (.jsonl, .json, .parquet, .csv)")
        _require_one_reward(cfg)
    elif command == "distill":
        _require(cfg, "model.actor_path", model + ", the student to start from (--student)")
        _require(
            cfg,
            "model.teacher_path",
            "the teacher: " + model + ", a run folder or a .gguf file (--teacher)",
        )
        _require(cfg, "data.train_path", "a prompt file (--data; .jsonl, .json, .parquet, .csv)")
        _require_one_reward(cfg)
    if command not in ("train", "distill", "config") and cfg.model.teacher_path:
        raise ConfigError(
            "`model.teacher_path` is read by `proxima train` and `proxima distill` "
            f"(on-policy distillation); `proxima {command}` has no teacher: unset it."
        )
    if command == "sft":
        _require(cfg, "model.actor_path", model + " (--model)")
        _require(cfg, "data.sft_path", "a file of prompt/response records (--data)")
        _require(cfg, "sft.out", "a new folder for the fine-tuned model (--out)")
    elif command == "rm":
        _require(cfg, "model.actor_path", model + ", the model to start from (--model)")
        _require(cfg, "rm.train_path", "a file of preference pairs (--data)")
        _require(cfg, "rm.out", "a new folder for the reward model (--out)")
    elif command == "dpo":
        _require(cfg, "model.actor_path", model + ", the policy to start from (--model)")
        _require(cfg, "dpo.train_path", "a file of preference pairs (--data)")
        _require(cfg, "dpo.out", "a new folder for the run (--out)")
    elif command == "pipeline":
        for key, instead in (("train_path", "prompts"), ("eval_path", "heldout")):
            if getattr(cfg.data, key):
                raise ConfigError(
                    f"`data.{key}` is not read by `proxima pipeline`: set "
                    f"pipeline.{instead} instead (with pipeline.gold, your gold scorer)."
                )
        if cfg.pipeline.prompts:
            _require(cfg, "pipeline.gold", "the gold scorer of your prompts, file.py:fn")
    elif command == "eval":
        _require(cfg, "model.actor_path", model + " (--model)")
        _require(cfg, "data.eval_path", "a prompt file (--data)")
        _require_one_reward(cfg, flags=True)
