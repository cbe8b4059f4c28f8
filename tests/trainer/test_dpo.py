"""The DPO loop on a nano llama: the sequence log-probs it trains on are those of each pair
read alone, unpadded; before training the policy is its own reference; a few steps raise the
implicit-reward accuracy of the training pairs; under LoRA the precomputed reference is the
model with its adapters off, after training too."""

from __future__ import annotations

import math

import pytest
import torch

from proxima.config import DPOConfig, ModelConfig
from proxima.data.preferences import PreferenceDataset, PreferenceItem
from proxima.models import (
    ARCHITECTURES,
    build_char_tokenizer,
    build_tiny_model,
    load_causal_lm,
    load_tokenizer,
)
from proxima.models.lora import AdapterDisabled, add_lora
from proxima.trainer.dpo import all_pair_logprobs, dpo_stats, dpo_train, pair_logprobs

pytestmark = pytest.mark.usefixtures("one_thread")
ALPHABET = "0123456789+="


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    tok = build_char_tokenizer(ALPHABET)
    out = tmp_path_factory.mktemp("dpo-lm")
    build_tiny_model("llama", tok, "nano", max_positions=32, seed=1).save_pretrained(out)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def pairs(folder):
    """64 pairs "a+b=": the right sum chosen, a wrong one of another length rejected."""
    tok = load_tokenizer(folder)
    records = [
        {"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1) * (1 + a % 3)}
        for a in range(8)
        for b in range(8)
    ]
    return tok, PreferenceDataset(records, tok, max_length=16)


def _alone(model, ids: list[int], prompt_length: int) -> float:
    """log p(response | prompt) of one unpadded sequence, from a plain forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    logp = torch.log_softmax(logits[:-1], dim=-1)
    return sum(logp[t - 1, ids[t]].item() for t in range(prompt_length, len(ids)))


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_sequence_logprobs_are_those_of_each_pair_read_alone(arch, pairs):
    tok, data = pairs
    model = build_tiny_model(arch, tok, "nano", max_positions=32, seed=2).eval()
    items = [data[0], data[13], data[42]]  # prompts and responses of different lengths
    items.append(PreferenceItem(data[13].rejected_ids, data[13].chosen_ids, data[13].prompt_length))
    with torch.no_grad():
        got = pair_logprobs(model, items, tok.pad_token_id, "cpu")
    for row, item in enumerate(items):
        assert got.chosen[row].item() == pytest.approx(
            _alone(model, item.chosen_ids, item.prompt_length), abs=1e-4
        )
        assert got.rejected[row].item() == pytest.approx(
            _alone(model, item.rejected_ids, item.prompt_length), abs=1e-4
        )
        assert got.chosen_tokens[row].item() == len(item.chosen_ids) - item.prompt_length
        assert got.rejected_tokens[row].item() == len(item.rejected_ids) - item.prompt_length


def test_the_starting_policy_is_its_own_reference(folder, pairs):
    tok, data = pairs
    model = load_causal_lm(folder)
    ref = all_pair_logprobs(model, data.items, tok.pad_token_id, batch_size=16)
    stats = dpo_stats(ref, ref, DPOConfig())
    # every implicit reward is 0: loss log 2, no pair ordered (ties are wrong), no drift
    assert stats["loss"] == pytest.approx(math.log(2.0), abs=1e-6)
    assert stats["rewards/accuracies"] == 0.0 and stats["rewards/margins"] == 0.0
    assert stats["logratio_per_token"] == 0.0 and stats["n"] == 64


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_a_few_steps_order_the_training_pairs(folder, pairs, loss_type, capsys):
    tok, data = pairs
    model = load_causal_lm(folder)
    d = DPOConfig(lr=3e-3, batch_size=16, epochs=3, loss_type=loss_type, eval_every=4)
    logged: list[tuple[int, dict]] = []
    res = dpo_train(model, tok, data, d, eval_dataset=data, log=lambda s, m: logged.append((s, m)))
    assert res["steps"] == 12  # 3 epochs x 64 // 16
    # Measured: 52 of the 64 training pairs (0.81) ordered after 12 steps, for both losses
    # (the ties of the start count as wrong: 0).
    assert res["train_after"]["rewards/accuracies"] >= 0.7, res["train_after"]
    assert res["train_after"]["rewards/margins"] > 0
    assert res["eval_before"]["rewards/accuracies"] == 0.0
    steps = [s for s, m in logged if "loss" in m]
    assert steps == list(range(1, 13))
    assert [s for s, m in logged if "eval/loss" in m] == [4, 8, 12]
    assert "dpo eval pairs: it 4/12" in capsys.readouterr().out


def test_under_lora_the_reference_is_the_model_with_adapters_off(folder, pairs):
    tok, data = pairs
    model = add_lora(load_causal_lm(folder), ModelConfig(lora_rank=4, lora_alpha=8), "CAUSAL_LM")
    before = all_pair_logprobs(model, data.items, tok.pad_token_id, batch_size=16)
    d = DPOConfig(lr=1e-2, batch_size=16, epochs=1)
    res = dpo_train(model, tok, data, d)
    assert res["train_after"]["logratio_per_token"] != 0.0  # the adapters moved the policy
    off = all_pair_logprobs(AdapterDisabled(model), data.items, tok.pad_token_id, batch_size=16)
    assert torch.allclose(off.chosen, before.chosen, atol=1e-5)
    assert torch.allclose(off.rejected, before.rejected, atol=1e-5)


def test_grouped_steps_take_all_pairs_of_a_prompt(folder, monkeypatch):
    """dpo.group_by_prompt: a step of batch_size 1 trains on all pairs of one prompt (every
    two of its three answers), each prompt once per epoch."""
    from proxima.trainer import dpo as dpo_module

    tok = load_tokenizer(folder)
    answers = {"1+1=": ["2", "3", "22"], "2+2=": ["4", "44", "5"]}
    records = [
        {"prompt": p, "chosen": a[i], "rejected": a[j]}
        for p, a in answers.items()
        for i, j in ((0, 1), (0, 2), (1, 2))
    ]
    data = PreferenceDataset(records, tok)
    seen, step = [], dpo_module._train_step

    def spy(model, items, *args):
        seen.append([data.items.index(item) for item in items])
        return step(model, items, *args)

    monkeypatch.setattr(dpo_module, "_train_step", spy)
    d = DPOConfig(lr=1e-3, batch_size=1, epochs=1, group_by_prompt=True)
    res = dpo_train(load_causal_lm(folder), tok, data, d)
    assert res["steps"] == 2
    assert sorted(sorted(s) for s in seen) == [[0, 1, 2], [3, 4, 5]]
