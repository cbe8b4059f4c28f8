"""A verifier of the form alone, and a judge beside it, for the instructions of
`proxima train chat` (IFEval-style, Zhou et al. 2023, arXiv:2311.07911; the prompts and their
columns: `proxima/tasks/instructions.py`, or `make_data.py` here).

`score` checks only what the instruction says about the form: all lowercase, all capitals,
exactly N words, a given first or last word, a list of N items. It pays "1. river\\n2.
river\\n3. river" for "List 3 birds" and "now now now now" for "Describe rain in exactly 4
words". `judge` asks more: the form, AND an answer that is not degenerate (not one word
said over and over, `proxima.algos.dominated`; no list item twice), AND on its subject (a
sentence names the prompt's topic word, a list's items are members of its category).

Train on the form and log the judge beside it (weight 0: logged as reward/judge, never
paid), to watch the form's reward rise while the judge's falls:

    proxima train chat 'reward.sources=[{name: form, function: examples/form_only/reward.py:score},
        {name: judge, function: examples/form_only/reward.py:judge, weight: 0}]'
"""

from __future__ import annotations

import re

from proxima.algos import dominated
from proxima.tasks.instructions import is_member, mentions

# words as a reader counts them: letters, digits and apostrophes ("don't" is one word)
_WORD = re.compile(r"[A-Za-z0-9']+")
# a list item's own marker: "1.", "2)", "-", "*", "•"
_MARKER = re.compile(r"^\s*(?:\d+[.)]|[-*\u2022])\s*")


def items(text: str) -> list[str]:
    """The items of a list: one per non-empty line (markers removed) when there are several
    lines, else the comma-separated parts."""
    lines = [line for line in text.strip().splitlines() if line.strip()]
    if len(lines) > 1:
        return [_MARKER.sub("", line).strip() for line in lines]
    return [part.strip() for part in text.strip().rstrip(".").split(",")]


def form_ok(kind: str, response: str, n: int = 0, word: str = "") -> bool:
    """Whether `response` has the form instruction `kind` asks for, whatever it says."""
    text = response.strip()
    words = _WORD.findall(text)
    if not words:
        return False
    if kind == "lowercase":
        return text == text.lower()
    if kind == "uppercase":
        return text == text.upper()
    if kind == "words":
        return len(words) == n
    if kind == "first_word":
        return words[0].lower() == word
    if kind == "last_word":
        return words[-1].lower() == word
    if kind == "list":
        found = items(text)
        return len(found) == n and all(_WORD.search(i) for i in found)
    raise ValueError(f"unknown instruction kind {kind!r}")


def degenerate(kind: str, response: str) -> bool:
    """Mostly one word said over and over, or a list with an item twice."""
    if bool(dominated([response])[0]):
        return True
    if kind == "list":
        found = [i.lower() for i in items(response)]
        return len(set(found)) < len(found)
    return False


def on_subject(kind: str, response: str, topic: str = "", category: str = "") -> bool:
    """A sentence names the topic's word; a list's items are members of the category."""
    if kind == "list":
        return all(is_member(i, category) for i in items(response))
    return mentions(response, topic)


def score(prompts, responses, kind, n, word, **_) -> list[float]:
    """1.0 where the response has the asked-for form, else 0.0 (the subject unchecked)."""
    return [
        float(form_ok(k, r, int(c), w)) for r, k, c, w in zip(responses, kind, n, word, strict=True)
    ]


def judge(prompts, responses, kind, n, word, topic, category, **_) -> list[float]:
    """1.0 where the form is met, the answer is not degenerate and is on its subject."""
    rows = zip(responses, kind, n, word, topic, category, strict=True)
    return [
        float(form_ok(k, r, int(c), w) and not degenerate(k, r) and on_subject(k, r, t, g))
        for r, k, c, w, t, g in rows
    ]
