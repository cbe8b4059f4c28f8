"""The run's configuration: one tree of dataclasses, a help text per field.

Loaded from YAML, overridden on the command line as ``section.key=value``, validated
before anything heavy happens. Defaults are DeepSpeed-Chat's step-3 values (kl 0.1,
clip 0.2, value clip 0.2, reward clip 5, gamma 1.0, lam 0.95; learning rates from the
PPO-tricks seed: actor 5e-7, critic 9e-6).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A configuration a user wrote that cannot run; the message says what to change."""


def _f(default: Any, help: str) -> Any:  # noqa: A002 - `help` reads best in the tables below
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass(frozen=True)
class TaskConfig:
    name: str = _f(
        "",
        "Built-in task that prepares model, data and reward (e.g. `arithmetic`); "
        "empty to train on your own model.actor_path / data.train_path / reward.",
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
class ModelConfig:
    actor_path: str = _f("", "Hugging Face folder of the initial policy (usually an SFT model).")
    reference_path: str = _f(
        "",
        "Folder of the reference policy; empty = frozen copy of actor_path. Must share the "
        "policy's vocabulary (checked).",
    )
    critic_path: str = _f(
        "",
        "Folder the critic starts from; empty = actor_path. Its tokenizer must number every "
        "token as the policy's does (checked before any model loads).",
    )
    critic_init: str = _f(
        "actor",
        "How the critic starts: actor (backbone + new value head), "
        "reward_model (backbone and head of a reward model, as the PPO-tricks write-up advises; "
        "it must share the policy's vocabulary, checked before any model loads) or "
        "critic (a critic saved by proxima).",
    )
    dtype: str = _f(
        "float32",
        "Parameter dtype: float32|bfloat16|float16 (weights and optimizer state; for speed "
        "keep float32 and set mixed_precision).",
    )
    mixed_precision: str = _f(
        "no",
        "no | bf16: bfloat16 autocast for generation (hf engine), scoring, the reward model "
        "and the updates, with float32 master weights and optimizer state (model.dtype must "
        "be float32); the frozen reference and reward model are held in bfloat16.",
    )
    device: str = _f("auto", "cpu, cuda, cuda:1, ... or auto (cuda when available).")
    lora_rank: int = _f(
        0,
        "LoRA rank r (0 = full fine-tuning). With r > 0 only low-rank adapters are trained and "
        "the reference is the actor with its adapters disabled (no second copy of the weights).",
    )
    lora_alpha: float = _f(16.0, "LoRA scaling numerator: adapters add (lora_alpha / r) B A x.")
    lora_dropout: float = _f(
        0.0,
        "Dropout on the LoRA input; keep 0 for PPO (dropout makes the first ratio differ from 1).",
    )
    lora_target_modules: list = _f(
        [],
        "Module names that get adapters (e.g. [q_proj, v_proj]); empty = every linear layer "
        "of the backbone (peft's all-linear, heads excluded).",
    )
    critic_lora: bool = _f(
        True,
        "With lora_rank > 0, train the critic's backbone through LoRA too; its value head "
        "stays fully trainable. False trains the whole critic.",
    )


@dataclass(frozen=True)
class DataConfig:
    train_path: str = _f(
        "", "Prompt file: .jsonl/.json/.parquet/.csv or a datasets.save_to_disk folder."
    )
    eval_path: str = _f("", "Held-out prompt file for in-loop evaluation (optional).")
    prompt_key: str = _f("prompt", "Column holding the prompt (a string or a chat message list).")
    max_prompt_length: int = _f(256, "Longest prompt in tokens.")
    overlong_prompts: str = _f("error", "What to do with longer prompts: error|drop|truncate.")
    train_batch_size: int = _f(64, "Prompts per PPO iteration (each sampled rollout.n times).")
    sft_path: str = _f(
        "", "Prompt/response records for the ptx (SFT) loss; used when actor.ptx_coef > 0."
    )
    response_key: str = _f("response", "Column holding the response in SFT records.")


@dataclass(frozen=True)
class VLLMConfig:
    """`rollout.name=vllm`: the engine options users know from verl's rollout config."""

    tensor_model_parallel_size: int = _f(
        1,
        "GPUs one vLLM engine shards the model over; > 1 needs a torchrun launch with that "
        "many processes (vLLM's external_launcher).",
    )
    gpu_memory_utilization: float = _f(
        0.5,
        "Share of GPU memory vLLM may take for weights and KV cache, next to training "
        "(colocated); ignored on CPU (see VLLM_CPU_KVCACHE_SPACE in the README).",
    )
    enable_prefix_caching: bool = _f(
        True,
        "Reuse the KV cache of shared prompt prefixes (the rollout.n samples of a prompt); "
        "reset after every weight push.",
    )
    enable_sleep_mode: bool = _f(
        True,
        "Release the KV cache (and offload the weights) between rollouts so training gets "
        "the memory back; where the platform supports it (CUDA; a no-op on CPU).",
    )
    enforce_eager: bool = _f(
        True,
        "Run eagerly; False captures CUDA graphs and compiles: faster decoding on a GPU, "
        "a slower start.",
    )
    dtype: str = _f(
        "auto", "Weights and activations in vLLM: auto (= model.dtype)|float32|bfloat16|float16."
    )
    seed: int = _f(
        0,
        "vLLM's engine seed (offset by rank). Each request's sampling seed is drawn from "
        "the trainer's RNG, so a resumed run replays its rollouts.",
    )


@dataclass(frozen=True)
class RolloutConfig:
    name: str = _f(
        "hf",
        "Rollout engine: hf (transformers generate with the KV cache on the actor itself; "
        "works everywhere) | vllm (vLLM in the training process, weights pushed after each "
        "update; needs the vllm or vllm-cpu package, see the README).",
    )
    n: int = _f(
        1,
        "Samples per prompt. grpo / rloo / reinforce_plus_plus_baseline want > 1: with 1, as "
        "in verl, the advantage is the raw score (no baseline) and a warning says so.",
    )
    max_response_length: int = _f(128, "Most new tokens per response.")
    temperature: float = _f(
        1.0, "Sampling temperature; log-probs are computed from logits / temperature."
    )
    top_p: float = _f(1.0, "Nucleus sampling threshold (1.0 = off).")
    top_k: int = _f(0, "Top-k sampling (0 = off).")
    stop_token_ids: list = _f([], "Token ids that end a response besides the tokenizer's EOS.")
    no_stop_penalty: float = _f(
        0.0,
        "Added to the score of responses that hit max_response_length "
        "without a stop token (e.g. -1.0); 0 disables.",
    )
    micro_batch_size: int = _f(
        64, "Sequences per generation call (hf engine) and per scoring forward pass."
    )
    old_logprobs: str = _f(
        "auto",
        "PPO's old log-probs: recompute (an actor forward pass over the rollout), engine (the "
        "engine's own log-probs of the sampled tokens: one forward pass less, numerics of "
        "generation) or auto (engine where both are the same quantity: hf engine, float32 "
        "without mixed precision, top_k=0, top_p=1, no rollout correction, and no sampling "
        "option in the actor's generation_config; else recompute). "
        "actor/first_logratio_abs shows the gap on the first mini-batch.",
    )
    logprob_diff_warn: float = _f(
        0.05,
        "Warn when rollout/logprob_diff_mean (mean |engine log-prob - trainer log-prob| over "
        "response tokens, logged every iteration) exceeds this; 0 disables the warning.",
    )
    vllm: VLLMConfig = field(default_factory=VLLMConfig)


@dataclass(frozen=True)
class KLControlConfig:
    type: str = _f("fixed", "fixed|adaptive (Ziegler et al. 2019).")
    kl_coef: float = _f(0.1, "(Initial) coefficient of the in-reward KL penalty (beta).")
    target_kl: float = _f(6.0, "Adaptive controller: KL per sequence it steers toward.")
    horizon: int = _f(10000, "Adaptive controller: horizon in samples.")


@dataclass(frozen=True)
class AlgorithmConfig:
    adv_estimator: str = _f(
        "gae", "gae|grpo|rloo|reinforce_plus_plus|reinforce_plus_plus_baseline."
    )
    gamma: float = _f(1.0, "Discount factor.")
    lam: float = _f(0.95, "GAE lambda.")
    whiten_advantages: bool = _f(
        True, "Whiten advantages over the batch (masked) before the update."
    )
    norm_adv_by_std_in_grpo: bool = _f(True, "GRPO: divide by the group's std (False = Dr.GRPO).")
    use_kl_in_reward: bool | None = _f(
        None,
        "Put -kl_coef * KL into the token rewards. Unset (null): on, unless actor.use_kl_loss "
        'is on; then the KL is in the loss only, as in verl ("When used, we are not applying '
        'KL in the reward function") and start-up says so. true together with '
        "actor.use_kl_loss=true counts the KL twice (reward and loss): only when set explicitly.",
    )
    kl_penalty: str = _f(
        "k1",
        "KL estimator in the reward: k1 (kl) | abs | k2 (mse) | k3 (low_var_kl) | full "
        "(exact over the vocabulary; one more forward pass pair per scoring micro-batch); "
        "a `+` suffix (k3+, ...) keeps the value with k2's gradient (verl), which only "
        "matters in a loss.",
    )
    kl_ctrl: KLControlConfig = field(default_factory=KLControlConfig)
    normalize_scores: bool = _f(
        False,
        "Standardise scores by the running mean and std of every score seen so far "
        "(OpenRLHF's normalize_reward), before clipping; the logged `score` stays raw.",
    )
    clip_reward_value: float = _f(
        5.0, "Scores are clipped to [-c, c] (DeepSpeed-Chat's clip_reward_value); 0 disables."
    )
    rollout_correction: str = _f(
        "",
        "Truncated importance sampling against the rollout engine's own log-probs mu (TIS, "
        "verl's rollout_is): each token's policy loss is weighted by min(pi_old / mu, "
        "rollout_correction_cap), per token (token) or per sequence (sequence); empty = off.",
    )
    rollout_correction_cap: float = _f(
        2.0, "Cap of the rollout correction weights (verl's rollout_is_threshold); >= 1."
    )


@dataclass(frozen=True)
class OptimConfig:
    lr: float = _f(5e-7, "AdamW learning rate.")
    weight_decay: float = _f(0.0, "AdamW weight decay.")
    betas: list = _f([0.9, 0.95], "AdamW betas.")
    eps: float = _f(1e-8, "AdamW epsilon.")
    warmup_steps: int = _f(0, "Linear warm-up in optimizer steps.")
    schedule: str = _f("constant", "constant|cosine (after warm-up).")
    min_lr_ratio: float = _f(0.0, "Cosine schedule floor as a fraction of lr.")
    grad_clip: float = _f(1.0, "Max global gradient norm (0 disables).")


@dataclass(frozen=True)
class ActorConfig:
    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo_epochs: int = _f(1, "Passes over the batch of experience per iteration.")
    ppo_mini_batch_size: int = _f(64, "Sequences per optimizer step.")
    ppo_micro_batch_size: int = _f(
        16, "Sequences per forward/backward (gradient accumulation); never changes the result."
    )
    shuffle: bool = _f(True, "Shuffle the experience into new mini-batches every epoch.")
    policy_loss: str = _f(
        "vanilla",
        "Policy loss, by verl's actor.policy_loss.loss_mode name: vanilla (PPO's clipped "
        "surrogate with the dual clip).",
    )
    clip_ratio: float = _f(0.2, "PPO clip range epsilon.")
    clip_ratio_low: float = _f(0.0, "Lower clip range (0 = clip_ratio).")
    clip_ratio_high: float = _f(
        0.0, "Upper clip range (0 = clip_ratio; > clip_ratio = clip-higher)."
    )
    clip_ratio_c: float = _f(
        3.0, "Dual-clip bound for negative advantages (0 disables; must be > 1)."
    )
    loss_agg_mode: str = _f(
        "token-mean",
        "token-mean|token-sum|seq-mean-token-sum|seq-mean-token-mean|seq-mean-token-sum-norm.",
    )
    entropy_coef: float = _f(0.0, "Entropy bonus coefficient (c2).")
    use_kl_loss: bool = _f(False, "Add kl_loss_coef * KL(actor || reference) to the actor loss.")
    kl_loss_coef: float = _f(0.001, "Coefficient of the KL loss.")
    kl_loss_type: str = _f(
        "low_var_kl",
        "KL estimator of the KL loss: k1|abs|k2|k3 (or their aliases), their straight-through "
        "forms k1+|k2+|k3+ (the value of the estimator, the gradient of k2; verl), or full "
        "(exact over the vocabulary; one more reference forward pass per micro-batch).",
    )
    ptx_coef: float = _f(0.0, "Coefficient of the SFT (ptx) loss on data.sft_path.")
    target_kl: float = _f(
        0.0,
        "Early stopping on the old-policy KL (PPO-KL, as Stable-Baselines3 and OpenRLHF): skip "
        "the iteration's remaining actor epochs once a finished epoch's mean approx_kl "
        "exceeds this; counted as actor/early_stopped. 0 = off (e.g. 0.02 with ppo_epochs > 1).",
    )


@dataclass(frozen=True)
class CriticConfig:
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=9e-6))
    ppo_epochs: int = _f(1, "Passes over the batch of experience per iteration.")
    ppo_mini_batch_size: int = _f(64, "Sequences per optimizer step.")
    ppo_micro_batch_size: int = _f(16, "Sequences per forward/backward.")
    shuffle: bool = _f(True, "Shuffle the experience into new mini-batches every epoch.")
    cliprange_value: float = _f(0.2, "Value clip range around the rollout values (0 disables).")
    loss_agg_mode: str = _f("token-mean", "Aggregation of the value loss (as actor.loss_agg_mode).")
    warmup_iterations: int = _f(
        0,
        "First iterations train only the critic (actor frozen; with shared_backbone only the "
        "value head).",
    )
    shared_backbone: bool = _f(
        False,
        "One network for policy and value (seed 001): the critic is a value head on the "
        "actor's final hidden state. One model less in memory; no critic pass when scoring "
        "(the values come with the actor's pass, or from generation when the old log-probs "
        "do); one forward/backward per micro-batch for loss = actor loss + vf_coef x value "
        "loss. The actor's epochs, batch sizes and schedule apply; critic.optim.lr is the "
        "value head's learning rate.",
    )
    vf_coef: float = _f(
        0.5,
        "With shared_backbone: weight of the value loss in the shared network's loss (seed "
        "001: c1 in [0.5, 1.0]).",
    )


