"""The chat preference task of `proxima pipeline` (`pipeline.task=chat`): everyday requests
to a real chat model, and a gold scorer that judges what a reader would prefer of an answer.

**Prompts** (`make_splits`): four kinds of short request about the topics and list
categories of `proxima train chat` (`proxima/tasks/instructions.py`), each something a
135M-parameter chat model does in part:

- `sentence`: "Describe {topic} in one sentence."
- `two`: "Explain {topic} to a child in two sentences."
- `short`: "Write a short sentence about {topic}, at most {n} words." (n from 6 to 10)
- `list`: "List {n} {category}." (n from 3 to 5)

The held-out prompts name topics and categories the training prompts never do (a quarter of
each, drawn by seed, `instructions.topic_pools`).

**The gold** (`gold_parts`, `gold`): the weighted sum of five parts (`WEIGHTS`), each in
[0, 1], so the gold is in [0, 1]:

- `instruction` (0.30): the request's form. The sentences asked (1, or 2 for `two`):
  1 - |sentences - asked| / 2, at least 0; `short` also at most n words: times
  1 - (words - n) / n beyond n, at least 0; `list`: n items, 1 - |items - n| / n, at least 0.
  Times the `topic` part (a form met about something else is not what was asked), and 0 for
  a degenerate answer (`instructions.degenerate`: one word over and over, a list item twice).
- `topic` (0.25): the answer names the topic's word (`instructions.mentions`, 0 or 1); a
  list: the share of its items that are members of the category (`instructions.is_member`).
- `variety` (0.20): 1 - the share of the answer's word pairs that repeat an earlier pair of
  it (seq-rep-2 over words, `algos.drift`); a list: distinct items / items; 0
  for a degenerate answer.
- `length` (0.15): 1 within the kind's band of words (`bands`: `sentence` 6-25, `two`
  10-30, `short` 4-n, `list` n-3n), rising linearly from 0 words up to the band, falling
  linearly above it to 0 at twice its top or at `RAMBLE` = 40 words (about what 48 tokens
  of English hold), whichever comes first.
- `ending` (0.10): the answer ends a sentence (`.`, `!` or `?`, a closing quote or bracket
  after it allowed), or a list's last item is a member of its category: 0 for an answer cut
  off at the token limit or trailing on.

An empty answer scores 0 on every part. The parts pull against each other: more words say
more about the topic and carry more sentences, but cost `length`, risk an answer cut off
(`ending`) and repeated pairs (`variety`); naming the topic again costs `variety`; an exact
count or word limit costs detail. The policy never sees the gold: `proxima pipeline` labels
preference pairs with it and scores the held-out answers with it.

The list items of an answer (`answer_items`): a heading is dropped (a first line that ends
with a colon; on a one-line list, at least HEADING_WORDS words before a colon: "Here are 3
fruits: ..."), the rest split into lines or comma-separated parts
(`instructions.list_items`); an item is a part's head, before a spaced dash, a colon, a
bracket or a sentence end ("Apple - a sweet fruit" -> "Apple"), split at "and" ("banana and
cherry"). A list's words (`length`) leave out the items' markers ("1.", "-").
"""

from __future__ import annotations

import random
import re
from pathlib import Path

import torch

from proxima.algos.drift import ngrams
from proxima.config import Config
from proxima.tasks.common import write_jsonl
from proxima.tasks.instructions import (
    MEMBERS,
    default_model,
    degenerate,
    is_member,
    item_key,
    list_items,
    mentions,
    topic_pools,
    words,
)

