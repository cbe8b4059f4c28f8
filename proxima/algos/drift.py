"""What shows degenerate answers beside the reward: repetition, diversity, the reference's
likelihood. Pure functions on the sampled token ids [B, T] and their ``response_mask`` (and on
decoded texts for `dominated`).

An n-gram is n consecutive positions that are all in the mask, so in a multi-turn episode
no n-gram joins the end of one action to the start of the next across an observation.

- `repetition_rate`: seq-rep-n of Welleck et al. 2019 ("Neural Text Degeneration with
  Unlikelihood Training", arXiv:1908.04319, section 5): per response, the share of its
  n-grams that repeat an earlier n-gram of the same response,
  1 - |unique n-grams| / |n-grams|. n = 3 tokens (`REPETITION_N`): a natural sentence
  seldom says the same three tokens twice, a loop ("now now now") says them at every
  position; bigrams repeat in healthy text ("of the"), and Welleck et al.'s 4-grams over
  100-token continuations miss short loops in answers of a few dozen tokens.
- `distinct_n`: distinct-n of Li et al. 2016 ("A Diversity-Promoting Objective Function for
  Neural Conversation Models", arXiv:1510.03055, section 4.3) over the whole batch: unique
  n-grams / all n-grams. Li et al. divide by the number of tokens; dividing by the number of
  n-grams keeps the value in [0, 1] for every n (1 = no n-gram twice).
- `dominated`: a response most of whose words are one word said at least three times
  ("1. river\\n2. river\\n3. river", "now now now now"): the numbers and punctuation that
  keep a numbered list's token n-grams apart are not words. The most frequent word of
  English text, "the", is about 7% of its words (the Brown corpus, Zipf's law:
  https://en.wikipedia.org/wiki/Zipf%27s_law), so half is far from any sentence.
- `wordless`: a response with no word at all: an end of turn alone, or only numbers and
  punctuation. No reward has to pay for it to spread: a critic-based update whose advantages
  are whitened around a negative mean pays a short failed answer (docs/real-models.md).
- `loglik_per_token`: the reference's mean log-likelihood per sampled token. Its
  expectation under the policy is -(H(pi) + KL(pi || ref)) per token: it falls as the
  policy leaves what the reference would write, even where the entropy rises.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence

import torch

from ._checks import check_same_shape, select

REPETITION_N = 3  # tokens per n-gram of `repetition_rate` (why: the module docstring)
DOMINANT_SHARE = 0.5  # `dominated`: the top word is at least this share of the words ...
DOMINANT_COUNT = 3  # ... and said at least this many times
_WORD = re.compile(r"[^\W\d_]+")  # a run of letters: numbers and punctuation are no words


def ngrams(ids: torch.Tensor, mask: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [M], grams [M, n]): each n-gram of `ids` [B, T] whose n positions are all in
    `mask` [B, T], with the row it belongs to, in row-major order."""
    check_same_shape("ngrams", ids=ids, mask=mask)
    if n < 1:
        raise ValueError(f"ngrams: n must be >= 1, got {n}")
    b, t = ids.shape
    if t < n:
        return ids.new_zeros(0, dtype=torch.long), ids.new_zeros((0, n), dtype=torch.long)
    windows = ids.long().unfold(1, n, 1)  # [B, T - n + 1, n]
    inside = (mask != 0).unfold(1, n, 1).all(-1)  # [B, T - n + 1]
    rows = torch.arange(b, device=ids.device).unsqueeze(1).expand_as(inside)
    return rows[inside], windows[inside]


def repetition_rate(ids: torch.Tensor, mask: torch.Tensor, n: int = REPETITION_N) -> torch.Tensor:
    """[B] float32: per response, the share of its n-grams that repeat an earlier n-gram of
    the same response (seq-rep-n); 0 for a response with no n-gram (fewer than n tokens)."""
    rows, grams = ngrams(ids, mask, n)
    b = ids.shape[0]
    total = torch.bincount(rows, minlength=b)
    keyed = torch.cat([rows.unsqueeze(1), grams], dim=1)  # unique per response, not batch
    unique_rows = torch.unique(keyed, dim=0)[:, 0] if len(rows) else rows
    unique = torch.bincount(unique_rows, minlength=b)
    return ((total - unique).float() / total.clamp(min=1).float()).float()


def repetition(ids: torch.Tensor, mask: torch.Tensor, n: int = REPETITION_N) -> torch.Tensor:
    """0-dim float32: `repetition_rate` averaged over the responses that have an n-gram (a
    response shorter than n tokens cannot repeat one: it is left out, not counted as 0);
    0 when none has."""
    rows, _ = ngrams(ids, mask, n)
    has = torch.bincount(rows, minlength=ids.shape[0]) > 0
    if not bool(has.any()):
        return torch.zeros((), dtype=torch.float32, device=ids.device)
    return repetition_rate(ids, mask, n)[has].mean()


def distinct_n(ids: torch.Tensor, mask: torch.Tensor, n: int) -> torch.Tensor:
    """0-dim float32: distinct-n over the batch, unique n-grams / all n-grams (n-grams taken
    within each response, counted over all of them); 0 when the batch has none."""
    _, grams = ngrams(ids, mask, n)
    if not len(grams):
        return torch.zeros((), dtype=torch.float32, device=ids.device)
    return torch.tensor(torch.unique(grams, dim=0).shape[0] / grams.shape[0])


def top_word(text: str) -> tuple[int, int]:
    """(count of the most frequent word, number of words) of `text`, words lowercased."""
    words = _WORD.findall(text.lower())
    return (Counter(words).most_common(1)[0][1] if words else 0), len(words)


def dominated(
    texts: Sequence[str], share: float = DOMINANT_SHARE, min_count: int = DOMINANT_COUNT
) -> torch.Tensor:
    """[B] bool: the response's most frequent word is at least `share` of its words and said
    at least `min_count` times."""
    out = []
    for text in texts:
        count, words = top_word(text)
        out.append(count >= min_count and count >= share * words)
    return torch.tensor(out, dtype=torch.bool)


def wordless(texts: Sequence[str]) -> torch.Tensor:
    """[B] bool: the response has no word (no run of letters)."""
    return torch.tensor([_WORD.search(t) is None for t in texts], dtype=torch.bool)


def loglik_per_token(logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """0-dim float32: the mean over the batch's response tokens of `logprobs` [B, T] (a
    reference's log-probs of the sampled tokens), summed per response first, so the ranks'
    rows give one process's value; 0 for an empty mask."""
    check_same_shape("loglik_per_token", logprobs=logprobs, mask=mask)
    per_row = select(logprobs.float(), mask).sum(dim=1)
    return per_row.sum() / (mask != 0).sum().clamp(min=1).float()
