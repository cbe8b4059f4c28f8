"""`PolicyServer`: the endpoint of one rollout. It opens the episodes on the process's HTTP
server (`app.shared`) and answers each of their requests in the request's worker
thread: the prompt rendered and tokenized, checked against the episode's limits, queued for
the `Dispatcher`, waited for, the reply decoded."""

from __future__ import annotations

import threading
import time

import torch
from pydantic import BaseModel

from proxima.config import AgentConfig
from proxima.data import render_prompt, tokenize_text
from proxima.rollout.contract import RolloutEngine
from proxima.rollout.endpoint import app, schema
from proxima.rollout.endpoint.dispatcher import Dispatcher, Pending, SamplingKey
from proxima.rollout.endpoint.records import Call, Choice, EpisodeLog
from proxima.rollout.endpoint.schema import Decoded, RequestError, episode_ended
from proxima.rollout.endpoint.tool_calls import parse_tool_calls
from proxima.rollout.types import Sampling


class PolicyServer:
    """The endpoint of one rollout (a context manager: its episodes answered until `__exit__`).
    `sampling` is the rollout's (stop ids, default budget, temperature, greedy, values);
    `agent` the limits (`rollout.agent`)."""

    def __init__(self, tokenizer, sampling: Sampling, agent: AgentConfig) -> None:
        self.tokenizer, self.sampling, self.agent = tokenizer, sampling, agent
        self.episodes: dict[int, EpisodeLog] = {}
        # a fast tokenizer sets its truncation state on each call: concurrent calls can
        # fail ("Already borrowed", huggingface/tokenizers#537), so one thread at a time
        self.text_lock = threading.Lock()
        self.dispatcher = Dispatcher(tokenizer, sampling, agent, self.text_lock)
        self.http = app.shared()

    @property
    def port(self) -> int:
        return self.http.port

    def __enter__(self) -> PolicyServer:
        return self

    def __exit__(self, *exc) -> None:
        """The rollout is over: its waiting requests refused, its episodes' later ones
        answered 410 by the process's endpoint."""
        self.dispatcher.end(self.episodes.values())
        self.http.close(self.episodes)

    def base_url(self, episode: EpisodeLog) -> str:
        return f"http://127.0.0.1:{self.port}/episode/{episode.id}/v1"

    def open_episode(self) -> EpisodeLog:
        e = EpisodeLog(self.http.open(self))
        self.episodes[e.id] = e
        return e

    def started(self, episode: EpisodeLog) -> None:
        self.dispatcher.started(episode)

    def finished(self, episode: EpisodeLog) -> None:
        self.dispatcher.finished(episode)

    def dispatch(self, engine: RolloutEngine, device: torch.device, more) -> None:
        """Generate the episodes' requests while `more()` or requests wait (`Dispatcher.run`)."""
        self.dispatcher.run(engine, device, more)

    def answer(self, episode_id: int, route: str, body: dict) -> BaseModel:
        """The reply to one request of one of this rollout's episodes (called in the
        request's worker thread); RequestError when it is refused."""
        episode = self.episodes[episode_id]
        chat = route == "chat/completions"
        with self.text_lock:
            prompt_ids = self._chat_prompt(body) if chat else self._completion_prompt(body)
        pending = self._pending(episode, prompt_ids, body)
        self.dispatcher.submit(pending)
        left = episode.deadline - time.monotonic()
        if not pending.done.wait(None if left == float("inf") else max(0.0, left) + 1.0):
            raise episode_ended(episode.id)
        if pending.error is not None:
            raise pending.error
        with self.text_lock:
            return self._reply(episode, pending.call, body, chat)

    def _pending(self, episode: EpisodeLog, prompt_ids: list[int], body: dict) -> Pending:
        """The request for the dispatcher: its max_tokens cut to fit the context and the
        rollout's budget, its sampling the rollout's (or the request's, with
        `rollout.agent.request_sampling`)."""
        a, s = self.agent, self.sampling
        n = schema.choices_asked(body)
        asked = schema.max_tokens_asked(body)
        room = a.max_context_tokens - len(prompt_ids)
        if room < 1:
            raise RequestError(
                400,
                f"the prompt has {len(prompt_ids)} tokens: no room to sample within "
                f"rollout.agent.max_context_tokens={a.max_context_tokens}",
                "context_length_exceeded",
            )
        budget = min(s.max_new_tokens, room)
        max_tokens = budget if asked is None else min(asked, budget)
        stop = schema.stop_strings(body)
        greedy, temperature, top_p = s.greedy, s.temperature, s.top_p
        if a.request_sampling and not s.greedy:
            temperature = schema.number(body, "temperature", temperature, 0.0, 2.0)
            top_p = schema.number(body, "top_p", top_p, 1e-9, 1.0)
            greedy = temperature == 0
        key = SamplingKey(n, greedy, temperature if not greedy else 1.0, top_p, stop)
        return Pending(episode, prompt_ids, max_tokens, key)

    def _chat_prompt(self, body: dict) -> list[int]:
        """The chat template's text of the messages (`tools` passed to it), or without a
        template the plain transcript of `data.render_prompt` (no tools then), in ids."""
        messages, tools = schema.chat_messages(body)
        if getattr(self.tokenizer, "chat_template", None):
            text = self.tokenizer.apply_chat_template(
                messages, tools=tools, add_generation_prompt=True, tokenize=False
            )
        elif tools:
            raise RequestError(400, "tools need a chat template; this tokenizer has none")
        else:
            text = render_prompt(messages, self.tokenizer)
        return _non_empty(tokenize_text(text, self.tokenizer))

    def _completion_prompt(self, body: dict) -> list[int]:
        """A string prompt tokenized as is (no BOS added); token ids as they are."""
        prompt = schema.completion_prompt(body)
        return (
            _non_empty(tokenize_text(prompt, self.tokenizer)) if isinstance(prompt, str) else prompt
        )

    def _reply(self, episode: EpisodeLog, call: Call, body: dict, chat: bool) -> BaseModel:
        """The API's reply to `call`: its choices decoded, a chat reply's tool calls parsed
        out of its text when the request offered tools."""
        stop, number = schema.stop_strings(body), len(episode.calls)
        with_tokens = body.get("logprobs") is not None
        decoded = [self._decoded(c, stop, with_tokens) for c in call.choices]
        name = f"{episode.id}-{number}"
        if not chat:
            return schema.completion_reply(call, decoded, name, body)
        tools = [[] for _ in decoded]
        if body.get("tools"):
            for i, d in enumerate(decoded):
                text, tools[i] = parse_tool_calls(d.text, episode.id, number)
                decoded[i] = Decoded(text, d.tokens)
        return schema.chat_reply(call, decoded, tools, name, body)

    def _decoded(self, choice: Choice, stop: tuple[str, ...], tokens: bool) -> Decoded:
        """A choice's text as the API returns it (without the stop token, ended before the
        stop string that ended it) and, when log-probs are asked, each token's string."""
        ids = choice.ids
        if ids and ids[-1] in self.sampling.stop_ids:
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        found = [text.index(s) for s in stop if s in text]
        text = text[: min(found)] if found else text
        if not tokens:
            return Decoded(text, [])
        decode = self.tokenizer.decode
        return Decoded(text, [decode([i], skip_special_tokens=False) for i in choice.ids])


def _non_empty(ids: list[int]) -> list[int]:
    if not ids:
        raise RequestError(400, "the prompt is empty after tokenization")
    return ids
