"""Drift metrics on literal token ids, each value worked out by hand in a comment."""

import pytest
import torch

from proxima.algos import (
    distinct_n,
    dominated,
    loglik_per_token,
    ngrams,
    repetition,
    repetition_rate,
    wordless,
)

# row 0: a loop of one token; row 1: all different; row 2: "1 . river \n 2 . river \n 3 .
# river" with 1=1, .=2, river=3, \n=4, 2=5, 3=6; row 3: empty (masked out)
IDS = torch.tensor(
    [
        [7, 7, 7, 7, 7, 0, 0, 0, 0, 0, 0],
        [1, 2, 3, 4, 5, 0, 0, 0, 0, 0, 0],
        [1, 2, 3, 4, 5, 2, 3, 4, 6, 2, 3],
        [9, 9, 9, 9, 9, 9, 9, 9, 9, 9, 9],
    ]
)
MASK = torch.tensor(
    [
        [1] * 5 + [0] * 6,
        [1] * 5 + [0] * 6,
        [1] * 11,
        [0] * 11,
    ]
)


def test_ngrams_stay_inside_the_mask():
    # row 0 has 5 tokens: 3 trigrams; row 1: 3; row 2 (11 tokens): 9; row 3: none
    rows, grams = ngrams(IDS, MASK, 3)
    assert rows.tolist() == [0] * 3 + [1] * 3 + [2] * 9
    assert grams[3].tolist() == [1, 2, 3]
    # a hole in the mask (an observation between two actions) breaks the n-grams there
    rows, grams = ngrams(torch.tensor([[1, 2, 3, 4, 5]]), torch.tensor([[1, 1, 0, 1, 1]]), 2)
    assert grams.tolist() == [[1, 2], [4, 5]]


def test_repetition_rate_by_hand():
    rate = repetition_rate(IDS, MASK, 3)
    # row 0: trigrams (7,7,7) x 3, 1 unique: 2 of 3 repeat an earlier one -> 2/3
    # row 1: (1,2,3) (2,3,4) (3,4,5), all new -> 0
    # row 2: (1,2,3) (2,3,4) (3,4,5) (4,5,2) (5,2,3) (2,3,4)* (3,4,6) (4,6,2) (6,2,3):
    #        one of 9 repeats -> 1/9
    # row 3: no trigram -> 0
    assert rate.tolist() == pytest.approx([2 / 3, 0.0, 1 / 9, 0.0])
    # the batch mean leaves out row 3 (it has no trigram): (2/3 + 0 + 1/9) / 3
    assert float(repetition(IDS, MASK, 3)) == pytest.approx((2 / 3 + 1 / 9) / 3)
    # bigrams of row 2: (1,2) (2,3) (3,4) (4,5) (5,2) (2,3)* (3,4)* (4,6) (6,2) (2,3)*: 3/10
    assert float(repetition_rate(IDS, MASK, 2)[2]) == pytest.approx(3 / 10)


def test_repetition_of_an_empty_batch_is_zero():
    empty = torch.zeros_like(MASK)
    assert repetition_rate(IDS, empty).tolist() == [0.0] * 4
    assert float(repetition(IDS, empty)) == 0.0
    short = torch.tensor([[1, 1, 0]])  # two tokens: no trigram
    assert float(repetition(torch.tensor([[5, 5, 5]]), short)) == 0.0


def test_distinct_over_the_batch_by_hand():
    # unigrams: row 0 {7} x5, row 1 {1..5}, row 2 {1,2,3,4,5,6} x11: 21 in all;
    # unique over the batch {7,1,2,3,4,5,6} = 7 -> 7/21
    assert float(distinct_n(IDS, MASK, 1)) == pytest.approx(7 / 21)
    # bigrams: row 0 (7,7) x4; row 1 (1,2) (2,3) (3,4) (4,5); row 2 the 10 above:
    # 18 in all; unique: (7,7), (1,2) (2,3) (3,4) (4,5), (5,2) (4,6) (6,2) = 8 -> 8/18
    assert float(distinct_n(IDS, MASK, 2)) == pytest.approx(8 / 18)
    assert float(distinct_n(IDS, torch.zeros_like(MASK), 2)) == 0.0


def test_dominated_by_one_word():
    texts = [
        "1. river\n2. river\n3. river",  # river 3 of 3 words
        "now now now now now",  # 5 of 5
        "the river runs to the sea",  # "the" 2 of 6: fewer than 3
        "1. apple\n2. pear\n3. plum",  # 1 of 3
        "river river",  # 2 of 2: said fewer than 3 times
        "",  # no word
        "the cat and the dog and the bird",  # "the" 3 of 8 < half
    ]
    assert dominated(texts).tolist() == [True, True, False, False, False, False, False]


def test_wordless_answers():
    texts = ["", " ", "1. 2. 3.", "...", "<|im_end|>", "a", "42 apples", "\n\n"]
    # "<|im_end|>" has letters: a special token decoded is not an empty answer's text
    assert wordless(texts).tolist() == [True, True, True, True, False, False, False, True]


def test_reference_loglik_per_token_by_hand():
    lp = torch.tensor([[-1.0, -2.0, float("nan")], [-4.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # (-1 - 2 - 4) / 3 tokens; the NaN is masked out
    assert float(loglik_per_token(lp, mask)) == pytest.approx(-7 / 3)
    assert float(loglik_per_token(lp, torch.zeros_like(mask))) == 0.0
