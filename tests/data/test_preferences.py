"""Preference pairs: prompt + chosen/rejected + EOS, right padding to one width, clear errors."""

import math

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from proxima.data.preferences import (
    PreferenceDataset,
    PreferenceItem,
    collate_policy_rows,
    distinct_sequences,
    pad_sequences,
    prompt_groups,
)

WORDS = ["<pad>", "<bos>", "<eos>", "<unk>", "user", ":", "hi", "assistant", "a", "b", "c", "d"]
VOCAB = {w: i for i, w in enumerate(WORDS)}  # <pad>=0 <bos>=1 <eos>=2 user=4 a=8 b=9 c=10 d=11


def _rows(items):
    """Both sides of each pair as (ids, prompt_length): the chosen rows, then the rejected."""
    return [(i.chosen_ids, i.prompt_length) for i in items] + [
        (i.rejected_ids, i.prompt_length) for i in items
    ]


def make_tokenizer():
    core = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>"
    )


def test_items_are_prompt_response_eos_on_both_sides():
    records = [
        {"prompt": "a b", "chosen": "c", "rejected": "d d"},
        {"prompt": [{"role": "user", "content": "hi"}], "chosen": "a", "rejected": "b"},
    ]
    ds = PreferenceDataset(records, make_tokenizer(), max_length=16)
    assert ds[0] == PreferenceItem([8, 9, 10, 2], [8, 9, 11, 11, 2], prompt_length=2)
    # no chat template: "user: hi\nassistant: " -> user : hi assistant : (5 tokens)
    assert ds[1] == PreferenceItem([4, 5, 6, 7, 5, 8, 2], [4, 5, 6, 7, 5, 9, 2], 5)
    assert len(ds) == 2 and ds.num_dropped == 0


def test_a_response_cut_at_the_token_limit_gets_no_eos():
    """`<key>_ended` false: laid out as PPO scores a response that never stopped; the policy
    layout (DPO) then has no EOS among the response tokens either."""
    records = [
        {"prompt": "a", "chosen": "b", "rejected": "c d", "rejected_ended": False},
        {"q": "a", "good": "b", "bad": "c", "good_ended": False, "bad_ended": True},
    ]
    ds = PreferenceDataset(records[:1], make_tokenizer())
    assert ds[0] == PreferenceItem([8, 9, 2], [8, 10, 11], prompt_length=1)
    keys = {"prompt_key": "q", "chosen_key": "good", "rejected_key": "bad"}
    ds = PreferenceDataset(records[1:], make_tokenizer(), **keys)
    assert ds[0] == PreferenceItem([8, 9], [8, 10, 2], prompt_length=1)
    batch = collate_policy_rows(_rows(ds.items), pad_token_id=0)
    assert batch["response_ids"].tolist() == [[9, 0], [10, 2]]
    assert batch["response_mask"].tolist() == [[1, 0], [1, 1]]


def test_pad_sequences_right_pads_to_the_longest():
    ids, mask = pad_sequences([[8, 10, 2], [9, 2], [8, 11, 11, 2]], pad_token_id=0)
    assert torch.equal(ids, torch.tensor([[8, 10, 2, 0], [9, 2, 0, 0], [8, 11, 11, 2]]))
    assert torch.equal(mask, torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]))
    assert ids.dtype == mask.dtype == torch.long
    with pytest.raises(ValueError, match="no pad token"):
        pad_sequences([[8]], pad_token_id=None)


def test_custom_keys_and_margin_column():
    records = [{"q": "a", "good": "b", "bad": "c", "m": 1.5}]
    ds = PreferenceDataset(
        records, make_tokenizer(), prompt_key="q", chosen_key="good", rejected_key="bad"
    )
    assert ds[0] == PreferenceItem([8, 9, 2], [8, 10, 2], 1, margin=0.0)  # margin unused
    ds = PreferenceDataset(
        records,
        make_tokenizer(),
        prompt_key="q",
        chosen_key="good",
        rejected_key="bad",
        margin_key="m",
    )
    assert ds[0].margin == 1.5


def test_missing_column_names_the_columns_found_and_the_option():
    with pytest.raises(ValueError) as err:
        PreferenceDataset([{"prompt": "a", "chosen": "b", "loser": "c"}], make_tokenizer())
    msg = str(err.value)
    assert "record 0 has no column 'rejected'" in msg
    assert "['chosen', 'loser', 'prompt']" in msg and "--rejected-key" in msg
    with pytest.raises(ValueError, match="--prompt-key"):
        PreferenceDataset([{"question": "a", "chosen": "b", "rejected": "c"}], make_tokenizer())
    with pytest.raises(ValueError, match=r"no column 'score'.*--margin-key"):
        PreferenceDataset(
            [{"prompt": "a", "chosen": "b", "rejected": "c"}], make_tokenizer(), margin_key="score"
        )


def test_overlong_pairs_error_with_index_and_length_or_are_dropped():
    records = [
        {"prompt": "a", "chosen": "b", "rejected": "c"},  # 3 tokens each side
        {"prompt": "a", "chosen": "b", "rejected": "c d d"},  # rejected: 1 + 3 + eos = 5
    ]
    with pytest.raises(ValueError) as err:
        PreferenceDataset(records, make_tokenizer(), max_length=4)
    msg = str(err.value)
    assert "pair 1 has 5 tokens" in msg and "max_length=4" in msg and "--max-length" in msg
    kept = PreferenceDataset(records, make_tokenizer(), max_length=4, overlong="drop")
    assert len(kept) == 1 and kept.num_dropped == 1 and kept[0].rejected_ids == [8, 10, 2]
    with pytest.raises(ValueError, match="all 2 pairs are longer than max_length=2"):
        PreferenceDataset(records, make_tokenizer(), max_length=2, overlong="drop")
    with pytest.raises(ValueError, match="overlong='truncate' is not one of"):
        PreferenceDataset(records, make_tokenizer(), overlong="truncate")


