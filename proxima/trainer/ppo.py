"""The PPO loop. `step()` reads as the numbered phases of DESIGN.md, one call each.

The trainer owns every piece of state that changes while it trains (the trained roles with
their optimizers and schedules, the KL controller, the score statistics, the prompt loaders,
the shuffle generator, the global RNG, the iteration) and exposes it through torch's
`state_dict()` / `load_state_dict()`; `proxima.checkpoint` only writes and finds folders.
"""

from __future__ import annotations

import time
import warnings
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from proxima.algos import (
    AdaptiveKLController,
    FixedKLController,
    RunningMoments,
    compute_advantages,
    logprob_diff,
    masked_mean,
    masked_var,
    masked_whiten,
    shape_rewards,
    truncated_is_weights,
)
from proxima.config import Config
from proxima.data import PromptLoader, collate_sft
from proxima.models.saving import export_weights, save_role
from proxima.models.value_head import load_value_head, save_value_head
from proxima.rng import rng_state, seed_everything, set_rng_state
from proxima.rollout.collect import Rollout, generate_rollout, score_rollout
from proxima.rollout.engine import LogprobMismatchWarning, RolloutEngine, build_engine
from proxima.rollout.score import build_experience, engine_logprobs_exact
from proxima.trainer.dist import Dist, shard, wrap_trained
from proxima.trainer.guard import NonFiniteOutputsError
from proxima.trainer.optim import TrainedRole
from proxima.trainer.setup import Roles, autocast
from proxima.trainer.update import (
    actor_micro_loss,
    critic_micro_loss,
    run_updates,
    shared_micro_loss,
)
from proxima.types import Experience


