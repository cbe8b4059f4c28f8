"""Locally built tokenizers: exact ids, exact round trips, save/load through AutoTokenizer."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from proxima.models import build_bpe_tokenizer, build_char_tokenizer, load_tokenizer

ALPHABET = "0123456789+="


def test_char_tokenizer_exact_ids_and_no_added_specials():
    tok = build_char_tokenizer(ALPHABET)
    # ids 0..3 = <pad> <s> </s> <unk>; then '0'->4 ... '9'->13, '+'->14, '='->15
    expected = [5, 6, 14, 7, 8, 15]  # "1" "2" "+" "3" "4" "="
    assert tok("12+34=")["input_ids"] == expected
    assert tok("12+34=", add_special_tokens=True)["input_ids"] == expected  # no BOS/EOS added
    assert tok.decode(expected, skip_special_tokens=True) == "12+34="
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert len(tok) == 4 + len(ALPHABET)
    assert tok.padding_side == "left"


def test_char_tokenizer_spaces_newlines_dedup_and_unknown():
    tok = build_char_tokenizer("ab a\n")  # deduplicated in order: 'a' 'b' ' ' '\n'
    assert len(tok) == 4 + 4
    ids = tok("a b\na")["input_ids"]
    assert ids == [4, 6, 5, 7, 4]  # a=4, b=5, ' '=6, '\n'=7
    assert tok.decode(ids) == "a b\na"
    assert tok("az")["input_ids"] == [4, 3]  # 'z' is outside the alphabet -> <unk> (id 3)
    # special tokens are skipped on request, and nothing else changes
    assert tok.decode([1, 4, 6, 5, 2, 0], skip_special_tokens=True) == "a b"


def test_char_tokenizer_pads_left():
    tok = build_char_tokenizer(ALPHABET)
    batch = tok(["1", "123"], padding=True)
    assert batch["input_ids"] == [[0, 0, 5], [5, 6, 7]]
    assert batch["attention_mask"] == [[0, 0, 1], [1, 1, 1]]


def test_char_tokenizer_rejects_empty_alphabet():
    with pytest.raises(ValueError, match="empty alphabet"):
        build_char_tokenizer("")


@pytest.mark.parametrize("loader", [AutoTokenizer.from_pretrained, load_tokenizer])
def test_char_tokenizer_save_load_round_trip(tmp_path, loader):
    tok = build_char_tokenizer(ALPHABET + " ")
    tok.save_pretrained(tmp_path)
    back = loader(str(tmp_path))
    text = "12 + 34 = 46"
    assert back(text)["input_ids"] == tok(text)["input_ids"]
    assert back.decode(back(text)["input_ids"]) == text
    assert back.padding_side == "left"
    assert (back.pad_token, back.bos_token, back.eos_token, back.unk_token) == (
        "<pad>",
        "<s>",
        "</s>",
        "<unk>",
    )
    assert len(back) == len(tok)


def _corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("the cat sat on the mat.\nthe dog sat on the log.\n" * 20, encoding="utf-8")
    return path


def test_bpe_tokenizer_round_trip_and_save(tmp_path):
    tok = build_bpe_tokenizer(_corpus(tmp_path), vocab_size=300)
    # 4 specials + 256 bytes are always there; merges fill the rest up to 300 at most
    assert 260 < len(tok) <= 300
    assert [tok.convert_ids_to_tokens(i) for i in range(4)] == ["<pad>", "<s>", "</s>", "<unk>"]
    text = "the cat sat.\n  héllo ✓"  # unseen bytes still encode: byte-level
    ids = tok(text)["input_ids"]
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == text
    # merges learned from the corpus make a frequent word shorter than its characters
    assert len(tok("the")["input_ids"]) < 3
    folder = tmp_path / "tok"
    tok.save_pretrained(folder)
    back = AutoTokenizer.from_pretrained(folder)
    assert back(text)["input_ids"] == ids
    assert back.padding_side == "left"
    assert back.pad_token_id == 0


def test_bpe_tokenizer_errors(tmp_path):
    with pytest.raises(ValueError, match="at least 260"):
        build_bpe_tokenizer(_corpus(tmp_path), vocab_size=100)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        build_bpe_tokenizer(tmp_path / "missing.txt")


def test_load_tokenizer_pad_falls_back_to_eos(tmp_path):
    base = build_char_tokenizer("ab")
    no_pad = PreTrainedTokenizerFast(tokenizer_object=base.backend_tokenizer, eos_token="</s>")
    assert no_pad.pad_token is None
    no_pad.save_pretrained(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert tok.pad_token == "</s>" and tok.pad_token_id == 2
    assert tok.padding_side == "left"


def test_load_tokenizer_missing_folder(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="does not exist.*proxima init-model"):
        load_tokenizer(missing)