@pytest.mark.parametrize(
    ("record", "match"),
    [
        ({"prompt": "a", "chosen": 3, "rejected": "c"}, r"'chosen' holds a int.*--chosen-key"),
        ({"prompt": 5, "chosen": "b", "rejected": "c"}, r"record 0, column 'prompt'"),
        ({"prompt": "a", "chosen": "b", "rejected": "c", "m": "x"}, r"'m' holds 'x'"),
        ({"prompt": "a", "chosen": "b", "rejected": "c", "m": math.nan}, r"'m' holds nan"),
        (
            {"prompt": "a", "chosen": "b", "rejected": "c", "chosen_ended": "no"},
            r"record 0: column 'chosen_ended' holds 'no', expected true",
        ),
    ],
)
def test_bad_values_are_named(record, match):
    with pytest.raises(ValueError, match=match):
        PreferenceDataset([record], make_tokenizer(), margin_key="m" if "m" in record else None)


def test_empty_dataset_rejected():
    with pytest.raises(ValueError, match="preference dataset is empty"):
        PreferenceDataset([], make_tokenizer())


def test_pairs_with_chosen_equal_to_rejected_warn_with_count_and_first_index():
    from proxima.data.preferences import IdenticalPairWarning
    from proxima.data.records import Records

    records = Records(
        [
            {"prompt": "a", "chosen": "b", "rejected": "c"},
            {"prompt": "a", "chosen": "d", "rejected": "d"},
            {"prompt": "b", "chosen": "c", "rejected": "d"},
            {"prompt": "b", "chosen": "c", "rejected": "c"},
        ],
        "pairs.jsonl",
    )
    with pytest.warns(IdenticalPairWarning) as caught:
        ds = PreferenceDataset(records, make_tokenizer(), max_length=16)
    assert len(caught) == 1 and len(ds) == 4
    assert str(caught[0].message).startswith(
        "pairs.jsonl: 2 of 4 pairs have the same 'chosen' and 'rejected' response (the first: "
        "record 1); they teach the reward model nothing"
    )


def test_policy_layout_left_pads_prompts_and_right_pads_responses():
    # pair 0: prompt [8, 9] (2 ids), chosen [10, eos], rejected [11, 11, eos];
    # pair 1: prompt [4] (1 id), chosen [8, eos], rejected [eos] (an empty response).
    items = [
        PreferenceItem([8, 9, 10, 2], [8, 9, 11, 11, 2], prompt_length=2),
        PreferenceItem([4, 8, 2], [4, 2], prompt_length=1),
    ]
    batch = collate_policy_rows(_rows(items), pad_token_id=0)
    # P = 2, R = 3; rows: chosen 0, chosen 1, rejected 0, rejected 1
    assert batch["input_ids"].tolist() == [
        [8, 9, 10, 2, 0],
        [0, 4, 8, 2, 0],
        [8, 9, 11, 11, 2],
        [0, 4, 2, 0, 0],
    ]
    assert batch["attention_mask"].tolist() == [
        [1, 1, 1, 1, 0],
        [0, 1, 1, 1, 0],
        [1, 1, 1, 1, 1],
        [0, 1, 1, 0, 0],
    ]
    assert batch["response_ids"].tolist() == [[10, 2, 0], [8, 2, 0], [11, 11, 2], [2, 0, 0]]
    assert batch["response_mask"].tolist() == [[1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 0, 0]]


def test_policy_layout_of_a_dataset_keeps_the_sft_token_layout():
    # The response ids (EOS included) are what an SFT example of the same record trains on.
    records = [{"prompt": "a b", "chosen": "c", "rejected": "d d"}]
    ds = PreferenceDataset(records, make_tokenizer(), max_length=16)
    batch = collate_policy_rows(_rows(ds.items), pad_token_id=0)
    assert batch["response_ids"].tolist() == [[10, 2, 0], [11, 11, 2]]
    assert batch["input_ids"][:, :2].tolist() == [[8, 9], [8, 9]]


def test_policy_layout_needs_a_pad_token():
    with pytest.raises(ValueError, match="no pad token"):
        collate_policy_rows([([8, 2], 1)], pad_token_id=None)


def test_distinct_sequences_and_prompt_groups():
    a, b, c, d = [5, 1], [5, 2], [5, 3], [6, 1]
    items = [PreferenceItem(a, b, 1), PreferenceItem(a, c, 1), PreferenceItem(c, b, 1)]
    items.append(PreferenceItem(d, a, 1))
    seqs, chosen, rejected = distinct_sequences(items)
    assert seqs == [(a, 1), (b, 1), (c, 1), (d, 1)]  # in order of first appearance
    assert chosen.tolist() == [0, 0, 2, 3] and rejected.tolist() == [1, 2, 1, 0]
    groups = prompt_groups(items)  # by the prompt's ids: [5] and [6]
    assert [len(g) for g in groups] == [3, 1] and groups[1][0] is items[3]
