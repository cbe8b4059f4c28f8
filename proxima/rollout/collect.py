"""Prompts -> responses (`generate_rollout`, phase 1) -> raw scores (`score_rollout`, phase
2), shared by training and evaluation (`collect` does both). The responses come from a
rollout engine (proxima.rollout.contract: `hf` or `vllm`); a plain model is served by the `hf`
engine. Scores
are the reward source's own output: every shaping (normalisation, no-stop penalty, clipping,
KL) is `algos.shape_rewards`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace

import torch

from proxima.algos import EXTRA_INPUTS
from proxima.config import RolloutConfig
from proxima.data import collate_prompts
from proxima.rollout.agent import play_agent_episodes
from proxima.rollout.contract import RolloutEngine
from proxima.rollout.engines import as_engine
from proxima.rollout.episodes import play_episodes
from proxima.rollout.types import Generation, Sampling, cat_generations, cat_rows, take_rows


@dataclass(kw_only=True)
class Rollout:
    """One batch of phases 1-2, a row per sequence. Every field but `gen` holds one entry
    per row (a tensor, a list, or a dict of lists) or None, so `rows` and `cat_rollouts`
    carry each field, one added later included, without naming it."""

    gen: Generation
    prompts: list[str]  # [B] prompt text of each sequence
    responses: list[str]  # [B] decoded response (special tokens skipped)
    columns: dict[str, list]  # extra dataset columns, one entry per sequence
    group_ids: torch.Tensor  # [B] index of the prompt within the batch
    scores: torch.Tensor | None = None  # [B] raw reward score (`collect`)
    # the estimators' extra inputs that phases 1-2 produce, each named as in
    # `algos.EXTRA_INPUTS`, the `Experience` and the `BatchView`, and carried into them by
    # that name (`sampled_inputs`):
    # [B] the score of a greedy response to the row's prompt (ReMax's baseline), or None
    reward_baselines: torch.Tensor | None = None
    # [B, K] the raw score of each of reward.sources, or None for a single source
    score_components: torch.Tensor | None = None
    # multi-turn episodes (rollout.env, rollout.agent): each one's turns, end and return
    episodes: list[dict] | None = None
    # [B] int64: the policy version (actor updates so far in the run) each row was sampled
    # with, set by the trainer (rollout.max_staleness trains it up to that many versions later)
    versions: torch.Tensor | None = None

    def total_rewards(self) -> torch.Tensor:
        """[B] what a sample earned: its score, plus its turn rewards in an episode."""
        if self.gen.turn_rewards is None:
            return self.scores
        return self.scores + self.gen.turn_rewards.sum(1).to(self.scores.device)

    def rows(self, index: torch.Tensor) -> Rollout:
        """The rows `index` ([K] long), in that order, of every field."""
        return Rollout(**{f.name: take_rows(getattr(self, f.name), index) for f in fields(self)})

    def to(self, device: torch.device | str) -> Rollout:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return replace(
            self,
            gen=self.gen.to(device),
            scores=move(self.scores),
            reward_baselines=move(self.reward_baselines),
            score_components=move(self.score_components),
            versions=move(self.versions),
        )


def cat_rollouts(parts: list[Rollout], pad_id: int) -> Rollout:
    """One rollout of several (DAPO's dynamic sampling: rounds of generation), the group ids
    of each part shifted past the previous parts' groups; every other field joined by
    `cat_rows`, so a field added to `Rollout` is joined without a change here."""
    offsets, groups = [], 0
    for ro in parts:
        offsets.append(groups)
        groups += int(ro.group_ids.max()) + 1 if ro.group_ids.numel() else 0
    joined = {
        f.name: cat_rows([getattr(ro, f.name) for ro in parts], [len(ro.prompts) for ro in parts])
        for f in fields(Rollout)
        if f.name not in ("gen", "group_ids")
    }
    return Rollout(
        gen=cat_generations([ro.gen for ro in parts], pad_id),
        group_ids=torch.cat([ro.group_ids + off for ro, off in zip(parts, offsets, strict=True)]),
        **joined,
    )


def sampled_inputs(ro: Rollout) -> dict[str, torch.Tensor]:
    """The estimators' extra inputs (`algos.EXTRA_INPUTS`) that `ro` holds, by name: what
    phase 3 carries into the `Experience` as it is."""
    return {
        f.name: getattr(ro, f.name)
        for f in fields(ro)
        if f.name in EXTRA_INPUTS and getattr(ro, f.name) is not None
    }


def select_groups(ro: Rollout, groups: list[int]) -> Rollout:
    """The rows of the groups `groups` (group ids of `ro`), in that order, renumbered 0..K-1."""
    rows, new_ids = [], []
    for new, g in enumerate(groups):
        members = (ro.group_ids == g).nonzero().flatten().tolist()
        rows += members
        new_ids += [new] * len(members)
    picked = ro.rows(torch.tensor(rows, dtype=torch.long))
    return replace(picked, group_ids=torch.tensor(new_ids, dtype=ro.group_ids.dtype))


def stop_token_ids(tokenizer, cfg: RolloutConfig) -> list[int]:
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids += [int(i) for i in cfg.stop_token_ids if int(i) not in ids]
    if not ids:
        raise ValueError(
            "The tokenizer has no EOS token and `rollout.stop_token_ids` is empty: "
            "responses could never end. Set rollout.stop_token_ids=[ID]."
        )
    return ids


def generate_rollout(
    engine: RolloutEngine | torch.nn.Module,
    tokenizer,
    items: list,
    cfg: RolloutConfig,
    device: torch.device,
    *,
    greedy: bool = False,
    n: int | None = None,
    logprobs: bool = False,
    values: bool = False,
) -> Rollout:
    """Generate `n` responses per prompt item (greedy or sampled), decoded; not scored.

    `engine` is a rollout engine or a model (served by the `hf` engine). With `logprobs`
    the engine also returns its own log-probs of the sampled tokens (`gen.logprobs`), with
    `values` the values of the sampled states (`gen.values`: hf engine, serving an actor
    that carries the critic). The engine is woken for the call and put to sleep after it
    (vLLM frees its KV cache)."""
    engine = as_engine(engine, tokenizer, cfg)
    n = cfg.n if n is None else n
    group_ids = torch.arange(len(items)).repeat_interleave(n)
    batch = collate_prompts(items, tokenizer.pad_token_id)
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    sampling = Sampling.from_config(
        cfg, stop_token_ids(tokenizer, cfg), greedy=greedy, n=n, logprobs=logprobs, values=values
    )
    episodes = None
    engine.wake_up()
    try:
        if cfg.episodes:  # multi-turn episodes, the prompts repeated n times
            rows = [it for it in items for _ in range(n)]
            play = play_agent_episodes if cfg.episodes == "agent" else play_episodes
            gen, episodes = play(engine, tokenizer, rows, cfg, device, replace(sampling, n=1))
        else:
            gen = engine.generate(ids, mask, sampling).to(device)
    finally:
        engine.sleep()
    responses = tokenizer.batch_decode(gen.response_ids.cpu(), skip_special_tokens=True)
    items = [it for it in items for _ in range(n)]
    prompts = [it.text for it in items]
    keys = dict.fromkeys(k for it in items for k in it.columns)  # sets may differ in columns
    columns = {k: [it.columns.get(k) for it in items] for k in keys}
    return Rollout(
        gen=gen,
        prompts=prompts,
        responses=responses,
        columns=columns,
        group_ids=group_ids,
        episodes=episodes,
    )


def reward_args(ro: Rollout) -> tuple:
    """What every reward source is called with (`proxima.rewards`): prompts, responses,
    columns, sequences, attention mask."""
    return ro.prompts, ro.responses, ro.columns, ro.gen.input_ids, ro.gen.attention_mask


def score_rollout(ro: Rollout, reward) -> torch.Tensor:
    """[B] float32: the reward source's raw score of each sequence."""
    return reward(*reward_args(ro)).float()


def collect(
    engine: RolloutEngine | torch.nn.Module,
    tokenizer,
    items: list,
    reward,
    cfg: RolloutConfig,
    device: torch.device,
    *,
    greedy: bool = False,
    n: int | None = None,
) -> Rollout:
    """`generate_rollout` then `score_rollout`, the scores in the returned Rollout
    (evaluation; training times the two phases apart)."""
    ro = generate_rollout(engine, tokenizer, items, cfg, device, greedy=greedy, n=n)
    return replace(ro, scores=score_rollout(ro, reward))


def rollout_state(ro: Rollout) -> dict:
    """`ro` as plain tensors, lists and dicts (on the CPU): what `torch.load(weights_only=
    True)` reads back, for a checkpoint (rollout.max_staleness keeps generated batches
    between iterations)."""
    ro = ro.to("cpu")
    state = {f.name: getattr(ro, f.name) for f in fields(ro) if f.name != "gen"}
    return {**state, "gen": asdict(ro.gen)}


def rollout_state_fits(state: dict) -> bool:
    """Whether `state` holds exactly the fields of this code's `Rollout`."""
    return set(state) == {f.name for f in fields(Rollout)}


def rollout_from_state(state: dict, device: torch.device | str) -> Rollout:
    """The rollout `rollout_state` wrote, on `device`."""
    rest = {k: v for k, v in state.items() if k != "gen"}
    return Rollout(gen=Generation(**state["gen"]), **rest).to(device)
