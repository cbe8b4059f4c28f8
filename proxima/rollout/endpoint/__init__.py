"""An OpenAI-compatible HTTP endpoint over the policy, for agent programs (`rollout.agent`):
`/v1/chat/completions`, `/v1/completions` and `/v1/models`, served by the rollout engine, every
call recorded in token ids.

Each episode has its own base URL, `http://127.0.0.1:PORT/episode/<id>/v1`, so a call is
attributed to its episode whatever client library makes it. One job per module:

- `policy_server`: `PolicyServer`, the endpoint of one rollout: its episodes, and each request
  answered in the request's thread (prompt -> ids -> queued -> waited for -> reply).
- `app`: the HTTP side, one per process (Starlette on uvicorn): routes each
  episode's requests to its rollout's policy server, answers the API's JSON errors.
- `schema`: the API's request fields checked, its replies built as the `openai` package's
  types, its errors.
- `tool_calls`: tool calls parsed out of a reply, and written back for the chat template.
- `dispatcher`: the one caller of the engine, batching the queued requests.
- `records`: what a call records (`Call`, `Choice`, `EpisodeLog`): the training rows of
  `rollout.agent` are built from these ids, never from text.

Requests:

- chat: the messages rendered by the tokenizer's chat template (`tools` passed to it), or,
  without a template, the plain transcript of `data.render_prompt` (no tools then); tool
  calls in the reply parsed back (`tool_calls`).
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