GOLD_FN = "proxima.tasks.chat_preferences:gold"
TEMPLATES = {
    "sentence": "Describe {topic} in one sentence.",
    "two": "Explain {topic} to a child in two sentences.",
    "short": "Write a short sentence about {topic}, at most {n} words.",
    "list": "List {n} {category}.",
}
KINDS = tuple(TEMPLATES)
SENTENCES = {"sentence": 1, "two": 2, "short": 1}  # the sentences each kind asks for
WEIGHTS = {"instruction": 0.30, "topic": 0.25, "variety": 0.20, "length": 0.15, "ending": 0.10}
RAMBLE = 40  # words at which `length` is 0 at the latest: about what 48 tokens of English hold
VARIETY_N = 2  # words per repeated pair of `variety`
HEADING_WORDS = 3  # words before a colon that make a heading of a one-line list
_SENTENCE_END = re.compile(r"[.!?]+[\"'\u201d\u2019)\]]*(?:\s+|$)")
_ENDS = re.compile(r"[.!?][\"'\u201d\u2019)\]]*$")
_AND = re.compile(r"\s*\band\b\s*", re.IGNORECASE)
_ITEM_TAIL = re.compile(r"\s+[-\u2013\u2014]\s|[:(\u2013\u2014]|[.!?]\s")


def bands(kind: str, n: int) -> tuple[int, int]:
    """(fewest, most) words of an answer of `kind` that `length` scores 1."""
    return {"sentence": (6, 25), "two": (10, 30), "short": (4, n), "list": (n, 3 * n)}[kind]


def sentences(text: str) -> int:
    """The sentences of `text`: the parts between sentence ends (. ! ? then a space or the
    end) that hold a word; an unfinished last one counts."""
    return sum(1 for part in _SENTENCE_END.split(text) if words(part))


def _parts(text: str) -> list[str]:
    """A list answer's lines or comma-separated parts, its heading dropped."""
    first, _, rest = text.strip().partition("\n")
    if rest and first.rstrip().endswith(":"):  # a heading line
        text = rest
    elif not rest and len(words(first.split(":", 1)[0])) >= HEADING_WORDS and ":" in first:
        text = first.split(":", 1)[1]
    return [p for p in list_items(text) if words(p)]


def _split_and(part: str) -> list[str]:
    return [x.strip().rstrip(".") for x in _AND.split(part) if words(x)]


def answer_items(text: str) -> list[str]:
    """A list answer's items (module docstring): heading dropped, split at lines or commas,
    each part's head, split at "and"."""
    heads = [_ITEM_TAIL.split(p, maxsplit=1)[0] for p in _parts(text)]
    return [x for h in heads for x in _split_and(h)]


def ends_on_item(text: str, category: str) -> bool:
    """Whether a list answer's last words are a member of `category` (nothing trails on)."""
    parts = _parts(text)
    last = _split_and(parts[-1]) if parts else []
    return bool(last) and is_member(last[-1], category)


def list_words(text: str) -> int:
    """The words of a list answer, its items' markers ("1.", "-") not counted."""
    return sum(len(words(p)) for p in list_items(text))


def length_part(count: int, low: int, high: int) -> float:
    """1 for `low` <= count <= `high` words, count / low below, falling linearly above to 0
    at twice `high` or at RAMBLE words, whichever comes first."""
    if count < low:
        return count / low
    if count <= high:
        return 1.0
    zero = min(2 * high, RAMBLE)
    return max(0.0, (zero - count) / (zero - high))


def variety_part(said: list[str]) -> float:
    """1 - the share of word pairs that repeat an earlier pair of the same answer (seq-rep-2
    over words, `algos.drift`): its distinct pairs / its pairs; 1 with fewer than 2 words."""
    ids = {w: i for i, w in enumerate(dict.fromkeys(said))}
    row = torch.tensor([[ids[w] for w in said]])
    _, pairs = ngrams(row, torch.ones_like(row), VARIETY_N)
    return torch.unique(pairs, dim=0).shape[0] / pairs.shape[0] if len(pairs) else 1.0


def _check_row(kind: str, n: int, topic: str, category: str) -> None:
    """A prompt row's columns make sense for its kind (a clear error, not a crash)."""
    if kind not in KINDS:
        raise ValueError(f"unknown request kind {kind!r}; kinds: {', '.join(KINDS)}")
    if kind in ("short", "list") and n < 1:
        raise ValueError(f"a {kind!r} request needs its count n >= 1 (column `n`), got {n}")
    if kind == "list" and category not in MEMBERS:
        raise ValueError(
            f"a 'list' request needs a category of instructions.MEMBERS (column `category`), "
            f"got {category!r}; categories: {', '.join(MEMBERS)}"
        )
    if kind != "list" and not topic.strip():
        raise ValueError(f"a {kind!r} request needs its topic (column `topic`), got none")