@dataclass(frozen=True)
class RewardConfig:
    function: str = _f(
        "",
        "Python reward `path/to/file.py:fn` or `package.module:fn`, called as "
        "fn(prompts, responses, **columns) -> list[float].",
    )
    model_path: str = _f("", "Reward model folder (sequence classification, one label).")
    batch_size: int = _f(64, "Sequences per reward model forward.")


@dataclass(frozen=True)
class EvalConfig:
    every: int = _f(0, "Evaluate on data.eval_path every N iterations (0 = only before and after).")
    max_prompts: int = _f(0, "Evaluate on at most this many prompts (0 = all).")
    sampled: bool = _f(False, "Also evaluate with sampling at rollout.temperature.")
    batch_size: int = _f(128, "Prompts per evaluation generate call.")
    out: str = _f("", "`proxima eval`: also write the results as JSON to this file.")


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
    batch_size: int = _f(16, "`proxima rm`: pairs per step.")
    max_length: int = _f(512, "`proxima rm`: most tokens of prompt + response.")
    overlong: str = _f("error", "`proxima rm`: pairs longer than max_length: error|drop.")
    chosen_key: str = _f("chosen", "`proxima rm`: column of the preferred response.")
    rejected_key: str = _f("rejected", "`proxima rm`: column of the other response.")
    margin_key: str = _f(
        "", "`proxima rm`: optional numeric column added as Llama 2's margin (empty = none)."
    )


