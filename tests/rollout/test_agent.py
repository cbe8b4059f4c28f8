"""Agent programs (`rollout.agent`) through the OpenAI-compatible endpoint, with the real
`openai` client: what the server answers (chat and completions, n > 1, stop strings, tool
calls, log-probs), what it records (the prompt ids the tokenizer gives, the engine's sampled
ids and log-probs), the rows built from the records (calls that extend merged, observations
masked), and the failures: a late episode, a function that raises, too many calls."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from proxima.config import AgentConfig, Config, ConfigError, RolloutConfig, load_config, validate
from proxima.data import PromptItem
from proxima.models import build_char_tokenizer
from proxima.rollout.agent import chain_of_calls, load_agent_fn
from proxima.rollout.collect import generate_rollout
from proxima.rollout.endpoint.records import Call, Choice
from proxima.rollout.endpoint.tool_calls import parse_tool_calls
from proxima.rollout.experience import sequence_logprobs
from proxima.rollout.hf_engine import HFEngine

pytest.importorskip("openai")  # the `agent` extra: the agents below are written against it

from tests.rollout.agents import ALPHABET, SEEN, RuleEngine, spec  # noqa: E402
from tests.rollout.scripted import EOS  # noqa: E402
from tests.rollout.test_episodes_engines import setup  # noqa: E402, F401 - the nano model

CPU = torch.device("cpu")
TEMPLATE = (
    "{% if tools %}<s>tools:{{ tools|length }}</s>{% endif %}"
    "{% for m in messages %}<s>{{ m.role }}:{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function|tojson }}</tool_call>{% endfor %}"
    "</s>{% endfor %}{% if add_generation_prompt %}<s>assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    t = build_char_tokenizer(ALPHABET)
    t.chat_template = TEMPLATE
    return t


def ids_of(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def items(tok, prompts: list[str], **columns) -> list[PromptItem]:
    return [
        PromptItem(p, ids_of(tok, p), {"i": i, **{k: v[i] for k, v in columns.items()}})
        for i, p in enumerate(prompts)
    ]


def play(tok, fn: str, rule, prompts=("ab", "ba"), n=1, columns=None, length=6, **keys):
    SEEN.clear()
    keys = {"max_context_tokens": 200, **keys}
    cfg = RolloutConfig(max_response_length=length, agent=AgentConfig(spec(fn), **keys))
    engine = RuleEngine(rule)
    ro = generate_rollout(
        engine, tok, items(tok, list(prompts), **(columns or {})), cfg, CPU, n=n, logprobs=True
    )
    return ro, engine


def asked(engine) -> list[list[int]]:
    """Every prompt the engine was given, in the order of its calls."""
    return [p for rows, _ in engine.calls for p in rows]


def answer(tok, text: str):
    return lambda prompt, j: ids_of(tok, text) + [EOS]


def test_chat_records_template_ids_and_engine_logprobs(tok):
    ro, engine = play(tok, "one_chat", answer(tok, "xyz"))
    prompt = ids_of(tok, "<s>user:ab</s><s>assistant:")
    assert prompt in asked(engine)  # the chat template's text, tokenized once
    reply = SEEN[0]["reply"]
    assert reply.choices[0].message.content == "xyz"  # the EOS is not text
    assert reply.choices[0].finish_reason == "stop"
    got = [t.logprob for t in reply.choices[0].logprobs.content]
    assert got == pytest.approx([-0.1, -0.2, -0.3, -0.4])  # x y z EOS: the engine's
    assert reply.prompt_token_ids == prompt and reply.usage.completion_tokens == 4
    g = ro.gen
    assert (
        g.input_ids[0, -g.response_mask.shape[1] - len(prompt) :].tolist()[: len(prompt)] == prompt
    )
    assert g.response_ids[0].tolist() == [*ids_of(tok, "xyz"), EOS]
    assert g.response_mask[0].tolist() == [1, 1, 1, 1]
    torch.testing.assert_close(g.logprobs[0], torch.tensor([-0.1, -0.2, -0.3, -0.4]))
    assert g.turn_rewards[0].tolist() == [0, 0, 0, 1.0]
    assert g.stopped.tolist() == [True, True]
    assert ro.episodes[0]["end"] == "done" and ro.episodes[0]["return"] == 1.0
    assert ro.episodes[0]["turns"][0]["trained"] is True


def test_completion_that_extends_the_previous_call_is_one_row(tok):
    """Call 1: "ab" -> "xcz" cut at the stop string "c" (text "x", ids x c); call 2: "abxc"
    + "xy" -> "zz" EOS. The row: x c | x y (observation, mask 0) | z z EOS."""
    rule = lambda p, j: ids_of(tok, "xcz") if len(p) == 2 else [*ids_of(tok, "zz"), EOS]  # noqa: E731
    ro, engine = play(tok, "two_completions", rule)
    first, second = SEEN[0]["replies"]
    assert first.choices[0].text == "x" and first.choices[0].finish_reason == "stop"
    assert first.choices[0].token_ids == ids_of(tok, "xc")  # the stop string's token kept
    assert second.choices[0].logprobs.token_logprobs == pytest.approx([-0.1, -0.2, -0.3])
    assert second.choices[0].logprobs.tokens == ["z", "z", "</s>"]
    g = ro.gen
    assert g.response_ids[0].tolist() == [*ids_of(tok, "xcxyzz"), EOS]
    assert g.response_mask[0].tolist() == [1, 1, 0, 0, 1, 1, 1]
    torch.testing.assert_close(g.logprobs[0], torch.tensor([-0.1, -0.2, 0, 0, -0.1, -0.2, -0.3]))
    torch.testing.assert_close(g.values, -g.logprobs) if g.values is not None else None
    assert g.turn_rewards[0].tolist() == [0, 0, 0, 0, 0, 0, 0.5]
    assert ro.episodes[0]["turns"][0]["trained"] and ro.episodes[0]["turns"][1]["trained"]
    assert ro.responses[0] == "xcxyzz"
    assert len(engine.calls) >= 2  # the two episodes' calls, batched as they came


def test_a_call_that_does_not_extend_starts_the_row_again(tok):
    ro, _ = play(tok, "rewritten_history", answer(tok, "x"))
    g = ro.gen
    prompt = ids_of(tok, "zz")
    assert (
        g.input_ids[0, -g.response_mask.shape[1] - 2 : -g.response_mask.shape[1]].tolist() == prompt
    )
    assert g.response_ids[0].tolist() == [ids_of(tok, "x")[0], EOS]
    turns = ro.episodes[0]["turns"]
    assert [t["trained"] for t in turns] == [False, True]
    assert g.turn_rewards[0].tolist() == [0, 0]  # None: reward.sources score it


def test_n_choices_stop_strings_and_the_chain_follows_the_choice_continued(tok):
    """n=2: choice 0 "xcz" cut after "c", choice 1 "xxx" cut by max_tokens=3 ("length").
    The second call continues choice 1 by its ids: the row is choice 1, then call 2."""
    rule = lambda p, j: (
        (ids_of(tok, "xcz") if j == 0 else ids_of(tok, "xxxx")) if len(p) == 2 else [EOS]
    )  # noqa: E731
    ro, engine = play(tok, "n_choices_with_stop", rule)
    first = SEEN[0]["first"]
    assert [c.text for c in first.choices] == ["x", "xxx"]
    assert [c.finish_reason for c in first.choices] == ["stop", "length"]
    assert engine.calls[0][1].n == 2 and engine.calls[0][1].stop_strings == ("c",)
    assert ro.gen.response_ids[0].tolist() == [*ids_of(tok, "xxx"), EOS]
    assert ro.gen.response_mask[0].tolist() == [1, 1, 1, 1]


def test_group_structure_with_rollout_n(tok):
    """rollout.n=2: each prompt played twice, rows prompt-major, the group ids as usual."""
    ro, _ = play(tok, "one_chat", answer(tok, "x"), n=2)
    assert ro.group_ids.tolist() == [0, 0, 1, 1]
    assert ro.prompts == ["ab", "ab", "ba", "ba"]
    assert len(ro.episodes) == 4


def test_tool_calls_parsed_and_rendered_back(tok):
    call = '<tool_call>{"name": "mul", "arguments": {"a": 2, "b": 3}}</tool_call>'
    rule = lambda p, j: (
        [*ids_of(tok, call), EOS]
        if p.count(ids_of(tok, "user")[0]) < 2 and "tool:6" not in tok.decode(p)
        else [*ids_of(tok, "6"), EOS]
    )  # noqa: E731
    ro, engine = play(tok, "tool_loop", rule, prompts=("2*3",), length=80)
    first = SEEN[0]["first"].choices[0]
    assert first.finish_reason == "tool_calls" and first.message.content is None
    assert first.message.tool_calls[0].function.name == "mul"
    assert first.message.tool_calls[0].function.arguments == '{"a": 2, "b": 3}'
    assert tok.decode(asked(engine)[1]) == (
        "<s>tools:1</s><s>user:2*3</s><s>assistant:"
        '<tool_call>{"arguments": {"a": 2, "b": 3}, "name": "mul"}</tool_call></s>'
        "<s>tool:6</s><s>assistant:"
    )
    assert SEEN[0]["second"].choices[0].message.content == "6"
    # the template writes the call back in another key order: not a prefix, last call alone
    assert [t["trained"] for t in ro.episodes[0]["turns"]] == [False, True]


def test_parse_tool_calls():
    text = (
        'ok <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call><tool_call>nope</tool_call>'
    )
    content, calls = parse_tool_calls(text, 3, 1)
    assert content == "ok <tool_call>nope</tool_call>"
    assert calls == [
        {"id": "call_3_1_0", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    ]
    assert parse_tool_calls("plain", 0, 0) == ("plain", [])


def test_chain_of_calls():
    c = lambda p, *outs: Call(p, [Choice(o, [0.0] * len(o), [], "stop") for o in outs])  # noqa: E731
    calls = [c([1], [2]), c([9], [9]), c([1, 2, 5], [6], [7]), c([1, 2, 5, 7, 8], [3])]
    assert chain_of_calls(calls) == [(0, 0), (2, 1), (3, 0)]
    assert chain_of_calls([]) == []
    assert chain_of_calls([c([1], [2]), c([1, 3], [4])]) == [(1, 0)]


def test_late_episode_gets_fallback_and_its_requests_are_refused(tok):
    start = time.monotonic()
    ro, _ = play(
        tok,
        "slow_when_asked",
        answer(tok, "x"),
        columns={"slow": [6.0, 0]},
        timeout_s=2.0,
        fallback_reward=-1.0,
    )
    # the limit leaves a loaded machine time for the first call; the rollout did not wait
    # for the late function
    assert time.monotonic() - start < 6.0
    slow, fine = ro.episodes
    assert slow["end"] == "timeout" and slow["return"] == -1.0
    assert "timed out after rollout.agent.timeout_s=2 s" in slow["turns"][-1]["error"]
    assert fine["end"] == "done" and fine["return"] == 1.0
    assert ro.gen.turn_rewards[0].tolist() == [0, -1.0]  # its call is trained, at the fallback
    deadline = time.monotonic() + 10
    while "late" not in SEEN.get(0, {}) and time.monotonic() < deadline:
        time.sleep(0.05)
    status, body = SEEN[0]["late"]
    assert status == 410 and body["code"] == "episode_ended"


def test_failing_function_is_counted_and_scored_with_the_fallback(tok):
    ro, _ = play(
        tok,
        "fails_when_asked",
        answer(tok, "x"),
        columns={"fail": [True, False]},
        fallback_reward=-0.5,
    )
    broken, fine = ro.episodes
    assert broken["end"] == "error" and broken["return"] == -0.5
    assert broken["turns"][-1]["error"] == "raised RuntimeError: the agent broke"
    assert fine["end"] == "done"
    assert ro.gen.turn_rewards[0].tolist() == [0, -0.5]


def test_calls_past_max_calls_are_refused(tok):
    ro, _ = play(tok, "too_many_calls", answer(tok, "x"), max_calls=2)
    assert SEEN[0]["refused"]["code"] == "max_calls_reached"
    assert len(ro.episodes[0]["turns"]) == 2


def test_prompt_without_room_is_refused(tok):
    ro, _ = play(tok, "one_chat", answer(tok, "x"), max_context_tokens=10)
    assert ro.episodes[0]["end"] == "error"
    assert "no room to sample" in ro.episodes[0]["turns"][0]["error"]
    assert ro.gen.response_mask.sum() == 0  # no call made: nothing to train


@pytest.mark.parametrize("honoured", [False, True])
def test_request_sampling(tok, honoured):
    """The request's temperature and top_p decide only with rollout.agent.request_sampling
    (temperature 0: greedy); else the rollout's (temperature 1, top_p 1)."""
    _, engine = play(tok, "zero_temperature", answer(tok, "x"), request_sampling=honoured)
    sampling = engine.calls[0][1]
    assert (sampling.greedy, sampling.top_p) == ((True, 0.5) if honoured else (False, 1.0))
    assert "stop must be a string" in SEEN[0]["refused"]["message"]


