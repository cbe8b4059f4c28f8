"""The role plan: which reference, which critic and which reward sources a run has, decided
once from the config (`role_plan(cfg)`: built on first use, then kept with that config) and
printed at start-up with the batch and scoring plans.

Loading (`trainer.setup`), the memory plan (`trainer.memory`), the batch plan (`plans`),
the scoring plan (`rollout.plan`) and the pipeline read it instead of the flags it comes
from (`actor.use_kl_loss`, `algorithm.use_kl_in_reward`, `model.lora_rank`,
`model.reference_path`, `model.teacher_path`, `critic.shared_backbone`, `model.critic_*`,
the estimator), as torchtitan's `ParallelDims` answers every "is X enabled?" question of a run.

- reference (the frozen policy of the KL term): `adapters off` (a LoRA actor with its
  adapters disabled: no weights of its own), `folder` (a frozen model loaded from
  `reference_folder`) or `none` (no KL term: neither in the reward nor in the actor loss);
- critic: `head` (a value head on the actor's backbone, trained in the actor's steps),
  `model` (a value model of its own, started from `critic_folder`) or `none` (a
  critic-free estimator);
- teacher (on-policy distillation, `model.teacher_path`): a frozen model of its own, or
  none; a run or checkpoint folder names its trained policy (`policy_folder`);
- rewards: the reward sources (`config.sources.RewardSource`), none when a multi-turn
  environment gives every reward, or under on-policy distillation alone (`distill`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from proxima.config.schema import Config, ConfigError
from proxima.config.sections import ActorConfig, CriticConfig
from proxima.config.sources import RewardSource, reward_sources

REFERENCES = ("adapters off", "folder", "none")
CRITICS = ("head", "model", "none")
# where a value model starts from, by model.critic_init (its folder named in the plan)
CRITIC_STARTS = {
    "actor": "the actor's backbone and a new value head",
    "reward_model": "the reward model (backbone and head)",
    "critic": "a saved critic",
}


@dataclass(frozen=True)
class RolePlan:
    """The run's roles besides the actor, each with the config key its folder comes from."""

    actor_folder: str
    reference: str  # REFERENCES
    reference_folder: str = ""  # the folder a `folder` reference loads
    reference_key: str = ""  # the key naming it: model.reference_path or model.actor_path
    critic: str = "none"  # CRITICS
    critic_folder: str = ""  # the folder a value model starts from
    critic_key: str = ""  # the key naming it (model.critic_path, ...critic_init=...)
    critic_init: str = ""  # model.critic_init of a value model: actor | reward_model | critic
    critic_lora: bool = False  # a value model trains LoRA adapters (model.critic_lora)
    vf_coef: float = 0.0  # a value head's weight in the actor loss (critic.vf_coef)
    estimator: str = ""  # algorithm.adv_estimator (what a critic-free plan names)
    rewards: tuple[RewardSource, ...] = ()
    teacher_folder: str = ""  # the folder of model.teacher_path's model; "" = no teacher
    distill_coef: float = 0.0  # the teacher term's weight (algorithm.distill_coef)

    @property
    def has_teacher(self) -> bool:
        """On-policy distillation: a frozen teacher scores every sampled token."""
        return bool(self.teacher_folder)

    @property
    def has_reference(self) -> bool:
        """A KL term to a frozen reference: in the reward, in the actor loss, or both."""
        return self.reference != "none"

    @property
    def critic_on_actor(self) -> bool:
        """The critic is a value head on the actor (its values come from the actor's pass)."""
        return self.critic == "head"

    @property
    def critic_model(self) -> bool:
        """The critic is a value model of its own, trained as a role with its own steps."""
        return self.critic == "model"

    @property
    def trained(self) -> tuple[str, ...]:
        """The roles PPO trains with optimizer steps of their own: the actor, and a value
        model (a value head trains in the actor's steps; a critic-free estimator has none)."""
        return ("actor", "critic") if self.critic_model else ("actor",)

    @property
    def reference_reads_other_folder(self) -> bool:
        """The reference loads a folder other than the actor's (`model.reference_path`)."""
        return self.reference == "folder" and self.reference_key == "model.reference_path"

    @property
    def critic_reads_other_folder(self) -> bool:
        """A value model starts from a folder other than the actor's."""
        return self.critic_model and self.critic_key != "model.actor_path"

    @property
    def reward_model_folders(self) -> tuple[str, ...]:
        """The reward model folders of the sources, in order."""
        return tuple(s.target for s in self.rewards if s.kind == "model_path")

    def describe(self) -> str:
        """The lines start-up and `proxima config` print: where each role comes from."""
        if self.reference == "adapters off":
            reference = "the actor with its LoRA adapters off (no weights of its own)"
        elif self.reference == "folder":
            what = "model" if self.reference_reads_other_folder else "copy of the starting actor"
            reference = f"a frozen {what}, from {_named(self.reference_key, self.reference_folder)}"
        else:
            reference = "none (no KL term)"
        if self.critic == "head":
            critic = (
                "a value head on the actor's backbone, trained in the actor's steps "
                f"(loss + {self.vf_coef:g} x value loss)"
            )
        elif self.critic == "model":
            critic = (
                f"a value model of its own: {CRITIC_STARTS[self.critic_init]}, from "
                f"{_named(self.critic_key, self.critic_folder)}"
                + (", LoRA adapters" if self.critic_lora else "")
            )
        else:
            critic = f"none ({self.estimator} trains no critic)"
        rewards = "; ".join(_describe_source(s, len(self.rewards)) for s in self.rewards)
        if not rewards:
            rewards = "none (the environment or agent gives every reward)"
            if self.estimator == "distill":
                rewards = "none (distill: the teacher's log-probs are the only signal)"
        elif self.estimator == "distill":
            rewards += " (scored and logged, not trained on: distill reads no reward)"
        lines = [f"role plan:\n  reference: {reference}\n  critic   : {critic}"]
        if self.has_teacher:
            lines.append(f"  teacher  : {self._describe_teacher()}")
        lines.append(f"  reward   : {rewards}")
        return "\n".join(lines)

    def _describe_teacher(self) -> str:
        use = (
            "the whole advantage"
            if self.estimator == "distill"
            else f"added to {self.estimator}'s advantage"
        )
        return (
            f"a frozen model, from {_named('model.teacher_path', self.teacher_folder)}: "
            f"{self.distill_coef:g} x (teacher - student log-prob) per token, {use}"
        )


