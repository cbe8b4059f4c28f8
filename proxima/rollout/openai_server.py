"""An OpenAI-compatible HTTP endpoint over the policy, for agent programs (`rollout.agent`):
`/v1/chat/completions`, `/v1/completions` and `/v1/models`, served by the rollout engine, every
call recorded in token ids.

Each episode has its own base URL, `http://127.0.0.1:PORT/episode/<id>/v1`, so a call is
attributed to its episode whatever client library makes it. The server (stdlib
`ThreadingHTTPServer` on a free port of 127.0.0.1) answers each request in a thread of its
own, which renders and tokenizes the prompt and then waits; the engine is not thread-safe, so
only the dispatcher (`PolicyServer.dispatch`, run by the thread that owns the engine and its
autocast and no-grad contexts) calls it: it collects the requests pending for
`rollout.agent.batch_wait_ms` after the first (or until every running episode has one
waiting), generates those that sample alike in one `engine.generate` call, and wakes their
threads.

What a call records (`Call`): its prompt's ids as the model saw them, and for each choice the
sampled ids (up to and including the stop token, or the token that completed a stop string),
the engine's log-probs of them and, where the engine gives them, the values. Training rows
are built from these ids (`rollout.agent`), never from text.

Requests:

- chat: the messages rendered by the tokenizer's chat template (`tools` passed to it), or,
  without a template, the plain transcript of `data.render_prompt` (no tools then). With
  `tools`, tool calls in the reply are parsed back in the Hermes / Qwen format the tiny
  models' test template and many chat models use: each `<tool_call>{"name": ...,
  "arguments": {...}}</tool_call>` block becomes one `tool_calls` entry (arguments as a JSON
  string, as the API gives them), the rest of the text the content; a block that is not
  such JSON stays text. An assistant message's tool calls going back into the template get
  their arguments as a dict (what Hugging Face templates read).
- completions: `prompt` a string (tokenized as is, no BOS added) or a list of token ids.
- `n`, `max_tokens` (or `max_completion_tokens`; cut to fit `rollout.agent.max_context_tokens`
  and to `rollout.max_response_length`), `stop` (the returned text ends before it, as the
  API's; the recorded ids keep it), `logprobs` (the sampled tokens' log-probs; no top
  alternatives), `temperature` and `top_p` (only with `rollout.agent.request_sampling`; 0
  is greedy). `stream` is refused.
- Errors are the API's JSON errors: 400 a bad request, a prompt with no room to sample or a
  call past `rollout.agent.max_calls`; 404 an unknown episode; 410 an episode that has
  ended (timed out). None of these is one the openai client retries.

Every reply also carries the ids (`prompt_token_ids`, and `token_ids` per choice, as vLLM's
server gives them on request), for an agent that wants them.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import torch

from proxima.config import AgentConfig
from proxima.data import PromptItem, collate_prompts, render_prompt, tokenize_text
from proxima.rollout.engine import RolloutEngine
from proxima.rollout.episodes import first_stop
from proxima.rollout.types import Sampling

MODEL_NAME = "policy"  # what /v1/models lists; any model name is accepted in a request
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
MAX_N = 64  # choices per request


@dataclass
class Choice:
    """One sampled answer of a call, in ids: what it trains."""

    ids: list[int]
    logprobs: list[float]
    values: list[float]
    finish: str  # "stop" (a stop token or string) or "length"


@dataclass
class Call:
    """One request of an episode as the model saw it: the prompt's ids and each choice."""

    prompt_ids: list[int]
    choices: list[Choice]


@dataclass
class EpisodeLog:
    """One episode's calls, in the order they were made, and its time limit."""

    id: int
    calls: list[Call] = field(default_factory=list)
    requests: int = 0  # calls asked for, refused ones included
    deadline: float = float("inf")  # time.monotonic() after which it is ended
    ended: bool = False