@dataclass(frozen=True)
class TrainerConfig:
    iterations: int = _f(100, "PPO iterations (each: generate, score, update).")
    seed: int = _f(42, "Seed of everything (offset by rank).")
    output_dir: str = _f(
        "runs/proxima", "Run folder: metrics, samples, plots, checkpoints, models."
    )
    save_every: int = _f(
        0,
        "Write a full checkpoint (models, optimizers, RNG, step) to "
        "output_dir/checkpoints/iter_N every N iterations (0 = only by time: save_every_minutes); "
        "one is always written at the end and when the run is stopped (Ctrl-C, SIGTERM).",
    )
    save_every_minutes: float = _f(
        30.0,
        "Also write a checkpoint once this many minutes have passed since the last one (0 = "
        "off), so a killed run loses at most that much; iterations whose metrics look "
        "diverged (guard.*) are not saved.",
    )
    keep_checkpoints: int = _f(
        2, "Newest checkpoints kept in output_dir/checkpoints (older ones deleted; 0 = keep all)."
    )
    resume_from: str = _f(
        "",
        "Checkpoint folder (run/checkpoints/iter_N) or run folder (its latest checkpoint) to "
        "continue from, with the same config; raise trainer.iterations to train longer. "
        "Writes a new run folder.",
    )
    log_samples: int = _f(4, "Sample generations written to samples.jsonl per iteration.")
    tensorboard: bool = _f(True, "Also write TensorBoard scalars to output_dir/tb.")
    threads: int = _f(0, "torch CPU threads per process (0 = torch's default).")
    strategy: str = _f(
        "auto",
        "Data parallelism across the processes torchrun starts: auto (none for one process, "
        "ddp otherwise) | none | ddp (DistributedDataParallel) | fsdp2 (fully_shard).",
    )
    dist_backend: str = _f(
        "auto",
        "torch.distributed backend: auto (gloo on CPU, nccl on CUDA), a name, or "
        "a map like cpu:gloo,cuda:nccl.",
    )
    dist_timeout_s: float = _f(
        600.0, "Seconds a collective may wait for the other ranks before the job fails."
    )


