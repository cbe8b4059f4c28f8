"""The chat preference task of `proxima pipeline` (`pipeline.task=chat`): the gold's parts on
answers written by hand, each value worked out in a comment (weights: instruction 0.30, topic
0.25, variety 0.20, length 0.15, ending 0.10); the orderings a reader would give; the
prompts and their held-out split; the preparation."""

from __future__ import annotations

import json

import pytest

from proxima.config import Config, ConfigError
from proxima.tasks import chat_preferences as C
from proxima.tasks import instructions

GOOD = "The ocean is a vast body of salt water that covers most of the planet."
# 33 words, three sentences (the last cut off), "the ocean" and "ocean is" said twice
RAMBLING = (
    "The ocean is a vast body of water. It covers most of the Earth and is home to many "
    "animals. The ocean is also important for the climate because it absorbs heat and"
)

# (kind, n, topic, category, response, parts, gold)
CASES = [
    # 15 words, one sentence, names the ocean, no pair twice, ends with a full stop
    ("sentence", 0, "the ocean", "", GOOD, (1, 1, 1, 1, 1), 1.0),
    # instruction: 3 sentences, 1 - |3 - 1| / 2 = 0; variety: 2 of 32 pairs repeat, 30/32;
    # length: 33 words above 25, (40 - 33) / (40 - 25) = 7/15; ending: cut off after "and"
    # gold 0.25 + 0.2 * 30/32 + 0.15 * 7/15 = 0.25 + 0.1875 + 0.07
    ("sentence", 0, "the ocean", "", RAMBLING, (0, 1, 30 / 32, 7 / 15, 0), 0.5075),
    # one word five times: degenerate, so no instruction and no variety; length 5/6 words
    # gold 0.25 + 0.15 * 5/6
    ("sentence", 0, "the ocean", "", "ocean ocean ocean ocean ocean", (0, 1, 0, 5 / 6, 0), 0.375),
    # a fluent sentence about something else: the form met about another topic counts 0
    # gold 0.2 + 0.15 + 0.1
    (
        "sentence",
        0,
        "the ocean",
        "",
        "The mountains are tall and covered in snow.",
        (0, 0, 1, 1, 1),
        0.45,
    ),
    # GOOD cut off before its end: only the ending lost, 1 - 0.1
    (
        "sentence",
        0,
        "the ocean",
        "",
        "The ocean is a vast body of salt water that covers most of",
        (1, 1, 1, 1, 0),
        0.9,
    ),
    # 14 words, 13 pairs of which 5 repeat (the ocean x2, ocean is x2, and the): variety 8/13
    # (no word is half of the words: not degenerate); gold 0.8 + 0.2 * 8/13
    (
        "sentence",
        0,
        "the ocean",
        "",
        "The ocean is blue and the ocean is wide and the ocean is deep.",
        (1, 1, 8 / 13, 1, 1),
        0.8 + 0.2 * 8 / 13,
    ),
    # two sentences asked, two given: 15 words in the band 10-30
    (
        "two",
        0,
        "rain",
        "",
        "Rain is water that falls from clouds. It helps plants grow and fills the rivers.",
        (1, 1, 1, 1, 1),
        1.0,
    ),
    # one sentence of two: instruction 1 - 1/2; gold 1 - 0.3 * 0.5
    (
        "two",
        0,
        "rain",
        "",
        "Rain is water that falls from clouds and helps plants grow.",
        (0.5, 1, 1, 1, 1),
        0.85,
    ),
    ("short", 8, "cats", "", "Cats love to nap in the sun.", (1, 1, 1, 1, 1), 1.0),  # 7 words
    # 10 words, 2 over 8: instruction 1 - 2/8; length (16 - 10) / (16 - 8), 0 at 2 * 8
    # gold 0.3 * 0.75 + 0.25 + 0.2 + 0.15 * 0.75 + 0.1
    (
        "short",
        8,
        "cats",
        "",
        "Cats love to nap in the warm sun every day.",
        (0.75, 1, 1, 0.75, 1),
        0.8875,
    ),
    # 16 words: instruction 1 - 8/8 = 0, length 0 at 16; gold 0.25 + 0.2 + 0.1
    (
        "short",
        8,
        "cats",
        "",
        "Cats are small furry animals that love to sleep in warm sunny places all day long.",
        (0, 1, 1, 0, 1),
        0.55,
    ),
    ("list", 3, "", "fruits", "apple, banana, cherry", (1, 1, 1, 1, 1), 1.0),
    # heading line dropped, items' heads Apple, Banana, Cherry; 10 words without the markers
    # (heading 4, "Apple - sweet and red" 4, 1, 1): length (18 - 10) / (18 - 9) = 8/9
    (
        "list",
        3,
        "",
        "fruits",
        "Here are 3 fruits:\n1. Apple - sweet and red\n2. Banana\n3. Cherry",
        (1, 1, 1, 8 / 9, 1),
        1 - 0.15 / 9,
    ),
    # the items said, then chatter cut off: 15 words, length (18 - 15) / 9; ending 0
    # gold 0.3 + 0.25 + 0.2 + 0.15 / 3
    (
        "list",
        3,
        "",
        "fruits",
        "Sure! Here are three fruits: apple, banana and cherry. These fruits are all delicious and",
        (1, 1, 1, 1 / 3, 0),
        0.8,
    ),
    # "List 3 birds" answered by one word three times: off the subject and degenerate
    ("list", 3, "", "birds", "1. river\n2. river\n3. river", (0, 0, 0, 1, 0), 0.15),
    # one fruit of three: topic 1/3, instruction 1 * 1/3; ends on "car", not a fruit
    # gold 0.1 + 0.25 / 3 + 0.2 + 0.15
    ("list", 3, "", "fruits", "apple, rock, car", (1 / 3, 1 / 3, 1, 1, 0), 0.45 + 0.25 / 3),
    # an item twice: degenerate (no instruction, no variety); gold 0.25 + 0.15 + 0.1
    ("list", 3, "", "fruits", "apple, apple, banana", (0, 1, 0, 1, 1), 0.5),
    ("list", 3, "", "fruits", "apple, banana", (2 / 3, 1, 1, 2 / 3, 1), 0.3 * 2 / 3 + 0.55 + 0.1),
    ("sentence", 0, "the ocean", "", "   ", (0, 0, 0, 0, 0), 0.0),  # nothing said
]


