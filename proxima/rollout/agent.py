"""Phase 1 for agent programs (`rollout.agent`): the user's own function plays each episode
against an OpenAI-compatible endpoint over the policy (`rollout.endpoint`), and its calls
become one training row per episode.

The function, `fn(base_url, row) -> reward or None` (sync, or `async def`), is called once
per sample, `rollout.agent.concurrency` at once, each in a thread of its own within
`rollout.agent.timeout_s` (`proxima.guarded`); meanwhile the calling thread dispatches the
episodes' requests to the engine in batches. A function that raises, returns something else
than a finite number or None, or passes its time limit gets `rollout.agent.fallback_reward`
(a late one keeps running in its thread, its requests refused, its result ignored); the run
goes on.

One row per episode, built from the recorded ids (nothing re-tokenized), so every prompt
keeps its `rollout.n` rows and the group estimators their groups: the episode's LAST call
(its first choice) and, before it, the chain of earlier calls each of which the next one
extends: a call whose prompt ids start with an earlier call's prompt + sampled ids (any of
its choices) continues that call's row. The row is the chain's first prompt, then in turn
each call's sampled ids (action tokens: response mask 1, the engine's log-probs and values)
and the ids the next prompt adds after them (observation tokens: response mask 0, context
only), as `rollout.episodes` lays out an environment's episode. Calls off the chain (an
agent that rewrote its history, a summarising sub-call, the other choices of n > 1) are not
trained; each record shows which calls were (`trained`). The reward sits at the row's last
action token (`Generation.turn_rewards`, as an environment's turn reward); `reward.sources`,
when set, score the episode's text as well (a function returning None leaves it to them).

`stopped` is the last call's: False when it ran to its max_tokens (`rollout.mask_truncated`,
`rollout.no_stop_penalty`). The records feed the `env/*` metrics: a call counts as a turn
(`env/turns`: calls per episode), a function that raised as `env/errors`, one past its
limit as `env/timeouts`.
"""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import inspect
import math
import threading

import torch

from proxima import plugins
from proxima.config import Config, ConfigError, RolloutConfig
from proxima.data import PromptItem
from proxima.guarded import Outcome, run_all
from proxima.rollout.contract import RolloutEngine
from proxima.rollout.endpoint.records import Call, Choice, EpisodeLog
from proxima.rollout.episodes import Episode, episode_rows, prompt_record
from proxima.rollout.types import Generation, Sampling


@functools.cache
def load_agent_fn(spec: str):
    """The agent function `spec` names (imported once per process); ConfigError naming what
    is wrong and the fix."""
    return plugins.load(
        spec,
        f"`rollout.agent.fn`={spec!r}",
        fits=_takes_url_and_row,
        wanted="a function fn(base_url: str, row: dict) -> reward or None",
        error=ConfigError,
    )


def _takes_url_and_row(obj) -> bool:
    """A callable that can be called as fn(base_url, row)."""
    if not callable(obj) or inspect.isclass(obj):
        return False
    try:
        inspect.signature(obj).bind("http://127.0.0.1", {})
    except TypeError:
        return False
    except ValueError:  # no signature to read (a builtin): found out at the first call
        pass
    return True


# what the endpoint serves with, installed by the `agent` extra
ENDPOINT_PACKAGES = ("openai", "starlette", "uvicorn")


def check_agent(cfg: Config) -> None:
    """Start-up: the endpoint's packages are installed, and the function
    `rollout.agent.fn` names imports and is callable."""
    if not cfg.rollout.agent.fn:
        return
    missing = [p for p in ENDPOINT_PACKAGES if importlib.util.find_spec(p) is None]
    if missing:
        raise ConfigError(
            f"`rollout.agent` serves the policy with {', '.join(missing)}, not installed here; "
            "install the `agent` extra: pip install 'proxima[agent]'."
        )
    load_agent_fn(cfg.rollout.agent.fn)