@dataclass(frozen=True)
class FSDPConfig:
    reshard_after_forward: bool = _f(
        True,
        "FSDP2: free the gathered parameters after each forward (less memory, one more "
        "all-gather in backward).",
    )
    param_dtype: str = _f(
        "float32",
        "FSDP2 mixed precision: dtype of gathered parameters in compute "
        "(float32|bfloat16|float16); the sharded master weights keep model.dtype.",
    )
    reduce_dtype: str = _f("float32", "FSDP2 mixed precision: dtype of the gradient reduction.")
    offload_frozen: bool = _f(
        False, "FSDP2: keep the frozen reference model's shards on the CPU (CPUOffloadPolicy)."
    )


@dataclass(frozen=True)
class GuardConfig:
    patience: int = _f(
        3,
        "Stop the run after this many consecutive unhealthy iterations (collapse: see the "
        "other guard.* keys), keeping the last good checkpoint as the result; 0 = never. "
        "Non-finite weights or outputs always stop the run at once.",
    )
    min_entropy: float = _f(
        1e-4,
        "An iteration is unhealthy when actor/entropy (nats per response token) is below this: "
        "the policy collapsed onto single tokens.",
    )
    max_kl_per_token: float = _f(
        5.0,
        "An iteration is unhealthy when the KL to the reference per response token (kl / "
        "response_length) is above this: a KL runaway (reward hacking when the score rises); "
        "0 = off.",
    )
    min_length_ratio: float = _f(
        0.1,
        "An iteration is unhealthy when the mean response length falls below this fraction "
        "of the run's first iteration's (length collapse); 0 = off.",
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
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    fsdp: FSDPConfig = field(default_factory=FSDPConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)

    @property
    def rollout_batch_size(self) -> int:
        """Sequences per iteration: prompts x samples per prompt."""
        return self.data.train_batch_size * self.rollout.n

    @property
    def kl_in_reward(self) -> bool:
        """Whether -kl_coef * KL goes into the token rewards: algorithm.use_kl_in_reward as
        set, and when unset (None) on unless the KL is already in the actor loss (verl's
        docs on actor.use_kl_loss: "When used, we are not applying KL in the reward
        function", https://verl.readthedocs.io/en/latest/examples/config.html)."""
        explicit = self.algorithm.use_kl_in_reward
        return (not self.actor.use_kl_loss) if explicit is None else explicit

    @property
    def uses_critic(self) -> bool:
        """The advantage estimator needs a value function (gae); the critic-free ones
        (grpo, rloo, ...) train none."""
        from proxima.algos import ADVANTAGE_ESTIMATORS

        estimator = ADVANTAGE_ESTIMATORS.get(self.algorithm.adv_estimator)
        return estimator is not None and estimator.critic

    @property
    def critic_on_actor(self) -> bool:
        """The critic is a value head on the actor's backbone (critic.shared_backbone), not
        a value model of its own."""
        return self.uses_critic and self.critic.shared_backbone

    def trained_roles(self) -> dict[str, ActorConfig | CriticConfig]:
        """The config section of each role PPO trains with its own optimizer steps, by role
        name (a shared-backbone critic is trained in the actor's steps)."""
        if self.critic.shared_backbone:
            return {"actor": self.actor}
        return {"actor": self.actor, "critic": self.critic}

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


# --------------------------------------------------------------------------- building


def _field_types(cls: type) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _suggest(key: str, valid: list[str], prefix: str = "") -> str:
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f" Did you mean `{prefix}{close[0]}`?" if close else ""
    return f"{hint} Valid keys: {', '.join(valid)}."


def _coerce(value: Any, typ: Any, where: str) -> Any:
    """Check a YAML value against a field type; ints are accepted for floats."""
    if isinstance(typ, types.UnionType) or typing.get_origin(typ) is typing.Union:
        if value is None:
            return None
        inner = [t for t in typing.get_args(typ) if t is not type(None)]
        return _coerce(value, inner[0], where) if len(inner) == 1 else value
    if typ is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if typ is float and isinstance(value, str):  # YAML 1.1 reads `1e-5` (no dot) as a string
        try:
            return float(value)
        except ValueError:
            pass
    if typ is bool and not isinstance(value, bool):
        raise ConfigError(f"`{where}` must be true or false, got {value!r}.")
    if typ is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"`{where}` must be an integer, got {value!r}.")
    if typ is float and not isinstance(value, float):
        raise ConfigError(f"`{where}` must be a number, got {value!r}.")
    if typ is str and not isinstance(value, str):
        if value is None:
            return ""
        raise ConfigError(f"`{where}` must be a string, got {value!r}. Quote it in YAML.")
    if typ is list and not isinstance(value, list):
        raise ConfigError(f"`{where}` must be a list like [1, 2], got {value!r}.")
    return value


