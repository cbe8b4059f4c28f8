"""Phase 1 for multi-turn episodes (`rollout.env`): the model acts, the environment answers,
turn after turn, and the episode becomes one row of the usual `Generation`.

Each turn, the engine continues every live episode's context (the prompt and everything
after it so far) until a stop token, one of `rollout.env.turn_stop` or the turn's token budget
(`Sampling.stop_strings`; the action is cut at the first stop string here as well, so an
engine that ran past one gives the same action). An engine that offers a session
(`HFEngine.session`) keeps each episode's KV cache between its turns
(`rollout.env.keep_kv_cache`): a turn then prefills only the tokens its context gained.
The environments' `step` calls of the batch then run concurrently (`proxima.guarded`).
Tokens are never re-tokenized: a row is the concatenation of the model's own sampled ids
and the observations' ids, each observation tokenized once (rendered with the chat template
when the prompt was chat messages: `data.observation_text`).

In the row, `response_mask` is 1 on the action tokens and 0 on the observation tokens, so
every loss, the KL and the entropy skip them; `attention_mask` is 1 on both (observations
are context). `logprobs` and `values` are the engine's at the action tokens, 0 elsewhere;
`turn_rewards` holds each turn's reward at its last action token. An episode ends when the
environment says done, at `rollout.env.max_turns`, when the next observation would leave no room
for an action in `rollout.env.max_episode_tokens`, or when an environment call fails (raises
or passes `rollout.env.timeout_s`; the turn's reward is then `rollout.env.fallback_reward`).
Every episode ends on an action token. `stopped` is False only for episodes cut by a limit
(max_turns, max_episode_tokens): those are the truncated ones of `rollout.mask_truncated` and
`rollout.no_stop_penalty`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import torch

from proxima.config import RolloutConfig
from proxima.data import collate_prompts, observation_text, tokenize_text
from proxima.guarded import Outcome, run_all
from proxima.rollout.contract import RolloutEngine
from proxima.rollout.environments import load_env_class
from proxima.rollout.types import Generation, Sampling

# why an episode ended; the first three count as stopped
ENDS = ("done", "error", "timeout", "max_turns", "max_episode_tokens")
# more characters than any tokenizer packs into one token (so a prefix of (n + 1) x this many
# characters that gives more than n tokens shows the whole text gives at least n)
MAX_CHARS_PER_TOKEN = 64
SHOWN_CHARS = 500  # of an observation the episode could not take, kept in samples.jsonl


@dataclass
class Episode:
    """One sample's episode while it is played: the ids after the prompt, which of them the
    model wrote, its log-probs and values there, and each turn's reward by token index."""

    item: Any  # the PromptItem
    env: Any = None
    failed: Outcome | None = None  # building the environment failed: ends at the 1st step
    ids: list[int] = field(default_factory=list)
    action: list[int] = field(default_factory=list)  # 1: the model's token, 0: observation
    logprobs: list[float] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    rewards: dict[int, float] = field(default_factory=dict)  # token index -> turn reward
    turns: list[dict] = field(default_factory=list)
    end: str = ""  # one of ENDS once it ended

    def record(self) -> dict:
        """The episode as samples.jsonl shows it: each turn (action, observation, reward,
        error, and the step's `info` when it gave one), why it ended, the sum of its turn
        rewards (`return`)."""
        return {"turns": self.turns, "end": self.end, "return": sum(self.rewards.values())}


def prompt_record(item) -> dict:
    """What the user's code of an episode gets (`Env(row)`, an agent's `fn(base_url, row)`):
    the record's columns and its prompt (text, or the chat messages)."""
    prompt = item.messages if item.messages is not None else item.text
    return {**item.columns, "prompt": prompt}


def first_stop(ids: list[int], decode, stop_strings: tuple[str, ...]) -> int | None:
    """The length of the shortest prefix of `ids` whose text holds one of `stop_strings`, or
    None (a prefix that holds one stays holding it: bisection)."""
    if not stop_strings or not any(s in decode(ids) for s in stop_strings):
        return None
    low, high = 1, len(ids)
    while low < high:
        mid = (low + high) // 2
        if any(s in decode(ids[:mid]) for s in stop_strings):
            high = mid
        else:
            low = mid + 1
    return low


