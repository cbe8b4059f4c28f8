"""SFT data: prompt + response + EOS, right padding, labels masked on prompt and padding."""

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from proxima.data.sft import SFTDataset, SFTItem, collate_sft

WORDS = ["<pad>", "<bos>", "<eos>", "<unk>", "user", ":", "hi", "assistant", "a", "b", "c", "d"]
VOCAB = {w: i for i, w in enumerate(WORDS)}  # <pad>=0 <bos>=1 <eos>=2 user=4 a=8 b=9 c=10 d=11


def make_tokenizer(eos="<eos>"):
    core = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token=eos,
        pad_token="<pad>",
        unk_token="<unk>",
    )


def test_items_are_prompt_response_eos():
    records = [
        {"prompt": "a b", "response": "c"},
        {"prompt": [{"role": "user", "content": "hi"}], "response": "d d"},
    ]
    ds = SFTDataset(records, make_tokenizer(), max_length=16)
    assert ds[0] == SFTItem([8, 9, 10, 2], prompt_length=2)
    # no chat template: "user: hi\nassistant: " -> user : hi assistant :
    assert ds[1] == SFTItem([4, 5, 6, 7, 5, 11, 11, 2], prompt_length=5)


def test_collate_right_pads_and_masks_labels_exactly():
    items = [SFTItem([8, 9, 10, 2], 2), SFTItem([8, 11, 2], 1)]
    batch = collate_sft(items, pad_token_id=0)
    assert torch.equal(batch["input_ids"], torch.tensor([[8, 9, 10, 2], [8, 11, 2, 0]]))
    assert torch.equal(batch["attention_mask"], torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]]))
    # Row 0: prompt "a b" (2 tokens) masked, then c, eos. Row 1: prompt "a", then d, eos, pad.
    expected = torch.tensor([[-100, -100, 10, 2], [-100, 11, 2, -100]])
    assert torch.equal(batch["labels"], expected)


def test_custom_keys_and_missing_column_messages():
    ds = SFTDataset([{"q": "a", "a": "b"}], make_tokenizer(), prompt_key="q", response_key="a")
    assert ds[0] == SFTItem([8, 9, 2], 1)
    with pytest.raises(ValueError) as err:
        SFTDataset([{"prompt": "a", "completion": "b"}], make_tokenizer())
    msg = str(err.value)
    assert "'response'" in msg and "['completion', 'prompt']" in msg and "data.response_key" in msg
    with pytest.raises(ValueError, match="data.prompt_key"):
        SFTDataset([{"question": "a", "response": "b"}], make_tokenizer())


def test_overlong_modes():
    records = [{"prompt": "a", "response": "b c d"}]  # 1 + 3 + eos = 5 tokens
    with pytest.raises(ValueError, match=r"example 0 has 5 tokens.*max_length=4"):
        SFTDataset(records, make_tokenizer(), max_length=4)
    cut = SFTDataset(records, make_tokenizer(), max_length=3, overlong="truncate")
    assert cut[0] == SFTItem([8, 9, 10], 1)
    with pytest.raises(ValueError, match="all examples are longer"):
        SFTDataset(records, make_tokenizer(), max_length=3, overlong="drop")
    # A prompt that fills max_length leaves nothing to learn: truncation cannot help.
    with pytest.raises(ValueError, match=r"prompt 1\)"):
        SFTDataset(records, make_tokenizer(), max_length=1, overlong="truncate")


def test_non_string_response_rejected():
    with pytest.raises(ValueError, match="holds a int"):
        SFTDataset([{"prompt": "a", "response": 3}], make_tokenizer())
