"""The PPO loop. `step()` reads as the numbered phases of docs/architecture.md, one call each.

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
from dataclasses import replace
from functools import partial

import torch

from proxima.algos import (
    ADVANTAGE_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    RunningMoments,
    explained_variance,
    logprob_diff,
    masked_mean,
    masked_var,
    overlong_penalty,
)
from proxima.config import Config
from proxima.data import PromptLoader
from proxima.models.critic import optimizer_groups
from proxima.models.unwrap import base_model, unwrap
from proxima.rewards import WeightedReward
from proxima.rng import rng_state, seed_everything, set_rng_state
from proxima.rollout.collect import (
    Rollout,
    cat_rollouts,
    generate_rollout,
    rollout_from_state,
    rollout_state,
    score_rollout,
    select_groups,
)
from proxima.rollout.engine import LogprobMismatchWarning, RolloutEngine
from proxima.rollout.engines import build_engine, engine_class, engine_of, sync_weights
from proxima.rollout.episodes import episode_stats
from proxima.rollout.plan import ScoringPlan, plan_scoring
from proxima.rollout.score import build_experience
from proxima.trainer.advantages import BatchView, Estimates, estimate
from proxima.trainer.dist import Dist, shard, wrap_trained
from proxima.trainer.guard import NonFiniteOutputsError
from proxima.trainer.optim import TrainedRole
from proxima.trainer.setup import Roles, autocast
from proxima.trainer.update import PolicyObjective, PtxLoss, run_epochs
from proxima.types import Experience

# Var(returns) below this is rounding, not signal: the explained variance is reported as 0
EV_MIN_VAR = 1e-8


class PhaseTimer:
    """Wall seconds per phase, for this iteration (`last`, summed over the phase's runs
    since `new_iteration`: dynamic sampling generates several times) and summed over the
    run. A `listener` (e.g. guard.PhaseWatch) is told when a phase starts and ends, to show
    it while it runs."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.last: dict[str, float] = {}
        self.current = ""  # the phase running now, or the one that raised
        self.listener = None  # .start(name), .end(name, seconds)

    def new_iteration(self) -> None:
        self.last = {}

    @contextmanager
    def __call__(self, name: str):
        self.current = name
        if self.listener is not None:
            self.listener.start(name)
        start = time.perf_counter()
        try:
            yield
        finally:
            seconds = time.perf_counter() - start
            self.last[name] = self.last.get(name, 0.0) + seconds
            self.total[name] += seconds
            if self.listener is not None:
                self.listener.end(name, seconds)


def _informative_groups(ro: Rollout) -> list[bool]:
    """Per group of `ro` (its group ids 0..G-1): whether its scores (an episode's: with its
    turn rewards) differ (DAPO keeps it)."""
    out, totals = [], ro.total_rewards()
    for g in range(int(ro.group_ids.max()) + 1 if ro.group_ids.numel() else 0):
        s = totals[(ro.group_ids == g).to(totals.device)]
        out.append(not bool((s == s[0]).all()))
    return out


def staleness_stats(versions: torch.Tensor, trained_at: int) -> dict[str, float]:
    """How many policy versions behind the trained weights (`trained_at`) the samples were
    generated ([B] `Rollout.versions`): mean and max over the batch."""
    stale = (trained_at - versions).float()
    return {
        "rollout/staleness_mean": float(stale.mean()),
        "rollout/staleness_max": float(stale.max()),
    }


def build_kl_controller(cfg: Config):
    k = cfg.algorithm.kl_ctrl
    if k.type == "adaptive":
        return AdaptiveKLController(k.kl_coef, k.target_kl, k.horizon)
    return FixedKLController(k.kl_coef)