def gold_parts(kind: str, response: str, n: int = 0, topic: str = "", category: str = "") -> dict:
    """The five parts of one answer's gold, each in [0, 1] (module docstring)."""
    _check_row(kind, n, topic, category)
    text = response.strip()
    said = [w.lower() for w in words(text)]
    if not said:
        return dict.fromkeys(WEIGHTS, 0.0)
    loop = degenerate(kind, text)
    if kind == "list":
        items = answer_items(text)
        members = [is_member(i, category) for i in items]
        topic_part = sum(members) / len(items) if items else 0.0
        form = max(0.0, 1 - abs(len(items) - n) / n)
        variety = len({item_key(i) for i in items}) / len(items) if items else 0.0
        clean = ends_on_item(text, category)
        count = list_words(text)
    else:
        topic_part = float(mentions(text, topic))
        form = max(0.0, 1 - abs(sentences(text) - SENTENCES[kind]) / 2)
        if kind == "short" and len(said) > n:
            form *= max(0.0, 1 - (len(said) - n) / n)
        variety = variety_part(said)
        clean, count = False, len(said)
    return {
        "instruction": 0.0 if loop else form * topic_part,
        "topic": topic_part,
        "variety": 0.0 if loop else variety,
        "length": length_part(count, *bands(kind, n)),
        "ending": float(clean or bool(_ENDS.search(text))),
    }


def weighted(parts: dict) -> float:
    """The gold of an answer from its parts: their sum weighted by WEIGHTS."""
    return sum(WEIGHTS[k] * parts[k] for k in WEIGHTS)


def gold(prompts, responses, kind, n, topic, category, **_) -> list[float]:
    """The gold score of each response, in [0, 1] (module docstring)."""
    rows = zip(responses, kind, n, topic, category, strict=True)
    return [weighted(gold_parts(k, r, int(c), t, g)) for r, k, c, t, g in rows]


def _row(kind: str, rng: random.Random, topics: list[str], categories: list[str]) -> dict:
    n = {"short": rng.randint(6, 10), "list": rng.randint(3, 5)}.get(kind, 0)
    fields = {"topic": rng.choice(topics), "category": rng.choice(categories), "n": n}
    return {
        "prompt": [{"role": "user", "content": TEMPLATES[kind].format(**fields)}],
        "kind": kind,
        "n": n,
        "topic": fields["topic"] if kind != "list" else "",
        "category": fields["category"] if kind == "list" else "",
    }


def make_splits(n_train: int, n_eval: int, seed: int) -> dict[str, list[dict]]:
    """Training and held-out prompts, each kind equally often; the held-out ones name only
    topics and categories the training ones never do."""
    rng = random.Random(seed)
    pools = topic_pools(rng)
    out = {}
    for name, size in (("eval", n_eval), ("train", n_train)):
        out[name] = [_row(KINDS[i % len(KINDS)], rng, *pools[name]) for i in range(size)]
    return out


def prepare(cfg: Config, folder: Path) -> tuple[Config, dict]:
    """Write the training prompts (task.n_train) and the held-out prompts (task.n_eval) into
    `folder`; returns the config pointed at them and at this task's gold, with
    SmolLM2-135M-Instruct as the policy unless model.actor_path names one (no
    demonstrations: the chat model is the SFT policy), and what was written."""
    t = cfg.task
    folder.mkdir(parents=True, exist_ok=True)
    splits = make_splits(t.n_train, t.n_eval, cfg.trainer.seed)
    paths = {
        "prompts": write_jsonl(folder / "prompts.jsonl", splits["train"]),
        "heldout": write_jsonl(folder / "heldout.jsonl", splits["eval"]),
    }
    model = cfg.model.actor_path or default_model("pipeline.task=chat")
    changes = {f"pipeline.{k}": str(v) for k, v in paths.items()}
    changes.update({"pipeline.gold": GOLD_FN, "model.actor_path": model})
    info = {"name": "chat", "model": model, "files": {k: str(v) for k, v in paths.items()}}
    return cfg.replace(changes), info
