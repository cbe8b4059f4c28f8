"""examples/form_only/reward.py: the form-only verifier pays degenerate answers that have the
form; the judge beside it does not. Literal answers, each verdict said in a comment."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxima.plugins import load

FILE = Path(__file__).parents[1] / "examples" / "form_only" / "reward.py"
score = load(f"{FILE}:score", "test")
judge = load(f"{FILE}:judge", "test")

# (kind, n, word, topic, category, response, form?, judge?)
CASES = [
    # a list of 3 items, each "river": the form holds, the answer is degenerate
    ("list", 3, "", "", "birds", "1. river\n2. river\n3. river", 1.0, 0.0),
    ("list", 3, "", "", "birds", "1. robin\n2. eagle\n3. owl", 1.0, 1.0),
    ("list", 3, "", "", "birds", "robin, eagle, owl", 1.0, 1.0),
    ("list", 3, "", "", "birds", "apple, cabbage, rock", 1.0, 0.0),  # off the subject
    ("list", 3, "", "", "birds", "robin, eagle", 0.0, 0.0),  # two items
    ("list", 3, "", "", "birds", "robin, robin, owl", 1.0, 0.0),  # an item twice
    # exactly 4 words: one word four times has the form, not the subject nor variety
    ("words", 4, "", "rain", "", "now now now now", 1.0, 0.0),
    ("words", 4, "", "rain", "", "rain falls softly tonight", 1.0, 1.0),
    ("words", 4, "", "rain", "", "rain rain rain rain", 1.0, 0.0),  # on it, degenerate
    ("words", 4, "", "rain", "", "rain falls tonight", 0.0, 0.0),  # three words
    ("lowercase", 0, "", "the ocean", "", "the ocean is wide and deep", 1.0, 1.0),
    ("lowercase", 0, "", "the ocean", "", "a quiet sky is wide", 1.0, 0.0),  # no "ocean"
    ("lowercase", 0, "", "the ocean", "", "The ocean is wide", 0.0, 0.0),  # a capital
    ("last_word", 0, "now", "cats", "", "cats sleep all day now", 1.0, 1.0),
    ("last_word", 0, "now", "cats", "", "now now now now now", 1.0, 0.0),
    ("uppercase", 0, "", "trains", "", "TRAINS ARE FAST", 1.0, 1.0),
    ("first_word", 0, "yes", "tea", "", "yes, tea is warm", 1.0, 1.0),
    ("first_word", 0, "yes", "tea", "", "", 0.0, 0.0),  # nothing said
]


@pytest.mark.parametrize("kind, n, word, topic, category, response, form, judged", CASES)
def test_form_against_judge(kind, n, word, topic, category, response, form, judged):
    columns = {"kind": [kind], "n": [n], "word": [word]}
    assert score(["p"], [response], **columns, topic=[topic], category=[category]) == [form]
    assert judge(["p"], [response], **columns, topic=[topic], category=[category]) == [judged]