def _build(cls: type, data: dict, prefix: str) -> Any:
    if not isinstance(data, dict):
        raise ConfigError(f"`{prefix.rstrip('.') or 'config'}` must be a mapping, got {data!r}.")
    ftypes = _field_types(cls)
    kwargs = {}
    for key, value in data.items():
        where = prefix + key
        if key not in ftypes:
            raise ConfigError(
                f"Unknown config key `{where}`." + _suggest(key, list(ftypes), prefix)
            )
        typ = ftypes[key]
        if dataclasses.is_dataclass(typ):
            kwargs[key] = _build(typ, value or {}, where + ".")
        else:
            kwargs[key] = _coerce(value, typ, where)
    return cls(**kwargs)


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"Cannot set `{dotted}`: `{part}` is not a section.")
        node = child
    node[parts[-1]] = value


def _yaml_problem(err: yaml.YAMLError) -> str:
    """What PyYAML was parsing and what it found, with 1-based line and column."""
    parts = []
    for text, mark in (
        (getattr(err, "context", None), getattr(err, "context_mark", None)),
        (getattr(err, "problem", None), getattr(err, "problem_mark", None)),
    ):
        if text:
            where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
            parts.append(text + where)
    return "; ".join(parts) or str(err)


def parse_overrides(items: list[str]) -> dict:
    """`["a.b=1", "c.d=x"]` -> nested dict; values parsed as YAML scalars."""
    tree: dict = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"Override `{item}` is not of the form section.key=value.")
        key, raw = item.split("=", 1)
        if not key.strip() or "" in key.strip().split("."):
            raise ConfigError(f"Override `{item}` has no key: write section.key=value.")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as err:
            raise ConfigError(
                f"Override `{item}`: the value {raw!r} is not valid YAML ({_yaml_problem(err)}). "
                f"Fix it, e.g. {key}=[1, 2] for a list, or quote a string: {key}='{raw}'."
            ) from None
        _set_dotted(tree, key.strip(), value)
    return tree


