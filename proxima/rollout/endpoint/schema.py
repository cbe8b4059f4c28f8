"""The OpenAI API's request and reply bodies, as the endpoint reads and writes them: the
fields of a request checked one by one (each refusal a `RequestError` naming the field), the
replies of chat and completions built from a recorded `Call` and its decoded text as the
`openai` package's own types (`ChatCompletion`, `Completion`: the schema the client parses,
kept by the package that defines it), the API's JSON errors.

Requests are read by hand: the package types a request's parameters as TypedDicts for the
client to write, not as models to validate, and a refusal here names the field and what it
must be."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from openai.types import Completion, CompletionChoice, CompletionUsage, Model
from openai.types.chat import ChatCompletion, ChatCompletionMessage, ChatCompletionTokenLogprob
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion import ChoiceLogprobs
from openai.types.completion_choice import Logprobs
from pydantic import BaseModel

from proxima.rollout.endpoint.records import Call
from proxima.rollout.endpoint.tool_calls import template_tool_call

MODEL_NAME = "policy"  # what /v1/models lists; any model name is accepted in a request
MAX_N = 64  # choices per request


class RequestError(Exception):
    """A request the server refuses: the HTTP status, the API's error code, the message."""

    def __init__(self, status: int, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.status, self.code = status, code


def episode_ended(episode_id: int) -> RequestError:
    return RequestError(
        410,
        f"episode {episode_id} has ended (rollout.agent.timeout_s, or its function returned)",
        "episode_ended",
    )


@dataclass(frozen=True)
class Decoded:
    """A choice as text: what the API returns (`text`) and each sampled token's string."""

    text: str
    tokens: list[str]


def parse_body(raw: bytes) -> dict:
    """A request's JSON body; RequestError when it is not a JSON object."""
    try:
        body = json.loads(raw or b"{}")
    except ValueError as err:
        raise RequestError(400, f"the body is not JSON: {err}") from None
    if not isinstance(body, dict):
        raise RequestError(400, "the body must be a JSON object")
    if body.get("stream"):
        raise RequestError(400, "stream=true is not served; ask without streaming")
    return body


def chat_messages(body: dict) -> tuple[list[dict], list | None]:
    """(the messages as a chat template reads them, the tools or None) of a chat request."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "messages must be a non-empty list of chat messages")
    return [_template_message(m) for m in messages], body.get("tools") or None


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
        out["tool_calls"] = [template_tool_call(c) for c in m["tool_calls"]]
    return out


def completion_prompt(body: dict) -> str | list[int]:
    """A completion request's one prompt: a string, or a list of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(type(i) is int for i in prompt):
        return prompt
    raise RequestError(400, "prompt must be a string or a list of token ids (one prompt)")


def choices_asked(body: dict) -> int:
    return integer("n", body.get("n", 1), 1, MAX_N)


def max_tokens_asked(body: dict) -> int | None:
    asked = body.get("max_completion_tokens") or body.get("max_tokens")
    return None if asked is None else integer("max_tokens", asked, 1)


def stop_strings(body: dict) -> tuple[str, ...]:
    """The request's stop strings; RequestError when they are not strings."""
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, list | tuple) or not all(isinstance(x, str) and x for x in stop):
        raise RequestError(400, f"stop must be a string or a list of strings, got {stop!r:.200}")
    return tuple(stop)


def integer(name: str, value: Any, low: int, high: int | None = None) -> int:
    if type(value) is not int or value < low or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise RequestError(400, f"{name} must be an integer {bounds}, got {value!r}")
    return value


def number(body: dict, name: str, default: float, low: float, high: float) -> float:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not low <= value <= high:
        raise RequestError(
            400, f"{name} must be a number in [{low:g}, {high:g}], got {value!r:.200}"
        )
    return float(value)


def chat_reply(
    call: Call, decoded: list[Decoded], tool_calls: list[list[dict]], name: str, body: dict
) -> ChatCompletion:
    """A chat.completion of `call`: each choice's content (None when empty), its tool calls
    (finish_reason "tool_calls" then) and, when asked, its tokens' log-probs."""
    choices = []
    for i, (c, d, tools) in enumerate(zip(call.choices, decoded, tool_calls, strict=True)):
        # tool_calls only when there are some: a reply without carries no such key
        called = {"tool_calls": tools} if tools else {}
        message = ChatCompletionMessage(role="assistant", content=d.text or None, **called)
        logprobs = None
        if body.get("logprobs"):
            logprobs = ChoiceLogprobs(
                content=[
                    ChatCompletionTokenLogprob(
                        token=t, logprob=lp, bytes=list(t.encode()), top_logprobs=[]
                    )
                    for t, lp in zip(d.tokens, c.logprobs, strict=True)
                ]
            )
        finish = "tool_calls" if tools else c.finish
        choices.append(
            ChatChoice(
                index=i, message=message, finish_reason=finish, logprobs=logprobs, token_ids=c.ids
            )
        )
    return ChatCompletion(
        object="chat.completion", choices=choices, **_head(f"chatcmpl-{name}", call)
    )


def completion_reply(call: Call, decoded: list[Decoded], name: str, body: dict) -> Completion:
    """A text_completion of `call`: each choice's text and, when asked, its tokens with
    their log-probs and text offsets (no top alternatives)."""
    choices = []
    for i, (c, d) in enumerate(zip(call.choices, decoded, strict=True)):
        logprobs = None
        if body.get("logprobs") is not None:
            offsets = [sum(len(t) for t in d.tokens[:k]) for k in range(len(d.tokens))]
            logprobs = Logprobs(
                tokens=d.tokens, token_logprobs=c.logprobs, top_logprobs=None, text_offset=offsets
            )
        choices.append(
            CompletionChoice(
                index=i, text=d.text, finish_reason=c.finish, logprobs=logprobs, token_ids=c.ids
            )
        )
    return Completion(object="text_completion", choices=choices, **_head(f"cmpl-{name}", call))


def _head(id: str, call: Call) -> dict:
    """The fields every reply has; `prompt_token_ids` (and each choice's `token_ids`) as
    vLLM's server gives them on request, for an agent that wants the ids (the openai types
    keep fields they do not name, and so does the client that reads them)."""
    sampled = sum(len(c.ids) for c in call.choices)
    usage = CompletionUsage(
        prompt_tokens=len(call.prompt_ids),
        completion_tokens=sampled,
        total_tokens=len(call.prompt_ids) + sampled,
    )
    return {
        "id": id,
        "created": int(time.time()),
        "model": MODEL_NAME,
        "usage": usage,
        "prompt_token_ids": call.prompt_ids,
    }


def model_list() -> dict:
    model = Model(id=MODEL_NAME, object="model", created=0, owned_by="proxima")
    return {"object": "list", "data": [model.model_dump(exclude_unset=True)]}


def encode(reply: BaseModel | dict) -> bytes:
    """A reply's JSON: an openai type with only the fields set (the API's optional fields
    left out, as today's servers do), a dict as it is."""
    if isinstance(reply, BaseModel):
        return reply.model_dump_json(exclude_unset=True).encode()
    return json.dumps(reply).encode()


def error_body(err: RequestError) -> dict:
    """The API's JSON error: its type from the status, the code the refusal names."""
    kind = "invalid_request_error" if err.status < 500 else "server_error"
    phrase = HTTPStatus(err.status).phrase
    return {"error": {"message": f"{phrase}: {err}", "type": kind, "code": err.code, "param": None}}