def play_agent_episodes(
    engine: RolloutEngine,
    tokenizer,
    items: list,
    cfg: RolloutConfig,
    device: torch.device,
    sampling: Sampling,
) -> tuple[Generation, list[dict]]:
    """One episode per item (repeat an item for several samples), each call sampled as
    `sampling` says (its budget the default max_tokens): the rows as a `Generation` (see
    the module's docstring) and each episode's record (its calls, end, return)."""
    # imported here, not with this module: the endpoint needs the `agent` extra, and a run
    # without rollout.agent imports this module all the same
    from proxima.rollout.endpoint.policy_server import PolicyServer

    fn, a = load_agent_fn(cfg.agent.fn), cfg.agent
    with PolicyServer(tokenizer, sampling, a) as server:
        logs = [server.open_episode() for _ in items]
        calls = [
            functools.partial(_play, fn, server, log, prompt_record(item))
            for log, item in zip(logs, items, strict=True)
        ]
        outcomes: list[Outcome] = []
        runner = threading.Thread(
            target=lambda: outcomes.extend(run_all(calls, a.concurrency, a.timeout_s or None)),
            name="agent episodes",
            daemon=True,
        )
        runner.start()
        server.dispatch(engine, device, runner.is_alive)
        runner.join()
    episodes, stopped = [], []
    for item, log, res in zip(items, logs, outcomes, strict=True):
        e, ended = _episode(item, log, res, cfg, tokenizer)
        episodes.append(e)
        stopped.append(ended)
    gen = episode_rows(episodes, stopped, tokenizer.pad_token_id, device, sampling)
    return gen, [e.record() for e in episodes]


def _play(fn, server, log: EpisodeLog, row: dict) -> float | None:
    """One episode: the function's reward, checked (None or a finite number)."""
    server.started(log)
    try:
        value = fn(server.base_url(log), row)
        if inspect.isawaitable(value):
            value = asyncio.run(_awaited(value))
    finally:
        server.finished(log)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(
            f"the agent function returned {value!r:.200}; return a finite number or None"
        )
    return float(value)


async def _awaited(awaitable):
    return await awaitable


def _episode(item, log: EpisodeLog, res: Outcome, cfg: RolloutConfig, tokenizer):
    """(the played `Episode`, whether its last call stopped): its row the chain of calls
    (`chain_of_calls`), the reward at its last token, its record's turns the calls."""
    a = cfg.agent
    if res.ok:
        reward, end, error = (0.0 if res.value is None else res.value), "done", ""
    else:
        reward, end = a.fallback_reward, "timeout" if res.timed_out else "error"
        error = res.why(f"rollout.agent.timeout_s={a.timeout_s:g} s")
    calls, chain = log.calls, chain_of_calls(log.calls)
    prompt = calls[chain[0][0]].prompt_ids if chain else item.ids
    e = Episode(PromptItem(item.text, list(prompt), item.columns, item.messages), end=end)
    context = list(prompt)
    for k, j in chain:
        added = calls[k].prompt_ids[len(context) :]  # the observation since the last action
        choice = calls[k].choices[j]
        e.ids += added + choice.ids
        e.action += [0] * len(added) + [1] * len(choice.ids)
        e.logprobs += [0.0] * len(added) + choice.logprobs
        e.values += [0.0] * len(added) + (choice.values or [0.0] * len(choice.ids))
        context = calls[k].prompt_ids + choice.ids
    if e.ids:  # a row ends on an action token; an episode without a call has no token
        e.rewards[len(e.ids) - 1] = reward
    e.turns = _turns(calls, dict(chain), tokenizer, reward, error)
    stopped = bool(chain) and calls[chain[-1][0]].choices[chain[-1][1]].finish == "stop"
    return e, stopped


def _turns(calls: list[Call], trained: dict[int, int], tokenizer, reward: float, error: str):
    """samples.jsonl: each call (the sampled text of the choice in the row, else the first;
    its prompt's length; whether it is in the row), the reward (and error) on the last."""
    turns = [
        {
            "action": tokenizer.decode(
                call.choices[trained.get(k, 0)].ids, skip_special_tokens=False
            ),
            "prompt_tokens": len(call.prompt_ids),
            "trained": k in trained,
            "reward": 0.0,
        }
        for k, call in enumerate(calls)
    ]
    if not turns:  # no call made: the reward and error still show
        turns.append({"action": "", "prompt_tokens": 0, "trained": False, "reward": 0.0})
    turns[-1]["reward"] = reward
    if error:
        turns[-1]["error"] = error
    return turns


def chain_of_calls(calls: list[Call]) -> list[tuple[int, int]]:
    """The (call, choice) pairs of the episode's row, first to last: the last call's first
    choice, and before each link the latest earlier call with a choice whose prompt +
    sampled ids the link's prompt starts with."""
    if not calls:
        return []
    chain = [(len(calls) - 1, 0)]
    while True:
        prompt = calls[chain[0][0]].prompt_ids
        link = next(
            (
                (k, j)
                for k in range(chain[0][0] - 1, -1, -1)
                for j, c in enumerate(calls[k].choices)
                if _extends(prompt, calls[k].prompt_ids, c)
            ),
            None,
        )
        if link is None:
            return chain
        chain.insert(0, link)


def _extends(prompt: list[int], before: list[int], choice: Choice) -> bool:
    n, m = len(before), len(choice.ids)
    return len(prompt) >= n + m and prompt[:n] == before and prompt[n : n + m] == choice.ids
