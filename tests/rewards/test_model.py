"""ModelReward: policy ids scored directly with a shared vocabulary, re-tokenized otherwise."""

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from proxima.rewards import ModelReward, RewardError, same_vocabulary

POLICY_VOCAB = {"<pad>": 0, "<bos>": 1, "<eos>": 2, "<unk>": 3, "a": 4, "b": 5, "c": 6}
# The reward model's own vocabulary: different ids, and it prepends <s> to every text.
RM_VOCAB = {"<pad>": 0, "<s>": 1, "c": 2, "b": 3, "a": 4, "<unk>": 5}


def make_tokenizer(vocab, bos):
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    if bos == "<s>":
        core.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", vocab["<s>"])]
        )
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=bos, pad_token="<pad>", unk_token="<unk>"
    )


def fake_reward_model(vocab_size):
    """Embedding whose weight for token id i is i: a sequence scores the sum of its ids."""
    model = torch.nn.Embedding(vocab_size, 1)
    with torch.no_grad():
        model.weight.copy_(torch.arange(vocab_size, dtype=torch.float32).unsqueeze(1))
    return model


CALLS = []


def sum_score(model, input_ids, attention_mask):
    CALLS.append(input_ids.shape[0])
    return (model(input_ids).squeeze(-1) * attention_mask).sum(-1)


def test_same_vocabulary_scores_policy_ids_directly():
    policy = make_tokenizer(POLICY_VOCAB, "<bos>")
    rm_tok = make_tokenizer(POLICY_VOCAB, "<bos>")  # another object, same vocabulary
    source = ModelReward(fake_reward_model(7), rm_tok, policy, sum_score, "cpu", batch_size=8)
    assert source.shares_tokenizer
    seq = torch.tensor([[0, 4, 5, 6], [0, 0, 4, 5]])
    mask = torch.tensor([[0, 1, 1, 1], [0, 0, 1, 1]])
    # Texts are deliberately unrelated: only the ids count. 4+5+6 = 15, 4+5 = 9.
    scores = source(["zz", "zz"], ["zz", "zz"], {}, seq, mask)
    assert scores.tolist() == [15.0, 9.0] and scores.dtype == torch.float32


def test_different_vocabulary_retokenizes_text():
    policy = make_tokenizer(POLICY_VOCAB, "<bos>")
    rm_tok = make_tokenizer(RM_VOCAB, "<s>")
    assert not same_vocabulary(rm_tok, policy)
    source = ModelReward(fake_reward_model(6), rm_tok, policy, sum_score, "cpu", batch_size=8)
    prompts, responses = ["a b", "a"], [" c", " b"]
    ids, mask = source.retokenize(prompts, responses)
    # The layout `proxima rm` trains on: prompt and response tokenized apart, without the
    # tokenizer's own special tokens (its <s> post-processor is not applied), then EOS, which
    # this tokenizer lacks. "a b" + " c" -> a b c = [4, 3, 2]; "a" + " b" -> [4, 3]
    # right-padded with <pad>=0.
    assert torch.equal(ids, torch.tensor([[4, 3, 2], [4, 3, 0]]))
    assert torch.equal(mask, torch.tensor([[1, 1, 1], [1, 1, 0]]))
    policy_seq = torch.tensor([[4, 5, 6], [0, 4, 5]])  # would score 15 and 9 if used
    scores = source(prompts, responses, {}, policy_seq, torch.ones_like(policy_seq))
    assert scores.tolist() == [9.0, 7.0]  # 4+3+2, 4+3


def test_max_length_keeps_the_last_tokens():
    rm_tok = make_tokenizer(RM_VOCAB, "<s>")
    source = ModelReward(fake_reward_model(6), rm_tok, None, sum_score, max_length=2)
    ids, _ = source.retokenize(["a b"], [" c"])
    assert ids.tolist() == [[3, 2]]  # <s> a b c -> last two: b c


def test_scores_in_chunks_of_batch_size():
    policy = make_tokenizer(POLICY_VOCAB, "<bos>")
    source = ModelReward(fake_reward_model(7), policy, policy, sum_score, batch_size=2)
    seq = torch.tensor([[4], [5], [6], [4], [5]])
    CALLS.clear()
    scores = source([""] * 5, [""] * 5, {}, seq, torch.ones_like(seq))
    assert CALLS == [2, 2, 1] and scores.tolist() == [4.0, 5.0, 6.0, 4.0, 5.0]


def test_non_finite_and_misshaped_scores_raise():
    policy = make_tokenizer(POLICY_VOCAB, "<bos>")
    seq = torch.tensor([[4], [5]])
    nan_fn = lambda m, ids, mask: torch.tensor([0.0, float("nan")])
    source = ModelReward(fake_reward_model(7), policy, policy, nan_fn)
    with pytest.raises(RewardError, match=r"non-finite scores at indices \[1\].*'b'"):
        source(["", ""], ["a", "b"], {}, seq, torch.ones_like(seq))
    flat_fn = lambda m, ids, mask: torch.zeros(ids.shape[0], 1)
    source = ModelReward(fake_reward_model(7), policy, policy, flat_fn)
    with pytest.raises(RewardError, match=r"shape \(2, 1\) for 2 sequences"):
        source(["", ""], ["a", "b"], {}, seq, torch.ones_like(seq))
