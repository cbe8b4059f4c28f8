"""Prompt rendering, tokenization, length limits, left-padded collation and the loader."""

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from proxima.data.prompts import (
    PromptDataset,
    PromptItem,
    PromptLoader,
    collate_prompts,
    observation_text,
    render_prompt,
)

WORDS = ["<pad>", "<bos>", "<eos>", "<unk>", "user", ":", "hi", "assistant", "a", "b", "c", "d"]
VOCAB = {w: i for i, w in enumerate(WORDS)}  # <pad>=0 <bos>=1 <eos>=2 user=4 :=5 hi=6 ...
TEMPLATE = (
    "{% for m in messages %}<bos>{{ m.role }}: {{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def make_tokenizer(chat_template=None):
    """Word-level tokenizer: one id per word/punctuation, split on whitespace."""
    core = Tokenizer(models.WordLevel(vocab=VOCAB, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    tok.chat_template = chat_template
    return tok


CHAT = [{"role": "user", "content": "hi"}]


def test_string_prompt_is_used_as_is():
    assert render_prompt("a b c", make_tokenizer(TEMPLATE)) == "a b c"


def test_chat_prompt_without_template_uses_plain_transcript():
    assert render_prompt(CHAT, make_tokenizer()) == "user: hi\nassistant: "


def test_chat_prompt_with_template():
    assert render_prompt(CHAT, make_tokenizer(TEMPLATE)) == "<bos>user: hi\nassistant:"


def test_malformed_chat_message_names_expected_keys():
    with pytest.raises(ValueError, match="'role' and 'content'"):
        render_prompt([{"role": "user", "text": "hi"}], make_tokenizer())


def test_dataset_items_text_ids_and_columns():
    records = [{"prompt": "a b", "answer": 3, "id": "x"}, {"prompt": CHAT, "answer": 4, "id": "y"}]
    ds = PromptDataset(records, make_tokenizer(), max_prompt_length=10)
    assert len(ds) == 2
    assert ds[0] == PromptItem("a b", [8, 9], {"answer": 3, "id": "x"})
    # "user: hi\nassistant: " -> user : hi assistant :
    want = PromptItem("user: hi\nassistant: ", [4, 5, 6, 7, 5], {"answer": 4, "id": "y"}, CHAT)
    assert ds[1] == want  # the chat messages kept (multi-turn observations render with them)


def test_add_bos_prepends_once():
    tok = make_tokenizer(TEMPLATE)
    plain = PromptDataset([{"prompt": "a"}], tok, add_bos=True)
    assert plain[0].ids == [1, 8]
    # The template already writes <bos>: no second one.
    chat = PromptDataset([{"prompt": CHAT}], tok, add_bos=True)
    assert chat[0].ids == [1, 4, 5, 6, 7, 5]


def test_missing_prompt_column_names_key_columns_and_config():
    with pytest.raises(ValueError) as err:
        PromptDataset([{"question": "a", "answer": 1}], make_tokenizer(), prompt_key="prompt")
    msg = str(err.value)
    assert "'prompt'" in msg and "['answer', 'question']" in msg and "data.prompt_key" in msg


def test_overlong_error_names_index_length_limit_and_fix():
    records = [{"prompt": "a"}, {"prompt": "a b c d"}]
    with pytest.raises(ValueError) as err:
        PromptDataset(records, make_tokenizer(), max_prompt_length=3)
    msg = str(err.value)
    assert "prompt 1 has 4 tokens" in msg and "max_prompt_length=3" in msg
    assert "data.max_prompt_length" in msg and "data.overlong_prompts=drop|truncate" in msg


def test_overlong_drop_and_truncate():
    records = [{"prompt": "a"}, {"prompt": "a b c d"}]
    dropped = PromptDataset(records, make_tokenizer(), max_prompt_length=3, overlong="drop")
    assert [it.ids for it in dropped.items] == [[8]] and dropped.num_dropped == 1
    cut = PromptDataset(records, make_tokenizer(), max_prompt_length=3, overlong="truncate")
    assert cut[1].ids == [9, 10, 11] and cut[1].text == "b c d"  # the last 3 tokens
    with_bos = PromptDataset(
        records, make_tokenizer(), max_prompt_length=3, overlong="truncate", add_bos=True
    )
    assert with_bos[1].ids == [1, 10, 11]  # BOS kept, then the last 2 tokens


def test_empty_dataset_and_bad_overlong_mode():
    with pytest.raises(ValueError, match="empty"):
        PromptDataset([], make_tokenizer())
    with pytest.raises(ValueError, match="data.overlong_prompts"):
        PromptDataset([{"prompt": "a"}], make_tokenizer(), overlong="skip")


def test_collate_left_pads_exactly():
    items = [PromptItem("", [8, 9, 10], {}), PromptItem("", [11], {}), PromptItem("", [4, 5], {})]
    batch = collate_prompts(items, pad_token_id=0)
    # P = 3 (longest); shorter prompts are padded on the left so they all end at column 2.
    assert torch.equal(batch["input_ids"], torch.tensor([[8, 9, 10], [0, 0, 11], [0, 4, 5]]))
    assert torch.equal(batch["attention_mask"], torch.tensor([[1, 1, 1], [0, 0, 1], [0, 1, 1]]))
    assert batch["input_ids"].dtype == torch.long and batch["attention_mask"].dtype == torch.long


def test_collate_without_pad_token_raises():
    with pytest.raises(ValueError, match="pad token"):
        collate_prompts([PromptItem("", [1], {})], pad_token_id=None)


def _take(loader, n):
    return [next(loader) for _ in range(n)]


def test_loader_is_reproducible_and_reshuffles_each_epoch():
    data = list(range(10))  # 10 items, batch 3 -> 3 batches per epoch, 1 item dropped
    a = _take(PromptLoader(data, batch_size=3, seed=7), 9)
    b = _take(PromptLoader(data, batch_size=3, seed=7), 9)
    assert a == b
    epochs = [sum(a[3 * e : 3 * e + 3], []) for e in range(3)]
    for items in epochs:
        assert len(items) == 9 and len(set(items)) == 9 and set(items) <= set(data)
    assert epochs[0] != epochs[1] and epochs[1] != epochs[2]  # a new order each epoch
    assert _take(PromptLoader(data, batch_size=3, seed=8), 3) != a[:3]


def test_loader_without_shuffle_is_sequential():
    loader = PromptLoader(list(range(5)), batch_size=2, seed=0, shuffle=False)
    assert _take(loader, 3) == [[0, 1], [2, 3], [0, 1]]  # item 4 is the dropped tail


@pytest.mark.parametrize("stop", [2, 3, 4])  # mid-epoch, exactly at the boundary, after it
def test_loader_resume_matches_uninterrupted_run(stop):
    data = list(range(10))
    reference = _take(PromptLoader(data, batch_size=3, seed=1), 8)
    first = PromptLoader(data, batch_size=3, seed=1)
    _take(first, stop)
    resumed = PromptLoader(data, batch_size=3, seed=1)
    resumed.load_state_dict(first.state_dict())
    assert _take(resumed, 8 - stop) == reference[stop:]


def test_loader_errors():
    with pytest.raises(ValueError, match=r"2 prompts, fewer than one batch of 4.*data.train_batch"):
        PromptLoader([0, 1], batch_size=4, seed=0)
    with pytest.raises(ValueError, match="data.train_batch_size"):
        PromptLoader([0, 1], batch_size=0, seed=0)
    loader = PromptLoader([0, 1], batch_size=1, seed=0)
    with pytest.raises(ValueError, match="seed 3 but this run uses 0"):
        loader.load_state_dict({"epoch": 0, "position": 1, "seed": 3})


def test_prompt_of_wrong_type_names_the_record():
    with pytest.raises(ValueError, match=r"record 1, column 'prompt': a prompt must be a string"):
        PromptDataset([{"prompt": "a"}, {"prompt": None}], make_tokenizer())


def test_characters_the_tokenizer_lacks_warn_once_with_examples_and_count():
    from proxima.data.prompts import UnknownCharactersWarning
    from proxima.data.records import Records

    records = Records(
        [{"prompt": "a b"}, {"prompt": "a é"}, {"prompt": "c"}, {"prompt": "€ d é"}], "p.jsonl"
    )
    with pytest.warns(UnknownCharactersWarning) as caught:
        ds = PromptDataset(records, make_tokenizer(), max_prompt_length=8)
    assert len(caught) == 1  # one warning for the file, not one per prompt
    message = str(caught[0].message)
    assert message.startswith("p.jsonl: 2 of 4 prompts hold characters the tokenizer has no")
    assert "('é', '€')" in message and "encoded as '<unk>' (id 3)" in message
    assert ds[1].ids == [8, 3]  # still loaded: the warning says what the policy will see


def test_prompts_the_tokenizer_covers_do_not_warn():
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        PromptDataset([{"prompt": "a b"}, {"prompt": CHAT}], make_tokenizer(), max_prompt_length=8)


def test_observation_text():
    """What an observation adds after the model's turn: as it is after a plain prompt; the
    transcript's lines without a template; with a template, what it writes between the
    assistant's message (its end included) and the next assistant turn."""
    assert observation_text(None, "42", "tool", make_tokenizer(TEMPLATE)) == "42"
    assert observation_text(CHAT, "42", "tool", make_tokenizer()) == "\ntool: 42\nassistant: "
    got = observation_text(CHAT, "42", "tool", make_tokenizer(TEMPLATE))
    assert got == "\n<bos>tool: 42\nassistant:"
    ends = "{% for m in messages %}{{ m.role }}: {{ m.content }}<eos>{% endfor %}"
    ends += "{% if add_generation_prompt %}assistant:{% endif %}"
    assert (
        observation_text(CHAT, "42", "tool", make_tokenizer(ends)) == "<eos>tool: 42<eos>assistant:"
    )
    broken = "{{ messages[-1].content }}"  # renders only the last message: no addition
    with pytest.raises(ValueError, match="rollout.env.observation_role"):
        observation_text(CHAT, "42", "tool", make_tokenizer(broken))