def read_yaml(path: Path) -> dict:
    """The mapping a YAML config file holds; ConfigError naming the file otherwise."""
    try:
        tree = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ConfigError(
            f"Config file {path} is not valid YAML ({_yaml_problem(err)}). Fix that line "
            "(indentation, a missing colon or bracket, an unquoted special character)."
        ) from None
    except (UnicodeDecodeError, OSError) as err:
        raise ConfigError(f"Config file {path} cannot be read as text ({err}).") from None
    if tree is None:
        return {}
    if not isinstance(tree, dict):
        raise ConfigError(
            f"Config file {path} holds a {type(tree).__name__} at the top level; a config is a "
            "mapping of sections, e.g.\n  model:\n    actor_path: path/to/model\n  trainer:\n"
            "    iterations: 100"
        )
    return tree


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


def load_config(
    path: str | Path | None = None,
    overrides: list[str] | None = None,
    base: dict | None = None,
    command: str = "train",
) -> Config:
    """Read YAML (or start from `base`, e.g. a checkpoint's saved config), apply `a.b=c`
    overrides, build and validate the config for `command` (train|sft|rm|eval)."""
    tree: dict = dict(base or {})
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(
                f"Config file {path} not found. Pass an existing YAML file "
                "or no file at all for the built-in default example."
            )
        tree = read_yaml(path)
    tree = _merge(tree, parse_overrides(overrides or []))
    cfg = _build(Config, tree, "")
    validate(cfg)
    if command != "train" or not cfg.task.name:  # a task names its sources when prepared
        check_sources(cfg, command)
    return cfg


# --------------------------------------------------------------------------- validation

_CHOICES = {
    "model.critic_init": ("actor", "reward_model", "critic"),
    "model.dtype": ("float32", "bfloat16", "float16"),
    "rollout.name": ("hf", "vllm"),
    "rollout.old_logprobs": ("auto", "engine", "recompute"),
    "model.mixed_precision": ("no", "bf16"),
    "rollout.vllm.dtype": ("auto", "float32", "bfloat16", "float16"),
    "data.overlong_prompts": ("error", "drop", "truncate"),
    "algorithm.kl_ctrl.type": ("fixed", "adaptive"),
    "actor.optim.schedule": ("constant", "cosine"),
    "critic.optim.schedule": ("constant", "cosine"),
    "rm.overlong": ("error", "drop"),
    "trainer.strategy": ("auto", "none", "ddp", "fsdp2"),
    "fsdp.param_dtype": ("float32", "bfloat16", "float16"),
    "fsdp.reduce_dtype": ("float32", "bfloat16", "float16"),
}


