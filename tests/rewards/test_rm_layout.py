"""A reward model with its own tokenizer is fed, during PPO, the very token ids it was
trained on by `proxima rm` (prompt ids, response ids, EOS), so a pair scores the same
through either path. The policy has a character tokenizer, the reward model a byte-level BPE
trained here so that a merge crosses the prompt/response boundary (" abcd" in "say ab" +
"cd"): tokenizing prompt + response as one text would give other ids."""

from __future__ import annotations

import pytest
import torch

from proxima.data.preferences import PreferenceDataset, reward_input_ids
from proxima.models import (
    build_bpe_tokenizer,
    build_char_tokenizer,
    build_tiny_reward_model,
    reward_model_scores,
)
from proxima.rewards import ModelReward
from proxima.trainer.rm import all_pair_scores

ALPHABET = "0123456789+= abcdesy"
PAIRS = [("12+34=", "46", "47"), ("say ab", "cd", "ce")]


@pytest.fixture(scope="module")
def policy_tok():
    return build_char_tokenizer(ALPHABET)


@pytest.fixture(scope="module")
def rm_tok(tmp_path_factory):
    text = tmp_path_factory.mktemp("bpe") / "text.txt"
    text.write_text("12+34=46\nsay abcd\n" * 200)
    return build_bpe_tokenizer(text, vocab_size=300)


def policy_batch(tok, rows: list[tuple[str, str, bool]]):
    """Left-padded prompt ids + response ids (+ EOS where it ended), as generation leaves
    them: sequences [B, L] and attention mask [B, L]."""
    seqs = []
    for prompt, response, ended in rows:
        ids = tok(prompt, add_special_tokens=False)["input_ids"]
        ids = ids + tok(response, add_special_tokens=False)["input_ids"]
        seqs.append(ids + ([tok.eos_token_id] if ended else []))
    width = max(len(s) for s in seqs)
    out = torch.full((len(seqs), width), tok.pad_token_id)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for i, s in enumerate(seqs):
        out[i, width - len(s) :] = torch.tensor(s)
        mask[i, width - len(s) :] = 1
    return out, mask


def test_training_and_ppo_feed_the_reward_model_the_same_ids(policy_tok, rm_tok):
    records = [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS]
    trained = PreferenceDataset(records, rm_tok, max_length=64)
    rm = build_tiny_reward_model("llama", rm_tok, size="nano", seed=3)
    source = ModelReward(rm, rm_tok, policy_tok, reward_model_scores, batch_size=8)
    assert not source.shares_tokenizer
    prompts = [p for p, _, _ in PAIRS for _ in range(2)]
    responses = [x for _, c, r in PAIRS for x in (c, r)]
    seqs, mask = policy_batch(
        policy_tok, [(p, x, True) for p, x in zip(prompts, responses, strict=True)]
    )
    ids, rm_mask = source.retokenize(prompts, responses, source.ended_with_eos(seqs, mask))
    expected = [side for item in trained.items for side in (item.chosen_ids, item.rejected_ids)]
    assert [row[m.bool()].tolist() for row, m in zip(ids, rm_mask, strict=True)] == expected
    # control: the boundary merge is real, encoding the whole text gives other ids
    whole = rm_tok("say abcd", add_special_tokens=False)["input_ids"]
    assert whole + [rm_tok.eos_token_id] != expected[2]

    chosen, rejected, _ = all_pair_scores(rm, trained, rm_tok.pad_token_id)
    in_training = torch.stack([chosen, rejected], 1).flatten()
    in_ppo = source(prompts, responses, {}, seqs, mask)
    torch.testing.assert_close(in_ppo, in_training, rtol=1e-5, atol=1e-6)


def test_no_eos_appended_for_a_response_that_did_not_end(policy_tok, rm_tok):
    rm = build_tiny_reward_model("llama", rm_tok, size="nano", seed=3)
    source = ModelReward(rm, rm_tok, policy_tok, reward_model_scores)
    seqs, mask = policy_batch(policy_tok, [("12+34=", "46", True), ("12+34=", "46", False)])
    assert source.ended_with_eos(seqs, mask) == [True, False]
    ids, m = source.retokenize(["12+34="] * 2, ["46"] * 2, [True, False])
    ended, cut = ids[0][m[0].bool()].tolist(), ids[1][m[1].bool()].tolist()
    assert ended == reward_input_ids("12+34=", "46", rm_tok)[0]
    assert ended[-1] == rm_tok.eos_token_id and ended[:-1] == cut


def test_shared_vocabulary_scores_policy_ids_as_in_training(policy_tok):
    # the other path: same tokenizer, policy ids scored as they are (left-padded); the score
    # equals the one `proxima rm` computes on the right-padded training layout
    rm = build_tiny_reward_model("llama", policy_tok, size="nano", seed=4)
    source = ModelReward(rm, policy_tok, policy_tok, reward_model_scores)
    assert source.shares_tokenizer
    records = [{"prompt": p, "chosen": c, "rejected": r} for p, c, r in PAIRS]
    trained = PreferenceDataset(records, policy_tok, max_length=64)
    chosen, rejected, _ = all_pair_scores(rm, trained, policy_tok.pad_token_id)
    prompts = [p for p, _, _ in PAIRS for _ in range(2)]
    responses = [x for _, c, r in PAIRS for x in (c, r)]
    seqs, mask = policy_batch(
        policy_tok, [(p, x, True) for p, x in zip(prompts, responses, strict=True)]
    )
    in_ppo = source(prompts, responses, {}, seqs, mask)
    torch.testing.assert_close(in_ppo, torch.stack([chosen, rejected], 1).flatten())
