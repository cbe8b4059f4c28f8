"""Reward-model training: the pairwise loss and accuracy on literal scores, the model built
from a causal-LM folder (for each architecture), scoring in one stacked pass, a short loop."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForSequenceClassification

from proxima.data.preferences import (
    PreferenceDataset,
    PreferenceItem,
    pad_sequences,
)
from proxima.models import (
    ARCHITECTURES,
    build_char_tokenizer,
    build_tiny_model,
    build_tiny_reward_model,
    init_reward_model,
    load_causal_lm,
    load_tokenizer,
    reward_model_scores,
    scalar_head,
    tiny_config,
)
from proxima.trainer.rm import (
    all_pair_scores,
    evaluate_preferences,
    pairwise_loss,
    preference_accuracy,
    rm_train,
)

ALPHABET = "0123456789+="
LOG3 = math.log(3.0)


def test_pairwise_loss_literals():
    # loss = -log sigmoid(d), d = r_c - r_r.  d = 0: sigmoid = 1/2 -> log 2.
    # d = log 3: sigmoid = 3 / (3 + 1) = 3/4 -> log(4/3).  d = -log 3: sigmoid = 1/4 -> log 4.
    # Mean over the three: (log 2 + log 4 - log 3 + log 4) / 3 = (5 log 2 - log 3) / 3.
    chosen = torch.tensor([1.0, LOG3, 0.0])
    rejected = torch.tensor([1.0, 0.0, LOG3])
    loss, stats = pairwise_loss(chosen, rejected)
    expected = (5 * math.log(2.0) - LOG3) / 3
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats["loss"] == pytest.approx(expected, abs=1e-6)
    assert stats["accuracy"] == pytest.approx(1 / 3)  # only row 1 has r_c > r_r (row 0 ties)
    assert stats["margin"] == pytest.approx(0.0, abs=1e-7)  # (0 + log 3 - log 3) / 3
    assert stats["chosen_score"] == pytest.approx((1.0 + LOG3) / 3)
    assert stats["rejected_score"] == pytest.approx((1.0 + LOG3) / 3)


def test_margin_shifts_the_difference_but_not_the_reported_margin():
    # d = log 3 + 1, m = 1: -log sigmoid(d - m) = -log sigmoid(log 3) = log(4/3).
    loss, stats = pairwise_loss(
        torch.tensor([LOG3 + 1.0]), torch.tensor([0.0]), margin=torch.tensor([1.0])
    )
    assert loss.item() == pytest.approx(math.log(4 / 3), abs=1e-6)
    assert stats["margin"] == pytest.approx(LOG3 + 1.0)
    assert stats["accuracy"] == 1.0


def test_loss_gradient_and_stability():
    # d loss / d r_c = -(1 - sigmoid(d)) / B; at d = 0, B = 1: -1/2 (and +1/2 for r_r).
    chosen = torch.tensor([0.0], requires_grad=True)
    rejected = torch.tensor([0.0], requires_grad=True)
    pairwise_loss(chosen, rejected)[0].backward()
    assert chosen.grad.item() == pytest.approx(-0.5)
    assert rejected.grad.item() == pytest.approx(0.5)
    # d = -200: -log sigmoid(-200) = 200 + log(1 + e^-200) = 200 in float32 (a naive
    # log(sigmoid) would give inf); d = +200: 0.
    loss, _ = pairwise_loss(torch.tensor([-100.0, 100.0]), torch.tensor([100.0, -100.0]))
    assert loss.item() == pytest.approx(100.0)  # (200 + 0) / 2


def test_preference_accuracy_counts_strict_wins():
    # 2 > 1 win, 1 = 1 tie (not a win), 0 < 1 loss, 5 > 0 win: 2 of 4.
    acc = preference_accuracy(torch.tensor([2.0, 1.0, 0.0, 5.0]), torch.tensor([1.0, 1, 1, 0]))
    assert acc == 0.5


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(ALPHABET)


def _save(model, tok, folder):
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_init_from_causal_lm_keeps_backbone_and_seeds_a_small_head(arch, tok, tmp_path):
    folder = _save(build_tiny_model(arch, tok, "nano", max_positions=32, seed=1), tok, tmp_path)
    rm = init_reward_model(folder, seed=3)
    lm = load_causal_lm(folder, trainable=False)
    lm_backbone, rm_backbone = lm.base_model.state_dict(), rm.base_model.state_dict()
    assert lm_backbone.keys() == rm_backbone.keys()
    assert all(torch.equal(lm_backbone[k], rm_backbone[k]) for k in lm_backbone)
    head = scalar_head(rm)
    assert head.weight.shape == (1, 32)  # nano hidden size 32, one label
    again, other = init_reward_model(folder, seed=3), init_reward_model(folder, seed=4)
    assert torch.equal(scalar_head(again).weight, head.weight)
    assert not torch.equal(scalar_head(other).weight, head.weight)
    # N(0, 1/sqrt(33)): all 32 weights within 5 standard deviations (0.87)
    assert head.weight.abs().max().item() < 5 / math.sqrt(33)
    assert rm.training and all(p.requires_grad for p in rm.parameters())
    assert rm.config.num_labels == 1
    assert all(m.p == 0.0 for m in rm.modules() if isinstance(m, torch.nn.Dropout))


def test_init_continues_a_reward_model_folder_and_rejects_bad_folders(tok, tmp_path):
    saved = build_tiny_reward_model("llama", tok, "nano", seed=2, max_positions=32)
    folder = _save(saved, tok, tmp_path / "rm")
    rm = init_reward_model(folder, seed=9)  # the seed does not redraw a saved head
    assert torch.equal(scalar_head(rm).weight, scalar_head(saved).weight)
    assert rm.training and all(p.requires_grad for p in rm.parameters())
    two = AutoModelForSequenceClassification.from_config(
        tiny_config("llama", tok, "nano", max_positions=32, num_labels=2)
    )
    with pytest.raises(ValueError, match="num_labels=2"):
        init_reward_model(_save(two, tok, tmp_path / "two"))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        init_reward_model(tmp_path / "nowhere")


@pytest.fixture(scope="module")
def setup(tok, tmp_path_factory):
    """(reward model from a nano llama folder, its tokenizer, 8 preference pairs)."""
    folder = tmp_path_factory.mktemp("rm-lm")
    _save(build_tiny_model("llama", tok, "nano", max_positions=32, seed=1), tok, folder)
    tokenizer = load_tokenizer(folder)
    records = [
        {"prompt": f"{a}+{a}=", "chosen": str(2 * a), "rejected": str(2 * a + 1) * (a % 3 + 1)}
        for a in range(8)
    ]
    return init_reward_model(folder, seed=0), tokenizer, PreferenceDataset(records, tokenizer)


def test_pair_scores_equal_separate_passes(setup):
    model, tokenizer, pairs = setup
    chosen, rejected, margins = all_pair_scores(model, pairs, tokenizer.pad_token_id, 3)
    assert margins.tolist() == [0.0] * 8
    pad = tokenizer.pad_token_id
    with torch.no_grad():
        for side, got in (("chosen_ids", chosen), ("rejected_ids", rejected)):
            ids, mask = pad_sequences([getattr(item, side) for item in pairs.items], pad)
            alone = reward_model_scores(model, ids, mask)
            torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)
        # chosen sides are shorter than rejected ones, so they carry right padding: unpadded
        # single rows give the same scores (the score is read at the last real token).
        one = pairs[5].chosen_ids
        single = reward_model_scores(model, torch.tensor([one]), torch.ones(1, len(one)))
    torch.testing.assert_close(chosen[5:6], single, rtol=1e-5, atol=1e-5)


def test_evaluate_matches_the_loss_on_all_pairs_and_restores_mode(setup):
    model, tokenizer, pairs = setup
    chosen, rejected, _ = all_pair_scores(model, pairs, tokenizer.pad_token_id, 8)
    _, expected = pairwise_loss(chosen, rejected)
    model.train()
    got = evaluate_preferences(model, pairs, tokenizer.pad_token_id, batch_size=3)  # 3+3+2
    assert model.training
    assert got["n"] == 8
    for key, value in expected.items():
        assert got[key] == pytest.approx(value, abs=1e-5)


def test_rm_train_returns_curves_and_evaluations(setup, tok, tmp_path):
    folder = _save(build_tiny_model("llama", tok, "nano", max_positions=32, seed=1), tok, tmp_path)
    model, tokenizer, pairs = init_reward_model(folder, seed=0), setup[1], setup[2]
    before = {k: v.clone() for k, v in model.state_dict().items()}
    res = rm_train(model, tokenizer, pairs, steps=3, lr=1e-2, batch_size=4, eval_dataset=pairs)
    assert len(res["loss"]) == len(res["accuracy"]) == len(res["margin"]) == 3
    assert {"train_before", "train_after", "eval_before", "eval_after"} <= res.keys()
    assert res["train_before"] == res["eval_before"]  # both probes are the same 8 pairs
    assert res["train_before"]["loss"] != res["train_after"]["loss"]
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert "score.weight" in changed and any(k.startswith("model.") for k in changed)
    without = rm_train(model, tokenizer, pairs, steps=1, lr=1e-3, batch_size=8)
    assert "eval_before" not in without and "train_after" in without
    no_probe = rm_train(model, tokenizer, pairs, steps=1, lr=1e-3, batch_size=8, train_probe_size=0)
    assert "train_before" not in no_probe and len(no_probe["loss"]) == 1
    small = rm_train(model, tokenizer, pairs, steps=1, lr=1e-3, batch_size=8, train_probe_size=3)
    assert small["train_before"]["n"] == 3


def test_grouped_steps_take_all_pairs_of_a_prompt(setup, tok, tmp_path):
    """rm.group_by_prompt: a step of batch_size 1 is the loss of all pairs of one prompt,
    and every prompt appears once per epoch (two steps: the two prompts' losses)."""
    tokenizer = setup[1]
    answers = {"1+1=": ["2", "3", "22"], "2+2=": ["4", "44", "5"]}
    records = [
        {"prompt": p, "chosen": a[i], "rejected": a[j]}
        for p, a in answers.items()
        for i, j in ((0, 1), (0, 2), (1, 2))
    ]
    pairs = PreferenceDataset(records, tokenizer)
    folder = _save(build_tiny_model("llama", tok, "nano", max_positions=32, seed=1), tok, tmp_path)
    model = init_reward_model(folder, seed=0)
    chosen, rejected, _ = all_pair_scores(model, pairs, tokenizer.pad_token_id)
    expected = sorted(
        pairwise_loss(chosen[k : k + 3], rejected[k : k + 3])[1]["loss"] for k in (0, 3)
    )
    res = rm_train(
        model, tokenizer, pairs, steps=2, lr=1e-9, batch_size=1, group_by_prompt=True,
        train_probe_size=0,
    )  # fmt: skip
    assert sorted(res["loss"]) == pytest.approx(expected, abs=1e-5)
    assert expected[0] != pytest.approx(expected[1], abs=1e-3)  # the two prompts differ
    with pytest.raises(ValueError, match=r"batch_size=3 .*2 \(the number of prompts"):
        rm_train(model, tokenizer, pairs, steps=1, lr=1e-3, batch_size=3, group_by_prompt=True)


def test_rm_train_size_errors_name_the_option(setup):
    model, tokenizer, pairs = setup
    with pytest.raises(ValueError, match=r"batch_size=9 .*--batch-size"):
        rm_train(model, tokenizer, pairs, steps=1, lr=1e-3, batch_size=9)
    with pytest.raises(ValueError, match=r"steps=0 .*--steps"):
        rm_train(model, tokenizer, pairs, steps=0, lr=1e-3, batch_size=2)


def test_non_finite_loss_stops_with_the_fix(setup, tok, tmp_path):
    folder = _save(build_tiny_model("llama", tok, "nano", max_positions=32, seed=1), tok, tmp_path)
    model, tokenizer, pairs = init_reward_model(folder, seed=0), setup[1], setup[2]
    with torch.no_grad():
        scalar_head(model).weight.fill_(float("nan"))  # what a diverged run produces
    with pytest.raises(ValueError, match=r"loss is nan at step 1; lower --lr"):
        rm_train(model, tokenizer, pairs, steps=2, lr=1e-3, batch_size=4)


def test_score_normalization_round_trip_through_a_saved_folder(setup, tmp_path):
    """The statistics of both sides of every pair, stored in config.json, read back, and
    applied by the reward source a run builds from the folder: mean 0, std 1 there. A
    response in several pairs counts once."""
    from proxima.config import Config
    from proxima.models import score_normalization as read_normalization
    from proxima.models.loading import SCORE_NORMALIZATION
    from proxima.trainer.rm import all_pair_scores, score_normalization
    from proxima.trainer.roles import build_reward

    model, tokenizer, pairs = setup
    chosen, rejected, _ = all_pair_scores(model, pairs, tokenizer.pad_token_id, batch_size=3)
    both = torch.cat([chosen, rejected]).double()
    norm = score_normalization(model, pairs, tokenizer.pad_token_id, "cpu")
    assert norm["n"] == 16
    assert norm["mean"] == pytest.approx(float(both.mean()), abs=1e-6)
    assert norm["std"] == pytest.approx(float(both.std(unbiased=False)), abs=1e-6)
    one = pairs[1]  # the same two responses again, reversed
    shared = [*pairs.items, PreferenceItem(one.rejected_ids, one.chosen_ids, one.prompt_length)]
    assert score_normalization(model, shared, tokenizer.pad_token_id, "cpu") == norm
    setattr(model.config, SCORE_NORMALIZATION, norm)
    model.save_pretrained(tmp_path / "rm")
    delattr(model.config, SCORE_NORMALIZATION)  # the fixture's model is shared
    tokenizer.save_pretrained(tmp_path / "rm")
    assert read_normalization(tmp_path / "rm") == pytest.approx((norm["mean"], norm["std"]))
    cfg = Config().replace({"reward.model_path": str(tmp_path / "rm")})
    source = build_reward(cfg, tokenizer, torch.device("cpu"))
    seqs = [item.chosen_ids for item in pairs.items] + [item.rejected_ids for item in pairs.items]
    ids, mask = pad_sequences(seqs, tokenizer.pad_token_id)
    got = source([""] * 16, [""] * 16, {}, ids, mask).double()
    torch.testing.assert_close(got, (both - norm["mean"]) / norm["std"], rtol=1e-5, atol=1e-5)
    assert float(got.mean()) == pytest.approx(0.0, abs=1e-5)
    assert float(got.std(unbiased=False)) == pytest.approx(1.0, abs=1e-5)


def test_a_folder_without_normalization_scores_raw_and_a_bad_one_is_named(setup, tmp_path):
    import json

    from proxima.models import score_normalization as read_normalization

    model, tokenizer, _ = setup
    model.save_pretrained(tmp_path / "rm")
    assert read_normalization(tmp_path / "rm") is None
    config = json.loads((tmp_path / "rm" / "config.json").read_text())
    config["score_normalization"] = {"mean": 0.0, "std": 0.0}
    (tmp_path / "rm" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"invalid `score_normalization`.*std > 0"):
        read_normalization(tmp_path / "rm")
