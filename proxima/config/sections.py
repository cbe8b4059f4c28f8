"""The sections a PPO run reads: model, data, rollout, algorithm, actor, critic, reward,
trainer, fsdp, guard. Frozen dataclasses, a help text per field (`_f`): the configuration
table is generated from them (`python -m proxima.config`).

Defaults are DeepSpeed-Chat's step-3 values (kl 0.1, clip 0.2, value clip 0.2, reward clip 5,
gamma 1.0, lam 0.95; learning rates from the PPO-tricks seed: actor 5e-7, critic 9e-6).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def _f(default: Any, help: str, fixed: bool = False) -> Any:  # noqa: A002 - reads best below
    """A field with its help text. `fixed`: a run resumes only with the value its checkpoint
    was written with (a change would make the saved state mean something else: batch
    shapes and optimizer steps per iteration, which models exist and where they come
    from, the prompt order)."""
    meta = {"help": help, "fixed": fixed}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ModelConfig:
    actor_path: str = _f(
        "", "Hugging Face folder of the initial policy (usually an SFT model).", fixed=True
    )
    reference_path: str = _f(
        "",
        "Folder of the reference policy; empty = frozen copy of actor_path. Must share the "
        "policy's vocabulary (checked).",
        fixed=True,
    )
    teacher_path: str = _f(
        "",
        "On-policy distillation's teacher: a Hugging Face folder, a `proxima train` run "
        "folder (its trained actor/) or a .gguf file; empty = none. Loaded frozen and scored "
        "on every sampled token beside the reference; its per-token log-ratio to the student "
        "is the advantage of algorithm.adv_estimator=distill, or is added to another "
        "estimator's (algorithm.distill_coef). Must share the policy's tokenizer (checked "
        "before any model loads).",
        fixed=True,
    )
    critic_path: str = _f(
        "",
        "Folder the critic starts from; empty = actor_path. Its tokenizer must number every "
        "token as the policy's does (checked before any model loads).",
    )
    critic_init: str = _f(
        "actor",
        "How the critic starts: actor (backbone + new value head), "
        "reward_model (backbone and head of a reward model, as OpenRLHF advises; "
        "it must share the policy's vocabulary, checked before any model loads) or "
        "critic (a critic saved by proxima).",
        fixed=True,
    )
    dtype: str = _f(
        "float32",
        "Parameter dtype: float32|bfloat16|float16 (weights and optimizer state; for speed "
        "keep float32 and set mixed_precision).",
        fixed=True,
    )
    mixed_precision: str = _f(
        "no",
        "no | bf16: bfloat16 autocast for scoring, the reward model and the updates (and "
        "generation with rollout.autocast=true), with float32 master weights and optimizer "
        "state (model.dtype must be float32); the frozen reference and reward model are held "
        "in bfloat16.",
    )
    device: str = _f("auto", "cpu, cuda, cuda:1, ... or auto (cuda when available).")
    gradient_checkpointing: bool = _f(
        False,
        "Recompute each decoder layer's activations in the backward pass instead of keeping "
        "them (the trained actor and critic): less memory per micro-batch, about one more "
        "forward of compute; the gradients are the same.",
    )
    packing: bool | None = _f(
        None,
        "Packed sequences in the scoring passes (old log-probs, reference, values, teacher), "
        "the reward models' forwards and the actor's and critic's updates: each forward lays "
        "its sequences end to end in rows as wide as its longest, no padding between them, "
        "positions from 0 at each sequence's start, attention within each sequence (the "
        "model builds that mask from the position ids); the rollout.n samples of a prompt "
        "share one copy of it (a 4D mask: each sample sees its prompt and itself) where the "
        "model's attention takes that mask and it computes less. Never more positions than "
        "padded rows; the results equal the padded ones to float rounding; token budgets "
        "(*.max_tokens_per_micro) count the packed rows. Each model is tried once before the "
        "run. Unset (null): on where every model keeps packed sequences apart, else padded "
        "rows and start-up says which model and why; true: a model that cannot is refused; "
        "false: padded rows (docs/performance.md).",
    )
    offload: str = _f(
        "auto",
        "On a GPU, what an iteration's phase does not use waits in (pinned) CPU memory: "
        "the trained roles' AdamW state and gradients outside the update, a value model's "
        "weights during generation, the reference outside scoring (and the update under "
        "actor.use_kl_loss), the reward models outside the reward phase; the actor's "
        "weights stay. none | trained (always) | auto (when the memory plan's peak does not "
        "fit the free device memory otherwise). Costs two copies of that state over PCIe "
        "per iteration (time/offload). Not with trainer.strategy=fsdp2 (see "
        "fsdp.offload_frozen) or rollout.max_staleness > 0.",
    )
    lora_rank: int = _f(
        0,
        "LoRA rank r (0 = full fine-tuning). With r > 0 only low-rank adapters are trained and "
        "the reference is the actor with its adapters disabled (no second copy of the weights).",
        fixed=True,
    )
    lora_alpha: float = _f(
        16.0, "LoRA scaling numerator: adapters add (lora_alpha / r) B A x.", fixed=True
    )
    lora_dropout: float = _f(
        0.0,
        "Dropout on the LoRA input; keep 0 for PPO (dropout makes the first ratio differ from 1).",
    )
    lora_target_modules: list = _f(
        [],
        "Module names that get adapters (e.g. [q_proj, v_proj]); empty = every linear layer "
        "of the backbone (peft's all-linear, heads excluded).",
        fixed=True,
    )
    critic_lora: bool = _f(
        True,
        "With lora_rank > 0, train the critic's backbone through LoRA too; its value head "
        "stays fully trainable. False trains the whole critic.",
        fixed=True,
    )


@dataclass(frozen=True)
class DataConfig:
    train_path: str | list = _f(
        "",
        "Prompt file: .jsonl/.json/.parquet/.csv or a datasets.save_to_disk folder; or a list "
        "of them ([math.jsonl, code.jsonl]), mixed in every batch by data.train_weights and "
        "each named by its file (a `dataset` column every record carries).",
        fixed=True,
    )
    train_weights: list[float] = _f(
        [],
        "With several data.train_path files: each one's share of a batch ([0.7, 0.3], "
        "normalised); empty = in proportion to their sizes. May change on resume.",
    )
    eval_path: str | list = _f(
        "",
        "Held-out prompt file(s) for in-loop evaluation (optional); with several, each is "
        "reported under its name (eval/<name>/accuracy) as well as together.",
    )
    prompt_key: str = _f(
        "prompt", "Column holding the prompt (a string or a chat message list).", fixed=True
    )
    max_prompt_length: int = _f(256, "Longest prompt in tokens.")
    overlong_prompts: str = _f("error", "What to do with longer prompts: error|drop|truncate.")
    train_batch_size: int = _f(
        64, "Prompts per PPO iteration (each sampled rollout.n times).", fixed=True
    )
    sft_path: str = _f(
        "", "Prompt/response records for the ptx (SFT) loss; used when actor.ptx_coef > 0."
    )
    response_key: str = _f("response", "Column holding the response in SFT records.")

    def train_files(self) -> list[str]:
        """The files of `train_path` (one, or the list)."""
        return _files(self.train_path)

    def eval_files(self) -> list[str]:
        """The files of `eval_path` (none, one, or the list)."""
        return _files(self.eval_path)


def set_names(paths: Sequence[str]) -> list[str]:
    """A short name for each file: its stem (`math` for data/math.jsonl), or, where stems
    repeat (math/train.jsonl, code/train.jsonl), its folder and stem (`math_train`)."""
    stems = [Path(p).stem or Path(p).name for p in paths]
    if len(set(stems)) == len(stems):
        return stems
    names = [f"{Path(p).parent.name}_{s}".lstrip("_") for p, s in zip(paths, stems, strict=True)]
    if len(set(names)) != len(names):
        repeated = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(
            f"several prompt files would share the name {repeated[0]!r} ({list(paths)}); "
            "rename the files (or their folders) so that each set has a name of its own."
        )
    return names


def _files(value: str | list) -> list[str]:
    if isinstance(value, str):
        return [value] if value else []
    return [str(v) for v in value]


@dataclass(frozen=True)
class VLLMConfig:
    """`rollout.name=vllm`: the engine options users know from verl's rollout config."""

    tensor_model_parallel_size: int = _f(
        1,
        "GPUs one vLLM engine shards the model over. Only 1 for now: under torchrun every "
        "process runs an engine of its own on its share of the prompts (data parallel).",
    )
    gpu_memory_utilization: float = _f(
        0.5,
        "Share of GPU memory vLLM may take for weights and KV cache, next to training "
        "(colocated); ignored on CPU (see VLLM_CPU_KVCACHE_SPACE in docs/engines.md).",
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
class EnvConfig:
    """`rollout.env`: multi-turn episodes against a Python environment (docs/multi-turn.md).
    `rollout.env=path/to/file.py:Env` is short for `rollout.env.cls=...`."""

    SHORTHAND = "cls"

    cls: str = _f(
        "",
        "Multi-turn episodes: a Python environment class `path/to/file.py:Env` or "
        "`package.module:Env`, one instance per sample built from the prompt record, "
        "Env(row).step(action) -> (observation or None, reward, done); empty = one response "
        "per prompt.",
        fixed=True,
    )
    max_turns: int = _f(4, "Most actions of the model per episode.")
    turn_stop: list = _f(
        [],
        'Strings that end a turn besides the stop tokens (e.g. ["</call>"]); the action '
        "keeps the string.",
    )
    max_turn_tokens: int = _f(0, "Most tokens of one action (0 = rollout.max_response_length).")
    max_episode_tokens: int = _f(
        256,
        "Most tokens after the prompt, actions and observations together; an episode that "
        "reaches it ends (truncated, like a response without a stop).",
    )
    keep_kv_cache: bool = _f(
        True,
        "The hf engine keeps each episode's KV cache between turns, so a turn prefills only "
        "the observation's tokens; the caches of the whole batch stay in memory between "
        "turns (false: each turn prefills its whole context, one micro-batch's cache at a "
        "time).",
    )
    workers: int = _f(8, "Environment calls of a batch run at once.")
    timeout_s: float = _f(
        30.0,
        "Seconds one environment call (Env(row) or step) may take; one that takes longer or "
        "raises ends its episode with rollout.env.fallback_reward (counted in env/timeouts, "
        "env/errors); 0 = no limit.",
    )
    fallback_reward: float = _f(0.0, "The reward of the turn whose environment call failed.")
    observation_role: str = _f(
        "tool",
        "With chat-message prompts: the role of the observations' messages in the chat template.",
    )


@dataclass(frozen=True)
class AgentConfig:
    """`rollout.agent`: episodes played by the user's own agent program through an
    OpenAI-compatible endpoint over the policy (docs/multi-turn.md#agent-programs).
    `rollout.agent=path/to/file.py:fn` is short for `rollout.agent.fn=...`."""

    SHORTHAND = "fn"

    fn: str = _f(
        "",
        "Agent programs: a Python function `path/to/file.py:fn` or `package.module:fn`, "
        "called once per sample as fn(base_url, row) -> reward or None (None: reward.sources "
        "score the episode), in a thread, sync or async; it calls the policy with the openai "
        "client at base_url (`pip install proxima[agent]`); empty = no agent.",
        fixed=True,
    )
    concurrency: int = _f(16, "Episodes (calls of the function) in flight at once.")
    timeout_s: float = _f(
        120.0,
        "Seconds one episode may take; a later one is scored rollout.agent.fallback_reward "
        "(counted in env/timeouts), its later requests refused; 0 = no limit.",
    )
    fallback_reward: float = _f(
        0.0, "The reward of an episode whose function raised, returned no number or timed out."
    )
    max_calls: int = _f(8, "Most model calls per episode; later ones are refused (HTTP 400).")
    max_context_tokens: int = _f(
        256,
        "Most tokens of one call, its prompt plus what it may sample (its max_tokens is cut "
        "to fit, a prompt that leaves no room is refused): the longest training row.",
    )
    request_sampling: bool = _f(
        False,
        "Sample at the request's temperature and top_p; false: at rollout.temperature, top_p, "
        "top_k, the distribution the trainer's log-probs assume.",
    )
    batch_wait_ms: float = _f(
        5.0,
        "After a first request, how long the server waits for more to generate them together "
        "(it goes at once when every running episode has a request waiting).",
    )


@dataclass(frozen=True)
class RolloutConfig:
    name: str = _f(
        "hf",
        "Rollout engine: hf (transformers generate with the KV cache on the actor itself; "
        "works everywhere) | vllm (vLLM in the training process, weights pushed after each "
        "update; needs the vllm or vllm-cpu package, see docs/engines.md).",
    )
    n: int = _f(
        1,
        "Samples per prompt. grpo / rloo / reinforce_plus_plus_baseline want > 1: with 1, as "
        "in verl, the advantage is the raw score (no baseline) and a warning says so.",
        fixed=True,
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
    mask_truncated: bool = _f(
        False,
        "Leave responses that hit max_response_length without a stop token out of every "
        "loss (DAPO's overlong filtering); they still count in the metrics.",
    )
    micro_batch_size: int = _f(
        64, "Sequences per generation call (hf engine) and per scoring forward pass."
    )
    max_tokens_per_micro: int = _f(
        -1,
        "Scoring forward passes (old log-probs, reference, values) by a token budget instead "
        "(as actor.ppo_max_tokens_per_micro): rows sorted by length, as many per pass as fit "
        "in this many padded tokens, the padding they share trimmed; never changes the "
        "result. -1 = micro_batch_size rows sorted by length, each pass trimmed; 0 = "
        "micro_batch_size rows in the batch's order.",
    )
    autocast: bool = _f(
        False,
        "Generate under bfloat16 autocast too when model.mixed_precision=bf16 (hf engine). "
        "Off: the engine samples in float32, as TRL does, and the other phases keep their "
        "autocast. Measured slower with it on every device tried (a decode step is many "
        "small kernels, and autocast adds a cast to each: docs/performance.md). The engine's "
        "float32 log-probs differ from a bfloat16 update's by rounding, so "
        "rollout.old_logprobs=auto recomputes them.",
    )
    old_logprobs: str = _f(
        "auto",
        "PPO's old log-probs: recompute (an actor forward pass over the rollout), engine (the "
        "engine's own log-probs of the sampled tokens: one forward pass less) or auto (engine "
        "where both are the same quantity, else recompute; when they are: docs/engines.md).",
    )
    max_staleness: int = _f(
        0,
        "Asynchronous rollouts with bounded staleness (verl's staleness_threshold, prime-rl's "
        "max_off_policy_steps): the batch trained at iteration i is generated from the "
        "weights of iteration i - max_staleness, during the iterations between, so no sample "
        "trains more than this many policy versions after it was sampled. 0 = synchronous. "
        "The old log-probs are recomputed and algorithm.rollout_correction defaults to token "
        "(docs/engines.md).",
        fixed=True,
    )
    workers: int = _f(
        0,
        "With max_staleness >= 1: rollout worker processes beside the trainer, generating "
        "and scoring while it trains (hf engine; rollout.worker_start, rollout.devices), or 0: "
        "sample ahead in the trainer's own process, one phase after the other, with no "
        "overlap (any engine, DAPO's dynamic sampling). Unset with max_staleness = k >= 1: "
        "min(k, trainer.iterations, 4) workers, one per batch the pipeline holds, where "
        "workers can sample the run, else 0 (the batch plan says which and why). Refused "
        "with max_staleness=0, where nothing overlaps. May change at a resume: the batches are "
        "the same whatever samples them.",
    )
    worker_threads: int = _f(
        1, "torch CPU threads of each rollout worker process (rollout.workers >= 1)."
    )
    worker_start: str = _f(
        "auto",
        "How rollout worker processes start: fork (the trainer forked at the first rollout, "
        "inheriting its built roles; CPU only), spawn (a fresh process that builds the "
        "tokenizer, its own copy of the actor and the reward sources from the run's config, "
        "on its rollout.devices entry), or auto: spawn when the actor or a rollout.devices "
        "entry is on CUDA (a CUDA process cannot be forked), else fork.",
    )
    devices: list = _f(
        [],
        "The devices of spawned rollout worker processes, like [cuda:1, cuda:2]: worker i "
        "on devices[i mod len]. Empty = the trainer's actor device (the workers share its "
        "GPU). The weights reach them through host shared memory (docs/engines.md).",
    )
    partial_rollouts: bool = _f(
        False,
        "With rollout workers: a generation in progress takes each update's weights as soon "
        "as they are published, between two decode steps, its KV cache kept (verl's "
        "partial_rollout, AReaL's interruptible generation); each sample's staleness is its "
        "first token's, rollout/token_staleness_mean the mean over its tokens. Fresher "
        "samples, but they depend on timing: a run is no longer reproducible.",
        fixed=True,
    )
    logprob_diff_warn: float = _f(
        0.05,
        "Warn when rollout/logprob_diff_mean (mean |engine log-prob - trainer log-prob| over "
        "response tokens, logged whenever the trainer computes its own old log-probs) "
        "exceeds this; 0 disables the warning.",
    )
    vllm: VLLMConfig = field(default_factory=VLLMConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)

    # the multi-turn keys that moved into `rollout.env` (answered with the new name)
    MOVED = {
        "max_turns": "env.max_turns",
        "turn_stop": "env.turn_stop",
        "max_turn_tokens": "env.max_turn_tokens",
        "max_episode_tokens": "env.max_episode_tokens",
        "env_workers": "env.workers",
        "env_timeout_s": "env.timeout_s",
        "env_fallback_reward": "env.fallback_reward",
        "observation_role": "env.observation_role",
    }
    # keys replaced by another with other values: what to write instead
    REPLACED = {
        "asynchronous": "rollout.max_staleness=1 (asynchronous rollouts one policy version "
        "stale, now generated by a worker process beside the trainer: docs/engines.md)",
    }

    @property
    def episodes(self) -> str:
        """Who plays each sample as an episode of several turns: `agent` (rollout.agent.fn),
        `env` (rollout.env.cls; validation refuses both), or "" for one response each."""
        return "agent" if self.agent.fn else "env" if self.env.cls else ""

    @property
    def after_prompt_key(self) -> str:
        """The key that bounds the tokens after the prompt: max_episode_tokens in multi-turn
        episodes (observations included), an agent's max_context_tokens (a whole row), else
        max_response_length."""
        keys = {"agent": "agent.max_context_tokens", "env": "env.max_episode_tokens"}
        return keys.get(self.episodes, "max_response_length")

    @property
    def after_prompt_tokens(self) -> int:
        """The value of `after_prompt_key`: the most tokens after a prompt."""
        section, _, key = self.after_prompt_key.rpartition(".")
        return getattr(getattr(self, section) if section else self, key)


@dataclass(frozen=True)
class KLControlConfig:
    type: str = _f("fixed", "fixed|adaptive (Ziegler et al. 2019).", fixed=True)
    kl_coef: float = _f(0.1, "(Initial) coefficient of the in-reward KL penalty (beta).")
    target_kl: float = _f(6.0, "Adaptive controller: KL per sequence it steers toward.")
    horizon: int = _f(10000, "Adaptive controller: horizon in samples.")


@dataclass(frozen=True)
class AlgorithmConfig:
    adv_estimator: str = _f(
        "gae",
        "Advantage estimator (verl's algorithm.adv_estimator; docs/algorithms.md): "
        "gae (with a critic) | grpo | grpo_vectorized | rloo | rloo_vectorized | "
        "reinforce_plus_plus | reinforce_plus_plus_baseline | remax | opo | grpo_passk | gpg | "
        "gdpo | optimal_token_baseline | tir_optimal_token_baseline (critic-free) | distill "
        "(on-policy distillation from model.teacher_path alone; no reward needed, docs/"
        "distillation.md).",
        fixed=True,
    )
    gamma: float = _f(1.0, "Discount factor.")
    lam: float = _f(0.95, "GAE lambda.")
    whiten_advantages: bool = _f(
        True,
        "GAE only: whiten the advantages over the batch (masked) before the update. The "
        "critic-free estimators normalise their own way: grpo by the group's std "
        "(norm_adv_by_std_in_grpo), reinforce_plus_plus(_baseline) and gdpo over the batch, "
        "the others not.",
    )
    whiten_shift_mean: bool = _f(
        True,
        "With whiten_advantages: subtract the batch's mean advantage (true, verl's and "
        "OpenRLHF's whitening) or keep it, scaling only (false, TRL's shift_mean=False). The "
        "mean is over tokens: where failed answers are longer than the rest it is negative, "
        "and subtracting it makes a short failed answer's advantage positive, a pull "
        "toward empty answers (docs/real-models.md measures it on SmolLM2).",
    )
    norm_adv_by_std_in_grpo: bool = _f(
        True,
        "grpo, grpo_passk, gdpo: divide by the group's std (False = Dr.GRPO).",
    )
    gdpo_reward_weights: list = _f(
        [],
        "gdpo: weight of each reward component (column of score_components) in the sum of "
        "the group-normalised components; empty = equal weights.",
    )
    handle_zero_tail: bool = _f(
        True,
        "optimal_token_baseline, tir_optimal_token_baseline: no baseline on the part of a "
        "group's longest response beyond the second longest (verl's default).",
    )
    distill_coef: float = _f(
        1.0,
        "On-policy distillation (model.teacher_path): each response token's advantage gets "
        "distill_coef x (teacher log-prob - old log-prob) of its sampled token, added to the "
        "estimator's advantage (after its normalisation); with adv_estimator=distill it is "
        "the whole advantage. > 0.",
    )
    distill_clip: float = _f(
        0.0,
        "On-policy distillation: clamp each token's log-ratio teacher - student to "
        "[-distill_clip, distill_clip] before distill_coef (verl's loss_max_clamp), so a "
        "token the teacher finds nearly impossible cannot dominate the batch; 0 = off.",
    )
    use_kl_in_reward: bool | None = _f(
        None,
        "Put -kl_coef * KL into the token rewards. Unset (null): on, unless actor.use_kl_loss "
        'is on; then the KL is in the loss only, as in verl ("When used, we are not applying '
        'KL in the reward function") and start-up says so; off with adv_estimator=distill, '
        "which reads no token reward. true together with "
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
        "rollout_correction_cap), per token (token) or per sequence (sequence); empty = off. "
        "Combines with rollout_rejection.",
    )
    rollout_correction_cap: float = _f(
        2.0, "Cap of the rollout correction weights (verl's rollout_is_threshold); >= 1."
    )
    rollout_rejection: str = _f(
        "",
        "Rejection against the rollout engine's log-probs mu (verl's rollout_rs): tokens "
        "(token), whole sequences by the product of their ratios (sequence) or by their "
        "geometric mean (geometric) whose ratio pi_old / mu is outside [rollout_rejection_"
        "threshold_lower, rollout_rejection_threshold] get policy-loss weight 0; combines "
        "with rollout_correction (weights multiply: TRL's masked IS, IcePop; "
        "docs/algorithms.md); empty = off.",
    )
    rollout_rejection_threshold: float = _f(
        0.0,
        "Upper bound of the ratio kept by rollout_rejection (verl's rollout_rs_threshold), "
        "> 1; 0 = verl's default for the level: 2.0 (token, sequence), 1.001 (geometric).",
    )
    rollout_rejection_threshold_lower: float = _f(
        0.0,
        "Lower bound of the ratio kept by rollout_rejection (verl's "
        "rollout_rs_threshold_lower), in (0, 1); 0 = 1 / rollout_rejection_threshold.",
    )
    filter_groups: bool = _f(
        False,
        "DAPO's dynamic sampling: drop the prompt groups whose scores are all equal (a group "
        "estimator gives them no gradient) and generate more prompts until the batch is full "
        "again, at most max_gen_batches rounds; a batch still short is filled with dropped "
        "groups (counted in dapo/groups_filled). Needs rollout.n > 1.",
    )
    max_gen_batches: int = _f(
        10, "Most generation rounds per iteration with filter_groups (>= 1; verl's name)."
    )

    @property
    def corrects_rollout(self) -> bool:
        """Whether the policy loss weighs each token by the engine's log-probs: importance
        weights (rollout_correction), rejection (rollout_rejection) or both."""
        return bool(self.rollout_correction or self.rollout_rejection)


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
class PolicyLossConfig:
    """`actor.policy_loss`: verl's section of the same name. `actor.policy_loss=NAME` is
    short for `actor.policy_loss.loss_mode=NAME`. Each option belongs to the losses that
    read it (`proxima.algos.POLICY_LOSSES[name].options`); setting it under another
    loss_mode is an error."""

    SHORTHAND = "loss_mode"

    loss_mode: str = _f(
        "vanilla",
        "Policy loss, by verl's actor.policy_loss.loss_mode name (docs/algorithms.md): "
        "vanilla (PPO's clipped surrogate with the dual clip), gspo, sapo, cispo, gpg, "
        "clip_cov, kl_cov, geo_mean, dppo_tv, dppo_kl, dro.",
    )
    clip_cov_ratio: float = _f(0.0002, "clip_cov: share of tokens whose gradient is cut.")
    clip_cov_lb: float = _f(1.0, "clip_cov: lower bound of the covariance for cutting.")
    clip_cov_ub: float = _f(5.0, "clip_cov: upper bound of the covariance for cutting.")
    kl_cov_ratio: float = _f(0.0002, "kl_cov: share of tokens given the KL penalty.")
    ppo_kl_coef: float = _f(0.1, "kl_cov: coefficient of that KL penalty.")
    tau_pos: float = _f(1.0, "sapo: temperature of the soft gate for positive advantages.")
    tau_neg: float = _f(1.05, "sapo: temperature of the soft gate for negative advantages.")
    dro_beta: float = _f(0.0, "dro: coefficient of the quadratic log-ratio penalty (> 0).")


@dataclass(frozen=True)
class ActorConfig:
    optim: OptimConfig = field(default_factory=OptimConfig)
    ppo_epochs: int = _f(1, "Passes over the batch of experience per iteration.", fixed=True)
    ppo_mini_batch_size: int = _f(64, "Sequences per optimizer step.", fixed=True)
    ppo_micro_batch_size: int = _f(
        16, "Sequences per forward/backward (gradient accumulation); never changes the result."
    )
    ppo_max_tokens_per_micro: int = _f(
        -1,
        "Micro-batches by a token budget instead (verl's dynamic batch size): rows sorted by "
        "length, as many per forward/backward as fit in this many padded tokens, the padding "
        "they all share trimmed; never changes the result. -1 = ppo_micro_batch_size rows "
        "sorted by length, each micro-batch trimmed; 0 = ppo_micro_batch_size rows in the "
        "mini-batch's order.",
    )
    shuffle: bool = _f(True, "Shuffle the experience into new mini-batches every epoch.")
    policy_loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
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
    ppo_epochs: int = _f(1, "Passes over the batch of experience per iteration.", fixed=True)
    ppo_mini_batch_size: int = _f(64, "Sequences per optimizer step.", fixed=True)
    ppo_micro_batch_size: int = _f(16, "Sequences per forward/backward.")
    ppo_max_tokens_per_micro: int = _f(
        -1,
        "Micro-batches by a token budget (as actor.ppo_max_tokens_per_micro); -1 = "
        "ppo_micro_batch_size rows sorted by length; 0 = in the mini-batch's order.",
    )
    shuffle: bool = _f(True, "Shuffle the experience into new mini-batches every epoch.")
    cliprange_value: float = _f(0.2, "Value clip range around the rollout values (0 disables).")
    loss_agg_mode: str = _f("token-mean", "Aggregation of the value loss (as actor.loss_agg_mode).")
    warmup_iterations: int = _f(
        0,
        "First iterations train only the critic (the actor's policy waits; with "
        "shared_backbone only the value head learns).",
    )
    shared_backbone: bool = _f(
        False,
        "One network for policy and value (PPO's shared parameterisation, arXiv:1707.06347): "
        "the critic is a value head on the actor's final hidden state. One model less in "
        "memory; no critic pass when scoring (the values come with the actor's pass, or from "
        "generation when the old log-probs do); one forward/backward per micro-batch for "
        "loss = actor loss + vf_coef x value loss. The actor's epochs, mini- and micro-batches "
        "and gradient clip apply (critic.ppo_*, critic.shuffle and critic.optim.grad_clip "
        "must match them or keep their defaults); critic.optim.* (lr, betas, eps, weight "
        "decay, warm-up, schedule) set the value head's own optimizer group.",
        fixed=True,
    )
    head_init: str = _f(
        "random",
        "How a new value head starts (critic.shared_backbone, or a value model from the "
        "actor): random (weight ~ N(0, 1/sqrt(hidden+1)), bias 0: distinct values from the "
        "start) | zero (every value 0 until it learns, as the value head of OpenAI's "
        "lm-human-preferences starts: on a real model's large hidden states a random head's "
        "values are of the order of the rewards, noise in the first advantages; "
        "docs/real-models.md).",
        fixed=True,
    )
    vf_coef: float = _f(
        0.5,
        "With shared_backbone: weight c1 of the value loss in the shared network's loss "
        "(the PPO paper's L = L_clip - c1 L_vf + c2 S; 0.5 to 1.0 are common).",
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
    max_tokens_per_micro: int = _f(
        -1,
        "Reward model forwards by a token budget instead (as rollout.max_tokens_per_micro); "
        "-1 = batch_size sequences sorted by length; 0 = batch_size in the batch's order.",
    )
    sources: list = _f(
        [],
        "Several reward sources, the score their weighted sum: a list of {name, weight, one of "
        "function / model_path / url, options} (docs/rewards.md); instead of "
        "reward.function / reward.model_path.",
    )
    overlong_buffer_len: int = _f(
        0,
        "DAPO's soft overlong punishment (verl's overlong_buffer.len): a response longer than "
        "rollout.max_response_length - this loses up to overlong_penalty_factor, linearly "
        "(docs/algorithms.md); 0 = off.",
    )
    overlong_penalty_factor: float = _f(
        1.0, "Penalty of a response at rollout.max_response_length (overlong_buffer_len > 0)."
    )


@dataclass(frozen=True)
class TrainerConfig:
    iterations: int = _f(100, "PPO iterations (each: generate, score, update).")
    seed: int = _f(42, "Seed of everything (offset by rank).", fixed=True)
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
        "Writes a new run folder. `proxima pipeline`: a pipeline run folder, which goes on "
        "after its finished stages (pipeline.json) with its own config.",
    )
    log_samples: int = _f(4, "Sample generations written to samples.jsonl per iteration.")
    loggers: list = _f(
        ["jsonl", "tensorboard"],
        "Where metrics, the resolved config, the summary and curves.png go: any of jsonl | "
        "tensorboard (output_dir/tb) | wandb (offline into output_dir/wandb without an API "
        "key) | mlflow (output_dir/mlflow.db unless MLFLOW_TRACKING_URI is set). jsonl "
        "(metrics.jsonl, which resume and the plots read) is always written, listed or not. "
        "wandb and mlflow need `pip install 'proxima[wandb]'` / `'proxima[mlflow]'` "
        "(docs/failures.md).",
    )
    tensorboard: bool = _f(
        True, "false leaves tensorboard out of trainer.loggers (the older switch, still read)."
    )
    project: str = _f(
        "proxima", "W&B project and MLflow experiment of the run (trainer.loggers: wandb, mlflow)."
    )
    run_name: str = _f("", "Name of the run in W&B and MLflow; empty = the run folder's name.")
    threads: int = _f(0, "torch CPU threads per process (0 = torch's default).")
    memory_check: str = _f(
        "error",
        "The memory plan (peak memory per role and phase, predicted from the config and the "
        "models' config.json before any model loads, printed with the batch plan): error "
        "stops a run whose peak does not fit the free memory (CPU: MemAvailable or the "
        "cgroup's limit; GPU: torch.cuda.mem_get_info) before it loads | warn says so and "
        "starts | off plans nothing.",
    )
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
        False,
        "FSDP2: keep the frozen reference's (and teacher's) shards on the CPU (CPUOffloadPolicy).",
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
    drift_min_distinct_ratio: float = _f(
        0.5,
        "Warn (once) when drift/distinct_2, the batch's unique token bigrams / all its "
        "bigrams, stays below this fraction of its start (the mean of the run's first 3 "
        "iterations) for 3 iterations: the answers lost their variety; 0 = off.",
    )
    drift_max_repetition_rise: float = _f(
        0.25,
        "Warn (once) when drift/repetition, the share of a response's token trigrams that "
        "repeat an earlier one, stays above its start plus this for 3 iterations; 0 = off.",
    )
    drift_max_dominated_rise: float = _f(
        0.25,
        "Warn (once) when drift/dominated, the share of responses mostly made of one word "
        "said over and over, stays above its start plus this for 3 iterations; 0 = off.",
    )
    drift_max_empty_rise: float = _f(
        0.2,
        "Warn (once) when drift/empty, the share of responses with no word at all (an end "
        "of turn alone, only numbers or punctuation), stays above its start plus this for 3 "
        "iterations; 0 = off.",
    )
    drift_min_entropy_ratio: float = _f(
        0.3,
        "Warn (once) when actor/entropy stays below this fraction of its start for 3 "
        "iterations (expected on a task with one right answer per prompt; a collapse "
        "when the answers also degenerate); 0 = off.",
    )
    drift_max_ref_logprob_drop: float = _f(
        1.0,
        "Warn (once) when drift/ref_logprob, the reference's mean log-likelihood per "
        "sampled token (runs with a reference only), stays more than this many nats below "
        "its start for 3 iterations; 0 = off.",
    )