def _named(key: str, folder: str) -> str:
    return f"{key} ({folder})" if folder else key


def _describe_source(source: RewardSource, count: int) -> str:
    kind = {"function": "the function", "model_path": "the reward model", "url": "the server"}
    what = f"{kind[source.kind]} {source.target}"
    return what if count == 1 else f"{source.name} = {source.weight:g} x {what}"


def role_plan(cfg: Config) -> RolePlan:
    """The role plan of `cfg`: built on first use and kept with the config (the config is
    frozen: the plan rides beside its fields, never among them, so `replace`, `to_dict` and
    equality ignore it). Raises ConfigError for a value model asked to start from a reward
    model the run has none of."""
    plan = cfg.__dict__.get(_KEPT)
    if plan is None:
        plan = plan_roles(cfg)
        object.__setattr__(cfg, _KEPT, plan)  # the frozen dataclass's own escape hatch
    return plan


_KEPT = "_role_plan"


def trained_sections(cfg: Config) -> dict[str, ActorConfig | CriticConfig]:
    """The config section of each role the role plan trains with optimizer steps of its own
    (`RolePlan.trained`), by role name."""
    return {role: getattr(cfg, role) for role in role_plan(cfg).trained}


def policy_folder(path: str) -> str:
    """The model folder `path` names as a policy: a `proxima train` run folder's or a
    checkpoint's trained policy (its actor/; their own config.json is proxima's), else
    `path` itself. Read from the files alone."""
    actor = Path(path) / "actor"
    return str(actor) if (actor / "config.json").is_file() else path


def plan_roles(cfg: Config) -> RolePlan:
    """The role plan of `cfg`, built anew (`role_plan` builds it once per config)."""
    m = cfg.model
    rewards = tuple(reward_sources(cfg))
    fields: dict = {"actor_folder": m.actor_path, "rewards": rewards, "reference": "none"}
    if cfg.kl_in_reward or cfg.actor.use_kl_loss:
        if m.lora_rank > 0 and not m.reference_path:
            fields["reference"] = "adapters off"
        elif m.reference_path:
            fields.update(reference="folder", reference_folder=m.reference_path)
            fields["reference_key"] = "model.reference_path"
        else:  # a frozen copy of the actor's starting weights
            fields.update(reference="folder", reference_folder=m.actor_path)
            fields["reference_key"] = "model.actor_path"
    fields["estimator"] = cfg.algorithm.adv_estimator
    if m.teacher_path:
        fields.update(teacher_folder=policy_folder(m.teacher_path))
        fields.update(distill_coef=cfg.algorithm.distill_coef)
    if cfg.uses_critic and cfg.critic.shared_backbone:
        fields.update(critic="head", vf_coef=cfg.critic.vf_coef)
    elif cfg.uses_critic:
        folder, key = _critic_folder(cfg, rewards)
        fields.update(critic="model", critic_folder=folder, critic_key=key)
        fields.update(critic_init=m.critic_init, critic_lora=m.lora_rank > 0 and m.critic_lora)
    return RolePlan(**fields)


def _critic_folder(cfg: Config, rewards: tuple[RewardSource, ...]) -> tuple[str, str]:
    """(folder, config key) a value model starts from: explicit, else the first reward
    model or the actor."""
    m = cfg.model
    if m.critic_path:
        return m.critic_path, "model.critic_path"
    if m.critic_init == "reward_model":
        folders = [s.target for s in rewards if s.kind == "model_path"]
        if not folders:
            raise ConfigError(
                "`model.critic_init=reward_model` needs `reward.model_path` (or a "
                "`reward.sources` entry with a model_path) or `model.critic_path` (a reward "
                "model folder)."
            )
        return folders[0], "model.critic_init=reward_model"
    return m.actor_path, "model.actor_path"
