"""Where each quantity of phase 3 comes from, decided once at start-up (`plan_scoring`),
printed, and followed by `score.build_experience`.

PPO's old log-probs are log-softmax(actor logits / temperature) of the sampled tokens. The
rollout engine already computed the log-probs of what it sampled; where the two are the same
quantity (the engine's class says when: `rollout.engines.EngineSpec.logprobs_differ`; the `hf`
engine's are exact in float32 with no truncation and no logits processor, up to the
KV-cached decode's float rounding, ~1e-7), the scoring forward pass of the actor is skipped
(`rollout.old_logprobs=auto`). With `rollout.max_staleness` they never are: the samples come
from weights up to that many versions behind the trainer's. A critic on the actor's backbone gives
its values from the same pass as the old log-probs: from the actor's scoring pass, or from
the generation itself. Which reference, critic and teacher the run has is the role plan's
(`config.roles`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from proxima.algos import ADVANTAGE_ESTIMATORS
from proxima.config import Config, ConfigError
from proxima.config.roles import role_plan

# generation_config fields that do not change the distribution tokens are sampled from
NEUTRAL_GENERATION_FIELDS = {
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "decoder_start_token_id",
    "max_length",
    "max_new_tokens",
    "do_sample",
    "temperature",
    "top_k",
    "top_p",
    "use_cache",
    "output_attentions",
    "output_hidden_states",
    "transformers_version",
    "_from_model_config",
}


class EngineSpec(Protocol):
    """What the plan asks of the engine that samples: its class in `rollout.engines`
    (imported by its callers: the engines import the decode loop, which imports this
    module)."""

    name: str
    serves_actor: bool  # generates with the actor module itself (values come with tokens)

    def logprobs_differ(self, cfg: Config, generation_config=None) -> str: ...


@dataclass(frozen=True)
class ScoringPlan:
    """`old_logprobs`: "engine" (the engine's own log-probs of the sampled tokens) or
    "actor" (an actor forward pass). `values`: "critic" (a pass of a value model), "actor"
    (with the old log-probs, from the actor's pass), "generation" (from the decode steps of
    the hf engine) or "" (no critic). `kl`: the per-token KL's estimator, "full" (exact over
    the vocabulary: one more pair of forward passes) or "" (no reference: the KL is 0)."""

    old_logprobs: str
    values: str
    kl: str
    why: str  # why the old log-probs come from where they do
    # sum over the vocabulary of pi^2 at each response token, from the actor's scoring pass
    # (the advantage estimator needs it: optimal_token_baseline)
    sum_pi_squared: bool = False
    # on-policy distillation: a pass of the frozen teacher, its log-probs of the sampled
    # tokens (in micro-batches of its own, as the reference's), beside the reference's
    teacher: bool = False

    @property
    def old_from_engine(self) -> bool:
        return self.old_logprobs == "engine"

    def describe(self) -> str:
        old = {
            "engine": "the engine's own log-probs, no actor pass",
            "actor": "an actor forward pass",
        }[self.old_logprobs]
        values = {
            "critic": "a pass of the value model",
            "actor": "the actor's pass (its value head)",
            "generation": "the generation (the value head on the decode steps)",
            "": "none (no critic)",
        }[self.values]
        kl = f"a reference pass, KL estimator {self.kl}" if self.kl else "none (no KL)"
        spsq = "\n  sum pi^2     : the actor's pass" if self.sum_pi_squared else ""
        teacher = (
            "\n  teacher      : a teacher pass (log-probs of the sampled tokens)"
            if self.teacher
            else ""
        )
        return (
            f"scoring plan:\n  old log-probs: {old} ({self.why})\n  values       : {values}\n"
            f"  reference    : {kl}{teacher}{spsq}"
        )


def _old_logprobs(cfg: Config, engine: EngineSpec, generation_config) -> tuple[str, str]:
    mode = cfg.rollout.old_logprobs
    if "sum_pi_squared" in _estimator_needs(cfg):
        name = cfg.algorithm.adv_estimator
        if mode == "engine":
            raise ConfigError(
                f"`algorithm.adv_estimator={name}` needs the sum of pi^2 over the vocabulary "
                "from the actor's scoring pass, which `rollout.old_logprobs=engine` skips. "
                "Use rollout.old_logprobs=auto or recompute."
            )
        return "actor", f"{name} needs the actor's logits (sum of pi^2)"
    if mode == "engine" and cfg.rollout.max_staleness:
        raise ConfigError(
            "`rollout.old_logprobs=engine` with `rollout.max_staleness` >= 1 would take the "
            "log-probs of older weights as PPO's old policy. Use "
            "rollout.old_logprobs=auto or recompute (the trainer's pass at its current weights)."
        )
    if mode == "engine" and cfg.algorithm.corrects_rollout:
        raise ConfigError(
            "`rollout.old_logprobs=engine` makes the engine's log-probs the old policy, so "
            "`algorithm.rollout_correction` / `rollout_rejection` (which weigh by the ratio "
            "old / engine) would always see 1. Use rollout.old_logprobs=recompute, or turn "
            "rollout_correction and rollout_rejection off."
        )
    if mode != "auto":
        return ("engine" if mode == "engine" else "actor"), f"rollout.old_logprobs={mode}"
    if cfg.rollout.max_staleness:  # the engine's log-probs are of older weights
        return "actor", "auto: rollout.max_staleness, the engine's weights are older"
    why_not = engine.logprobs_differ(cfg, generation_config)
    if why_not:
        return "actor", f"auto: {why_not}"
    return "engine", f"auto: exact here, the {engine.name} engine's own"


def _estimator_needs(cfg: Config) -> tuple[str, ...]:
    return ADVANTAGE_ESTIMATORS[cfg.algorithm.adv_estimator].needs


def plan_scoring(cfg: Config, engine: EngineSpec, generation_config=None) -> ScoringPlan:
    """The scoring plan of a run whose samples come from `engine` (its class in
    `rollout.engines`: `engine_spec(cfg.rollout.name)`, or `spec_of` a built one) and
    whose actor has `generation_config`. Raises ConfigError for a combination that cannot be
    scored."""
    old, why = _old_logprobs(cfg, engine, generation_config)
    roles, values = role_plan(cfg), ""
    if roles.critic_on_actor:
        values = "generation" if old == "engine" else "actor"
        if values == "generation" and not engine.serves_actor:
            raise ConfigError(
                "a critic on the actor's backbone with `rollout.old_logprobs=engine` would "
                "need the values from the generation, which only the hf engine can give "
                f"(rollout.name={engine.name}). Fix: set rollout.old_logprobs=auto (one actor "
                "pass gives log-probs and values)."
            )
    elif roles.critic_model:
        values = "critic"
    kl = cfg.algorithm.kl_penalty if roles.has_reference else ""
    spsq = "sum_pi_squared" in _estimator_needs(cfg)
    return ScoringPlan(old, values, kl, why, spsq, teacher=roles.has_teacher)
