"""Phases 1-2 as samplers chosen once (`build_sampler`): `sample()` returns this rank's share
of an iteration's scored batch and its sampling stats; `step()` never asks which one runs.
They read a `RolloutContext` (`trainer.context`: the engine, the prompts, the reward source,
the clock, ...), never the trainer, so a rollout worker runs them on a context of its own.

- `OnPolicy`: one round: the next prompts, generated from the current weights and scored,
  with what the estimator needs of sampling (`PREPARE`).
- `DynamicSampling` (`algorithm.filter_groups`, DAPO's dynamic sampling): rounds of the
  on-policy sampler until the batch is full of informative groups.
- `Ahead` (`rollout.max_staleness` = k, verl's one-step off-policy pipeline when k = 1): the
  batch trained now was sampled from the weights of k iterations ago, by rollout worker
  processes while the trainer trained (`InWorkers`, `trainer.workers`) or in the trainer's
  process (`InProcess`).

Each owns its state: `state_dict()` / `load_state_dict()` for a checkpoint and, where it keeps
something between iterations, `snapshot()` / `restore()` for `PPOTrainer.undo_iteration`.
"""

from __future__ import annotations

import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import torch

from proxima.algos import overlong_penalty
from proxima.rng import preserve_rng, seed_everything
from proxima.rollout.collect import (
    Rollout,
    cat_rollouts,
    generate_rollout,
    reward_args,
    rollout_from_state,
    rollout_state,
    rollout_state_fits,
    score_rollout,
    select_groups,
)
from proxima.rollout.episodes import episode_stats
from proxima.trainer.context import RolloutContext
from proxima.trainer.health import NonFiniteOutputsError
from proxima.trainer.workers import Request, RolloutWorkerError, Workers

# a sampled batch (this rank's share) and its sampling statistics
Sampled = tuple[Rollout, dict[str, float]]