class PPOTrainer:
    """Wires rollout, algos and the optimisers; holds no math of its own.

    `engine` writes the responses (default: the one `rollout.name` names, built here); the
    trainer pushes the actor's weights into it whenever they changed (`sync_engine`).
    `plan`: where phase 3 takes each quantity from (default: `rollout.plan.plan_scoring`
    for this engine and the actor's generation config)."""

    def __init__(
        self,
        cfg: Config,
        roles: Roles,
        prompts,
        device: torch.device,
        sft_data=None,
        dist: Dist | None = None,
        engine: RolloutEngine | None = None,
        plan: ScoringPlan | None = None,
    ) -> None:
        self.cfg, self.roles, self.device = cfg, roles, device
        self.dist = dist = dist or Dist()
        self.loader = PromptLoader(prompts, cfg.data.train_batch_size, seed=cfg.trainer.seed)
        self.kl_ctl = build_kl_controller(cfg)
        self.score_moments = RunningMoments()  # for algorithm.normalize_scores
        # one per reward source (reward.sources) that is standardised (`normalize`)
        parts = getattr(roles.reward, "parts", [])
        self.source_moments = {p.name: RunningMoments() for p in parts if p.normalize}
        self.generator = torch.Generator().manual_seed(cfg.trainer.seed)
        self.iteration = 0
        self.weight_version = 0  # +1 whenever the actor's weights change (update, load)
        # actor updates over the whole run (resumed with it): the version of the policy that
        # each sample is stamped with (`Rollout.versions`) and trained at (staleness)
        self.policy_version = 0
        # rollout.asynchronous: the next iteration's scored batch and its sampling stats,
        # generated during this one from the weights before its update
        self.pending: tuple[Rollout, dict[str, float]] | None = None
        if plan is None:  # before the engine is built: a plan that cannot be fails first
            kind = engine_of(engine) if engine is not None else engine_class(cfg.rollout.name)
            plan = plan_scoring(cfg, kind, base_model(roles.actor).generation_config)
        self.plan = plan
        self.estimator = ADVANTAGE_ESTIMATORS[cfg.algorithm.adv_estimator]
        if engine is None:
            engine = build_engine(cfg, roles.actor, roles.tokenizer, device)
        self.engine = engine
        self.timer = PhaseTimer()
        self.sft_loader = (
            PromptLoader(sft_data, cfg.actor.ppo_micro_batch_size, seed=cfg.trainer.seed + 1)
            if sft_data
            else None
        )
        self.trained, self.objectives = self._trained_roles()
        if dist.strategy == "fsdp2" and roles.reference is not None:
            shard(roles.reference, cfg.fsdp, trainable=False)

    def _trained_roles(self) -> tuple[dict[str, TrainedRole], dict]:
        """The roles the update trains (the actor, and a value model of its own), each
        wrapped for the processes, and their objectives."""
        cfg, roles, critic = self.cfg, self.roles, self.roles.critic
        trained, objectives = {}, {}

        def role(name: str, module: torch.nn.Module, sec) -> TrainedRole:
            steps = cfg.trainer.iterations * cfg.steps_per_iteration(sec)
            model = wrap_trained(module, self.dist, self.device, cfg.fsdp)
            groups = optimizer_groups(unwrap(model), name, sec.optim, cfg.critic.optim)
            return TrainedRole(name, model, sec, steps, self.dist, groups)

        trained["actor"] = role("actor", roles.actor, cfg.actor)
        objectives["actor"] = PolicyObjective(cfg.actor, cfg.rollout.temperature, roles.reference)
        if critic is not None:  # the critic's value loss: in the actor's or its own
            objectives = critic.objectives(objectives["actor"])
        if critic is not None and critic.model is not None:
            trained["critic"] = role("critic", critic.model, cfg.critic)
        return trained, objectives

    def precision(self, generation: bool = False):
        """Mixed-precision context (model.mixed_precision) of forward passes; for generation
        only around the hf engine (vLLM has its own dtype)."""
        if generation and not engine_of(self.engine).serves_actor:
            return nullcontext()
        return autocast(self.cfg, self.device)

    # ------------------------------------------------------------------ one iteration

    def step(self) -> tuple[dict[str, float], Rollout]:
        self._started = self._iteration_start()  # what `undo_iteration` puts back
        self.timer.new_iteration()
        t = self.timer
        # 1. the actor writes responses, 2. they are scored (asynchronous: also the next batch)
        sampled_now = self.pending is None  # asynchronous: this batch is generated now too
        ro, sampling_stats, ahead = self.sample_batches()
        trained_at = self.policy_version  # staleness: against the weights the batch trains
        scores = ro.scores
        with t("score"), self.precision():  # 3. old / reference log-probs, values, KL
            exp = self.dist.agree(lambda: self.score(ro, scores), "scoring")
        with t("advantages"):  # 4. token rewards, 5. advantages and returns (whole batch)
            groups = len(ro.prompts) // self.cfg.rollout.n
            inputs = (*self.estimator.inputs, "score_components")  # sources: metrics, norm
            batch = BatchView.gather(exp, self.dist, groups, tuple(dict.fromkeys(inputs)))
            est = self.estimate(batch)
            exp = est.rows(exp, self.dist)
            if self.cfg.rollout.mask_truncated:  # DAPO's overlong filtering
                exp = replace(exp, response_mask=exp.response_mask * exp.stopped.unsqueeze(1))
        with t("update"):  # 6. PPO epochs over shuffled mini-batches
            train_stats = self.update(exp)
        with t("sync"):  # 6b. the rollout engine gets the actor's new weights
            self.sync_engine()
        metrics = self.metrics(batch, est, exp, train_stats)  # 7. metrics; KL controller
        metrics.update(sampling_stats)
        if ahead is not None:
            made = [ahead[0], ro] if sampled_now else [ahead[0]]
            metrics.update(self._async_stats(ro, made, trained_at))
        self.kl_ctl.update(est.stats["kl"], exp.batch_size)
        self.pending = ahead  # only now: a step that raised leaves the old one for its retry
        self.iteration += 1
        return metrics, ro

    def _async_stats(self, ro: Rollout, made: list[Rollout], trained_at: int) -> dict:
        """rollout.asynchronous: the staleness of the batch `ro` trained at `trained_at`,
        and the generation speed of the rollouts `made` this iteration (the time of
        `generate` is theirs: the batch sampled ahead, and the first iteration's own), over
        every rank's rows."""
        stats = staleness_stats(self.dist.gather_rows(ro.versions), trained_at)
        tokens = sum(float(r.gen.response_mask.sum()) for r in made)
        tokens = float(self.dist.all_reduce_sum(torch.tensor(tokens)))
        stats["tokens_per_s"] = tokens / max(self.timer.last["generate"], 1e-9)
        return stats

    def sample_batches(self) -> tuple[Rollout, dict[str, float], tuple | None]:
        """Phases 1-2 of this iteration: (its scored batch, sampling stats, the next
        iteration's batch with its stats, or None). Synchronous: `sample()` from the current
        weights. `rollout.asynchronous` (verl's one-step off-policy pipeline): the batch
        generated during the previous iteration, from the weights before that iteration's
        update (the first iteration has none: it samples now); and the next one, sampled
        now from the current weights, which the update below is about to replace. Every
        batch but the first is thus trained one policy version after it was sampled. The
        two generations run one after the other, not in a thread beside the update: HF
        generate samples from torch's process-wide generator, which a concurrent update
        (dropout) would draw from in an order that varies, and on a CPU both would share
        the same cores."""
        if not self.cfg.rollout.asynchronous:
            return (*self.sample(), None)
        ro, stats = self.pending if self.pending is not None else self.sample()
        return ro, stats, self.sample()

    def sample(self) -> tuple[Rollout, dict[str, float]]:
        """Phases 1-2: a scored rollout of this rank's share of the batch. With
        `algorithm.filter_groups` (DAPO's dynamic sampling) the groups whose scores are all
        equal are dropped and more prompts generated until the global batch is full of
        informative groups, at most `algorithm.max_gen_batches` rounds; a batch still short
        is filled with dropped groups, so it keeps its shape. The choice is global, in the
        order one process would generate (round, rank, group), and each rank then takes its
        share of the chosen groups (gathered from the ranks that generated them), so N
        processes train on the batch one process would."""
        alg = self.cfg.algorithm
        ro, stats = self.sample_once()
        if not alg.filter_groups:
            return ro, stats
        need = len(ro.prompts) // self.cfg.rollout.n  # groups per rank
        world = self.dist.world_size
        parts, flags = [ro], []  # flags[r][q]: informative groups of rank q in round r
        while True:
            flags.append(self.dist.all_gather_object(_informative_groups(parts[-1])))
            kept = sum(int(x) for rank_flags in flags for q in rank_flags for x in q)
            if kept >= need * world or len(parts) >= alg.max_gen_batches:
                break
            more, more_stats = self.sample_once()
            parts.append(more)
            stats = {k: stats[k] + more_stats[k] for k in stats}
        # global group order (round, rank, group); the kept first, then the dropped
        order = [
            (r, q, g)
            for r, ranks in enumerate(flags)
            for q, f in enumerate(ranks)
            for g in range(len(f))
        ]
        good = [key for key in order if flags[key[0]][key[1]][key[2]]]
        bad = [key for key in order if not flags[key[0]][key[1]][key[2]]]
        chosen = (good + bad)[: need * world]
        mine = chosen[self.dist.rank * need : (self.dist.rank + 1) * need]
        ro = self._gather_groups(parts, mine)
        rounds = len(parts)
        stats = {k: v / rounds for k, v in stats.items()}
        stats.update(
            {
                "dapo/gen_batches": float(rounds),
                "dapo/groups_generated": float(rounds * need * world),
                "dapo/groups_kept": float(min(len(good), need * world)),
                "dapo/groups_filled": float(max(0, need * world - len(good))),
            }
        )
        return ro, stats

    def _gather_groups(self, parts: list[Rollout], keys: list[tuple[int, int, int]]) -> Rollout:
        """The groups `keys` ((round, rank, group) each), in that order, as one rollout on
        this rank; groups another rank generated come from it (every rank's rounds are
        gathered when several processes run)."""
        pad = self.roles.tokenizer.pad_token_id
        if not self.dist.active:
            offsets = [
                sum(int(p.group_ids.max()) + 1 for p in parts[:r]) for r in range(len(parts))
            ]
            return select_groups(cat_rollouts(parts, pad), [offsets[r] + g for r, _, g in keys])
        everyone = self.dist.all_gather_object([p.to("cpu") for p in parts])  # [rank][round]
        picked = [select_groups(everyone[q][r], [g]) for r, q, g in keys]
        return cat_rollouts(picked, pad).to(self.device)

    def sample_once(self) -> tuple[Rollout, dict[str, float]]:
        """One round of phases 1-2: generate this rank's share of the next batch of prompts
        and score it (the raw score, plus DAPO's overlong penalty when configured); for an
        estimator that needs it (ReMax), a greedy response to each prompt is generated and
        scored too, its score the baseline of the prompt's samples."""
        t, agree = self.timer, self.dist.agree
        items = self.next_prompts()
        with t("generate"), self.precision(generation=True):  # 1. the actor writes responses
            ro = agree(lambda: self.generate(items), "generation")
        with t("reward"), self.precision():  # 2. the reward model / function scores them
            scores, penalty, components = agree(lambda: self.reward(ro), "the reward")
        ro = replace(ro, scores=scores, components=components)
        if "reward_baselines" in self.estimator.needs:
            with t("generate"), self.precision(generation=True):
                greedy = agree(lambda: self.generate(items, greedy=True), "generation")
            with t("reward"), self.precision():
                base = agree(lambda: self.reward(greedy), "the reward")[0]
            base = replace(greedy, scores=base).total_rewards()  # an episode's whole return
            ro = replace(ro, baselines=base.repeat_interleave(self.cfg.rollout.n))
        stats = self._episode_stats(ro) if ro.episodes is not None else {}
        if penalty is not None:
            total = self.dist.all_reduce_sum(
                torch.tensor(
                    [float(penalty.sum()), float((penalty < 0).sum()), penalty.numel()],
                    dtype=torch.float64,
                )
            )
            stats["overlong_penalty_mean"] = float(total[0] / total[2])
            stats["overlong_fraction"] = float(total[1] / total[2])
        return ro, stats

    def _episode_stats(self, ro: Rollout) -> dict[str, float]:
        """Multi-turn episodes over the whole batch: turns per episode, the shares of
        episodes that ended done, truncated (max_turns, max_episode_tokens), on an
        environment error or timeout, tokens per episode (actions and observations) and the
        mean reward of a turn."""
        sums = episode_stats(ro.episodes, ro.gen)
        keys = sorted(sums)
        total = self.dist.all_reduce_sum(torch.tensor([sums[k] for k in keys], dtype=torch.float64))
        got = {k: float(v) for k, v in zip(keys, total, strict=True)}
        episodes, turns = max(got["episodes"], 1.0), max(got["turns"], 1.0)
        out = {f"env/{k}": got[k] / episodes for k in ("turns", "done", "truncated", "errors")}
        out["env/timeouts"] = got["timeouts"] / episodes
        out["env/episode_length"] = got["episode_tokens"] / episodes
        out["env/reward_per_turn"] = got["turn_reward"] / turns
        return out

    def reward(self, ro: Rollout) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """([B] the reward source's score of each response plus DAPO's overlong penalty
        (`reward.overlong_buffer_len`), [B] that penalty or None when it is off, [B, K] the
        raw score of each of `reward.sources` or None for a single source)."""
        source, components = self.roles.reward, None
        if isinstance(source, WeightedReward):
            gen = ro.gen
            components = source.components(
                ro.prompts, ro.responses, ro.columns, gen.input_ids, gen.attention_mask
            )
            scores = source.combine(components)
        else:
            scores = score_rollout(ro, source)
        r = self.cfg.reward
        if not r.overlong_buffer_len:
            return scores, None, components
        penalty = overlong_penalty(
            ro.gen.response_mask.sum(1).to(scores.device),
            self.cfg.rollout.max_response_length,
            r.overlong_buffer_len,
            r.overlong_penalty_factor,
        )
        return scores + penalty, penalty, components

    def _iteration_start(self) -> dict:
        """The state an iteration changes before its first optimizer step: the loaders'
        positions, the random streams, the score statistics (and the steps taken so far)."""
        return {
            "loader": self.loader.state_dict(),
            "sft_loader": self.sft_loader.state_dict() if self.sft_loader else None,
            "generator": self.generator.get_state(),
            "score_moments": self.score_moments.state_dict(),
            "source_moments": {k: m.state_dict() for k, m in self.source_moments.items()},
            "rng": rng_state(),
            "steps": [role.scheduler.last_epoch for role in self.trained.values()],
        }

    def undo_iteration(self) -> bool:
        """After `step()` raised: put back the state the iteration started from, so that the
        trainer is at the end of its last completed iteration (what a checkpoint must hold),
        and drop the gradients it accumulated. False when it cannot: an optimizer step had
        already changed the weights."""
        start = getattr(self, "_started", None)
        steps = [role.scheduler.last_epoch for role in self.trained.values()]
        if start is None or steps != start["steps"]:
            return False
        self.loader.load_state_dict(start["loader"])
        if self.sft_loader is not None:
            self.sft_loader.load_state_dict(start["sft_loader"])
        self.generator.set_state(start["generator"])
        self.score_moments.load_state_dict(start["score_moments"])
        for name, moments in self.source_moments.items():
            moments.load_state_dict(start["source_moments"][name])
        set_rng_state(start["rng"])
        for role in self.trained.values():
            role.optimizer.zero_grad(set_to_none=True)
        return True

    def next_prompts(self) -> list:
        """This rank's share of the next global batch of prompts (all samples of a prompt
        stay on one rank)."""
        items = next(self.loader)
        k = len(items) // self.dist.world_size
        return items[self.dist.rank * k : (self.dist.rank + 1) * k]

    def generate(self, items: list | None = None, greedy: bool = False) -> Rollout:
        """rollout.n responses to each of `items` (default: `next_prompts()`), with the
        engine's own log-probs (rollout/logprob_diff_*, rollout correction); `greedy`: one
        greedy response each (ReMax's baseline)."""
        items = self.next_prompts() if items is None else items
        try:
            ro = generate_rollout(
                self.synced_engine(),
                self.roles.tokenizer,
                items,
                self.cfg.rollout,
                self.device,
                greedy=greedy,
                n=1 if greedy else None,
                logprobs=not greedy,
                values=self.plan.values == "generation" and not greedy,
            )
        except RuntimeError as err:  # torch.multinomial on inf/nan probabilities
            if "inf" in str(err) and "nan" in str(err):
                raise NonFiniteOutputsError(f"sampling failed: {err}") from err
            raise
        # the engine holds the actor's current weights (synced above): this policy version
        stamp = torch.full((len(ro.prompts),), self.policy_version, dtype=torch.long)
        return replace(ro, versions=stamp)

    def sync_engine(self) -> None:
        """Push the actor's weights into the rollout engine if it holds older ones (after an
        actor update, after `load_models`, before the first rollout)."""
        sync_weights(self.engine, self.roles.actor, self.weight_version)

    def synced_engine(self) -> RolloutEngine:
        """The rollout engine, holding the actor's current weights (training, evaluation)."""
        self.sync_engine()
        return self.engine

    def score(self, ro: Rollout, scores: torch.Tensor) -> Experience:
        """Phase 3 as the scoring plan says; refuses non-finite log-probs or values (the
        previous update diverged)."""
        roles = self.roles
        exp = build_experience(
            ro.gen,
            scores,
            ro.group_ids,
            self.plan,
            actor=roles.actor,
            reference=roles.reference,
            critic=roles.critic,
            rollout=self.cfg.rollout,
            algorithm=self.cfg.algorithm,
        )
        if ro.baselines is not None:
            exp = replace(exp, reward_baselines=ro.baselines.to(exp.scores.device))
        if ro.components is not None:
            exp = replace(exp, score_components=ro.components.to(exp.scores.device))
        for role, tensor in (("actor", exp.old_logprobs), ("critic", exp.values)):
            if tensor is not None and not bool(torch.isfinite(tensor).all()):
                what = "log-probs" if role == "actor" else "values"
                raise NonFiniteOutputsError(f"its {what} of the rollout are not finite", role)
        return exp

    def estimate(self, batch: BatchView) -> Estimates:
        """Phases 4-5 on the whole batch (the running score statistics updated first, when
        algorithm.normalize_scores)."""
        algorithm, source = self.cfg.algorithm, self.roles.reward
        if self.source_moments:  # reward.sources standardised one by one
            comps = batch.score_components
            mean, std = torch.zeros(comps.shape[1]), torch.ones(comps.shape[1])
            for k, part in enumerate(source.parts):
                if part.normalize:
                    self.source_moments[part.name].update(comps[:, k])
                    mean[k] = self.source_moments[part.name].mean
                    std[k] = self.source_moments[part.name].std
            shaped = source.combine(comps, mean, std)  # the overlong penalty stays added
            batch = replace(batch, scores=batch.scores - source.combine(comps) + shaped)
        if "gdpo_reward_weights" in self.estimator.options and not algorithm.gdpo_reward_weights:
            weights = [p.weight for p in getattr(source, "parts", [])]
            algorithm = replace(algorithm, gdpo_reward_weights=weights)  # the sources' own
        mean, std = 0.0, 1.0
        if algorithm.normalize_scores:
            self.score_moments.update(batch.scores)
            mean, std = self.score_moments.mean, self.score_moments.std
        return estimate(
            batch,
            algorithm,
            kl_coef=self.kl_ctl.value if self.cfg.kl_in_reward else 0.0,
            no_stop_penalty=self.cfg.rollout.no_stop_penalty,
            score_mean=mean,
            score_std=std,
        )

    def update(self, exp: Experience) -> dict[str, float]:
        """Phase 6: each trained role's epochs, a value model of its own first (as
        DeepSpeed-Chat), then the actor. During the critic's warm-up the actor's policy
        waits: only a value head on it learns (its weights, and so the engine's, stay as
        they are)."""
        warmup = self.iteration < self.cfg.critic.warmup_iterations
        stats = {}
        for name in sorted(self.trained, key=("critic", "actor").index):
            role, objective = self.trained[name], self.objectives[name]
            objective = objective.during_warmup() if warmup else objective
            if objective is None:
                continue
            actor = name == "actor" and not warmup
            out = run_epochs(
                role,
                exp,
                objective,
                generator=self.generator,
                dist=self.dist,
                precision=partial(autocast, self.cfg, self.device),
                extra_loss=self._ptx_loss() if actor else None,
                target_kl=self.cfg.actor.target_kl if actor else 0.0,
            )
            stats.update({k if "/" in k else f"{name}/{k}": v for k, v in out.items()})
        if not warmup:
            self.weight_version += 1
            self.policy_version += 1
        return stats

    def _ptx_loss(self) -> PtxLoss | None:
        if not (self.sft_loader and self.cfg.actor.ptx_coef):
            return None
        pad = self.roles.tokenizer.pad_token_id
        return PtxLoss(self.sft_loader, pad, self.cfg.actor.ptx_coef, self.device)

    # ------------------------------------------------------------------ metrics

    def metrics(
        self, batch: BatchView, est: Estimates, local: Experience, train_stats: dict
    ) -> dict[str, float]:
        """The iteration's metrics from the whole batch (the same on every rank); the
        rollout-trust ones from this rank's `local` rows, gathered."""
        mask = batch.response_mask
        lengths = mask.sum(1).float()
        m = {
            "score": float(batch.scores.mean()),
            "score_std": float(batch.scores.std()) if batch.batch_size > 1 else 0.0,
            # the KL that is optimised: the configured estimator, summed over each response
            **est.stats,
            "response_length": float(lengths.mean()),
            "advantages_mean": float(masked_mean(est.advantages, mask)),
            "advantages_std": float(masked_var(est.advantages, mask).sqrt()),
            "returns_mean": float(masked_mean(est.returns, mask)),
            "tokens_per_s": float(lengths.sum()) / max(self.timer.last["generate"], 1e-9),
        }
        if batch.turn_rewards is not None:  # an episode's return: turn rewards + score
            m["env/return"] = float((batch.scores + batch.turn_rewards.sum(1)).mean())
        if batch.score_components is not None:  # each of reward.sources, raw
            for k, name in enumerate(self.roles.reward.names):
                m[f"reward/{name}"] = float(batch.score_components[:, k].mean())
            m.update(self.roles.reward.pop_stats())
        if self.cfg.kl_in_reward:  # the coefficient of the KL in the reward (beta)
            m["kl_coef"] = float(self.kl_ctl.value)
        if batch.values is not None:
            m["values_mean"] = float(masked_mean(batch.values, mask))
            # how much of the returns' variance the rollout's values explained, whole batch
            ev = explained_variance(batch.values, est.returns, mask, min_var=EV_MIN_VAR)
            m["critic/explained_variance"] = float(ev)
        m.update(self._rollout_trust(local))
        for role in self.trained.values():
            m.update({f"{group}/lr": lr for group, lr in role.lrs().items()})
        m.update(train_stats)
        m.update({f"time/{k}": v for k, v in self.timer.last.items()})
        return m

    def _rollout_trust(self, exp: Experience) -> dict[str, float]:
        """How far the engine's log-probs are from the trainer's old ones (and the rollout
        correction's weights), over the whole batch (this rank's rows `exp`, gathered);
        warns above rollout.logprob_diff_warn. Nothing when the old log-probs are the
        engine's (then `actor/first_logratio_abs` measures the same gap)."""
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
            warnings.warn(LogprobMismatchWarning(self._mismatch(m, limit)), stacklevel=2)
        return m

    def _mismatch(self, m: dict[str, float], limit: float) -> str:
        engine = self.engine.name
        fixes = ["algorithm.rollout_correction=token", *engine_of(self.engine).logprob_fixes]
        also = ""
        if self.cfg.rollout.asynchronous:  # the gap includes one update: expected there
            also = (
                " With rollout.asynchronous it also includes the last update (the samples "
                "come from the weights before it); rollout/is_weight_mean and "
                "rollout/is_truncated_frac show what the correction makes of it."
            )
        return (
            f"rollout/logprob_diff_mean={m['rollout/logprob_diff_mean']:.3g} exceeds "
            f"rollout.logprob_diff_warn={limit} at iteration {self.iteration + 1}: the "
            f"{engine} engine's log-probs differ from the trainer's (dtype or kernels, "
            "top_p / top_k renormalisation, or stale weights). PPO's ratio uses the "
            f"trainer's; consider {', '.join(fixes)}, or a higher threshold.{also}"
        )

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """Everything but the weights that a resumed run needs to continue exactly; only
        types `torch.load(weights_only=True)` reads back. Every rank calls it (the RNG
        states of all ranks are gathered); rank 0's copy is the one written."""
        return {
            "iteration": int(self.iteration),
            "policy_version": int(self.policy_version),
            "roles": {name: role.state_dict() for name, role in self.trained.items()},
            "kl_coef": float(self.kl_ctl.value),
            "score_moments": self.score_moments.state_dict(),
            "source_moments": {k: m.state_dict() for k, m in self.source_moments.items()},
            "loader": self.loader.state_dict(),
            "sft_loader": self.sft_loader.state_dict() if self.sft_loader else None,
            "generator": self.generator.get_state(),
            "rng": self.dist.all_gather_object(rng_state()),  # one per rank
            # rollout.asynchronous: each rank's share of the batch sampled from the
            # previous weights (they are not saved, so it could not be sampled again)
            "pending": self.dist.all_gather_object(self._pending_state())
            if self.cfg.rollout.asynchronous
            else None,
        }

    def _pending_state(self) -> dict | None:
        if self.pending is None:
            return None
        return {"rollout": rollout_state(self.pending[0]), "stats": dict(self.pending[1])}

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
        for name, moments in self.source_moments.items():
            moments.load_state_dict(state["source_moments"][name])
        self.loader.load_state_dict(state["loader"])
        if self.sft_loader is not None and state["sft_loader"] is not None:
            self.sft_loader.load_state_dict(state["sft_loader"])
        self.generator.set_state(state["generator"])
        self.iteration = int(state["iteration"])
        # absent from older checkpoints: the actor is updated once per iteration after the
        # critic's warm-up, so the count follows from the iteration
        done = self.iteration - self.cfg.critic.warmup_iterations
        self.policy_version = int(state.get("policy_version", max(0, done)))
        self.pending = None  # none kept (older checkpoints), or of another number of ranks:
        pending = state.get("pending") or []  # the next iteration samples its own batch
        if len(pending) == self.dist.world_size and pending[self.dist.rank] is not None:
            mine = pending[self.dist.rank]
            self.pending = (rollout_from_state(mine["rollout"], self.device), mine["stats"])
        rngs = state["rng"]
        if len(rngs) == self.dist.world_size:
            set_rng_state(rngs[self.dist.rank])
        else:
            seed_everything(self.cfg.trainer.seed + self.dist.rank + 7919 * self.iteration)

    def save_models(self, folder) -> None:
        """Each trained module as plain Hugging Face folders (`actor/`, and the critic's:
        `models.critic.save_module`; LoRA merged in, plus the adapters). Every rank calls it
        (FSDP2 gathers the shards); rank 0 writes."""
        for role in self.trained.values():
            role.save(folder, self.roles.tokenizer)

    def load_models(self, folder) -> None:
        """Weights written by `save_models`, in place (the optimizers keep their tensors)."""
        for role in self.trained.values():
            role.load(folder)
        self.weight_version += 1  # the engine gets these at the next rollout
