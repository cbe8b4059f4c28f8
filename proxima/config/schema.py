"""The whole config tree: the root `Config` (its derived values, `replace`), the sections of
the other commands (task, eval, sft, rm, dpo, pipeline) and `ConfigError`; the PPO run's
sections are in `sections`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from proxima.config.sections import (
    ActorConfig,
    AlgorithmConfig,
    CriticConfig,
    DataConfig,
    FSDPConfig,
    GuardConfig,
    ModelConfig,
    RewardConfig,
    RolloutConfig,
    TrainerConfig,
    _f,
)


class ConfigError(ValueError):
    """A configuration a user wrote that cannot run; the message says what to change."""


@dataclass(frozen=True)
class TaskConfig:
    name: str = _f(
        "",
        "Built-in task that prepares model, data and reward (e.g. `arithmetic`); "
        "empty to train on your own model.actor_path / data.train_path / reward. A recipe "
        "given your own data.train_path prepares nothing: its settings train your model, "
        "data and reward.",
        fixed=True,
    )
    arch: str = _f(
        "llama", "Architecture of the tiny model the task builds: llama|qwen2|gpt2|gpt_neox."
    )
    size: str = _f("tiny", "Size preset of the tiny model: nano|tiny|small.")
    digits: int = _f(2, "Arithmetic task: largest number of digits of each operand.")
    n_train: int = _f(4000, "Number of RL training prompts the task writes.")
    n_eval: int = _f(256, "Number of held-out evaluation prompts (never seen in SFT or RL).")
    n_sft: int = _f(1000, "Number of supervised (prompt, answer) pairs for the SFT warm start.")
    sft_steps: int = _f(3000, "Most optimizer steps of the SFT warm start (0 skips it).")
    sft_target_accuracy: float = _f(
        0.3,
        "Stop the SFT warm start once greedy accuracy on a "
        "validation split reaches this (0 = run all sft_steps).",
    )
    sft_check_every: int = _f(10, "SFT steps between two validation checks.")
    sft_smooth_checks: int = _f(
        3,
        "The SFT stopping rule compares the mean accuracy of this many last validation "
        "checks with sft_target_accuracy (1 = a single check, noisy).",
    )
    sft_lr: float = _f(3e-3, "Learning rate of the SFT warm start.")
    sft_batch_size: int = _f(64, "Batch size of the SFT warm start.")


@dataclass(frozen=True)
class EvalConfig:
    every: int = _f(0, "Evaluate on data.eval_path every N iterations (0 = only before and after).")
    max_prompts: int = _f(
        0, "Evaluate on at most this many prompts (0 = all); of each file, with several."
    )
    sampled: bool = _f(False, "Also evaluate with sampling at rollout.temperature.")
    n: int = _f(
        1,
        "Samples per held-out prompt: n > 1 also samples n responses per prompt (rollout's "
        "temperature) and reports unbiased pass@k for k = 1..n and mean@n (0/1 scores: a "
        "score of 1 counts as correct), per data_source when the prompts have that column.",
    )
    batch_size: int = _f(128, "Prompts per evaluation generate call.")
    out: str = _f(
        "",
        "`proxima eval`: also write the results as JSON to this file (a .jsonl file: JSON "
        "lines, one per evaluation mode).",
    )


@dataclass(frozen=True)
class SFTConfig:
    out: str = _f(
        "", "`proxima sft`: folder the fine-tuned model is written to (must not hold one)."
    )
    steps: int = _f(200, "`proxima sft`: optimizer steps.")
    lr: float = _f(1e-4, "`proxima sft`: peak learning rate (cosine to 10% after warm-up).")
    batch_size: int = _f(16, "`proxima sft`: records per step.")
    max_length: int = _f(512, "`proxima sft`: most tokens of prompt + response.")


@dataclass(frozen=True)
class RMConfig:
    train_path: str = _f("", "`proxima rm`: preference pairs (prompt, chosen, rejected[, margin]).")
    eval_path: str = _f("", "`proxima rm`: held-out pairs, evaluated before and after.")
    out: str = _f("", "`proxima rm`: folder the reward model is written to (must not hold one).")
    steps: int = _f(200, "`proxima rm`: optimizer steps.")
    lr: float = _f(1e-5, "`proxima rm`: peak learning rate (cosine to 10% after warm-up).")
    batch_size: int = _f(16, "`proxima rm`: pairs per step (prompts with rm.group_by_prompt).")
    group_by_prompt: bool = _f(
        False,
        "`proxima rm`: each step takes rm.batch_size prompts with all their pairs "
        "(InstructGPT: the K-choose-2 comparisons of K answers to a prompt in one batch "
        "element, K forward passes for them all), not rm.batch_size pairs drawn apart.",
    )
    max_length: int = _f(512, "`proxima rm`: most tokens of prompt + response.")
    overlong: str = _f("error", "`proxima rm`: pairs longer than max_length: error|drop.")
    chosen_key: str = _f("chosen", "`proxima rm`: column of the preferred response.")
    rejected_key: str = _f("rejected", "`proxima rm`: column of the other response.")
    margin_key: str = _f(
        "", "`proxima rm`: optional numeric column added as Llama 2's margin (empty = none)."
    )
    probe_size: int = _f(
        512,
        "`proxima rm`: the first N training pairs whose accuracy is measured before and after "
        "training (train_before / train_after); 0 = none (on a real model each costs a "
        "forward pass of both responses).",
    )
    normalize: bool = _f(
        True,
        "`proxima rm`: store the mean and std of the trained model's scores on the training "
        "pairs' responses in its config.json; a run that reads the model subtracts the mean "
        "and divides by the std (scores of mean 0, std 1 on the data it learned from).",
    )


@dataclass(frozen=True)
class DPOConfig:
    train_path: str = _f(
        "", "`proxima dpo`: preference pairs (prompt, chosen, rejected), as `proxima rm` reads."
    )
    eval_path: str = _f(
        "", "`proxima dpo`: held-out pairs, their implicit-reward accuracy before and after."
    )
    out: str = _f(
        "",
        "`proxima dpo`: new run folder: the trained policy in its actor/, metrics.jsonl, "
        "summary.json, curves.png.",
    )
    beta: float = _f(
        0.1,
        "`proxima dpo`: beta of the implicit reward beta * (log pi - log pi_ref): smaller "
        "lets the policy move further from the reference.",
    )
    loss_type: str = _f(
        "sigmoid",
        "`proxima dpo`: sigmoid (DPO, Rafailov et al. 2023) | ipo (Azar et al. 2023, on "
        "log-probs averaged per token).",
    )
    label_smoothing: float = _f(
        0.0,
        "`proxima dpo`: cDPO's probability that a label is flipped, in [0, 0.5) (sigmoid "
        "loss only).",
    )
    epochs: int = _f(1, "`proxima dpo`: passes over the training pairs.")
    lr: float = _f(
        1e-6, "`proxima dpo`: peak learning rate (cosine to 10% after warm-up), TRL's default."
    )
    warmup_steps: int = _f(0, "`proxima dpo`: optimizer steps of linear learning-rate warm-up.")
    batch_size: int = _f(
        16, "`proxima dpo`: pairs per optimizer step (prompts with dpo.group_by_prompt)."
    )
    group_by_prompt: bool = _f(
        False,
        "`proxima dpo`: each step takes dpo.batch_size prompts with all their pairs, as "
        "rm.group_by_prompt does (a response in several pairs is read once per step).",
    )
    grad_clip: float = _f(1.0, "`proxima dpo`: gradient-norm clip (0 = none).")
    max_length: int = _f(512, "`proxima dpo`: most tokens of prompt + response.")
    overlong: str = _f("error", "`proxima dpo`: pairs longer than max_length: error|drop.")
    chosen_key: str = _f("chosen", "`proxima dpo`: column of the preferred response.")
    rejected_key: str = _f("rejected", "`proxima dpo`: column of the other response.")
    eval_every: int = _f(
        0,
        "`proxima dpo`: optimizer steps between two held-out evaluations (0 = before and "
        "after training only).",
    )


@dataclass(frozen=True)
class PipelineConfig:
    task: str = _f(
        "preferences",
        "`proxima pipeline`: the built-in task that writes the prompts and names the gold "
        "when `prompts` is empty: preferences (letters, a tiny model) | chat (everyday "
        "requests to SmolLM2-135M-Instruct or model.actor_path, proxima/tasks/"
        "chat_preferences.py). With your `prompts` it writes nothing; chat then lends its "
        "model when model.actor_path is empty.",
    )
    gold: str = _f(
        "",
        "`proxima pipeline`: the gold scorer that labels the preferences and judges the "
        "policies, `file.py:fn` or `module:fn`, called like reward.function; empty = the "
        "built-in task's.",
    )
    prompts: str = _f(
        "",
        "`proxima pipeline`: prompt file (as data.train_path) for the preference pairs and "
        "PPO; empty = the built-in preference task writes its own.",
    )
    heldout: str = _f(
        "",
        "`proxima pipeline`: held-out prompt file for the reward model's accuracy and the "
        "gold evaluation; empty = heldout_size prompts of `prompts` set aside.",
    )
    heldout_size: int = _f(
        128, "`proxima pipeline`: prompts set aside as held-out when `heldout` is empty."
    )
    sft_data: str = _f(
        "",
        "`proxima pipeline`: demonstrations (prompt/response records) for the SFT stage; "
        "empty = no SFT, the pairs are sampled from model.actor_path.",
    )
    pairs: int = _f(
        2,
        "`proxima pipeline`: 2 x pairs responses are sampled per prompt and labelled in pairs "
        "(pipeline.pairing).",
    )
    pairing: str = _f(
        "consecutive",
        "`proxima pipeline`: which pairs of a prompt's 2 x pipeline.pairs training responses "
        "are labelled: consecutive (the 1st with the 2nd, the 3rd with the 4th, ...) or all "
        "(every two of them, as InstructGPT ranks K answers; pair it with rm.group_by_prompt "
        "so that each response is scored once per step). The held-out pairs, which measure "
        "the reward model, are consecutive either way.",
    )
    label_temperature: float = _f(
        0.5,
        "`proxima pipeline`: Bradley-Terry temperature of the labels, in units of the std of "
        "the sampled responses' gold scores: P(a > b) = sigmoid((g_a - g_b) / (T std)); "
        "0 = the better response always wins.",
    )
    label_noise: float = _f(
        0.0, "`proxima pipeline`: probability that a label is flipped (0 to 0.5)."
    )
    critic_from_rm: bool = _f(
        True,
        "`proxima pipeline`: the PPO critic starts from the reward model (as DeepSpeed-Chat "
        "and OpenRLHF do); false = from the SFT policy.",
    )
    eval_points: int = _f(
        10,
        "`proxima pipeline`: PPO checkpoints (evenly spaced, the last included) whose gold "
        "score, proxy score and KL are measured on the held-out prompts.",
    )
    eval_samples: int = _f(
        2, "`proxima pipeline`: sampled responses per held-out prompt in each evaluation."
    )
    kl_budget: float = _f(
        10.0,
        "`proxima pipeline`: the best checkpoint is the one with the highest held-out gold "
        "score whose KL to the SFT policy (nats per response) is at most this.",
    )
    dpo: bool = _f(
        False,
        "`proxima pipeline`: also train `proxima dpo` (dpo.*) on the same pairs from the SFT "
        "policy and evaluate it beside PPO: gold, proxy and KL on the held-out prompts.",
    )


@dataclass(frozen=True)
class Config:
    task: TaskConfig = field(default_factory=TaskConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    critic: CriticConfig = field(default_factory=CriticConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rm: RMConfig = field(default_factory=RMConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)

    @property
    def rollout_batch_size(self) -> int:
        """Sequences per iteration: prompts x samples per prompt."""
        return self.data.train_batch_size * self.rollout.n

    def steps_per_iteration(self, section: ActorConfig | CriticConfig) -> int:
        """Optimizer steps of a trained role per iteration: epochs x mini-batches."""
        return section.ppo_epochs * (self.rollout_batch_size // section.ppo_mini_batch_size)

    @property
    def kl_in_reward(self) -> bool:
        """Whether -kl_coef * KL goes into the token rewards: algorithm.use_kl_in_reward as
        set, and when unset (None) on unless the KL is already in the actor loss (verl's
        docs on actor.use_kl_loss: "When used, we are not applying KL in the reward
        function", https://verl.readthedocs.io/en/latest/examples/config.html); off when
        unset under adv_estimator=distill, which reads no token reward."""
        explicit = self.algorithm.use_kl_in_reward
        if explicit is None and self.algorithm.adv_estimator == "distill":
            return False  # it reads no token reward: the KL would be computed for nothing
        return (not self.actor.use_kl_loss) if explicit is None else explicit

    @property
    def uses_critic(self) -> bool:
        """The advantage estimator needs a value function (gae); the critic-free ones
        (grpo, rloo, ...) train none."""
        from proxima.algos import ADVANTAGE_ESTIMATORS

        estimator = ADVANTAGE_ESTIMATORS.get(self.algorithm.adv_estimator)
        return estimator is not None and estimator.critic

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, changes: dict[str, Any]) -> Config:
        """A new config with `{"section.key": value}` changed (the config is frozen)."""
        return _replace_dotted(self, changes)


def _replace_dotted(node: Any, changes: dict[str, Any]) -> Any:
    direct = {k: v for k, v in changes.items() if "." not in k}
    nested: dict[str, dict[str, Any]] = {}
    for key, value in changes.items():
        if "." in key:
            head, rest = key.split(".", 1)
            nested.setdefault(head, {})[rest] = value
    for head, sub in nested.items():
        direct[head] = _replace_dotted(getattr(node, head), sub)
    return dataclasses.replace(node, **direct)
