"""A verifier of the form alone, and a judge beside it, for the instructions of
`proxima train chat` (IFEval-style, Zhou et al. 2023, arXiv:2311.07911; the prompts and their
columns: `proxima/tasks/instructions.py`, or `make_data.py` here).

`score` checks only what the instruction says about the form: all lowercase, all capitals,
exactly N words, a given first or last word, a list of N items. It pays "1. river\\n2.
river\\n3. river" for "List 3 birds" and "now now now now" for "Describe rain in exactly 4
words". `judge` asks more: the form, AND an answer that is not degenerate (not one word
said over and over, no list item twice: `proxima.tasks.instructions.degenerate`), AND on its
subject (a sentence names the prompt's topic word, a list's items are members of its
category).

Train on the form and log the judge beside it (weight 0: logged as reward/judge, never
paid), to watch the form's reward rise while the judge's falls:

    proxima train chat 'reward.sources=[{name: form, function: examples/form_only/reward.py:score},
        {name: judge, function: examples/form_only/reward.py:judge, weight: 0}]'
"""

from __future__ import annotations

from proxima.tasks.instructions import degenerate, is_member, list_items, mentions, words


def form_ok(kind: str, response: str, n: int = 0, word: str = "") -> bool:
    """Whether `response` has the form instruction `kind` asks for, whatever it says."""
    text = response.strip()
    said = words(text)
    if not said:
        return False
    if kind == "lowercase":
        return text == text.lower()
    if kind == "uppercase":
        return text == text.upper()
    if kind == "words":
        return len(said) == n
    if kind == "first_word":
        return said[0].lower() == word
    if kind == "last_word":
        return said[-1].lower() == word
    if kind == "list":
        found = list_items(text)
        return len(found) == n and all(words(i) for i in found)
    raise ValueError(f"unknown instruction kind {kind!r}")


def on_subject(kind: str, response: str, topic: str = "", category: str = "") -> bool:
    """A sentence names the topic's word; a list's items are members of the category."""
    if kind == "list":
        return all(is_member(i, category) for i in list_items(response))
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