def play_episodes(
    engine: RolloutEngine,
    tokenizer,
    items: list,
    cfg: RolloutConfig,
    device: torch.device,
    sampling: Sampling,
) -> tuple[Generation, list[dict]]:
    """One episode per item (repeat an item for several samples), each turn sampled with
    `sampling` (one sample per row; `Sampling.from_config` gives a turn's budget and stop
    strings): the rows as a `Generation` (see the module's docstring) and each episode's
    record (turns with their action, observation, reward and error; why it ended; its
    return)."""
    env_cls = load_env_class(cfg.env.cls)
    episodes = [Episode(item) for item in items]
    made = _run([partial(env_cls, prompt_record(e.item)) for e in episodes], cfg)
    for e, res in zip(episodes, made, strict=True):
        e.env, e.failed = (res.value, None) if res.ok else (None, res)
    session = _session(engine, cfg)
    for turn in range(cfg.env.max_turns):
        keys = [k for k, e in enumerate(episodes) if not e.end]
        if not keys:
            break
        live = [episodes[k] for k in keys]
        generate = engine.generate if session is None else partial(session.generate, keys)
        _act(generate, tokenizer, live, sampling, cfg, device)
        _step(live, tokenizer, cfg, last_turn=turn + 1 == cfg.env.max_turns)
    stopped = [e.end in ENDS[:3] for e in episodes]
    gen = episode_rows(episodes, stopped, tokenizer.pad_token_id, device, sampling)
    return gen, [e.record() for e in episodes]


def _session(engine: RolloutEngine, cfg: RolloutConfig):
    """The engine's session that keeps each episode's KV cache between turns
    (`HFEngine.session`), with `rollout.env.keep_kv_cache` where the engine offers one
    that applies; else None: each turn prefills its whole context."""
    offer = getattr(engine, "session", None)
    return offer() if cfg.env.keep_kv_cache and offer is not None else None


def _run(calls: list, cfg: RolloutConfig) -> list[Outcome]:
    """The environment calls of a turn, `rollout.env.workers` at once, each within
    `rollout.env.timeout_s` (0: no limit)."""
    return run_all(calls, cfg.env.workers, cfg.env.timeout_s or None)


def _decode(tokenizer):
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=False)


def _act(generate, tokenizer, live: list[Episode], sampling: Sampling, cfg, device) -> None:
    """One action of every live episode, appended to it (cut at the first stop string and
    at the episode's token budget); `generate`: the engine's, or its session's for these
    episodes."""
    budgets = [min(sampling.max_new_tokens, cfg.env.max_episode_tokens - len(e.ids)) for e in live]
    contexts = [_Context(e.item.ids + e.ids) for e in live]
    batch = collate_prompts(contexts, tokenizer.pad_token_id)
    turn = replace(sampling, max_new_tokens=max(budgets))
    gen = generate(batch["input_ids"].to(device), batch["attention_mask"].to(device), turn)
    gen = gen.to("cpu")
    decode = _decode(tokenizer)
    for j, e in enumerate(live):
        keep = gen.response_mask[j].bool()
        ids = gen.response_ids[j][keep].tolist()
        stop = first_stop(ids, decode, sampling.stop_strings)
        n = min(stop or len(ids), budgets[j])
        e.ids += ids[:n]
        e.action += [1] * n
        lp = gen.logprobs[j][keep].tolist()[:n] if gen.logprobs is not None else [0.0] * n
        v = gen.values[j][keep].tolist()[:n] if gen.values is not None else [0.0] * n
        e.logprobs += lp
        e.values += v
        e.turns.append({"action": decode(ids[:n])})


@dataclass
class _Context:
    ids: list[int]  # what collate_prompts reads


def _checked(value: Any) -> tuple[str | None, float, bool, dict | None]:
    """A step's return as (observation, reward, done, info or None); ValueError naming what
    is wrong."""
    if not (isinstance(value, tuple | list) and len(value) in (3, 4)):
        raise ValueError(
            f"step returned {value!r:.200}; it must return (observation or None, reward, done)"
            " or (observation or None, reward, done, info)"
        )
    obs, reward, done, *info = value
    if obs is not None and not isinstance(obs, str):
        raise ValueError(f"step's observation must be a string or None, got {obs!r:.200}")
    try:
        reward = float(reward)
    except (TypeError, ValueError):
        raise ValueError(f"step's reward must be a number, got {reward!r:.200}") from None
    if not math.isfinite(reward):
        raise ValueError(f"step's reward must be finite, got {reward}")
    if info and not _json_dict(info[0]):
        raise ValueError(f"step's info must be a dict of JSON values, got {info[0]!r:.200}")
    return obs, reward, bool(done), info[0] if info else None


def _json_dict(value: Any) -> bool:
    """Whether samples.jsonl can keep ``value`` as a JSON object."""
    try:
        return isinstance(value, dict) and json.dumps(value) is not None
    except (TypeError, ValueError):
        return False


def _checked_step(env, action: str) -> tuple[str | None, float, bool, dict | None]:
    return _checked(env.step(action))


