"""Agent programs written against the real `openai` client, and a rule-following engine, for
the tests of `rollout.agent` (tests/rollout/test_agent.py). The functions are named in
configs as `tests.rollout.agents:<fn>` (`spec(name)`: the module, not the file, so the
test reads the same `SEEN`: what each agent got back, by the row's `i`)."""

from __future__ import annotations

import string
import threading
import time

import openai

from proxima.rollout.types import Generation, Sampling
from tests.rollout.scripted import ScriptedEngine, scripted_generation

# every printable character a token: tool-call JSON and chat templates tokenize exactly
ALPHABET = "abcxyz" + "".join(c for c in string.printable if c not in "abcxyz\x0b\x0c\r")
SEEN: dict = {}  # row["i"] -> what the agent got back (replies, errors)
LOCK = threading.Lock()


def spec(name: str) -> str:
    return f"tests.rollout.agents:{name}"


def client(base_url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=20)


def seen(row: dict, key: str, value) -> None:
    with LOCK:
        SEEN.setdefault(row["i"], {})[key] = value


class RuleEngine(ScriptedEngine):
    """Answers every prompt with `rule(prompt_ids, choice)` (token ids; cut at
    `max_new_tokens` and after a stop id), log-probs and values as `ScriptedEngine`'s;
    records each call (`calls`: prompts and sampling)."""

    name = "rule"

    def __init__(self, rule) -> None:
        super().__init__([])
        self.rule = rule

    def generate(self, prompt_ids, prompt_mask, sampling: Sampling) -> Generation:
        rows = [ids[m.bool()].tolist() for ids, m in zip(prompt_ids, prompt_mask, strict=True)]
        self.calls.append((rows, sampling))
        acts = []
        for p in rows:
            for j in range(sampling.n):
                out = list(self.rule(p, j))[: sampling.max_new_tokens]
                stop = next((k for k, t in enumerate(out) if t in sampling.stop_ids), None)
                acts.append(out if stop is None else out[: stop + 1])
        n = sampling.n
        ids, mask = prompt_ids.repeat_interleave(n, 0), prompt_mask.repeat_interleave(n, 0)
        return scripted_generation(ids, mask, acts)


# ---------------------------------------------------------------- agent functions


def one_chat(base_url: str, row: dict) -> float:
    """One chat call with log-probs; reward 1."""
    reply = client(base_url).chat.completions.create(
        model="policy", messages=[{"role": "user", "content": row["prompt"]}], logprobs=True
    )
    seen(row, "reply", reply)
    return 1.0


def two_completions(base_url: str, row: dict) -> float:
    """A completion, then another whose prompt is the first's prompt + its text + its stop
    string + an observation "xy": the second extends the first (one row)."""
    c = client(base_url)
    first = c.completions.create(model="policy", prompt=row["prompt"], stop=["c"], max_tokens=3)
    text = first.choices[0].text + ("c" if first.choices[0].finish_reason == "stop" else "")
    second = c.completions.create(model="policy", prompt=row["prompt"] + text + "xy", logprobs=1)
    seen(row, "replies", [first, second])
    return 0.5


def rewritten_history(base_url: str, row: dict) -> None:
    """Two calls, the second not extending the first: only the second is trained."""
    c = client(base_url)
    c.completions.create(model="policy", prompt=row["prompt"])
    c.completions.create(model="policy", prompt="zz")
    return None


def n_choices_with_stop(base_url: str, row: dict) -> float:
    """n=2 with a stop string; the second call continues the SECOND choice."""
    c = client(base_url)
    first = c.completions.create(model="policy", prompt=row["prompt"], n=2, stop="c", max_tokens=3)
    seen(row, "first", first)
    ids = first.prompt_token_ids + first.choices[1].token_ids
    second = c.completions.create(model="policy", prompt=ids)
    seen(row, "second", second)
    return 1.0


def slow_when_asked(base_url: str, row: dict) -> float:
    """Row "slow": one call, then sleeps past the limit and tries another call (refused);
    the others: one call."""
    c = client(base_url)
    c.completions.create(model="policy", prompt=row["prompt"])
    if row.get("slow"):
        time.sleep(row["slow"])
        try:
            c.completions.create(model="policy", prompt=row["prompt"])
        except openai.APIStatusError as err:
            seen(row, "late", (err.status_code, err.body))
    return 1.0


def fails_when_asked(base_url: str, row: dict) -> float:
    """Row "fail": one call, then raises."""
    client(base_url).completions.create(model="policy", prompt=row["prompt"])
    if row.get("fail"):
        raise RuntimeError("the agent broke")
    return 1.0


def too_many_calls(base_url: str, row: dict) -> float:
    """Calls until refused; keeps the refusal."""
    c = client(base_url)
    for _ in range(10):
        try:
            c.completions.create(model="policy", prompt=row["prompt"])
        except openai.BadRequestError as err:
            seen(row, "refused", err.body)
            break
    return 1.0


def zero_temperature(base_url: str, row: dict) -> float:
    """A chat call at temperature 0 and top_p 0.5, then one with a bad stop (refused)."""
    c = client(base_url)
    messages = [{"role": "user", "content": row["prompt"]}]
    c.chat.completions.create(model="policy", messages=messages, temperature=0, top_p=0.5)
    try:
        c.chat.completions.create(model="policy", messages=messages, stop=[""])
    except openai.BadRequestError as err:
        seen(row, "refused", err.body)
    return 1.0


async def async_chat(base_url: str, row: dict) -> float:
    """An `async def` agent on the async client."""
    c = openai.AsyncOpenAI(base_url=base_url, api_key="none", max_retries=0)
    reply = await c.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": row["prompt"]}]
    )
    seen(row, "reply", reply)
    return 2.0


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "mul",
            "description": "a times b",
            "parameters": {"type": "object", "properties": {"a": {}, "b": {}}},
        },
    }
]


def tool_loop(base_url: str, row: dict) -> float:
    """A chat with a tool: the reply's tool call answered as a `tool` message, then the
    final answer."""
    c = client(base_url)
    messages = [{"role": "user", "content": row["prompt"]}]
    first = c.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    message = first.choices[0].message
    seen(row, "first", first)
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls or []:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "6"})
    second = c.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
    seen(row, "second", second)
    return 1.0


def sampled_chat_turns(base_url: str, row: dict) -> float:
    """Three completions on a real model, each continuing the last (its prompt the ids so far
    + an observation): one merged row."""
    c = client(base_url)
    ids = list(row["ids"])
    for _ in range(3):
        reply = c.completions.create(model="policy", prompt=ids, max_tokens=4, logprobs=1)
        ids += reply.choices[0].token_ids + row["observation"]
    return 1.0


def takes_one(base_url: str) -> float:
    """Not an agent function: it takes no row."""
    return 0.0
