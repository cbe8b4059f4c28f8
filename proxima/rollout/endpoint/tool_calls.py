"""Tool calls in the Hermes / Qwen format that many chat models and the tiny models' test
template use: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks in the text.
Parsed out of a reply into the API's `tool_calls` (arguments a JSON string, as the API gives
them); written back for the chat template with their arguments as a dict (what Hugging Face
templates read)."""

from __future__ import annotations

import json
import re

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str, episode: int, call: int) -> tuple[str, list[dict]]:
    """(the text without its tool-call blocks, the tool calls in the API's form) of a reply;
    a block that is not `{"name": str, "arguments": ...}` JSON stays text."""
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


def template_tool_call(call: dict) -> dict:
    """An API tool call of an assistant message as a chat template reads it: its arguments
    a dict (a string that is not JSON is left as the agent sent it)."""
    fn = dict(call.get("function", {}))
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args)
        except ValueError:
            pass
    return {**call, "function": fn}
