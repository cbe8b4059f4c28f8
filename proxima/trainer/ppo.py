"""The PPO loop. `step()` reads as the numbered phases of DESIGN.md, one call each."""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from proxima.algos import (
    AdaptiveKLController,
    FixedKLController,
    RunningMoments,
    compute_advantages,
    kl_penalty,
    masked_mean,
    masked_var,
    masked_whiten,
    token_rewards,
)
from proxima.config import Config
from proxima.data import PromptLoader, collate_sft
from proxima.rollout.collect import Rollout, collect
from proxima.rollout.score import build_experience
from proxima.trainer.optim import build_optimizer
from proxima.trainer.setup import Roles
from proxima.trainer.update import actor_micro_loss, critic_micro_loss, run_updates
from proxima.types import Experience


class PhaseTimer:
    """Wall seconds per phase, for this iteration and summed over the run."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.last: dict[str, float] = {}

    @contextmanager
    def __call__(self, name: str):
        start = time.perf_counter()
        yield
        self.last[name] = time.perf_counter() - start
        self.total[name] += self.last[name]


def build_kl_controller(cfg: Config):
    k = cfg.algorithm.kl_ctrl
    if k.type == "adaptive":
        return AdaptiveKLController(k.kl_coef, k.target_kl, k.horizon)
    return FixedKLController(k.kl_coef)


class PPOTrainer:
    """Wires rollout, algos and the optimisers; holds no math of its own."""

    def __init__(
        self, cfg: Config, roles: Roles, prompts, device: torch.device, sft_data=None
    ) -> None:
        self.cfg, self.roles, self.device = cfg, roles, device
        self.loader = PromptLoader(prompts, cfg.data.train_batch_size, seed=cfg.trainer.seed)
        self.kl_ctl = build_kl_controller(cfg)
        self.score_moments = RunningMoments()  # for algorithm.normalize_scores
        self.generator = torch.Generator().manual_seed(cfg.trainer.seed)
        self.iteration = 0
        self.timer = PhaseTimer()
        n_seq = cfg.rollout_batch_size
        steps = lambda sec: (
            cfg.trainer.iterations * sec.ppo_epochs * (n_seq // sec.ppo_mini_batch_size)
        )
        self.actor_opt = build_optimizer(roles.actor, cfg.actor.optim, steps(cfg.actor))
        self.critic_opt = (
            build_optimizer(roles.critic, cfg.critic.optim, steps(cfg.critic))
            if roles.critic is not None
            else None
        )
        self.sft_loader = (
            PromptLoader(sft_data, cfg.actor.ppo_micro_batch_size, seed=cfg.trainer.seed + 1)
            if sft_data
            else None
        )

    # ------------------------------------------------------------------ one iteration

    def step(self) -> tuple[dict[str, float], Rollout]:
        t = self.timer
        with t("generate"):
            ro = self.generate()  # 1. the actor writes responses; the reward scores them
        with t("score"):
            exp = self.score(ro)  # 2. old / reference log-probs and values
        with t("rewards"):
            kl = self.compute_token_rewards(exp)  # 3. -kl_coef * KL + clipped score
        with t("advantages"):
            self.compute_advantages(exp)  # 4. GAE or a critic-free estimator
        with t("update"):
            train_stats = self.update(exp)  # 5. PPO epochs over shuffled mini-batches
        metrics = self.metrics(exp, kl, train_stats)  # 6. metrics; KL controller update
        self.kl_ctl.update(metrics["kl"], exp.batch_size)
        self.iteration += 1
        return metrics, ro

    def generate(self) -> Rollout:
        items = next(self.loader)
        return collect(
            self.roles.actor,
            self.roles.tokenizer,
            items,
            self.roles.reward,
            self.cfg.rollout,
            self.device,
        )

    def score(self, ro: Rollout) -> Experience:
        return build_experience(
            ro.gen,
            actor=self.roles.actor,
            reference=self.roles.reference,
            critic=self.roles.critic,
            scores=ro.scores,
            temperature=self.cfg.rollout.temperature,
            micro_batch_size=self.cfg.rollout.micro_batch_size,
            group_ids=ro.group_ids,
            full_kl=self.cfg.algorithm.kl_penalty == "full",
        )

    def compute_token_rewards(self, exp: Experience) -> torch.Tensor:
        """Fill exp.token_rewards; return the per-token KL estimate [B, R] (0 without a ref)."""
        a = self.cfg.algorithm
        mask = exp.response_mask
        if exp.full_kl is not None:
            kl = exp.full_kl * mask
        elif exp.ref_logprobs is not None:
            kl = kl_penalty(exp.old_logprobs, exp.ref_logprobs, a.kl_penalty) * mask
        else:
            kl = torch.zeros_like(exp.old_logprobs)
        coef = self.kl_ctl.value if a.use_kl_in_reward else 0.0
        scores = exp.scores
        if a.normalize_scores:
            self.score_moments.update(scores)
            scores = (scores - self.score_moments.mean) / self.score_moments.std
        exp.token_rewards = token_rewards(scores, kl, mask, coef, a.clip_reward_value or None)
        return kl

    def compute_advantages(self, exp: Experience) -> None:
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
        stats = {}
        if self.roles.critic is not None:
            stats.update(
                self._update_role(
                    "critic",
                    exp,
                    lambda mb: critic_micro_loss(self.roles.critic, mb, self.cfg.critic),
                )
            )
        if self.iteration < self.cfg.critic.warmup_iterations:
            return stats  # critic warm-up: the actor waits for a useful baseline
        a, temperature = self.cfg.actor, self.cfg.rollout.temperature
        stats.update(
            self._update_role(
                "actor",
                exp,
                lambda mb: actor_micro_loss(
                    self.roles.actor, mb, a, temperature, self.roles.reference
                ),
                extra_loss=self._ptx_loss if a.ptx_coef else None,
            )
        )
        return stats

    def _update_role(
        self, role: str, exp: Experience, micro_loss, extra_loss=None
    ) -> dict[str, float]:
        """Epochs x mini-batches of one trained role, as its config section says."""
        sec = getattr(self.cfg, role)
        stats = run_updates(
            getattr(self.roles, role),
            *getattr(self, f"{role}_opt"),
            exp,
            epochs=sec.ppo_epochs,
            mini_size=sec.ppo_mini_batch_size,
            micro_size=sec.ppo_micro_batch_size,
            shuffle=sec.shuffle,
            agg=sec.loss_agg_mode,
            grad_clip=sec.optim.grad_clip,
            micro_loss=micro_loss,
            generator=self.generator,
            extra_loss=extra_loss,
        )
        return {f"{role}/{k}": v for k, v in stats.items()}

    def _ptx_loss(self) -> torch.Tensor:
        """ptx_coef x next-token cross-entropy on one SFT micro-batch (seed 003)."""
        batch = collate_sft(next(self.sft_loader), self.roles.tokenizer.pad_token_id)
        batch = {k: v.to(self.device) for k, v in batch.items()}
        out = self.roles.actor(**batch)
        return self.cfg.actor.ptx_coef * out.loss

    # ------------------------------------------------------------------ metrics

    def metrics(self, exp: Experience, kl: torch.Tensor, train_stats: dict) -> dict[str, float]:
        mask = exp.response_mask
        lengths = mask.sum(1).float()
        gen_s = self.timer.last["generate"]
        m = {
            "score": float(exp.scores.mean()),
            "score_std": float(exp.scores.std()) if exp.batch_size > 1 else 0.0,
            "reward": float((exp.token_rewards * mask).sum(1).mean()),
            # the KL that is optimised: the configured estimator, summed over each response
            "kl": float((kl * mask).sum(1).mean()),
            "kl_coef": float(self.kl_ctl.value),
            "response_length": float(lengths.mean()),
            "advantages_mean": float(masked_mean(exp.advantages, mask)),
            "advantages_std": float(masked_var(exp.advantages, mask).sqrt()),
            "returns_mean": float(masked_mean(exp.returns, mask)),
            "actor/lr": self.actor_opt[1].get_last_lr()[0],
            "tokens_per_s": float(lengths.sum()) / max(gen_s, 1e-9),
        }
        if exp.values is not None:
            m["values_mean"] = float(masked_mean(exp.values, mask))
            m["critic/lr"] = self.critic_opt[1].get_last_lr()[0]
        m.update(train_stats)
        m.update({f"time/{k}": v for k, v in self.timer.last.items()})
        return m