def test_an_engine_failure_ends_the_rollout_and_answers_the_waiting_requests(tok):
    def broken(prompt, j):
        raise RuntimeError("probability tensor contains inf")

    with pytest.raises(RuntimeError, match="contains inf"):
        play(tok, "one_chat", broken)


def test_async_agent(tok):
    ro, _ = play(tok, "async_chat", answer(tok, "y"))
    assert SEEN[1]["reply"].choices[0].message.content == "y"
    assert [e["return"] for e in ro.episodes] == [2.0, 2.0]


def test_the_example_config_is_valid():
    root = Path(__file__).parents[2]
    cfg = load_config(str(root / "examples" / "agent" / "calculator.yaml"))
    assert cfg.rollout.agent.fn == "examples/agent/calculator_agent.py:solve"
    assert cfg.rollout.after_prompt_tokens == 48


def test_config_checks(tmp_path):
    with pytest.raises(ConfigError, match="rollout.agent.fn` is empty"):
        validate(Config().replace({"rollout.agent.timeout_s": 3.0}))
    both = {"rollout.agent.fn": spec("one_chat"), "rollout.env.cls": "x.py:Env"}
    with pytest.raises(ConfigError, match="both set"):
        validate(Config().replace(both))
    with pytest.raises(ConfigError, match="max_calls` must be >= 1"):
        validate(
            Config().replace({"rollout.agent.fn": spec("one_chat"), "rollout.agent.max_calls": 0})
        )
    fsdp = {"rollout.agent.fn": spec("one_chat"), "trainer.strategy": "fsdp2"}
    with pytest.raises(ConfigError, match="every FSDP2 generation is a collective"):
        validate(Config().replace(fsdp))
    with pytest.raises(ConfigError, match=r"it must be a function fn\(base_url: str, row: dict\)"):
        load_agent_fn(spec("takes_one"))
    with pytest.raises(ConfigError, match="has no attribute 'nope'"):
        load_agent_fn(spec("nope"))