@pytest.mark.parametrize("kind, n, topic, category, response, parts, value", CASES)
def test_gold_parts(kind, n, topic, category, response, parts, value):
    got = C.gold_parts(kind, response, n, topic, category)
    assert list(got) == list(C.WEIGHTS)
    assert list(got.values()) == pytest.approx(parts, abs=1e-12)
    assert C.weighted(got) == pytest.approx(value, abs=1e-12)


def test_a_reader_prefers_good_then_on_topic_then_fluent_then_a_loop():
    """A good answer beats the same answer cut off, which beats rambling on the topic, which
    beats a fluent answer about something else, which beats one word said over and over."""

    def gold(response):
        return C.gold_parts("sentence", response, 0, "the ocean")

    order = [
        GOOD,
        "The ocean is a vast body of salt water that covers most of",
        RAMBLING,
        "The mountains are tall and covered in snow.",
        "ocean ocean ocean ocean ocean",
    ]
    scores = [C.weighted(gold(r)) for r in order]
    assert scores == sorted(scores, reverse=True) and len(set(scores)) == len(scores)


def test_gold_reads_the_columns():
    scores = C.gold(
        ["p", "q"],
        ["Cats love to nap in the sun.", "apple, rock, car"],
        kind=["short", "list"],
        n=[8, "3"],  # a count read from a file may be text
        topic=["cats", ""],
        category=["", "fruits"],
        other=["ignored", "ignored"],
    )
    assert scores == pytest.approx([1.0, 0.45 + 0.25 / 3], abs=1e-12)