def _get(cfg: Config, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def world_size() -> int:
    """Processes in this job: torchrun's WORLD_SIZE, 1 without torchrun."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def _check_batch_sizes(cfg: Config, world: int) -> None:
    """Sizes in sequences; train_batch_size and ppo_mini_batch_size are global (all
    processes together), ppo_micro_batch_size is per process (verl's convention)."""
    rollout = cfg.rollout_batch_size
    if cfg.data.train_batch_size % world:
        raise ConfigError(
            f"`data.train_batch_size`={cfg.data.train_batch_size} is global: it must split "
            f"evenly over the {world} processes. Pick a multiple of {world}."
        )
    for role, sec in cfg.trained_roles().items():
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


def _algorithm_choices() -> dict[str, tuple[str, ...]]:
    """Names the math in proxima.algos accepts, checked before any model is loaded."""
    from proxima.algos import ADVANTAGE_ESTIMATORS, AGG_MODES, KL_ESTIMATORS, POLICY_LOSSES

    return {
        "algorithm.adv_estimator": tuple(ADVANTAGE_ESTIMATORS),
        "actor.policy_loss": tuple(POLICY_LOSSES),
        "algorithm.kl_penalty": (*KL_ESTIMATORS, "full"),
        "actor.kl_loss_type": (*KL_ESTIMATORS, "full"),
        "actor.loss_agg_mode": AGG_MODES,
        "critic.loss_agg_mode": AGG_MODES,
    }


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
    modules = cfg.model.lora_target_modules
    if not all(isinstance(m, str) and m for m in modules):
        raise ConfigError(
            f"`model.lora_target_modules` must be a list of module names, like "
            f"[q_proj, v_proj]; got {modules!r}."
        )


def _check_optim(cfg: Config) -> None:
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


def validate(cfg: Config) -> None:
    """Raise ConfigError naming the key for anything that cannot run (any command)."""
    for key, choices in {**_CHOICES, **_algorithm_choices()}.items():
        if _get(cfg, key) not in choices:
            raise ConfigError(
                f"`{key}` must be one of {', '.join(choices)}; got {_get(cfg, key)!r}."
            )
    for key in (
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
        "sft.steps",
        "sft.batch_size",
        "sft.max_length",
        "rm.steps",
        "rm.batch_size",
        "rm.max_length",
    ):
        if _get(cfg, key) <= 0:
            raise ConfigError(f"`{key}` must be positive, got {_get(cfg, key)}.")
    if cfg.trainer.iterations <= 0:
        raise ConfigError(
            f"`trainer.iterations` must be >= 1, got {cfg.trainer.iterations}: a run trains at "
            "least one iteration (use `proxima eval` to only evaluate)."
        )
    for key in (
        "trainer.save_every",
        "trainer.save_every_minutes",
        "trainer.keep_checkpoints",
        "guard.patience",
        "guard.min_entropy",
        "guard.max_kl_per_token",
        "guard.min_length_ratio",
    ):
        if _get(cfg, key) < 0:
            raise ConfigError(f"`{key}` must be >= 0, got {_get(cfg, key)}.")
    _check_lora(cfg.model)
    _check_lists(cfg)
    _check_optim(cfg)
    if cfg.actor.target_kl < 0:
        raise ConfigError(
            f"`actor.target_kl` must be >= 0 (0 = no early stopping), got {cfg.actor.target_kl}."
        )
    if cfg.rollout.temperature <= 0:
        raise ConfigError(
            "`rollout.temperature` must be > 0 (use a small value such as 1e-3 "
            "for near-greedy sampling)."
        )
    if cfg.model.mixed_precision != "no" and cfg.model.dtype != "float32":
        raise ConfigError(
            f"`model.mixed_precision={cfg.model.mixed_precision}` keeps float32 master weights "
            f"and autocasts the compute; `model.dtype` is {cfg.model.dtype}. Set "
            "model.dtype=float32 (or mixed_precision=no to train in that dtype)."
        )
    if cfg.rollout.old_logprobs == "engine" and cfg.algorithm.rollout_correction:
        raise ConfigError(
            "`rollout.old_logprobs=engine` makes the engine's log-probs the old policy, so "
            "`algorithm.rollout_correction` (which weights by old / engine) would always be 1. "
            "Use rollout.old_logprobs=recompute, or turn rollout_correction off."
        )
    if not 0 < cfg.rollout.top_p <= 1:
        raise ConfigError("`rollout.top_p` must be in (0, 1].")
    if not 0 < cfg.rollout.vllm.gpu_memory_utilization <= 1:
        raise ConfigError(
            "`rollout.vllm.gpu_memory_utilization` must be in (0, 1] (a share of GPU memory), "
            f"got {cfg.rollout.vllm.gpu_memory_utilization}."
        )
    if cfg.algorithm.rollout_correction not in ("", "token", "sequence"):
        raise ConfigError(
            "`algorithm.rollout_correction` must be token, sequence or empty (off); got "
            f"{cfg.algorithm.rollout_correction!r}."
        )
    if cfg.algorithm.rollout_correction_cap < 1:
        raise ConfigError(
            "`algorithm.rollout_correction_cap` must be >= 1 (weights above it are truncated), "
            f"got {cfg.algorithm.rollout_correction_cap}; verl uses 2.0."
        )
    if cfg.rollout.logprob_diff_warn < 0:
        raise ConfigError("`rollout.logprob_diff_warn` must be >= 0 (0 disables the warning).")
    if cfg.actor.clip_ratio_c and cfg.actor.clip_ratio_c <= 1:
        raise ConfigError("`actor.clip_ratio_c` must be > 1 (dual clip) or 0 to disable it.")
    if cfg.actor.ptx_coef > 0 and not cfg.data.sft_path:
        raise ConfigError("`actor.ptx_coef` > 0 needs `data.sft_path` (prompt/response records).")
    if cfg.algorithm.adv_estimator != "gae" and cfg.critic.warmup_iterations:
        raise ConfigError(
            "`critic.warmup_iterations` needs a critic; the estimator "
            f"`{cfg.algorithm.adv_estimator}` trains none. Set it to 0."
        )
    _check_shared_backbone(cfg)
    if cfg.trainer.strategy == "fsdp2" and cfg.model.lora_rank:
        raise ConfigError(
            "`trainer.strategy=fsdp2` with `model.lora_rank` > 0 is not supported yet: use "
            "trainer.strategy=ddp for LoRA (its adapters are small), or model.lora_rank=0."
        )
    if cfg.rollout.name == "vllm" and world_size() > 1:
        raise ConfigError(
            "`rollout.name=vllm` in a multi-process (torchrun) job is not supported yet: use "
            "rollout.name=hf with several processes, or vllm in a single process."
        )
    _check_batch_sizes(cfg, world_size())


def _check_shared_backbone(cfg: Config) -> None:
    """critic.shared_backbone: the value head reads the actor's own backbone, so anything
    that gives the critic a model, a schedule or steps of its own cannot apply."""
    c, m = cfg.critic, cfg.model
    if not c.shared_backbone:
        return
    why = ""
    if cfg.algorithm.adv_estimator != "gae":
        why = f"the estimator `{cfg.algorithm.adv_estimator}` uses no critic"
        fix = "set algorithm.adv_estimator=gae, or critic.shared_backbone=false"
    elif m.critic_path or m.critic_init != "actor":
        why = "`model.critic_path` / `model.critic_init` name a separate critic model"
        fix = "leave model.critic_path empty and model.critic_init=actor"
    elif cfg.rollout.name != "hf" and cfg.rollout.old_logprobs == "engine":
        why = (
            f"with `rollout.old_logprobs=engine` the values would come from the generation, "
            f"which only the hf engine can give (rollout.name={cfg.rollout.name})"
        )
        fix = "set rollout.old_logprobs=auto (one actor pass gives log-probs and values)"
    elif c.vf_coef <= 0:
        why = f"`critic.vf_coef`={c.vf_coef} would never train the value head"
        fix = "set critic.vf_coef > 0 (0.5 to 1.0, seed 001)"
    if why:
        raise ConfigError(f"`critic.shared_backbone=true`: {why}. Fix: {fix}.")


def _require(cfg: Config, key: str, what: str) -> None:
    if not _get(cfg, key):
        raise ConfigError(f"`{key}` is empty. Set it to {what}.")


def _require_one_reward(cfg: Config, flags: bool = False) -> None:
    if bool(cfg.reward.function) == bool(cfg.reward.model_path):
        fn, rm = (" (--reward)", " (--reward-model)") if flags else ("", "")
        raise ConfigError(
            f"Set exactly one of `reward.function`{fn} (path.py:fn or module:fn) "
            f"and `reward.model_path`{rm} (a reward model folder)."
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
    elif command == "sft":
        _require(cfg, "model.actor_path", model + " (--model)")
        _require(cfg, "data.sft_path", "a file of prompt/response records (--data)")
        _require(cfg, "sft.out", "a new folder for the fine-tuned model (--out)")
    elif command == "rm":
        _require(cfg, "model.actor_path", model + ", the model to start from (--model)")
        _require(cfg, "rm.train_path", "a file of preference pairs (--data)")
        _require(cfg, "rm.out", "a new folder for the reward model (--out)")
    elif command == "eval":
        _require(cfg, "model.actor_path", model + " (--model)")
        _require(cfg, "data.eval_path", "a prompt file (--data)")
        _require_one_reward(cfg, flags=True)


def batch_plan(cfg: Config, world: int = 1) -> str:
    """Human-readable batch plan, printed at start-up: one unit (sequences), every count,
    global and per process."""
    rollout = cfg.rollout_batch_size
    lines = [
        f"batch plan: {cfg.data.train_batch_size} prompts x {cfg.rollout.n} samples = "
        f"{rollout} sequences per iteration"
        + (f" ({rollout // world} per process, {world} processes)" if world > 1 else "")
    ]
    for role, sec in cfg.trained_roles().items():
        mini = sec.ppo_mini_batch_size
        n_mini = rollout // mini
        n_micro = mini // world // sec.ppo_micro_batch_size
        per = f" ({mini // world} per process)" if world > 1 else ""
        lines.append(
            f"  {role:6s}: {sec.ppo_epochs} epoch(s) x {n_mini} mini-batch(es) of "
            f"{mini}{per} = {sec.ppo_epochs * n_mini} optimizer step(s) per "
            f"iteration; {n_micro} micro-batch(es) of {sec.ppo_micro_batch_size}"
        )
    if cfg.critic.shared_backbone:
        lines.append(
            f"  critic: a value head on the actor's backbone, trained in the actor's steps "
            f"(loss + {cfg.critic.vf_coef:g} x value loss)"
        )
    elif cfg.algorithm.adv_estimator != "gae":
        lines[-1] += f"  (unused: {cfg.algorithm.adv_estimator} trains no critic)"
    lines += kl_plan(cfg)
    lines.append(
        f"  total : {cfg.trainer.iterations} iterations, "
        f"{cfg.trainer.iterations * rollout} sequences"
    )
    return "\n".join(lines)


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


def describe_fields(node: Any = None, prefix: str = "") -> list[tuple[str, Any, str]]:
    """(dotted key, default, help) for every leaf field: the README's config table."""
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
    """The README's config table, generated from the fields (`python -m proxima.config`)."""
    rows = ["| key | default | meaning |", "|---|---|---|"]
    for key, default, help_text in describe_fields():
        rows.append(f"| `{key}` | `{default!r}` | {help_text.replace('|', chr(92) + '|')} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(keys_markdown())
