"""The calculator task of `proxima train tools` played by an agent program written against
the official `openai` client, as any agent would be, and trained by proxima through
`rollout.agent` (docs/multi-turn.md#agent-programs):

    proxima train examples/agent/calculator.yaml

proxima calls `solve(base_url, row)` once per sample, in a thread; `base_url` is this
episode's OpenAI-compatible endpoint over the policy being trained. The policy may write a
call "[37*48]" (the completion stops at "]"): the agent computes it, appends "]" and the
result "1776;" to the prompt and asks again; any other text is the final answer, reward 1
when right. The prompts are strings, each the previous prompt + the policy's text + what the
agent adds, so the calls of an episode extend each other and become one training row (the
calculator's "1776;" masked as an observation). With a tokenizer whose text does not always
tokenize back to the sampled ids, send `prompt_token_ids + choices[0].token_ids` instead.
"""

from __future__ import annotations

import re

import openai

CALL = re.compile(r"\[(\d+)\*(\d+)")  # the stop string "]" is not in the returned text
# One HTTP client for every episode: a client of its own builds a TLS context each time
# (31 ms of CPU here, more than the whole call), and it is thread-safe.
HTTP = openai.DefaultHttpxClient()


def solve(base_url: str, row: dict) -> float:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0, http_client=HTTP)
    prompt = row["prompt"]  # "37*48="
    for _ in range(3):
        reply = client.completions.create(model="policy", prompt=prompt, stop=["]"], max_tokens=8)
        choice = reply.choices[0]
        call = CALL.fullmatch(choice.text) if choice.finish_reason == "stop" else None
        if call is None:  # the final answer
            return float(choice.text.strip() == row["answer"])
        product = int(call[1]) * int(call[2])
        prompt = f"{prompt}{choice.text}]{product};"  # the tool's answer, then the policy again
    return 0.0