class Stateless:
    """A sampler that keeps nothing between iterations."""

    def close(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class OnPolicy(Stateless):
    """One round of phases 1-2 on the context's engine, prompts and clock: generate this
    rank's share of the next prompts from the actor's current weights and score them (the
    reward source's score plus DAPO's overlong penalty when configured), then add what the
    estimator needs of sampling (`PREPARE`)."""

    def __init__(self, context: RolloutContext) -> None:
        self.context = ctx = context
        reward = ctx.reward
        # a source of several parts returns their raw scores too (`WeightedReward.scored`)
        scored = getattr(reward, "scored", None)
        self.scored = (
            (lambda ro: scored(*reward_args(ro)))
            if scored is not None
            else (lambda ro: (score_rollout(ro, reward), None))
        )
        self.prepare = [PREPARE[name] for name in ctx.needs if name in PREPARE]
        # sampling ahead scores the parts of a single-turn batch as they finish
        self.overlap = bool(ctx.run.ahead) and not ctx.run.multi_turn

    def sample(self) -> Sampled:
        ro, penalty = self.produce(self.next_prompts())
        return ro, self.stats(ro, penalty)

    def produce(self, items: list) -> tuple[Rollout, torch.Tensor | None]:
        """Phases 1-2 for `items` (this rank's share of a batch), no statistic over the ranks:
        (the scored rollout with what the estimator needs of sampling, DAPO's overlong
        penalty or None). A rollout worker runs this alone (`trainer.workers`). With
        `overlap` (sampling ahead), single-turn batches are scored as they finish
        (`_produce_overlapped`)."""
        ctx = self.context
        if self.overlap:
            ro, (scores, penalty, score_components) = self._produce_overlapped(items)
        else:
            timer, agree = ctx.timer, ctx.dist.agree
            with timer("generate"), ctx.precision(generation=True):  # 1. the actor writes
                ro = agree(lambda: self.generate(items), "generation")
            with timer("reward"), ctx.precision():  # 2. the reward model / function scores them
                scores, penalty, score_components = agree(lambda: self.reward(ro), "the reward")
        ro = replace(ro, scores=scores, score_components=score_components)
        for prepare in self.prepare:
            ro = prepare(self, items, ro)
        return ro, penalty

    def _produce_overlapped(self, items: list) -> tuple[Rollout, tuple]:
        """Generate in parts of one micro-batch (`rollout.micro_batch_size` rows, whole
        groups) and score each part in a thread as soon as it is generated, while the next
        is: a reward server's or a reward model's time hides behind generation (verl's
        reward loop). The scores are the same as the whole batch's for any reward that
        scores each sample (or each group) on its own. `time/reward` is then the wait for
        the last part's score."""
        ctx = self.context
        timer, agree = ctx.timer, ctx.dist.agree
        per = max(1, ctx.cfg.rollout.micro_batch_size // ctx.cfg.rollout.n)
        chunks = [items[i : i + per] for i in range(0, len(items), per)]

        def score(ro: Rollout):
            with ctx.precision():  # autocast is per thread
                return self.reward(ro)

        parts, pending = [], []
        with ThreadPoolExecutor(1, thread_name_prefix="score-as-finished") as pool:
            for chunk in chunks:
                with timer("generate"), ctx.precision(generation=True):
                    parts.append(agree(lambda c=chunk: self.generate(c), "generation"))
                pending.append(pool.submit(score, parts[-1]))
            with timer("reward"):  # raises on every rank when a part raised on one
                got = agree(lambda: [f.result() for f in pending], "the reward")
        ro = cat_rollouts(parts, ctx.tokenizer.pad_token_id)

        def cat(k: int) -> torch.Tensor | None:
            return None if got[0][k] is None else torch.cat([g[k] for g in got])

        return ro, (cat(0), cat(1), cat(2))

    def stats(self, ro: Rollout, penalty: torch.Tensor | None) -> dict[str, float]:
        """The sampling statistics of a produced batch over all ranks (every rank calls it):
        its episodes' and the overlong penalty's."""
        stats = self._episode_stats(ro) if ro.episodes is not None else {}
        if penalty is not None:
            stats.update(self._penalty_stats(penalty))
        return stats

    def next_prompts(self) -> list:
        """This rank's share of the next global batch of prompts (all samples of a prompt
        stay on one rank)."""
        dist = self.context.dist
        items = next(self.context.loader)
        k = len(items) // dist.world_size
        return items[dist.rank * k : (dist.rank + 1) * k]

    def generate(self, items: list | None = None, greedy: bool = False) -> Rollout:
        """rollout.n responses to each of `items` (default: `next_prompts()`), with the
        engine's own log-probs (rollout/logprob_diff_*, rollout correction); `greedy`: one
        greedy response each (ReMax's baseline)."""
        ctx = self.context
        items = self.next_prompts() if items is None else items
        try:
            ro = generate_rollout(
                ctx.synced_engine(),
                ctx.tokenizer,
                items,
                ctx.cfg.rollout,
                ctx.device,
                greedy=greedy,
                n=1 if greedy else None,
                logprobs=not greedy,
                values=ctx.generation_values and not greedy,
            )
        except RuntimeError as err:  # torch.multinomial on inf/nan probabilities
            if "inf" in str(err) and "nan" in str(err):
                raise NonFiniteOutputsError(f"sampling failed: {err}") from err
            raise
        # the engine holds the actor's current weights (synced above): this policy version
        version = ctx.clock.policy_version
        stamp = torch.full((len(ro.prompts),), version, dtype=torch.long, device=ctx.device)
        return replace(ro, versions=stamp)

    def reward(self, ro: Rollout) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """([B] the reward source's score of each response plus DAPO's overlong penalty
        (`reward.overlong_buffer_len`), [B] that penalty or None when it is off, [B, K] the
        raw score of each of `reward.sources` or None for a single source)."""
        gen, cfg = ro.gen, self.context.cfg
        scores, score_components = self.scored(ro)
        r = cfg.reward
        if not r.overlong_buffer_len:
            return scores, None, score_components
        penalty = overlong_penalty(
            gen.response_mask.sum(1).to(scores.device),
            cfg.rollout.max_response_length,
            r.overlong_buffer_len,
            r.overlong_penalty_factor,
        )
        return scores + penalty, penalty, score_components

    def _penalty_stats(self, penalty: torch.Tensor) -> dict[str, float]:
        """DAPO's overlong penalty over the whole batch: its mean and the share penalised."""
        total = self.context.dist.all_reduce_sum(
            torch.tensor(
                [float(penalty.sum()), float((penalty < 0).sum()), penalty.numel()],
                dtype=torch.float64,
            )
        )
        return {
            "overlong_penalty_mean": float(total[0] / total[2]),
            "overlong_fraction": float(total[1] / total[2]),
        }

    def _episode_stats(self, ro: Rollout) -> dict[str, float]:
        """Multi-turn episodes over the whole batch: turns per episode, the shares of
        episodes that ended done, truncated (max_turns, max_episode_tokens), on an
        environment error or timeout, tokens per episode (actions and observations) and the
        mean reward of a turn."""
        sums = episode_stats(ro.episodes, ro.gen)
        keys = sorted(sums)
        total = self.context.dist.all_reduce_sum(
            torch.tensor([sums[k] for k in keys], dtype=torch.float64)
        )
        got = {k: float(v) for k, v in zip(keys, total, strict=True)}
        episodes, turns = max(got["episodes"], 1.0), max(got["turns"], 1.0)
        out = {f"env/{k}": got[k] / episodes for k in ("turns", "done", "truncated", "errors")}
        out["env/timeouts"] = got["timeouts"] / episodes
        out["env/episode_length"] = got["episode_tokens"] / episodes
        out["env/reward_per_turn"] = got["turn_reward"] / turns
        return out


def greedy_baselines(sampler: OnPolicy, items: list, ro: Rollout) -> Rollout:
    """ReMax's baseline: a greedy response to each prompt, scored; its score (an episode's
    whole return) the baseline of the prompt's samples."""
    ctx = sampler.context
    with ctx.timer("generate"), ctx.precision(generation=True):
        greedy = ctx.dist.agree(lambda: sampler.generate(items, greedy=True), "generation")
    with ctx.timer("reward"), ctx.precision():
        base = ctx.dist.agree(lambda: sampler.reward(greedy), "the reward")[0]
    base = replace(greedy, scores=base).total_rewards()
    return replace(ro, reward_baselines=base.repeat_interleave(ctx.cfg.rollout.n))


# What an estimator needs (its registry entry's `needs`) that sampling supplies, by name. The
# other inputs come from phase 3 (old_logprobs; sum_pi_squared: the scoring plan computes it,
# `rollout.plan`) or from the reward sources (score_components, `WeightedReward.scored`).
PREPARE = {"reward_baselines": greedy_baselines}


def informative_groups(ro: Rollout) -> list[bool]:
    """Per group of `ro` (its group ids 0..G-1): whether its scores (an episode's: with its
    turn rewards) differ (DAPO keeps it)."""
    out, totals = [], ro.total_rewards()
    for g in range(int(ro.group_ids.max()) + 1 if ro.group_ids.numel() else 0):
        s = totals[(ro.group_ids == g).to(totals.device)]
        out.append(not bool((s == s[0]).all()))
    return out


class DynamicSampling(Stateless):
    """DAPO's dynamic sampling (`algorithm.filter_groups`): the groups whose scores are all
    equal are dropped and more rounds of `rounds` sampled until the global batch is full of
    informative groups, at most `max_rounds` (`algorithm.max_gen_batches`); a batch still
    short is filled with dropped groups, so it keeps its shape. The choice is global, in the
    order one process would generate (round, rank, group), and each rank then takes its
    share of the chosen groups (gathered from the ranks that generated them), so N processes
    train on the batch one process would."""

    def __init__(self, rounds: OnPolicy, max_rounds: int) -> None:
        self.rounds, self.max_rounds = rounds, max_rounds
        self.dist = rounds.context.dist
        self.told = False  # the console heard of a batch with no informative group

    def sample(self) -> Sampled:
        ro, stats = self.rounds.sample()
        need = len(ro.prompts) // self.rounds.context.cfg.rollout.n  # groups per rank
        world = self.dist.world_size
        parts, flags = [ro], []  # flags[r][q]: informative groups of rank q in round r
        while True:
            flags.append(self.dist.all_gather_object(informative_groups(parts[-1])))
            kept = sum(int(x) for rank_flags in flags for q in rank_flags for x in q)
            if kept >= need * world or len(parts) >= self.max_rounds:
                break
            more, more_stats = self.rounds.sample()
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
        rounds = len(parts)
        if not good and not self.told and self.dist.is_main:
            self.told = True
            print(
                f"dapo: {rounds} batch(es), {rounds * need * world} groups, and in every group "
                "all samples scored the same (a constant reward?): the batch trains on groups "
                "whose advantages are all 0. Check the reward, or turn algorithm.filter_groups "
                "off (said once; dapo/groups_kept counts them every iteration).",
                file=sys.stderr,
                flush=True,
            )
        stats = {k: v / rounds for k, v in stats.items()}
        stats.update(
            {
                "dapo/gen_batches": float(rounds),
                "dapo/groups_generated": float(rounds * need * world),
                "dapo/groups_kept": float(min(len(good), need * world)),
                "dapo/groups_filled": float(max(0, need * world - len(good))),
            }
        )
        return self._gather_groups(parts, mine), stats

    def _gather_groups(self, parts: list[Rollout], keys: list[tuple[int, int, int]]) -> Rollout:
        """The groups `keys` ((round, rank, group) each), in that order, as one rollout on
        this rank; groups another rank generated come from it (every rank's rounds are
        gathered when several processes run)."""
        pad = self.rounds.context.tokenizer.pad_token_id
        if not self.dist.active:
            offsets = [
                sum(int(p.group_ids.max()) + 1 for p in parts[:r]) for r in range(len(parts))
            ]
            return select_groups(cat_rollouts(parts, pad), [offsets[r] + g for r, _, g in keys])
        everyone = self.dist.all_gather_object([p.to("cpu") for p in parts])  # [rank][round]
        picked = [select_groups(everyone[q][r], [g]) for r, q, g in keys]
        return cat_rollouts(picked, pad).to(self.rounds.context.device)


def staleness_stats(versions: torch.Tensor, trained_at: int) -> dict[str, float]:
    """How many policy versions behind the trained weights (`trained_at`) the samples were
    generated ([B] `Rollout.versions`): mean and max over the batch."""
    stale = (trained_at - versions).float()
    return {
        "rollout/staleness_mean": float(stale.mean()),
        "rollout/staleness_max": float(stale.max()),
    }


class InProcess:
    """`rollout.workers=0`: a batch is sampled when it is submitted, by the inner sampler in
    the trainer's process (on-policy rounds or dynamic sampling, every engine), under the
    batch's own seed (the trainer's random streams are left as they were)."""

    def __init__(self, inner) -> None:
        self.inner = inner

    def start(self, index: int) -> None:
        pass

    def publish(self, index: int) -> None:
        pass  # the engine serves the trainer's weights, current at every submit

    def submit(self, batch: int, weights: int, seed: int) -> Sampled:
        with preserve_rng():
            seed_everything(seed)
            return self.inner.sample()

    def sent(self, batch: int) -> bool:
        return False

    def receive(self, batch: int) -> tuple[int, Sampled]:
        raise AssertionError("a batch sampled in the trainer's process is never waited for")

    def close(self) -> None:
        pass


class InWorkers:
    """`rollout.workers` >= 1: the batch's prompts drawn here and sent to a worker process
    (`trainer.workers`), which samples it from the weights of iteration `weights` while the
    trainer goes on; its statistics over the ranks computed when it is received."""

    def __init__(self, rounds: OnPolicy, count: int, threads: int, staleness: int) -> None:
        self.rounds, self.context = rounds, rounds.context
        self.workers = Workers(rounds.context, count, threads, staleness, OnPolicy)

    def start(self, index: int) -> None:
        self.workers.start(index)

    def publish(self, index: int) -> None:
        self.workers.publish(index)

    def submit(self, batch: int, weights: int, seed: int) -> None:
        items = self.rounds.next_prompts()  # drawn again after an undo: the loader's order
        if not self.sent(batch):
            self.workers.submit(Request(batch, items, weights, seed))

    def sent(self, batch: int) -> bool:
        return self.workers.pending(batch)

    def receive(self, batch: int) -> tuple[int, Sampled]:
        """`batch`, with its statistics (every rank receives the same batches in the same
        order); a batch that raised in its worker raises here, on every rank."""

        def local():
            out, error = self.workers.receive(batch)
            if error is not None:
                raise RolloutWorkerError(f"batch {batch + 1} raised in its rollout worker: {error}")
            return out

        dist = self.context.dist
        ro, penalty, seconds = dist.agree(local, "generation")
        ro = ro.to(self.context.device)
        stats = self.rounds.stats(ro, penalty)
        tokens = float(ro.gen.response_mask.sum())
        keys = ("generate", "reward", "token_version")
        times = torch.tensor([*(seconds.get(k, 0.0) for k in keys), tokens])
        times = dist.all_reduce_sum(times) / dist.world_size
        stats["time/worker_generate"] = float(times[0])
        stats["time/worker_reward"] = float(times[1])
        stats["tokens_per_s"] = float(times[3] / max(float(times[0]), 1e-9)) * dist.world_size
        if "token_version" in seconds:  # partial rollouts: the mean version of the tokens
            stats["rollout/token_version_mean"] = float(times[2])
        return batch, (ro, stats)

    def close(self) -> None:
        self.workers.close()


class Ahead:
    """`rollout.max_staleness` = k >= 1: the batch trained at iteration i is sampled from the
    weights the trainer had at the start of iteration i - k (or of the iteration this run
    started at, when later), so no sample trains more than k policy versions after it was
    sampled. Up to k batches are thus sampled ahead (never one past `trainer.iterations`,
    so a k beyond the run holds no more than the batches it trains): by worker processes
    while the trainer trains (`InWorkers`), or in the trainer's process, one phase after
    the other (`InProcess`). Each batch has its own seed (trainer.seed, the rank, its
    index), so both sample the same batch, and its samples depend on nothing that varies
    with timing.

    A checkpoint holds the batches sampled ahead (those in flight are waited for): they come
    from weights older than the checkpoint's, which cannot be sampled from again. The next
    batches need the checkpoint's weights, and are sampled again after a resume, with the
    same prompts and seeds: a resumed run trains what the uninterrupted one would have."""

    def __init__(
        self, context: RolloutContext, staleness: int, backend: InProcess | InWorkers
    ) -> None:
        self.context, self.k, self.backend = context, staleness, backend
        self.ready: dict[int, Sampled] = {}  # sampled, not yet trained, by the iteration that will
        self.first: int | None = None  # the iteration this run started the pipeline at
        self.drawn = 0  # the batches before this one are submitted (their prompts drawn)
        self.taken: tuple[int, Sampled] | None = None  # the batch the last `sample` returned

    def _seed(self, batch: int) -> int:
        ctx = self.context
        return (ctx.cfg.trainer.seed * 1_000_003 + batch) * 4099 + ctx.dist.rank

    def sample(self) -> Sampled:
        ctx = self.context
        i = ctx.clock.iteration
        if self.first is None:  # the first rollout of this process: the workers start
            self.first, self.drawn = i, i + len(self.ready)
            self.backend.start(i)
        self.backend.publish(i)  # the weights of iteration i, for the batch i + k
        made = []
        # no batch past the run's last: it would be sampled, held and never trained
        end = min(i + self.k, max(i, ctx.cfg.trainer.iterations - 1))
        if isinstance(self.backend, InProcess) and end > self.drawn and ctx.dist.is_main:
            print(  # the first of these waits holds up iteration i for minutes at a large k
                f"sampling batches {self.drawn + 1}-{end + 1} ahead in the trainer's process "
                f"(rollout.max_staleness={self.k}, rollout.workers=0)",
                file=sys.stderr,
                flush=True,
            )
        while self.drawn <= end:
            j, self.drawn = self.drawn, self.drawn + 1
            got = self.backend.submit(j, max(self.first, j - self.k), self._seed(j))
            if got is not None:
                self.ready[j] = got
                made.append(got[0])
        with ctx.timer("generate"):  # waiting for a worker: the time the overlap did not hide
            ro, stats = self._take(i)
        self.taken = (i, (ro, stats))
        version = ctx.clock.policy_version
        out = {**stats, **staleness_stats(ctx.dist.gather_rows(ro.versions), version)}
        if "rollout/token_version_mean" in stats:  # partial rollouts: over the tokens
            out["rollout/token_staleness_mean"] = version - stats["rollout/token_version_mean"]
        if isinstance(self.backend, InProcess):  # the speed of the rollouts made just now
            tokens = sum(float(r.gen.response_mask.sum()) for r in made)
            tokens = float(ctx.dist.all_reduce_sum(torch.tensor(tokens)))
            out["tokens_per_s"] = tokens / max(ctx.timer.last["generate"], 1e-9)
        return ro, out

    def _take(self, batch: int) -> Sampled:
        while batch not in self.ready:
            got, produced = self.backend.receive(batch)
            self.ready[got] = produced
        return self.ready.pop(batch)

    def state_dict(self) -> dict:
        """Each rank's batches sampled ahead (waited for), from the next iteration on; every
        rank calls it."""
        ctx = self.context
        for j in range(ctx.clock.iteration, self.drawn):
            if j not in self.ready and not self.backend.sent(j):
                break  # lost with a batch that raised: sampled again after a resume
            try:
                self.ready[j] = self._take(j)
            except RolloutWorkerError:  # on every rank (`agree`): keep what came before
                break
        mine, j = {}, ctx.clock.iteration
        while j in self.ready:
            ro, stats = self.ready[j]
            mine[j] = {"rollout": rollout_state(ro), "stats": dict(stats)}
            j += 1
        return {"ready": ctx.dist.all_gather_object(mine)}

    def load_state_dict(self, state: dict) -> None:
        """This rank's batches sampled ahead; none when the checkpoint was written by another
        number of processes (its rows are not this rank's), with other `Rollout` fields than
        this code's, or synchronously: the next iterations sample their own, from the
        current weights."""
        dist, ready = self.context.dist, state.get("ready") or []
        self.ready = {}
        mine = ready[dist.rank] if len(ready) == dist.world_size else {}
        if all(rollout_state_fits(got["rollout"]) for got in mine.values()):
            for j, got in mine.items():
                ro = rollout_from_state(got["rollout"], self.context.device)
                self.ready[int(j)] = (ro, got["stats"])

    def snapshot(self) -> tuple[dict[int, Sampled], int]:
        return dict(self.ready), self.drawn

    def restore(self, snapshot: tuple[dict[int, Sampled], int]) -> None:
        """The batches ahead as the iteration found them, with the one it took back and those
        received since (a worker sends each batch once); the prompts drawn since are drawn
        again (the loader is put back too), and a batch submitted since is not sent again."""
        ready, self.drawn = {**self.ready, **snapshot[0]}, snapshot[1]
        if self.taken is not None and self.taken[0] >= self.context.clock.iteration:
            ready[self.taken[0]] = self.taken[1]
        self.ready = ready

    def close(self) -> None:
        self.backend.close()


def build_sampler(context: RolloutContext) -> tuple[OnPolicy, OnPolicy | DynamicSampling | Ahead]:
    """(the on-policy round, the sampler `step()` calls), chosen once from the config."""
    cfg, plan = context.cfg, context.run
    rounds = sampler = OnPolicy(context)
    if cfg.algorithm.filter_groups:
        sampler = DynamicSampling(rounds, cfg.algorithm.max_gen_batches)
    if plan.workers:
        backend = InWorkers(rounds, plan.workers, plan.worker_threads, plan.ahead)
        sampler = Ahead(context, plan.ahead, backend)
    elif plan.ahead:
        sampler = Ahead(context, plan.ahead, InProcess(sampler))
    return rounds, sampler