class RequestError(Exception):
    """A request the server refuses: the HTTP status, the API's error code, the message."""

    def __init__(self, status: int, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.status, self.code = status, code


@dataclass(frozen=True)
class SamplingKey:
    """What requests must share to be generated in one engine call."""

    n: int
    greedy: bool
    temperature: float
    top_p: float
    stop: tuple[str, ...]


@dataclass
class Pending:
    """A request waiting for the dispatcher, and then its result (a Call or an error)."""

    episode: EpisodeLog
    prompt_ids: list[int]
    max_tokens: int
    key: SamplingKey
    done: threading.Event = field(default_factory=threading.Event)
    call: Call | None = None
    error: RequestError | None = None


class PolicyServer:
    """The endpoint of one rollout (a context manager: serving from `__enter__` to `__exit__`).
    `sampling` is the rollout's (stop ids, default budget, temperature, greedy, values);
    `agent` the limits (`rollout.agent`)."""

    def __init__(self, tokenizer, sampling: Sampling, agent: AgentConfig) -> None:
        self.tokenizer, self.sampling, self.agent = tokenizer, sampling, agent
        self.episodes: dict[int, EpisodeLog] = {}
        self.pending: list[Pending] = []
        self.running = 0  # episodes whose function is running
        self.lock = threading.Condition()
        # a fast tokenizer sets its truncation state on each call: concurrent calls can
        # fail ("Already borrowed", huggingface/tokenizers#537), so one thread at a time
        self.text_lock = threading.Lock()
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.http.daemon_threads = True
        self.port = self.http.server_address[1]

    def __enter__(self) -> PolicyServer:
        threading.Thread(target=self.http.serve_forever, name="policy server", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.http.shutdown()
        self.http.server_close()
        with self.lock:
            for e in self.episodes.values():
                e.ended = True
            self._refuse_ended()

    def base_url(self, episode: EpisodeLog) -> str:
        return f"http://127.0.0.1:{self.port}/episode/{episode.id}/v1"

    def open_episode(self) -> EpisodeLog:
        with self.lock:
            e = self.episodes[len(self.episodes)] = EpisodeLog(len(self.episodes))
            return e

    def started(self, episode: EpisodeLog) -> None:
        """The episode's function starts: its time limit runs from now."""
        with self.lock:
            if self.agent.timeout_s:
                episode.deadline = time.monotonic() + self.agent.timeout_s
            self.running += 1

    def finished(self, episode: EpisodeLog) -> None:
        """The episode's function returned (or raised): later requests are refused."""
        with self.lock:
            episode.ended = True
            self.running -= 1
            self.lock.notify_all()

    # ------------------------------------------------------------------ the dispatcher

    def dispatch(self, engine: RolloutEngine, device: torch.device, more: Callable[[], bool]):
        """Generate the pending requests, batch after batch, while `more()` (the episodes
        are still running) or requests wait."""
        while True:
            batch = self._take()
            if not batch:
                if not more():
                    return
                continue
            groups: dict[SamplingKey, list[Pending]] = {}
            for p in batch:
                groups.setdefault(p.key, []).append(p)
            try:
                for key, group in groups.items():
                    self._generate(engine, device, key, group)
            except BaseException:
                for p in batch:  # nobody is left waiting on an engine failure
                    if not p.done.is_set():
                        p.error = RequestError(500, "the policy failed to generate", "server_error")
                        p.done.set()
                raise

    def _take(self) -> list[Pending]:
        """The requests to generate now: none after 50 ms without one, else those that
        arrive within `batch_wait_ms` of the first (at once when every running episode has
        one waiting); the requests of ended episodes are refused on the way."""
        with self.lock:
            self.lock.wait_for(lambda: self.pending, timeout=0.05)
            if not self.pending:
                return []
            until = time.monotonic() + self.agent.batch_wait_ms / 1000
            while len(self.pending) < self.running and (left := until - time.monotonic()) > 0:
                self.lock.wait(left)
            self._refuse_ended()
            batch, self.pending = self.pending, []
            return batch

    def _refuse_ended(self) -> None:
        """Answer the pending requests of ended episodes (HTTP 410); keep the others."""
        now, keep = time.monotonic(), []
        for p in self.pending:
            if p.episode.ended or now > p.episode.deadline:
                p.error = _ended(p.episode)
                p.done.set()
            else:
                keep.append(p)
        self.pending = keep

    def _generate(self, engine, device, key: SamplingKey, group: list[Pending]) -> None:
        """One engine call for `group`; each request's choices cut at its stop strings and
        its max_tokens, recorded in its episode."""
        sampling = replace(
            self.sampling,
            max_new_tokens=max(p.max_tokens for p in group),
            greedy=key.greedy,
            temperature=key.temperature,
            top_p=key.top_p,
            n=key.n,
            logprobs=True,
            stop_strings=key.stop,
        )
        batch = collate_prompts([PromptItem("", p.prompt_ids) for p in group], self._pad())
        ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
        gen = engine.generate(ids, mask, sampling).to("cpu")
        with self.text_lock:
            for i, p in enumerate(group):
                p.call = Call(
                    p.prompt_ids,
                    [self._choice(gen, row, p, key) for row in range(i * key.n, (i + 1) * key.n)],
                )
                with self.lock:
                    p.episode.calls.append(p.call)
                p.done.set()

    def _choice(self, gen, row: int, p: Pending, key: SamplingKey) -> Choice:
        """Row `row` of `gen` as a choice of request `p`: cut after its first stop string
        and at its max_tokens; "stop" when a stop string or a stop id ended it."""
        keep = gen.response_mask[row].bool()
        out = gen.response_ids[row][keep].tolist()
        decode = lambda t: self.tokenizer.decode(t, skip_special_tokens=False)  # noqa: E731
        stop = first_stop(out, decode, key.stop)
        cut = min(stop or len(out), p.max_tokens)
        ended = (stop is not None and stop <= cut) or (
            cut > 0 and out[cut - 1] in self.sampling.stop_ids
        )
        lp = gen.logprobs[row][keep].tolist()[:cut]
        v = gen.values[row][keep].tolist()[:cut] if gen.values is not None else []
        return Choice(out[:cut], lp, v, "stop" if ended else "length")

    def _pad(self) -> int:
        pad = self.tokenizer.pad_token_id
        return self.tokenizer.eos_token_id if pad is None else pad

    # ------------------------------------------------------------------ one request

    def answer(self, episode_id: int, route: str, body: dict) -> dict:
        """The reply to one request (called in the request's thread); RequestError when it
        is refused."""
        episode = self.episodes.get(episode_id)
        if episode is None:
            raise RequestError(404, f"no episode {episode_id} in this rollout", "not_found")
        if body.get("stream"):
            raise RequestError(400, "stream=true is not served; ask without streaming")
        chat = route == "chat/completions"
        with self.text_lock:
            prompt_ids = self._chat_prompt(body) if chat else self._completion_prompt(body)
        pending = self._submit(episode, prompt_ids, body)
        left = episode.deadline - time.monotonic()
        if not pending.done.wait(None if left == float("inf") else max(0.0, left) + 1.0):
            raise _ended(episode)
        if pending.error is not None:
            raise pending.error
        with self.text_lock:
            return (_chat_reply if chat else _completion_reply)(self, episode, pending.call, body)

    def _submit(self, episode: EpisodeLog, prompt_ids: list[int], body: dict) -> Pending:
        """The request checked against the episode's limits and queued for the dispatcher:
        its max_tokens cut to fit, its sampling the rollout's (or the request's)."""
        a, s = self.agent, self.sampling
        n = _int("n", body.get("n", 1), 1, MAX_N)
        asked = body.get("max_completion_tokens") or body.get("max_tokens")
        room = a.max_context_tokens - len(prompt_ids)
        if room < 1:
            raise RequestError(
                400,
                f"the prompt has {len(prompt_ids)} tokens: no room to sample within "
                f"rollout.agent.max_context_tokens={a.max_context_tokens}",
                "context_length_exceeded",
            )
        budget = min(s.max_new_tokens, room)
        max_tokens = budget if asked is None else min(_int("max_tokens", asked, 1), budget)
        stop = _stop(body)
        greedy, temperature, top_p = s.greedy, s.temperature, s.top_p
        if a.request_sampling and not s.greedy:
            temperature = _number(body, "temperature", temperature, 0.0, 2.0)
            top_p = _number(body, "top_p", top_p, 1e-9, 1.0)
            greedy = temperature == 0
        key = SamplingKey(n, greedy, temperature if not greedy else 1.0, top_p, stop)
        pending = Pending(episode, prompt_ids, max_tokens, key)
        with self.lock:
            if episode.ended or time.monotonic() > episode.deadline:
                raise _ended(episode)
            episode.requests += 1
            if episode.requests > a.max_calls:
                raise RequestError(
                    400,
                    f"episode {episode.id} has made rollout.agent.max_calls={a.max_calls} calls",
                    "max_calls_reached",
                )
            self.pending.append(pending)
            self.lock.notify_all()
        return pending

    def _chat_prompt(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise RequestError(400, "messages must be a non-empty list of chat messages")
        tools = body.get("tools") or None
        messages = [_template_message(m) for m in messages]
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
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return _non_empty(tokenize_text(prompt, self.tokenizer))
        if isinstance(prompt, list) and prompt and all(type(i) is int for i in prompt):
            return prompt
        raise RequestError(400, "prompt must be a string or a list of token ids (one prompt)")


def _ended(episode: EpisodeLog) -> RequestError:
    return RequestError(
        410,
        f"episode {episode.id} has ended (rollout.agent.timeout_s, or its function returned)",
        "episode_ended",
    )


def _int(name: str, value: Any, low: int, high: int | None = None) -> int:
    if type(value) is not int or value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise RequestError(400, f"{name} must be an integer {bounds}, got {value!r}")
    return value


def _non_empty(ids: list[int]) -> list[int]:
    if not ids:
        raise RequestError(400, "the prompt is empty after tokenization")
    return ids


def _template_message(m: Any) -> dict:
    """An API chat message as a chat template reads it: text parts joined, None content as
    "", tool-call arguments as a dict."""
    if not isinstance(m, dict) or "role" not in m:
        raise RequestError(400, f"chat message {m!r:.200} must be an object with a 'role'")
    out = dict(m)
    content = m.get("content")
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    out["content"] = content or ""
    if m.get("tool_calls"):
        out["tool_calls"] = [_template_tool_call(c) for c in m["tool_calls"]]
    return out


def _template_tool_call(call: dict) -> dict:
    fn = dict(call.get("function", {}))
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args)
        except ValueError:
            pass  # left as the string the agent sent
    return {**call, "function": fn}


def parse_tool_calls(text: str, episode: int, call: int) -> tuple[str, list[dict]]:
    """(the text without its tool-call blocks, the tool calls in the API's form) of a reply
    in the Hermes / Qwen format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`."""
    calls, kept = [], text
    for k, m in enumerate(TOOL_CALL.finditer(text)):
        try:
            obj = json.loads(m[1])
        except ValueError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append(
            {
                "id": f"call_{episode}_{call}_{k}",
                "type": "function",
                "function": {
                    "name": obj["name"],
                    "arguments": args if isinstance(args, str) else json.dumps(args),
                },
            }
        )
        kept = kept.replace(m[0], "", 1)
    return kept.strip() if calls else text, calls


def _text(server: PolicyServer, choice: Choice, stop: tuple[str, ...]) -> str:
    """A choice's text as the API returns it: without the stop token, ended before the stop
    string that ended it."""
    ids = choice.ids
    if ids and ids[-1] in server.sampling.stop_ids:
        ids = ids[:-1]
    text = server.tokenizer.decode(ids, skip_special_tokens=True)
    found = [text.index(s) for s in stop if s in text]
    return text[: min(found)] if found else text


def _tokens(server: PolicyServer, choice: Choice) -> list[str]:
    return [server.tokenizer.decode([i], skip_special_tokens=False) for i in choice.ids]


def _head(kind: str, episode: EpisodeLog, call: Call, calls: int) -> dict:
    sampled = sum(len(c.ids) for c in call.choices)
    return {
        "id": f"{kind}-{episode.id}-{calls}",
        "created": int(time.time()),
        "model": MODEL_NAME,
        "usage": {
            "prompt_tokens": len(call.prompt_ids),
            "completion_tokens": sampled,
            "total_tokens": len(call.prompt_ids) + sampled,
        },
        "prompt_token_ids": call.prompt_ids,
    }


def _chat_reply(server: PolicyServer, episode: EpisodeLog, call: Call, body: dict) -> dict:
    stop, number = _stop(body), len(episode.calls)
    choices = []
    for i, c in enumerate(call.choices):
        content, tool_calls = _text(server, c, stop), []
        if body.get("tools"):
            content, tool_calls = parse_tool_calls(content, episode.id, number)
        message = {"role": "assistant", "content": content or None}
        if tool_calls:
            message["tool_calls"] = tool_calls
        logprobs = None
        if body.get("logprobs"):
            tokens = _tokens(server, c)
            logprobs = {
                "content": [
                    {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                    for t, lp in zip(tokens, c.logprobs, strict=True)
                ]
            }
        finish = "tool_calls" if tool_calls else c.finish
        choices.append(
            {
                "index": i,
                "message": message,
                "finish_reason": finish,
                "logprobs": logprobs,
                "token_ids": c.ids,
            }
        )
    return {
        "object": "chat.completion",
        **_head("chatcmpl", episode, call, number),
        "choices": choices,
    }


def _completion_reply(server: PolicyServer, episode: EpisodeLog, call: Call, body: dict) -> dict:
    stop, number = _stop(body), len(episode.calls)
    choices = []
    for i, c in enumerate(call.choices):
        logprobs = None
        if body.get("logprobs") is not None:
            tokens = _tokens(server, c)
            offsets = [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]
            logprobs = {
                "tokens": tokens,
                "token_logprobs": c.logprobs,
                "top_logprobs": None,
                "text_offset": offsets,
            }
        choices.append(
            {
                "index": i,
                "text": _text(server, c, stop),
                "finish_reason": c.finish,
                "logprobs": logprobs,
                "token_ids": c.ids,
            }
        )
    return {"object": "text_completion", **_head("cmpl", episode, call, number), "choices": choices}


def _stop(body: dict) -> tuple[str, ...]:
    """The request's stop strings; RequestError when they are not strings."""
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, list | tuple) or not all(isinstance(x, str) and x for x in stop):
        raise RequestError(400, f"stop must be a string or a list of strings, got {stop!r:.200}")
    return tuple(stop)


def _number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise RequestError(
            400, f"{name} must be a number in [{low:g}, {high:g}], got {value!r:.200}"
        )
    return float(value)


ROUTE = re.compile(r"^/episode/(\d+)/v1/(chat/completions|completions|models)/?$")


def _handler(server: PolicyServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive: the openai client reuses connections

        def log_message(self, *args) -> None:  # quiet: a request per model call
            pass

        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            m = ROUTE.match(self.path)
            if m and m[2] == "models":
                model = {"id": MODEL_NAME, "object": "model", "created": 0, "owned_by": "proxima"}
                self._send(200, {"object": "list", "data": [model]})
            else:
                self._send(404, _error(RequestError(404, f"no route {self.path}", "not_found")))

        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            m = ROUTE.match(self.path)
            try:
                if not m or m[2] == "models":
                    raise RequestError(404, f"no route POST {self.path}", "not_found")
                try:
                    body = json.loads(raw or b"{}")
                except ValueError as err:
                    raise RequestError(400, f"the body is not JSON: {err}") from None
                if not isinstance(body, dict):
                    raise RequestError(400, "the body must be a JSON object")
                self._send(200, server.answer(int(m[1]), m[2], body))
            except RequestError as err:
                self._send(err.status, _error(err))
            except Exception as err:  # noqa: BLE001 - e.g. a chat template that raises
                refused = RequestError(400, f"the request failed: {type(err).__name__}: {err}")
                self._send(400, _error(refused))

        def _send(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    return Handler


def _error(err: RequestError) -> dict:
    kind = "invalid_request_error" if err.status < 500 else "server_error"
    phrase = HTTPStatus(err.status).phrase
    return {"error": {"message": f"{phrase}: {err}", "type": kind, "code": err.code, "param": None}}