class PhaseTimer:
    """Wall seconds per phase, for this iteration and summed over the run. A `listener`
    (e.g. guard.PhaseWatch) is told when a phase starts and ends, to show it while it runs."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.last: dict[str, float] = {}
        self.listener = None  # .start(name), .end(name, seconds)

    @contextmanager
    def __call__(self, name: str):
        if self.listener is not None:
            self.listener.start(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            self.last[name] = time.perf_counter() - start
            self.total[name] += self.last[name]
            if self.listener is not None:
                self.listener.end(name, self.last[name])


@dataclass
class BatchView:
    """The per-sequence quantities of the whole global batch that phases 4 and 5 need, on
    every rank (rows in rank order, so one process and N processes see the same batch):
    GAE, whitening, score normalisation, group baselines and the KL controller are then
    computed from global quantities, identically on every rank (verl's flow)."""

    scores: torch.Tensor  # [B]
    stopped: torch.Tensor  # [B] bool
    kl: torch.Tensor  # [B, R]
    response_mask: torch.Tensor  # [B, R]
    values: torch.Tensor | None  # [B, R]
    group_ids: torch.Tensor  # [B], unique across ranks
    token_rewards: torch.Tensor | None = None
    advantages: torch.Tensor | None = None
    returns: torch.Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.scores.shape[0]

    @classmethod
    def gather(cls, exp: Experience, dist: Dist, groups_per_rank: int) -> BatchView:
        g = dist.gather_rows
        return cls(
            scores=g(exp.scores),
            stopped=g(exp.stopped),
            kl=g(exp.kl),
            response_mask=g(exp.response_mask),
            values=g(exp.values) if exp.values is not None else None,
            group_ids=g(exp.group_ids + dist.rank * groups_per_rank),
        )

    def scatter_to(self, exp: Experience, dist: Dist) -> None:
        """This rank's rows of the token rewards, advantages and returns, into `exp`."""
        b, r = exp.batch_size, exp.response_mask.shape[1]
        rows = slice(dist.rank * b, (dist.rank + 1) * b)
        exp.token_rewards = self.token_rewards[rows, :r]
        exp.advantages = self.advantages[rows, :r]
        exp.returns = self.returns[rows, :r]


def build_kl_controller(cfg: Config):
    k = cfg.algorithm.kl_ctrl
    if k.type == "adaptive":
        return AdaptiveKLController(k.kl_coef, k.target_kl, k.horizon)
    return FixedKLController(k.kl_coef)


class PPOTrainer:
    """Wires rollout, algos and the optimisers; holds no math of its own.

    `engine` writes the responses (default: the one `rollout.name` names, built here); the
    trainer pushes the actor's weights into it whenever they changed (`sync_engine`)."""

    def __init__(
        self,
        cfg: Config,
        roles: Roles,
        prompts,
        device: torch.device,
        sft_data=None,
        dist: Dist | None = None,
        engine: RolloutEngine | None = None,
    ) -> None:
        self.cfg, self.roles, self.device = cfg, roles, device
        self.dist = dist = dist or Dist()
        self.loader = PromptLoader(prompts, cfg.data.train_batch_size, seed=cfg.trainer.seed)
        self.kl_ctl = build_kl_controller(cfg)
        self.score_moments = RunningMoments()  # for algorithm.normalize_scores
        self.generator = torch.Generator().manual_seed(cfg.trainer.seed)
        self.iteration = 0
        self.weight_version = 0  # +1 whenever the actor's weights change (update, load)
        self.engine = (
            engine
            if engine is not None
            else build_engine(cfg, roles.actor, roles.tokenizer, device, roles.value_head)
        )
        self.timer = PhaseTimer()
        self.old_from_engine, self.old_logprobs_source = self._old_logprobs_source()
        # a shared-backbone critic's values come with the engine's log-probs (same states)
        self.values_from_engine = self.old_from_engine and roles.value_head is not None
        n_seq = cfg.rollout_batch_size
        self.trained: dict[str, TrainedRole] = {}  # actor, and critic when one is trained
        for name, sec in cfg.trained_roles().items():
            model = getattr(roles, name)
            if model is not None:
                steps = cfg.trainer.iterations * sec.ppo_epochs * (n_seq // sec.ppo_mini_batch_size)
                model = wrap_trained(model, dist, device, cfg.fsdp)
                head = roles.value_head if name == "actor" else None
                self.trained[name] = TrainedRole(
                    name, model, sec, steps, dist, head=head, head_lr=cfg.critic.optim.lr
                )
        if dist.strategy == "fsdp2" and roles.reference is not None:
            shard(roles.reference, cfg.fsdp, trainable=False)
        self.sft_loader = (
            PromptLoader(sft_data, cfg.actor.ppo_micro_batch_size, seed=cfg.trainer.seed + 1)
            if sft_data
            else None
        )

    def _old_logprobs_source(self) -> tuple[bool, str]:
        """(take the engine's log-probs as old log-probs?, a line saying which and why)."""
        mode = self.cfg.rollout.old_logprobs
        if mode != "auto":
            return mode == "engine", f"{mode} (rollout.old_logprobs={mode})"
        why_not = engine_logprobs_exact(self.cfg, self.roles.actor, self.engine.name)
        if why_not:
            return False, f"recompute (an actor forward pass; auto: {why_not})"
        if self.roles.value_head is not None:
            return True, (
                "engine, values too (the hf engine's own, no actor forward pass; auto: exact here)"
            )
        return True, "engine (the hf engine's own, one forward pass less; auto: exact here)"

    def autocast(self, generation: bool = False):
        """Mixed-precision context (model.mixed_precision) of forward passes; for generation
        only around the hf engine (vLLM has its own dtype)."""
        if generation and self.engine.name != "hf":
            return nullcontext()
        return autocast(self.cfg, self.device)

    # ------------------------------------------------------------------ one iteration

    def step(self) -> tuple[dict[str, float], Rollout]:
        t = self.timer
        with t("generate"), self.autocast(generation=True):  # 1. the actor writes responses
            ro = self.dist.agree(self.generate, "generation")
        with t("reward"), self.autocast():  # 2. the reward model / function scores them
            self.dist.agree(lambda: score_rollout(ro, self.roles.reward), "the reward")
        with t("score"), self.autocast():  # 3. old / reference log-probs, values, KL
            exp = self.dist.agree(lambda: self.score(ro), "scoring")
        with t("rewards"):
            batch = BatchView.gather(exp, self.dist, len(ro.prompts) // self.cfg.rollout.n)
            shaping = self.shape_rewards(batch)  # 4. -kl_coef * KL + shaped, clipped score
        with t("advantages"):
            self.compute_advantages(batch)  # 5. GAE or a critic-free estimator
            batch.scatter_to(exp, self.dist)
        with t("update"):  # (autocast per forward pass: run_updates)
            train_stats = self.update(exp)  # 6. PPO epochs over shuffled mini-batches
        with t("sync"):
            self.sync_engine()  # 6b. the rollout engine gets the actor's new weights
        metrics = self.metrics(batch, exp, shaping, train_stats)  # 7. metrics; KL controller
        self.kl_ctl.update(shaping["kl"], exp.batch_size)
        self.iteration += 1
        return metrics, ro

    def generate(self) -> Rollout:
        """This rank's share of the next global batch of prompts (all samples of a prompt
        stay on one rank), with rollout.n responses each, and the engine's own log-probs
        (rollout/logprob_diff_*, rollout correction)."""
        items = next(self.loader)
        k = len(items) // self.dist.world_size
        mine = items[self.dist.rank * k : (self.dist.rank + 1) * k]
        try:
            return generate_rollout(
                self.synced_engine(),
                self.roles.tokenizer,
                mine,
                self.cfg.rollout,
                self.device,
                logprobs=True,
                values=self.values_from_engine,
            )
        except RuntimeError as err:  # torch.multinomial on inf/nan probabilities
            if "inf" in str(err) and "nan" in str(err):
                raise NonFiniteOutputsError(f"sampling failed: {err}") from err
            raise

    def sync_engine(self) -> None:
        """Push the actor's weights into the rollout engine if it holds older ones (after an
        actor update, after `load_models`, before the first rollout). The `hf` engine serves
        the actor itself and never reads them; LoRA is merged into a copy first."""
        if self.engine.weight_version != self.weight_version:
            self.engine.update_weights(export_weights(self.roles.actor), self.weight_version)

    def synced_engine(self) -> RolloutEngine:
        """The rollout engine, holding the actor's current weights (training, evaluation)."""
        self.sync_engine()
        return self.engine

    def score(self, ro: Rollout) -> Experience:
        exp = self._score(ro)
        for role, tensor in (("actor", exp.old_logprobs), ("critic", exp.values)):
            if tensor is not None and not bool(torch.isfinite(tensor).all()):
                what = "log-probs" if role == "actor" else "values"
                raise NonFiniteOutputsError(f"its {what} of the rollout are not finite", role)
        return exp

    def _score(self, ro: Rollout) -> Experience:
        exp = build_experience(
            ro.gen,
            actor=self.roles.actor,
            reference=self.roles.reference,
            critic=self.roles.critic,
            scores=ro.scores,
            temperature=self.cfg.rollout.temperature,
            micro_batch_size=self.cfg.rollout.micro_batch_size,
            group_ids=ro.group_ids,
            kl_estimator=self.cfg.algorithm.kl_penalty,
            old_from_engine=self.old_from_engine,
            value_head=self.roles.value_head,
        )
        a = self.cfg.algorithm
        if a.rollout_correction and exp.rollout_logprobs is not None:
            exp.is_weights, _ = truncated_is_weights(
                exp.old_logprobs,
                exp.rollout_logprobs,
                exp.response_mask,
                cap=a.rollout_correction_cap,
                level=a.rollout_correction,
            )
        return exp

    def shape_rewards(self, exp: BatchView) -> dict[str, float]:
        """Fill exp.token_rewards; return the shaping stats (kl, reward, no_stop_fraction)."""
        a = self.cfg.algorithm
        mean, std = 0.0, 1.0
        if a.normalize_scores:
            self.score_moments.update(exp.scores)
            mean, std = self.score_moments.mean, self.score_moments.std
        exp.token_rewards, stats = shape_rewards(
            exp.scores,
            exp.stopped,
            exp.kl,
            exp.response_mask,
            kl_coef=self.kl_ctl.value if self.cfg.kl_in_reward else 0.0,
            clip_reward_value=a.clip_reward_value or None,
            no_stop_penalty=self.cfg.rollout.no_stop_penalty,
            score_mean=mean,
            score_std=std,
        )
        return {k: float(v) for k, v in stats.items()}

    def compute_advantages(self, exp: BatchView) -> None:
        a = self.cfg.algorithm
        options = {"norm_by_std": a.norm_adv_by_std_in_grpo} if a.adv_estimator == "grpo" else {}
        adv, ret = compute_advantages(
            a.adv_estimator,
            exp.token_rewards,
            exp.response_mask,
            values=exp.values,
            gamma=a.gamma,
            lam=a.lam,
            group_ids=exp.group_ids,
            **options,
        )
        if a.whiten_advantages and a.adv_estimator == "gae":
            adv = masked_whiten(adv, exp.response_mask)
        exp.advantages, exp.returns = adv, ret

    def update(self, exp: Experience) -> dict[str, float]:
        """Phase 6: the critic's epochs, then the actor's. With critic.shared_backbone there
        is no critic role: the actor's micro-batches carry loss + vf_coef x the value loss
        (one forward / backward), and during the critic's warm-up only the value head
        learns (the actor's weights, and so the engine's, stay as they are; the shared
        schedule advances all the same)."""
        stats = {}
        critic = self.trained.get("critic")
        if critic is not None:
            stats.update(
                self._update_role(
                    critic, exp, lambda mb: critic_micro_loss(critic.model, mb, critic.cfg)
                )
            )
        warmup = self.iteration < self.cfg.critic.warmup_iterations
        head = self.roles.value_head
        if warmup and head is None:
            return stats  # critic warm-up: the actor waits for a useful baseline
        actor, temperature = self.trained["actor"], self.cfg.rollout.temperature

        def micro_loss(mb: Experience):
            if head is None:
                return actor_micro_loss(
                    actor.model, mb, actor.cfg, temperature, self.roles.reference
                )
            return shared_micro_loss(
                actor.model,
                head,
                mb,
                actor.cfg,
                self.cfg.critic,
                temperature,
                self.roles.reference,
                head_only=warmup,
            )

        stats.update(
            self._update_role(
                actor,
                exp,
                micro_loss,
                extra_loss=self._ptx_loss if actor.cfg.ptx_coef and not warmup else None,
                target_kl=0.0 if warmup else actor.cfg.target_kl,
            )
        )
        if not warmup:
            self.weight_version += 1
        return stats

    def _update_role(
        self, role: TrainedRole, exp: Experience, micro_loss, extra_loss=None, target_kl=0.0
    ) -> dict[str, float]:
        """Epochs x mini-batches of one trained role, as its config section says."""
        stats = run_updates(
            role,
            exp,
            micro_loss=micro_loss,
            generator=self.generator,
            extra_loss=extra_loss,
            dist=self.dist,
            target_kl=target_kl,
            autocast=self.autocast,
        )
        return {k if "/" in k else f"{role.name}/{k}": v for k, v in stats.items()}

    def _ptx_loss(self) -> torch.Tensor:
        """ptx_coef x next-token cross-entropy on one SFT micro-batch (InstructGPT's PPO-ptx,
        arXiv:2203.02155 eq. 2)."""
        batch = collate_sft(next(self.sft_loader), self.roles.tokenizer.pad_token_id)
        batch = {k: v.to(self.device) for k, v in batch.items()}
        out = self.trained["actor"].model(**batch)  # through DDP / FSDP2: gradients sync
        return self.cfg.actor.ptx_coef * out.loss

    # ------------------------------------------------------------------ metrics

    def metrics(
        self, exp: BatchView, local: Experience, shaping: dict, train_stats: dict
    ) -> dict[str, float]:
        """The iteration's metrics from the whole batch (`exp`: the same on every rank); the
        rollout-trust ones from this rank's `local` rows."""
        mask = exp.response_mask
        lengths = mask.sum(1).float()
        gen_s = self.timer.last["generate"]
        m = {
            "score": float(exp.scores.mean()),
            "score_std": float(exp.scores.std()) if exp.batch_size > 1 else 0.0,
            # the KL that is optimised: the configured estimator, summed over each response
            **shaping,
            "kl_coef": float(self.kl_ctl.value),
            "response_length": float(lengths.mean()),
            "advantages_mean": float(masked_mean(exp.advantages, mask)),
            "advantages_std": float(masked_var(exp.advantages, mask).sqrt()),
            "returns_mean": float(masked_mean(exp.returns, mask)),
            "tokens_per_s": float(lengths.sum()) / max(gen_s, 1e-9),
        }
        if exp.values is not None:
            m["values_mean"] = float(masked_mean(exp.values, mask))
        m.update(self._rollout_trust(local))
        m.update({f"{name}/lr": role.lr for name, role in self.trained.items()})
        if self.roles.value_head is not None:  # the shared backbone's value head group
            m["critic/lr"] = self.trained["actor"].optimizer.param_groups[1]["lr"]
        m.update(train_stats)
        m.update({f"time/{k}": v for k, v in self.timer.last.items()})
        return m

    def _rollout_trust(self, exp: Experience) -> dict[str, float]:
        """How far the engine's log-probs are from the trainer's old ones (and the rollout
        correction's weights), over the whole batch (this rank's rows `exp`, gathered);
        warns above rollout.logprob_diff_warn."""
        if exp.rollout_logprobs is None:
            return {}
        g = self.dist.gather_rows
        mask = g(exp.response_mask)
        diff = logprob_diff(g(exp.rollout_logprobs), g(exp.old_logprobs), mask)
        m = {f"rollout/logprob_diff_{k}": float(v) for k, v in diff.items()}
        if exp.is_weights is not None:  # the stats of algos.truncated_is_weights
            w, cap = g(exp.is_weights), self.cfg.algorithm.rollout_correction_cap
            m["rollout/is_weight_mean"] = float(masked_mean(w, mask))
            m["rollout/is_truncated_frac"] = float(masked_mean((w >= cap).float(), mask))
        limit = self.cfg.rollout.logprob_diff_warn
        if limit and m["rollout/logprob_diff_mean"] > limit:
            warnings.warn(
                LogprobMismatchWarning(
                    f"rollout/logprob_diff_mean={m['rollout/logprob_diff_mean']:.3g} exceeds "
                    f"rollout.logprob_diff_warn={limit} at iteration {self.iteration}: the "
                    f"{self.engine.name} engine's log-probs differ from the trainer's "
                    "(dtype or kernels, top_p / top_k renormalisation, or stale weights). "
                    "PPO's ratio uses the trainer's; consider algorithm.rollout_correction="
                    "token, rollout.vllm.dtype=float32, or a higher threshold."
                ),
                stacklevel=2,
            )
        return m

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """Everything but the weights that a resumed run needs to continue exactly; only
        types `torch.load(weights_only=True)` reads back. Every rank calls it (the RNG
        states of all ranks are gathered); rank 0's copy is the one written."""
        return {
            "iteration": int(self.iteration),
            "roles": {name: role.state_dict() for name, role in self.trained.items()},
            "kl_coef": float(self.kl_ctl.value),
            "score_moments": self.score_moments.state_dict(),
            "loader": self.loader.state_dict(),
            "sft_loader": self.sft_loader.state_dict() if self.sft_loader else None,
            "generator": self.generator.get_state(),
            "rng": self.dist.all_gather_object(rng_state()),  # one per rank
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`. The KL coefficient is restored for an adaptive controller
        only (a fixed one keeps the config's value, which a resumed run may change). With
        another number of processes than the checkpoint's, each rank's random streams start
        anew from trainer.seed, the rank and the iteration: the run continues, not bit for
        bit as the uninterrupted one would have."""
        for name, role in self.trained.items():
            role.load_state_dict(state["roles"][name])
        if self.cfg.algorithm.kl_ctrl.type == "adaptive":
            self.kl_ctl.value = float(state["kl_coef"])
        self.score_moments.load_state_dict(state["score_moments"])
        self.loader.load_state_dict(state["loader"])
        if self.sft_loader is not None and state["sft_loader"] is not None:
            self.sft_loader.load_state_dict(state["sft_loader"])
        self.generator.set_state(state["generator"])
        self.iteration = int(state["iteration"])
        rngs = state["rng"]
        if len(rngs) == self.dist.world_size:
            set_rng_state(rngs[self.dist.rank])
        else:
            seed_everything(self.cfg.trainer.seed + self.dist.rank + 7919 * self.iteration)

    @property
    def is_main(self) -> bool:
        return self.dist.is_main

    def save_models(self, folder) -> None:
        """Each trained role as a plain Hugging Face folder (`actor/`, `critic/`; LoRA
        merged in, plus `actor_adapter/`, `critic_adapter/`). Every rank calls it (FSDP2
        gathers the shards); rank 0 writes."""
        for name, role in self.trained.items():
            state = role.full_state_dict()
            if self.is_main:
                save_role(role.unwrapped, self.roles.tokenizer, folder, name, state_dict=state)
        if self.roles.value_head is not None and self.is_main:
            save_value_head(self.roles.value_head, folder)

    def load_models(self, folder) -> None:
        """Weights written by `save_models`, in place (the optimizers keep their tensors)."""
        for name, role in self.trained.items():
            role.load_weights(folder, name)
        if self.roles.value_head is not None:
            load_value_head(self.roles.value_head, folder)
        self.weight_version += 1  # the engine gets these at the next rollout
