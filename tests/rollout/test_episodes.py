"""Multi-turn episodes (`rollout.env`), played by a scripted policy against scripted
environments (tests/rollout/scripted.py), every expected tensor written out by hand: the
layout of actions and observations, masks, the engine's log-probs and values at action
tokens, turn rewards at each turn's last action token, cuts at stop strings, limits,
environment errors, exits and timeouts, empty actions."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from proxima.config import EnvConfig, RolloutConfig
from proxima.data import PromptItem
from proxima.models import build_char_tokenizer
from proxima.rollout.collect import generate_rollout
from proxima.rollout.environments import load_env_class
from proxima.rollout.episodes import first_stop
from tests.rollout.scripted import ALPHABET, EOS, ScriptedEngine, spec

A, B, C, X, Y, Z = 4, 5, 6, 7, 8, 9
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(ALPHABET)


def items(k: int = 2, **columns) -> list[PromptItem]:
    return [PromptItem("ab", [A, B], {"i": i, **columns}) for i in range(k)]


def play(tok, env: str, actions, n_items: int = 2, item_list=None, **keys):
    """`keys`: those of `rollout.env` (EnvConfig)."""
    keys = {"max_turn_tokens": 3, "max_episode_tokens": 12, **keys}
    cfg = RolloutConfig(env=EnvConfig(spec(env), **keys))
    engine = ScriptedEngine(actions)
    ro = generate_rollout(
        engine, tok, item_list or items(n_items), cfg, CPU, n=1, logprobs=True, values=True
    )
    return ro, engine


def test_two_turns_layout(tok):
    """Row 0: action "ac" (the engine ran on to "b" past the stop string "c": cut), observation
    "xy", action "b" EOS. Row 1: action "aaa" (3 tokens: the turn's budget, no stop),
    observation, action EOS."""
    actions = [[[A, C, B], [A, A, A]], [[B, EOS], [EOS]]]
    ro, engine = play(tok, "TwoTurns", actions, turn_stop=["c"])
    g = ro.gen
    assert g.response_ids.tolist() == [[A, C, X, Y, B, EOS], [A, A, A, X, Y, EOS]]
    assert g.response_mask.tolist() == [[1, 1, 0, 0, 1, 1], [1, 1, 1, 0, 0, 1]]
    assert g.attention_mask.tolist() == [[1, 1, 1, 1, 1, 1, 1, 1]] * 2  # observations: context
    assert g.turn_rewards.tolist() == [[0, 0.5, 0, 0, 0, 1.0], [0, 0, 0.5, 0, 0, 1.0]]
    # the engine's log-probs -0.1 (index + 1) of each action, 0 on observations
    want_lp = [[-0.1, -0.2, 0, 0, -0.1, -0.2], [-0.1, -0.2, -0.3, 0, 0, -0.1]]
    torch.testing.assert_close(g.logprobs, torch.tensor(want_lp))
    torch.testing.assert_close(g.values, -torch.tensor(want_lp))
    assert g.stopped.tolist() == [True, True]
    # turn 2 continued the whole context: prompt, action, observation
    assert engine.calls[1][0] == [[A, B, A, C, X, Y], [A, B, A, A, A, X, Y]]
    assert engine.calls[0][1].stop_strings == ("c",)
    ep = ro.episodes[0]
    assert ep["end"] == "done" and ep["return"] == 1.5
    assert ep["turns"] == [
        {"action": "ac", "observation": "xy", "reward": 0.5},
        {"action": "b</s>", "observation": None, "reward": 1.0},
    ]
    assert ro.responses == ["acxyb", "aaaxy"]  # the episode's text, special tokens skipped
    scored = replace(ro, scores=torch.tensor([2.0, 0.0]))  # + the reward source's score
    torch.testing.assert_close(scored.total_rewards(), torch.tensor([3.5, 1.5]))


def test_env_gets_row_and_actions(tok):
    """Env(row) gets the record's columns and its prompt; step gets each turn's text."""
    built = load_env_class(spec("Recorder")).built
    built.clear()
    play(tok, "Recorder", [[[A, EOS]], [[B]]], n_items=1)
    assert built[0].row == {"i": 0, "prompt": "ab"}
    assert built[0].actions == ["a</s>", "b"]


def test_max_turns_truncates(tok):
    """An environment that is never done: the episode ends after max_turns actions, not
    stopped, the last turn's observation not appended."""
    ro, _ = play(tok, "Never", [[[A]], [[B]]], n_items=1, max_turns=2)
    assert ro.gen.response_ids.tolist() == [[A, Z, B]]
    assert ro.gen.response_mask.tolist() == [[1, 0, 1]]
    assert ro.gen.turn_rewards.tolist() == [[0.25, 0, 0.25]]
    assert ro.episodes[0]["end"] == "max_turns" and not bool(ro.gen.stopped[0])


def test_max_episode_tokens(tok):
    """Budget 9 after the prompt: action (3) + observation (5) = 8 leaves 1 token, so the
    next action is cut to 1 token; its observation would not fit: the episode ends there."""
    actions = [[[A, A, A]], [[B, B, B]]]
    ro, engine = play(tok, "LongObservation", actions, n_items=1, max_episode_tokens=9)
    assert engine.calls[1][1].max_new_tokens == 1  # the budget left
    assert ro.gen.response_ids.tolist() == [[A, A, A, X, Y, Z, X, Y, B]]
    assert ro.gen.response_mask.tolist() == [[1, 1, 1, 0, 0, 0, 0, 0, 1]]
    assert ro.gen.turn_rewards[0, 2] == 0.5 and ro.gen.turn_rewards[0, 8] == 0.5
    assert ro.episodes[0]["end"] == "max_episode_tokens" and not bool(ro.gen.stopped[0])


def test_a_huge_observation_ends_the_episode_unread(tok, monkeypatch):
    """100,000 characters with 9 tokens of room: a prefix shows it cannot fit (the whole text
    is never tokenized), and samples.jsonl keeps its start and its size, not all of it."""
    import proxima.rollout.episodes as episodes

    seen = []
    real = episodes.tokenize_text
    monkeypatch.setattr(episodes, "tokenize_text", lambda t, k: seen.append(len(t)) or real(t, k))
    ro, _ = play(tok, "HugeObservation", [[[A, A, A]]], n_items=1, max_episode_tokens=12)
    ep = ro.episodes[0]
    assert ep["end"] == "max_episode_tokens"
    assert seen == [(12 - 3 + 1) * episodes.MAX_CHARS_PER_TOKEN]
    shown = ep["turns"][0]["observation"]
    assert shown.startswith("xyz" * 10) and len(shown) < 700
    assert "(100002 characters, not shown to the model" in shown
    assert ro.gen.response_ids.tolist() == [[A, A, A]]


def test_env_error_ends_episode_with_fallback(tok):
    ro, _ = play(tok, "FailsSecond", [[[A]], [[B, B]]], n_items=1, fallback_reward=-1.0)
    ep = ro.episodes[0]
    assert ep["end"] == "error"
    assert ep["turns"][1]["error"] == "raised RuntimeError: the calculator broke"
    assert ro.gen.turn_rewards.tolist() == [[0.5, 0, 0, -1.0]]  # at its last token
    assert ro.gen.response_mask.tolist() == [[1, 0, 1, 1]]


def test_broken_init_and_bad_return(tok):
    """Env(row) that raises: the first action is played, then the episode ends with the
    error; a step returning two values is an error too."""
    ro, engine = play(tok, "BrokenInit", [[[A, B]]], n_items=1, fallback_reward=0.5)
    assert len(engine.calls) == 1
    assert ro.episodes[0]["turns"][0]["error"] == "raised KeyError: 'answer'"
    assert ro.gen.turn_rewards.tolist() == [[0, 0.5]]
    ro, _ = play(tok, "BadReturn", [[[A]]], n_items=1)
    assert ro.episodes[0]["end"] == "error"
    assert "must return (observation or None, reward, done)" in ro.episodes[0]["turns"][0]["error"]


def test_timeout_ends_only_the_slow_episode(tok):
    rows = [PromptItem("ab", [A, B], {"slow": s}) for s in (False, True, False)]
    start = time.monotonic()
    ro, _ = play(tok, "Sleeps", [[[A]] * 3], item_list=rows, timeout_s=1.0)
    assert time.monotonic() - start < 4.0  # not the 5 s of the slow step
    assert [e["end"] for e in ro.episodes] == ["done", "timeout", "done"]
    assert ro.episodes[1]["turns"][0]["error"] == "timed out after rollout.env.timeout_s=1 s"
    assert ro.gen.turn_rewards[:, 0].tolist() == [1.0, 0.0, 1.0]


def test_empty_action(tok):
    """An action that is EOS alone: one token, its text "</s>"."""
    ro, _ = play(tok, "Echo", [[[EOS]]], n_items=1)
    assert ro.gen.response_ids.tolist() == [[EOS]] and ro.gen.response_mask.tolist() == [[1]]
    assert ro.episodes[0]["turns"][0]["action"] == "</s>"
    assert ro.gen.turn_rewards.tolist() == [[1.0]]


def test_chat_observation_once_with_the_template():
    """Chat prompts: the observation is a `tool` message rendered by the chat template and
    tokenized once; the end of the assistant's message the template writes ("</s>") is left
    out after an action that ended with EOS (the model wrote it), kept after one that ended
    with a stop string."""
    tok = build_char_tokenizer(ALPHABET + "usertolin:")
    tok.chat_template = (
        "{% for m in messages %}<s>{{ m.role }}:{{ m.content }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<s>assistant:{% endif %}"
    )
    messages = [{"role": "user", "content": "ab"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    item = PromptItem(text, tok(text, add_special_tokens=False)["input_ids"], {}, messages)
    ids = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    actions = [[[A, EOS], [A, C]], [[B, EOS], [B, EOS]]]
    ro, _ = play(
        tok, "TwoTurns", actions, item_list=[item, item], turn_stop=["c"], max_episode_tokens=40
    )
    row = ro.gen.response_ids.tolist()
    after_eos = ids("<s>tool:xy</s><s>assistant:")
    after_stop = ids("</s><s>tool:xy</s><s>assistant:")
    assert row[0][: 2 + len(after_eos)] == [A, EOS, *after_eos]
    assert row[1][: 2 + len(after_stop)] == [A, C, *after_stop]
    assert ro.gen.response_mask[0].tolist() == [1, 1] + [0] * len(after_eos) + [1, 1, 0]
    assert ro.episodes[0]["turns"][0]["observation"] == "xy"


def test_first_stop(tok):
    decode = tok.decode
    assert first_stop([A, B, C, A], decode, ("bc",)) == 3
    assert first_stop([A, B, C, A], decode, ("ca", "b")) == 2
    assert first_stop([A, B], decode, ("c",)) is None
    assert first_stop([A, B], decode, ()) is None


def test_sys_exit_in_step_is_an_error_not_a_hang(tok):
    """An environment whose step calls sys.exit(3) ends its episode at once, named, instead
    of ending its worker thread in silence and leaving the turn to wait `timeout_s`."""
    start = time.monotonic()
    ro, _ = play(tok, "Exits", [[[A]]], n_items=1, timeout_s=30.0)
    assert time.monotonic() - start < 10
    assert ro.episodes[0]["end"] == "error"
    assert ro.episodes[0]["turns"][0]["error"] == "called sys.exit(3)"


def test_step_info_is_kept_in_the_turn(tok):
    """A fourth value of step, a dict of JSON values, is the turn's `info`; one that JSON
    cannot write is an error of that turn."""
    ro, _ = play(tok, "WithInfo", [[[A]], [[B]]], n_items=1, fallback_reward=-1.0)
    first, second = ro.episodes[0]["turns"]
    assert first == {
        "action": "a",
        "observation": "x",
        "reward": 0.5,
        "info": {"outcome": "ok", "seconds": 0.25},
    }
    assert second["error"].startswith("raised ValueError: step's info must be a dict of JSON")
    assert second["reward"] == -1.0 and "info" not in second
    assert ro.episodes[0]["end"] == "error"
