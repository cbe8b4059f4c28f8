"""Several prompt sets: names from files, mixing weights, the make-up of each batch (exact
in expectation, within one prompt every batch), each set's reshuffled epochs, and resume."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from proxima.config.sections import set_names
from proxima.data import PromptLoader
from proxima.data.mixing import (
    MixedPromptLoader,
    all_items,
    batch_counts,
    mixing_weights,
    prompt_loader,
    tag_records,
)


def test_sets_are_named_by_their_files_and_by_folder_where_stems_repeat():
    assert set_names(["data/math.jsonl", "code.parquet"]) == ["math", "code"]
    assert set_names(["math/train.jsonl", "code/train.jsonl"]) == ["math_train", "code_train"]
    with pytest.raises(ValueError, match="share the name 'a_train'"):
        set_names(["x/a/train.jsonl", "y/a/train.jsonl"])


def test_weights_are_normalised_and_default_to_the_sizes():
    assert mixing_weights([3, 1], [10, 10]) == [0.75, 0.25]
    assert mixing_weights([], [30, 10]) == [0.75, 0.25]  # as if the files were one
    assert mixing_weights([0, 2], [5, 5]) == [0.0, 1.0]


def test_batch_counts_take_whole_parts_and_draw_the_rest_on_the_fractions():
    # 16 x (0.7, 0.3) = 11.2 / 4.8: 11 and 4, the last slot to set 0 with probability 0.2
    gen = torch.Generator().manual_seed(5)
    u = float(torch.rand((), generator=torch.Generator().manual_seed(5), dtype=torch.float64))
    counts = batch_counts([0.7, 0.3], 16, gen)
    assert counts == ([12, 4] if u < 0.2 else [11, 5])
    assert batch_counts([0.5, 0.25, 0.25], 8, gen) == [4, 2, 2]  # whole: nothing drawn
    assert batch_counts([1.0, 0.0], 4, gen) == [4, 0]


def test_batch_counts_are_exact_in_expectation_and_within_one_of_it():
    gen = torch.Generator().manual_seed(0)
    shares, size, draws = [0.55, 0.3, 0.15], 6, 20_000  # expected 3.3, 1.8, 0.9
    rows = [batch_counts(shares, size, gen) for _ in range(draws)]
    assert all(sum(r) == size for r in rows)
    for i, s in enumerate(shares):
        got = [r[i] for r in rows]
        assert set(got) <= {int(s * size), int(s * size) + 1}
        assert abs(sum(got) / draws - s * size) < 0.02  # 4 standard errors: ~0.005 each


def _sets():
    return {"a": [f"a{i}" for i in range(5)], "b": [f"b{i}" for i in range(3)]}


def test_mixed_batches_follow_the_weights_and_each_set_cycles_through_its_items():
    loader = MixedPromptLoader(_sets(), [3, 1], batch_size=4, seed=7)
    assert loader.expected_counts() == {"a": 3.0, "b": 1.0}
    batches = [next(loader) for _ in range(10)]
    assert all(len(b) == 4 for b in batches)
    assert all(sum(x[0] == "a" for x in b) == 3 for b in batches)  # 3 x 1.0: exact each time
    drawn = Counter(x for b in batches for x in b)  # a: 30 = 6 epochs of 5; b: 10 = 3 of 3 + 1
    assert all(drawn[x] == 6 for x in _sets()["a"])
    assert sorted(drawn[x] for x in _sets()["b"]) == [3, 3, 4]
    # one set, a batch per epoch: every batch holds the whole set, in a new order
    one = MixedPromptLoader(_sets(), [1, 0], batch_size=5, seed=7)
    epochs = [next(one) for _ in range(4)]
    assert all(sorted(e) == _sets()["a"] for e in epochs)
    assert len({tuple(e) for e in epochs}) > 1


def test_mixed_batches_are_reproducible_and_resume_exactly():
    a = MixedPromptLoader(_sets(), [0.6, 0.4], batch_size=4, seed=3)
    first = [next(a) for _ in range(4)]
    state = a.state_dict()
    rest = [next(a) for _ in range(6)]
    b = MixedPromptLoader(_sets(), [0.6, 0.4], batch_size=4, seed=3)
    assert [next(b) for _ in range(4)] == first
    c = MixedPromptLoader(_sets(), [0.6, 0.4], batch_size=4, seed=3)
    c.load_state_dict(state)
    assert [next(c) for _ in range(6)] == rest
    other = MixedPromptLoader(_sets(), [0.6, 0.4], batch_size=4, seed=4)
    assert [next(other) for _ in range(4)] != first
    with pytest.raises(ValueError, match="same `trainer.seed`"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match=r"no position for the prompt set\(s\) \['c'\]"):
        MixedPromptLoader({**_sets(), "c": ["c0"]}, [], 4, seed=3).load_state_dict(state)
    with pytest.raises(ValueError, match="single prompt set"):
        c.load_state_dict(PromptLoader(list(range(8)), 4, seed=3).state_dict())


def test_weights_may_change_on_resume():
    a = MixedPromptLoader(_sets(), [1, 1], batch_size=4, seed=0)
    [next(a) for _ in range(3)]
    b = MixedPromptLoader(_sets(), [1, 0], batch_size=4, seed=0)
    b.load_state_dict(a.state_dict())
    assert all(x[0] == "a" for x in next(b))


def test_one_set_keeps_the_single_loader_and_all_items_flattens():
    assert type(prompt_loader(list(range(8)), 4, seed=0)) is PromptLoader
    assert type(prompt_loader(_sets(), 4, seed=0)) is MixedPromptLoader
    assert all_items(_sets()) == [*_sets()["a"], *_sets()["b"]]
    assert all_items([1, 2]) == [1, 2]


def test_records_carry_their_set_and_a_dataset_column_of_their_own_is_refused():
    assert tag_records([{"prompt": "x"}], "math") == [{"prompt": "x", "dataset": "math"}]
    with pytest.raises(ValueError, match="record 1 has a column 'dataset'"):
        tag_records([{"prompt": "x"}, {"prompt": "y", "dataset": "z"}], "math")
