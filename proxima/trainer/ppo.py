"""The PPO loop. `step()` reads as the numbered phases of docs/architecture.md, one call each.

Phases 1-2 are the sampler's, chosen once from the config (`trainer.samplers`: on-policy,
dynamic sampling, sampling ahead). The trainer owns every piece of state that changes while
it trains (the trained roles with their optimizers and schedules, the KL controller, the
score statistics, the reward sources' own, the prompt loaders, the shuffle generator, the
random streams, the sampler's, the iteration), registered once (`trainer.state`) and exposed
through torch's `state_dict()` / `load_state_dict()`; the same registry gives the snapshot
that `undo_iteration` puts back. `proxima.checkpoint` only writes and finds folders.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from functools import partial

import torch

from proxima.algos import (
    ADVANTAGE_ESTIMATORS,
    AdaptiveKLController,
    FixedKLController,
    RunningMoments,
    explained_variance,
    first_token_explained_variance,
    logprob_diff,
    masked_mean,
    masked_var,
    mismatch_stats,
    reverse_kl_stats,
)
from proxima.config import Config
from proxima.config.run import run_plan
from proxima.data import PromptLoader
from proxima.data.mixing import DATASET_COLUMN, MixedPromptLoader, prompt_loader
from proxima.models.critic import optimizer_groups
from proxima.models.unwrap import base_model, unwrap
from proxima.rng import rng_state, seed_everything, set_rng_state
from proxima.rollout.collect import Rollout, sampled_inputs
from proxima.rollout.contract import LogprobMismatchWarning, RolloutEngine
from proxima.rollout.engines import build_engine, engine_spec, spec_of
from proxima.rollout.experience import build_experience, rollout_correction
from proxima.rollout.plan import ScoringPlan, plan_scoring
from proxima.trainer.advantages import (
    BatchView,
    Estimates,
    estimate_advantages,
    with_source_options,
)
from proxima.trainer.context import Clock, PhaseTimer, rollout_context
from proxima.trainer.device import autocast
from proxima.trainer.dist import Dist, shard, wrap_trained
from proxima.trainer.drift import batch_drift
from proxima.trainer.health import NonFiniteOutputsError
from proxima.trainer.offload import Offload, reward_models, wants_offload
from proxima.trainer.optim import TrainedRole
from proxima.trainer.roles import Roles
from proxima.trainer.samplers import build_sampler
from proxima.trainer.state import Part, StateRegistry, stateful
from proxima.trainer.update import PolicyObjective, PtxLoss, run_epochs
from proxima.types import Experience

# Var(returns) below this is rounding, not signal: the explained variance is reported as 0
EV_MIN_VAR = 1e-8


def build_kl_controller(cfg: Config):
    k = cfg.algorithm.kl_ctrl
    if k.type == "adaptive":
        return AdaptiveKLController(k.kl_coef, k.target_kl, k.horizon)
    return FixedKLController(k.kl_coef)


def _on_clock(name: str) -> property:
    """A trainer attribute kept in its `Clock`, which the samplers read too."""
    return property(
        lambda self: getattr(self.clock, name), lambda self, v: setattr(self.clock, name, v)
    )


class PPOTrainer:
    """Wires rollout, algos and the optimisers; holds no math of its own.

    `engine` writes the responses (default: the one `rollout.name` names, built here); the
    trainer pushes the actor's weights into it whenever they changed (`sync_engine`).
    `plan`: where phase 3 takes each quantity from (default: `rollout.plan.plan_scoring`
    for this engine and the actor's generation config). `offload`: what a phase does not
    use waits on the CPU (`trainer.offload`; default: model.offload=trained on a GPU; the
    recipe passes the memory plan's decision, which resolves auto)."""

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
        offload: bool | None = None,
    ) -> None:
        self.cfg, self.roles, self.device = cfg, roles, device
        # packed rows in the passes: model.packing, or when unset what the models take
        self.packed = roles.packed if cfg.model.packing is None else cfg.model.packing
        self.dist = dist = dist or Dist()
        d = cfg.data
        self.loader = prompt_loader(prompts, d.train_batch_size, cfg.trainer.seed, d.train_weights)
        self.kl_ctl = build_kl_controller(cfg)
        self.score_moments = RunningMoments()  # for algorithm.normalize_scores
        self.generator = torch.Generator().manual_seed(cfg.trainer.seed)
        self.clock = Clock()  # the iteration, the policy and weight versions
        if plan is None:  # before the engine is built: a plan that cannot be fails first
            kind = spec_of(engine) if engine is not None else engine_spec(cfg.rollout.name)
            plan = plan_scoring(cfg, kind, base_model(roles.actor).generation_config)
        self.plan = plan
        # the estimator's options, those the reward sources supply filled in; the extra
        # inputs phases 4-5 gather (score_components: the sources' metrics, standardisation)
        self.algorithm = with_source_options(cfg.algorithm, roles.reward)
        inputs = ADVANTAGE_ESTIMATORS[cfg.algorithm.adv_estimator].inputs
        if plan.teacher:  # the teacher's term, added to any estimator's (and its metrics)
            inputs = (*inputs, "old_logprobs", "teacher_logprobs")
        self.batch_inputs = tuple(dict.fromkeys((*inputs, "score_components")))
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
        for frozen in (roles.reference, roles.teacher):
            if dist.strategy == "fsdp2" and frozen is not None:
                shard(frozen, cfg.fsdp, trainable=False)
        self.context = rollout_context(  # what phases 1-2 read
            cfg,
            roles,
            engine,
            device,
            generation_values=plan.values == "generation",
            dist=dist,
            loader=self.loader,
            clock=self.clock,
            timer=self.timer,
        )
        self.on_policy, self.sampler = build_sampler(self.context)  # phases 1-2
        self.state = self._state_registry()
        if offload is None:
            offload = wants_offload(cfg, device)
        self.offload = self._offload() if offload else None
        self.timer.residency = self.offload

    def _offload(self) -> Offload:
        """model.offload: the parts that wait on the CPU while a phase does not use them (a
        value model's weights, the reference, the teacher, the reward models, the
        optimizers' state)."""
        off = Offload(
            self.device,
            reference_in_update=run_plan(self.cfg).reference_in_update,
            release=not spec_of(self.engine).serves_actor,  # vLLM allocates beside torch
        )
        if "critic" in self.trained:
            off.add_weights("critic weights", [self.trained["critic"].unwrapped])
        if self.roles.reference is not None:
            off.add_weights("reference", [self.roles.reference])
        if self.roles.teacher is not None:
            off.add_weights("teacher", [self.roles.teacher])
        off.add_weights("reward models", reward_models(self.roles.reward))
        for name, role in self.trained.items():
            off.add_optimizer(f"{name} optimizer", role.optimizer)
        return off

    def prepare(self, phase: str) -> None:
        """Before `phase` outside `step()` (`evaluate`: between iterations): what it needs
        on the device (model.offload; timed as `offload`)."""
        if self.offload is not None:
            with self.timer.clock("offload"):
                self.offload.enter(phase)

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
        objectives["actor"] = PolicyObjective(
            cfg.actor, cfg.rollout.temperature, roles.reference, packed=self.packed
        )
        if critic is not None:  # the critic's value loss: in the actor's or its own
            objectives = critic.objectives(objectives["actor"])
        if critic is not None and critic.model is not None:
            trained["critic"] = role("critic", critic.model, cfg.critic)
        return trained, objectives

    def precision(self, generation: bool = False):
        """Mixed-precision context of forward passes (`RolloutContext.precision`)."""
        return self.context.precision(generation)

    iteration = _on_clock("iteration")
    policy_version = _on_clock("policy_version")
    weight_version = _on_clock("weight_version")

    # ------------------------------------------------------------------ one iteration

    def step(self) -> tuple[dict[str, float], Rollout]:
        self._started = self._iteration_start()  # what `undo_iteration` puts back
        self.timer.new_iteration()
        timer = self.timer
        # 1. the actor writes responses, 2. the reward sources score them (see `samplers`)
        ro, sampling_stats = self.sampler.sample()
        with timer("score"), self.precision():  # 3. old / reference log-probs, values, KL
            exp = self.dist.agree(lambda: self.make_experience(ro), "scoring")
        with timer("advantages"):  # 4. token rewards, 5. advantages and returns (whole batch)
            groups = len(ro.prompts) // self.cfg.rollout.n
            batch = BatchView.gather(exp, self.dist, groups, self.batch_inputs)
            est = self.estimate(batch)
            exp = est.rows(exp, self.dist)
            if self.cfg.rollout.mask_truncated:  # DAPO's overlong filtering
                exp = replace(exp, response_mask=exp.response_mask * exp.stopped.unsqueeze(1))
        with timer("update"):  # 6. PPO epochs over shuffled mini-batches
            train_stats = self.update(exp)
        with timer("sync"):  # 6b. the rollout engine gets the actor's new weights
            self.sync_engine()
        metrics = self.metrics(batch, est, exp, train_stats)  # 7. metrics; KL controller
        metrics.update(sampling_stats)
        metrics.update(self._set_stats(ro))
        metrics.update(batch_drift(batch.response_mask, exp, ro.responses, self.dist))
        self.kl_ctl.update(est.stats["kl"], exp.batch_size)
        self.iteration += 1
        return metrics, ro

    def _iteration_start(self) -> dict:
        """The state an iteration changes before its first optimizer step (the registered
        parts' snapshots) and the steps taken so far."""
        steps = [role.scheduler.last_epoch for role in self.trained.values()]
        return {"state": self.state.snapshot(), "steps": steps}

    def undo_iteration(self) -> bool:
        """After `step()` raised: put back the state the iteration started from, so that the
        trainer is at the end of its last completed iteration (what a checkpoint must hold),
        and drop the gradients it accumulated. False when it cannot: an optimizer step had
        already changed the weights."""
        start = getattr(self, "_started", None)
        steps = [role.scheduler.last_epoch for role in self.trained.values()]
        if start is None or steps != start["steps"]:
            return False
        self.state.restore(start["state"])
        for role in self.trained.values():
            role.optimizer.zero_grad(set_to_none=True)
        return True

    def close(self) -> None:
        """Stop the rollout workers and release the engine (the end of a run, whatever it was)."""
        self.sampler.close()
        self.engine.close()

    def sync_engine(self) -> None:
        """Push the actor's weights into the rollout engine if it holds older ones (after an
        actor update, after `load_models`, before the first rollout)."""
        self.context.sync_engine()

    def synced_engine(self) -> RolloutEngine:
        """The rollout engine, holding the actor's current weights (training, evaluation)."""
        return self.context.synced_engine()

    def make_experience(self, ro: Rollout) -> Experience:
        """Phase 3: the scoring passes as the scoring plan says (timed as `score`), with the
        estimators' extra inputs that sampling produced carried by name; refuses non-finite
        log-probs or values (the previous update diverged)."""
        roles = self.roles
        exp = build_experience(
            ro.gen,
            ro.scores,
            ro.group_ids,
            self.plan,
            actor=roles.actor,
            reference=roles.reference,
            critic=roles.critic,
            rollout=self.cfg.rollout,
            algorithm=self.cfg.algorithm,
            teacher=roles.teacher,
            packed=self.packed,
        )
        sampled = sampled_inputs(ro)
        exp = replace(exp, **{k: v.to(exp.scores.device) for k, v in sampled.items()})
        for role, tensor in (("actor", exp.old_logprobs), ("critic", exp.values)):
            if tensor is not None and not bool(torch.isfinite(tensor).all()):
                what = "log-probs" if role == "actor" else "values"
                raise NonFiniteOutputsError(f"its {what} of the rollout are not finite", role)
        return exp

    def estimate(self, batch: BatchView) -> Estimates:
        """Phases 4-5 on the whole batch (the running score statistics updated first, when
        algorithm.normalize_scores)."""
        algorithm = self.algorithm
        if batch.score_components is not None:  # reward.sources standardised one by one
            scores = self.roles.reward.standardise(batch.scores, batch.score_components)
            batch = replace(batch, scores=scores)  # the overlong penalty stays added
        mean, std = 0.0, 1.0
        if algorithm.normalize_scores:
            self.score_moments.update(batch.scores)
            mean, std = self.score_moments.mean, self.score_moments.std
        return estimate_advantages(
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
            m.update(self._source_stats(len(local.scores)))
        if self.cfg.kl_in_reward:  # the coefficient of the KL in the reward (beta)
            m["kl_coef"] = float(self.kl_ctl.value)
        teacher = batch.inputs.get("teacher_logprobs")
        if teacher is not None:  # on-policy distillation: the reverse KL to the teacher
            kl = reverse_kl_stats(teacher, batch.inputs["old_logprobs"], mask)
            m.update({f"teacher/{k}": float(v) for k, v in kl.items()})
        if batch.values is not None:
            m["values_mean"] = float(masked_mean(batch.values, mask))
            # how much of the returns' variance the rollout's values explained, whole batch
            ev = explained_variance(batch.values, est.returns, mask, min_var=EV_MIN_VAR)
            m["critic/explained_variance"] = float(ev)
            first, group = first_token_explained_variance(
                batch.values, est.returns, mask, batch.group_ids, min_var=EV_MIN_VAR
            )
            m["critic/explained_variance_first"] = float(first)
            m["critic/explained_variance_group"] = float(group)
        m.update(self._rollout_trust(local))
        for role in self.trained.values():
            m.update({f"{group}/lr": lr for group, lr in role.lrs().items()})
        m.update(train_stats)
        m.update({f"time/{k}": v for k, v in self.timer.last.items()})
        return m

    def _set_stats(self, ro: Rollout) -> dict[str, float]:
        """Several prompt sets: each one's share of the batch's samples and their mean score
        (data/<name>/share, data/<name>/score; no score for a set absent this time), over
        the ranks."""
        sets = ro.columns.get(DATASET_COLUMN)
        if not isinstance(self.loader, MixedPromptLoader) or sets is None:
            return {}
        names = self.loader.names
        k = len(names)
        sums = torch.zeros(2 * k, dtype=torch.float64)  # counts, then score sums
        for name, score in zip(sets, ro.total_rewards().tolist(), strict=True):
            sums[names.index(name)] += 1
            sums[k + names.index(name)] += score
        sums = self.dist.all_reduce_sum(sums)
        out = {}
        for i, name in enumerate(names):
            out[f"data/{name}/share"] = float(sums[i] / sums[:k].sum())
            if sums[i]:
                out[f"data/{name}/score"] = float(sums[k + i] / sums[i])
        return out

    def _source_stats(self, rows: int) -> dict[str, float]:
        """The reward sources' counters (reward/<name>/<stat>), summed over the ranks, and
        each source's share of samples scored its fallback (reward/<name>/fallback_share)."""
        stats = self.roles.reward.pop_stats()
        keys = sorted(stats)
        total = self.dist.all_reduce_sum(
            torch.tensor([stats[k] for k in keys] + [float(rows)], dtype=torch.float64)
        )
        out = {k: float(v) for k, v in zip(keys, total[:-1], strict=True)}
        for k in [k for k in keys if k.endswith("/fallback_samples")]:
            out[k.replace("/fallback_samples", "/fallback_share")] = out[k] / float(total[-1])
        return out

    def _rollout_trust(self, exp: Experience) -> dict[str, float]:
        """How far the engine's log-probs are from the trainer's old ones (logprob_diff_*,
        kl_k3, seq_logratio_*) and what the rollout correction makes of it (is_weight_mean,
        is_truncated_frac, rejected_token_frac, rejected_seq_frac: the weights' stats
        recomputed on the gathered rows), over the whole batch (this rank's rows `exp`,
        gathered); warns above rollout.logprob_diff_warn. Nothing when the old log-probs are
        the engine's (then `actor/first_logratio_abs` measures the same gap)."""
        if exp.rollout_logprobs is None:
            return {}
        g = self.dist.gather_rows
        mask, old, engine_lp = g(exp.response_mask), g(exp.old_logprobs), g(exp.rollout_logprobs)
        diff = logprob_diff(engine_lp, old, mask)
        m = {f"rollout/logprob_diff_{k}": float(v) for k, v in diff.items()}
        _, stats = rollout_correction(self.cfg.algorithm).weights(old, engine_lp, mask)
        stats.update(mismatch_stats(old, engine_lp, mask))
        m.update({f"rollout/{k}": float(v) for k, v in stats.items()})
        limit = self.cfg.rollout.logprob_diff_warn
        if limit and m["rollout/logprob_diff_mean"] > limit:
            warnings.warn(LogprobMismatchWarning(self._mismatch(m, limit)), stacklevel=2)
        return m

    def _mismatch(self, m: dict[str, float], limit: float) -> str:
        engine = self.engine.name
        fixes = ["algorithm.rollout_correction=token", *spec_of(self.engine).logprob_fixes]
        also = ""
        if self.cfg.rollout.max_staleness:  # the gap includes updates: expected there
            also = (
                " With rollout.max_staleness it also includes the last updates (the samples "
                "come from the weights before them); rollout/is_weight_mean and "
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

    def _state_registry(self) -> StateRegistry:
        """Every part of the trainer that changes while it trains, by its checkpoint key (in
        the order it is saved and loaded); those an iteration changes before its first
        optimizer step are snapshotted for `undo_iteration`."""
        reg, dist = StateRegistry(), self.dist

        def attribute(name: str) -> Part:  # an int, checkpointed only
            return Part(lambda: int(getattr(self, name)), lambda v: setattr(self, name, int(v)))

        reg.add("iteration", attribute("iteration"))
        reg.add("policy_version", attribute("policy_version"))
        reg.add("roles", Part(self._roles_state, self._load_roles_state))
        reg.add("kl_coef", Part(lambda: float(self.kl_ctl.value), self._load_kl_coef))
        reg.add("score_moments", stateful(self.score_moments))
        if hasattr(self.roles.reward, "standardise"):  # its standardised sources' moments
            reg.add("source_moments", stateful(self.roles.reward))
        reg.add("loader", stateful(self.loader))
        if self.sft_loader is not None:
            reg.add("sft_loader", stateful(self.sft_loader))
        g = self.generator
        reg.add("generator", Part(g.get_state, g.set_state, g.get_state, g.set_state))
        gathered = lambda: dist.all_gather_object(rng_state())  # noqa: E731 - one per rank
        reg.add("rng", Part(gathered, self._load_rng, rng_state, set_rng_state))
        reg.add("sampler", stateful(self.sampler))
        return reg

    def _roles_state(self) -> dict:
        return {name: role.state_dict() for name, role in self.trained.items()}

    def _load_roles_state(self, state: dict) -> None:
        for name, role in self.trained.items():
            role.load_state_dict(state[name])

    def _load_kl_coef(self, value: float) -> None:
        """Only an adaptive controller's (a fixed one keeps the config's value, which a
        resumed run may change)."""
        if self.cfg.algorithm.kl_ctrl.type == "adaptive":
            self.kl_ctl.value = float(value)

    def _load_rng(self, rngs: list) -> None:
        """This rank's random streams; with another number of processes than the
        checkpoint's, they start anew from trainer.seed, the rank and the iteration: the run
        continues, not bit for bit as the uninterrupted one would have."""
        if len(rngs) == self.dist.world_size:
            set_rng_state(rngs[self.dist.rank])
        else:
            seed_everything(self.cfg.trainer.seed + self.dist.rank + 7919 * self.iteration)

    def state_dict(self) -> dict:
        """Everything but the weights that a resumed run needs to continue exactly (the
        registered parts, `_state_registry`); only types `torch.load(weights_only=True)`
        reads back. Every rank calls it (the RNG states and the batch sampled ahead of all
        ranks are gathered); rank 0's copy is the one written."""
        return self.state.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()`."""
        self.state.load_state_dict(state)

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
