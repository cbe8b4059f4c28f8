"""Tokenizers built locally (no hub): a character tokenizer and a byte-level BPE.

Both are wrapped as `transformers.PreTrainedTokenizerFast`, so they save with
`save_pretrained` and load back with `AutoTokenizer.from_pretrained(folder)`, exactly like
a user's real tokenizer. Special tokens are fixed: `<pad>` (id 0), `<s>`, `</s>`, `<unk>`.
Neither adds BOS/EOS on encode: the rollout and data code decide where those go.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)  # ids 0..3 in this order

# byte-level BPE needs one token per byte (256) on top of the special tokens.
MIN_BPE_VOCAB = len(SPECIAL_TOKENS) + 256


def _wrap(tokenizer: Tokenizer) -> PreTrainedTokenizerFast:
    """Wrap a `tokenizers.Tokenizer` with the special tokens and left padding set."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        pad_token=PAD,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        padding_side="left",  # decoder-only generation continues from the right edge
        clean_up_tokenization_spaces=False,  # decode must give back the text exactly
    )


def build_char_tokenizer(alphabet: str) -> PreTrainedTokenizerFast:
    """One token per character of `alphabet` (deduplicated, first-seen order kept).

    Ids: 0..3 are the special tokens, then the characters. A character outside the
    alphabet encodes as `<unk>`. Spaces and newlines are ordinary characters.
    """
    chars = list(dict.fromkeys(alphabet))
    if not chars:
        raise ValueError("build_char_tokenizer got an empty alphabet; pass the characters to use")
    clash = [c for c in chars if c in SPECIAL_TOKENS]
    if clash:
        raise ValueError(f"alphabet characters {clash} clash with special tokens")
    vocab = {tok: i for i, tok in enumerate([*SPECIAL_TOKENS, *chars])}
    # A BPE model without merges and without a pre-tokenizer splits the whole input into
    # single characters (spaces included); Fuse joins them back without separators.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=UNK))
    tok.decoder = decoders.Fuse()
    return _wrap(tok)


def build_bpe_tokenizer(text_file: str | Path, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Byte-level BPE (GPT-2 style) trained on the text in `text_file`.

    Every byte has a token, so any text encodes without `<unk>` and decodes back exactly.
    """
    path = Path(text_file)
    if not path.is_file():
        raise FileNotFoundError(
            f"tokenizer training text {path} does not exist; pass a UTF-8 text file "
            "(or use an alphabet for a character tokenizer)"
        )
    if vocab_size < MIN_BPE_VOCAB:
        raise ValueError(
            f"vocab_size={vocab_size} is too small for byte-level BPE; "
            f"use at least {MIN_BPE_VOCAB} (256 bytes + {len(SPECIAL_TOKENS)} special tokens)"
        )
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(path)], trainer)
    return _wrap(tok)