def test_a_missing_endpoint_package_names_the_extra(monkeypatch):
    import importlib.util

    from proxima.rollout.agent import check_agent

    found = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "uvicorn" else found(name)
    )
    cfg = Config().replace({"rollout.agent.fn": spec("one_chat")})
    with pytest.raises(ConfigError, match=r"with uvicorn, not installed here; .*proxima\[agent\]"):
        check_agent(cfg)


def test_sampled_rows_logprobs_equal_the_trainer_on_a_real_model(setup):  # noqa: F811
    """The hf engine on a nano model (test_episodes_engines' `setup`): three completions each
    continuing the ids so far and an observation; the merged row's engine log-probs equal
    the trainer's forward pass."""
    tok, model = setup[:2]
    cfg = RolloutConfig(
        temperature=0.9,
        max_response_length=4,
        stop_token_ids=[tok.convert_tokens_to_ids("=")],
        agent=AgentConfig(spec("sampled_chat_turns"), max_context_tokens=40),
    )
    obs = ids_of(tok, "xy")
    its = [
        PromptItem(p, ids_of(tok, p), {"i": i, "ids": ids_of(tok, p), "observation": obs})
        for i, p in enumerate(["12+34", "7+8"])
    ]
    torch.manual_seed(0)
    ro = generate_rollout(
        HFEngine(model, tok.pad_token_id, 4, tok), tok, its, cfg, CPU, n=2, logprobs=True
    )
    g = ro.gen
    assert all(all(t["trained"] for t in e["turns"]) and len(e["turns"]) == 3 for e in ro.episodes)
    observed = (g.response_mask == 0) & (g.attention_mask[:, -g.response_mask.shape[1] :] == 1)
    assert int(observed.sum()) == 4 * 2 * 2  # 4 rows, 2 observations "xy" each
    trainer = sequence_logprobs(model, g, cfg.temperature, 8)
    torch.testing.assert_close(g.logprobs, trainer, rtol=0, atol=1e-4)


def test_the_calculator_example(tok):
    """examples/agent/calculator_agent.py: "[2*3]" (stopped at "]"), the agent's "6;", then
    "6": one row, the calculator's answer masked, reward 1."""
    example = Path(__file__).parents[2] / "examples" / "agent" / "calculator_agent.py"
    rule = lambda p, j: (
        ids_of(tok, "[2*3]6") if tok.decode(p).endswith("=") else [*ids_of(tok, "6"), EOS]
    )  # noqa: E731
    cfg = RolloutConfig(max_response_length=8, agent=AgentConfig(f"{example}:solve"))
    its = [PromptItem("2*3=", ids_of(tok, "2*3="), {"answer": "6"})]
    ro = generate_rollout(RuleEngine(rule), tok, its, cfg, CPU, n=1, logprobs=True)
    assert ro.gen.response_ids[0].tolist() == [*ids_of(tok, "[2*3]6;6"), EOS]
    assert ro.gen.response_mask[0].tolist() == [1] * 5 + [0, 0] + [1, 1]
    assert ro.gen.turn_rewards[0, -1] == 1.0 and ro.episodes[0]["end"] == "done"