def _step(live: list[Episode], tokenizer, cfg: RolloutConfig, last_turn: bool) -> None:
    """The environments' answers to the actions just taken (run concurrently): each turn's
    reward at its last action token, the episode ended or its observation appended."""
    ready = [e for e in live if e.failed is None]  # the others' environment never built
    calls = [partial(_checked_step, e.env, e.turns[-1]["action"]) for e in ready]
    answers = iter(_run(calls, cfg))
    results = [next(answers) if e.failed is None else e.failed for e in live]
    eos = tokenizer.eos_token_id
    for e, res in zip(live, results, strict=True):
        turn = e.turns[-1]
        failed = (None, cfg.env.fallback_reward, True, None)
        obs, reward, done, info = res.value if res.ok else failed
        if not res.ok:
            turn["error"] = res.why(f"rollout.env.timeout_s={cfg.env.timeout_s:g} s")
            e.end = "timeout" if res.timed_out else "error"
        turn["observation"], turn["reward"] = obs, reward
        if info is not None:
            turn["info"] = info
        last = len(e.ids) - 1
        e.rewards[last] = e.rewards.get(last, 0.0) + reward
        if e.end:
            continue
        if done:
            e.end = "done"
        elif last_turn:
            e.end = "max_turns"
        else:
            _observe(e, obs, tokenizer, cfg, ended_on_eos=e.ids[-1] == eos)


def _observe(e: Episode, obs: str | None, tokenizer, cfg: RolloutConfig, ended_on_eos: bool):
    """Append the observation's ids (none for None), or end the episode when they would
    leave no room for another action."""
    ids: list[int] = []
    room = cfg.env.max_episode_tokens - len(e.ids)
    if obs is not None:
        text = observation_text(e.item.messages, obs, cfg.env.observation_role, tokenizer)
        eos_text = tokenizer.eos_token or ""
        if ended_on_eos and e.item.messages is not None and eos_text and text.startswith(eos_text):
            text = text[len(eos_text) :]  # the model already wrote the end of its message
        # a huge observation: a prefix already past the room is enough to know it cannot fit
        ids = tokenize_text(text[: (room + 1) * MAX_CHARS_PER_TOKEN], tokenizer)
        if len(ids) <= room:
            ids = tokenize_text(text, tokenizer)
    if len(ids) >= room:
        e.end = "max_episode_tokens"
        if obs is not None and len(obs) > SHOWN_CHARS:  # samples.jsonl: what it was, not all
            e.turns[-1]["observation"] = (
                f"{obs[:SHOWN_CHARS]}... ({len(obs)} characters, not shown to the model: "
                "past rollout.env.max_episode_tokens)"
            )
        return
    e.ids += ids
    e.action += [0] * len(ids)
    e.logprobs += [0.0] * len(ids)
    e.values += [0.0] * len(ids)


def episode_rows(
    episodes: list[Episode], stopped: list[bool], pad: int, device, sampling: Sampling
) -> Generation:
    """The episodes as one `Generation`: prompts (`item.ids`) left-padded, episodes
    right-padded (at least one position wide: an episode may hold no token); `stopped` is
    each row's `Generation.stopped`; log-probs and values kept as `sampling` asks."""
    prompts = collate_prompts([e.item for e in episodes], pad)
    width = max(1, *(len(e.ids) for e in episodes))
    shape = (len(episodes), width)
    ids = torch.full(shape, pad, dtype=torch.long)
    real, action = torch.zeros(shape, dtype=torch.long), torch.zeros(shape, dtype=torch.long)
    lp, v, rewards = torch.zeros(shape), torch.zeros(shape), torch.zeros(shape)
    for b, e in enumerate(episodes):
        n = len(e.ids)
        ids[b, :n] = torch.tensor(e.ids, dtype=torch.long)
        real[b, :n] = 1
        action[b, :n] = torch.tensor(e.action, dtype=torch.long)
        lp[b, :n] = torch.tensor(e.logprobs)
        v[b, :n] = torch.tensor(e.values)
        for t, r in e.rewards.items():
            rewards[b, t] = r
    gen = Generation(
        input_ids=torch.cat([prompts["input_ids"], ids], dim=1),
        attention_mask=torch.cat([prompts["attention_mask"], real], dim=1),
        response_mask=action,
        stopped=torch.tensor(stopped, dtype=torch.bool),
        logprobs=lp if sampling.logprobs else None,
        values=v if sampling.values else None,
        turn_rewards=rewards,
    )
    return gen.to(device)


def episode_stats(records: list[dict], gen: Generation) -> dict[str, float]:
    """Sums over this rank's episodes, for the iteration's metrics (summed over the ranks,
    then divided by `episodes`): turns, environment errors and timeouts, turns that got a
    nonzero reward, episodes that ended done / at a limit, tokens (actions and observations),
    the turn rewards."""
    ends = [r["end"] for r in records]
    return {
        "episodes": float(len(records)),
        "turns": float(sum(len(r["turns"]) for r in records)),
        "errors": float(ends.count("error")),
        "timeouts": float(ends.count("timeout")),
        "done": float(ends.count("done")),
        "truncated": float(ends.count("max_turns") + ends.count("max_episode_tokens")),
        "episode_tokens": float(gen.attention_mask[:, -gen.response_mask.shape[1] :].sum()),
        "turn_reward": float(sum(t["reward"] for r in records for t in r["turns"])),
    }