@pytest.mark.parametrize(
    "kind, n, topic, category, message",
    [
        ("poem", 0, "cats", "", "unknown request kind 'poem'"),
        ("list", 0, "", "fruits", r"'list' request needs its count n >= 1"),
        ("short", 0, "cats", "", r"'short' request needs its count n >= 1"),
        ("list", 3, "", "rocks", r"category of instructions.MEMBERS .* got 'rocks'"),
        ("sentence", 0, " ", "", r"'sentence' request needs its topic"),
    ],
)
def test_bad_rows_are_named(kind, n, topic, category, message):
    with pytest.raises(ValueError, match=message):
        C.gold_parts(kind, "some answer.", n, topic, category)


@pytest.mark.parametrize(
    "text, items, ends",
    [
        ("apple, banana and cherry", ["apple", "banana", "cherry"], True),
        ("Fruits: apple, pear.", ["Fruits", "pear"], True),  # 1 word before the colon: no heading
        ("Here are some fruits: apple, pear", ["apple", "pear"], True),
        # the items' heads; the last line ends on "purple", not a fruit (nor a full stop)
        ("1. Apple (red)\n2. Pear: green\n3. Plum \u2013 purple", ["Apple", "Pear", "Plum"], False),
        ("apple, pear, and then some more words", ["apple", "pear", "then some more words"], False),
    ],
)
def test_answer_items(text, items, ends):
    assert C.answer_items(text) == items
    assert C.ends_on_item(text, "fruits") is ends


def test_sentences_and_length():
    assert C.sentences("It is 3.5 km long. Is it? Yes!") == 3  # no end inside 3.5
    assert C.sentences('He said "go." Then he left') == 2  # the unfinished one counts
    assert C.sentences("...") == 0
    # 3 words below a band of 6: 3/6; above 25: (40 - 30) / (40 - 25) at 30, 0 at 40 (2 * 25
    # = 50 comes later)
    assert [C.length_part(c, 6, 25) for c in (0, 3, 6, 25, 30, 40, 60)] == pytest.approx(
        [0, 0.5, 1, 1, 2 / 3, 0, 0]
    )
    assert C.length_part(12, 3, 9) == pytest.approx(2 / 3)  # 0 at 2 * 9 = 18


def test_splits_hold_topics_and_categories_out():
    s = C.make_splits(40, 20, seed=3)
    assert len(s["train"]) == 40 and len(s["eval"]) == 20
    for rows in s.values():  # every kind equally often
        kinds = [r["kind"] for r in rows]
        assert {kinds.count(k) for k in C.KINDS} == {len(rows) // len(C.KINDS)}
    for key in ("topic", "category"):
        held = {r[key] for r in s["eval"]} - {""}
        assert held and not held & {r[key] for r in s["train"]}
    row = next(r for r in s["train"] if r["kind"] == "list")
    assert row["prompt"][0]["content"] == f"List {row['n']} {row['category']}."
    assert 3 <= row["n"] <= 5 and row["category"] in instructions.MEMBERS
    assert C.make_splits(40, 20, seed=3) == s and C.make_splits(40, 20, seed=4) != s
    # every row scores: the gold reads each one's columns
    rows = s["train"] + s["eval"]
    columns = {k: [r[k] for r in rows] for k in ("kind", "n", "topic", "category")}
    assert len(C.gold([""] * len(rows), ["A short answer."] * len(rows), **columns)) == 60


def test_prepare_writes_the_prompts_and_names_the_gold(tmp_path):
    cfg = Config().replace({"task.n_train": 8, "task.n_eval": 4, "model.actor_path": "MODEL"})
    out, info = C.prepare(cfg, tmp_path / "task")
    assert out.pipeline.gold == C.GOLD_FN and out.model.actor_path == "MODEL"
    rows = [json.loads(line) for line in open(out.pipeline.prompts)]
    held = [json.loads(line) for line in open(out.pipeline.heldout)]
    assert len(rows) == 8 and len(held) == 4
    assert rows == C.make_splits(8, 4, cfg.trainer.seed)["train"]
    assert info["name"] == "chat" and info["model"] == "MODEL"


def test_prepare_without_a_model_names_the_missing_wheel(tmp_path, monkeypatch):
    monkeypatch.setattr(instructions, "SMOLLM_PACKAGE", "no_such_package_here")
    with pytest.raises(ConfigError, match=r"`pipeline.task=chat` without `model.actor_path`"):
        C.prepare(Config(), tmp_path / "task")
