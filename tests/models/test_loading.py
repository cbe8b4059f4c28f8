"""Loading the four roles from folders, for each tiny architecture.

Oracles: the models' own Hugging Face forward on unpadded single rows (no padding means no
pooling or position ambiguity), and weights compared tensor by tensor.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from torch import nn
from transformers import AutoModelForTokenClassification, AutoTokenizer

from proxima.algos import last_token_index
from proxima.models import (
    ARCHITECTURES,
    build_char_tokenizer,
    build_tiny_model,
    build_tiny_reward_model,
    describe_model,
    load_causal_lm,
    load_critic,
    load_reward_model,
    load_tokenizer,
    position_ids_from_mask,
    reward_model_scores,
    scalar_head,
)
from proxima.models.loading import SCORE_NORMALIZATION
from tests.oracles import critic_values

ALPHABET = "0123456789+= "
TEXTS = ["1+2=3", "12+34=46", "7="]  # lengths 5, 8, 2: padding in two of the three rows


@pytest.fixture(scope="module", params=ARCHITECTURES)
def folders(request, tmp_path_factory):
    """(arch, actor folder, reward-model folder, the actor as built) for one architecture."""
    arch = request.param
    root = tmp_path_factory.mktemp(arch)
    tok = build_char_tokenizer(ALPHABET)
    actor = build_tiny_model(arch, tok, "nano", max_positions=32, seed=1)
    actor.save_pretrained(root / "actor")
    tok.save_pretrained(root / "actor")
    rm = build_tiny_reward_model(arch, tok, "nano", seed=2, max_positions=32)
    rm.save_pretrained(root / "rm")
    tok.save_pretrained(root / "rm")
    return arch, root / "actor", root / "rm", actor


def _batch(folder, side):
    tok = load_tokenizer(folder)
    tok.padding_side = side
    return tok(TEXTS, padding=True, return_tensors="pt")


def _row(folder, i):
    return load_tokenizer(folder)(TEXTS[i], return_tensors="pt")["input_ids"]  # [1, T_i]


def test_position_ids_and_last_index_literals():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0]])
    # cumsum - 1 = [-1,-1,0,1,2] / [0,1,2,2,2] / [-1]*5, then clamped at 0
    expected = torch.tensor([[0, 0, 0, 1, 2], [0, 1, 2, 2, 2], [0, 0, 0, 0, 0]])
    assert torch.equal(position_ids_from_mask(mask), expected)
    # last 1 sits at index 4 (left padded) and 2 (right padded); an empty row gives 0
    assert last_token_index(mask)[0].tolist() == [4, 2, 0]


def test_causal_lm_logits_survive_save_and_load(folders):
    _, actor_dir, _, actor = folders
    ids = _row(actor_dir, 1)
    loaded = load_causal_lm(actor_dir)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, actor.eval()(ids).logits, rtol=0, atol=0)


def test_actor_trainable_reference_frozen(folders):
    _, actor_dir, rm_dir, _ = folders
    actor = load_causal_lm(actor_dir, trainable=True)
    assert actor.training and all(p.requires_grad for p in actor.parameters())
    for frozen in (load_causal_lm(actor_dir, trainable=False), load_reward_model(rm_dir)):
        assert not frozen.training
        assert not any(p.requires_grad for p in frozen.parameters())
        assert describe_model(frozen)["trainable_parameters"] == 0


def test_dropout_is_disabled_even_when_the_folder_asks_for_it(folders, tmp_path):
    arch = folders[0]
    tok = build_char_tokenizer(ALPHABET)
    noisy = {"gpt2": {"resid_pdrop": 0.5, "embd_pdrop": 0.5, "attn_pdrop": 0.5}}.get(
        arch, {"attention_dropout": 0.5}
    )
    build_tiny_model(arch, tok, "nano", **noisy).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    actor = load_causal_lm(tmp_path)
    critic = load_critic(tmp_path, init_from="actor")
    for model in (actor, critic):
        assert all(m.p == 0 for m in model.modules() if isinstance(m, nn.Dropout))
        for key in noisy:
            assert getattr(model.config, key) == 0.0
    ids = _row(tmp_path, 1)
    assert actor.training  # train mode, yet two forwards agree exactly: no dropout noise
    torch.testing.assert_close(actor(ids).logits, actor(ids).logits, rtol=0, atol=0)


def test_critic_from_actor_shapes_backbone_and_head(folders):
    _, actor_dir, _, actor = folders
    critic = load_critic(actor_dir, init_from="actor", seed=5)
    batch = _batch(actor_dir, "left")
    values = critic_values(critic, batch["input_ids"], batch["attention_mask"])
    assert values.shape == (3, 8) and values.dtype == torch.float32
    assert values.requires_grad  # the critic trains through these
    torch.testing.assert_close(
        critic.get_input_embeddings().weight, actor.get_input_embeddings().weight, rtol=0, atol=0
    )
    head = scalar_head(critic)
    hidden = head.weight.shape[-1]
    torch.manual_seed(5)  # same draw as load_critic: N(0, 1) / sqrt(hidden + 1)
    expected = torch.randn(1, hidden) / (hidden + 1) ** 0.5
    torch.testing.assert_close(head.weight.detach(), expected, rtol=0, atol=0)
    assert torch.count_nonzero(head.bias) == 0


def test_a_zero_head_starts_every_value_at_zero(folders):
    """critic.head_init=zero: a value model from the actor whose values are all 0 until it
    learns (the value head of OpenAI's lm-human-preferences), the backbone as loaded."""
    _, actor_dir, _, _ = folders
    critic = load_critic(actor_dir, init_from="actor", seed=5, head_init="zero")
    batch = _batch(actor_dir, "left")
    values = critic_values(critic, batch["input_ids"], batch["attention_mask"])
    assert torch.count_nonzero(values) == 0 and values.requires_grad
    assert torch.count_nonzero(scalar_head(critic).weight) == 0
    with pytest.raises(ValueError, match="unknown head init 'ones'.*'random', 'zero'"):
        load_critic(actor_dir, init_from="actor", head_init="ones")


@pytest.mark.parametrize("side", ["left", "right"])
def test_critic_values_padding_invariant(folders, side):
    _, actor_dir, _, _ = folders
    critic = load_critic(actor_dir, init_from="actor")
    batch = _batch(actor_dir, side)
    with torch.no_grad():
        values = critic_values(critic, batch["input_ids"], batch["attention_mask"])
        for i in range(len(TEXTS)):
            ids = _row(actor_dir, i)
            alone = critic_values(critic, ids, torch.ones_like(ids))[0]  # [T_i]
            real = batch["attention_mask"][i].bool()
            torch.testing.assert_close(values[i][real], alone, rtol=1e-5, atol=1e-5)


def test_saved_critic_is_a_plain_hf_token_classifier(folders, tmp_path):
    _, actor_dir, _, _ = folders
    critic = load_critic(actor_dir, init_from="actor", seed=3)
    critic.save_pretrained(tmp_path)
    batch = _batch(actor_dir, "left")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        expected = critic_values(critic, ids, mask)
        plain = AutoModelForTokenClassification.from_pretrained(tmp_path).eval()
        logits = plain(
            input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)
        ).logits
        torch.testing.assert_close(logits[..., 0], expected, rtol=1e-6, atol=1e-6)
        again = critic_values(load_critic(tmp_path, init_from="critic"), ids, mask)
        torch.testing.assert_close(again, expected, rtol=0, atol=0)


@pytest.mark.parametrize("side", ["left", "right"])
def test_reward_score_reads_last_real_token(folders, side):
    _, _, rm_dir, _ = folders
    rm = load_reward_model(rm_dir)
    batch = _batch(rm_dir, side)
    with torch.no_grad():
        scores = reward_model_scores(rm, batch["input_ids"], batch["attention_mask"])
        # oracle: HF's own forward on one unpadded row pools at its last token
        alone = torch.stack([rm(_row(rm_dir, i)).logits[0, 0] for i in range(len(TEXTS))])
    assert scores.shape == (3,) and scores.dtype == torch.float32
    torch.testing.assert_close(scores, alone, rtol=1e-5, atol=1e-5)
    assert scores.unique().numel() == 3  # three different texts, three different scores


def test_reward_score_when_pad_is_eos(folders):
    _, _, rm_dir, _ = folders
    rm = load_reward_model(rm_dir)
    tok = load_tokenizer(rm_dir)
    eos = tok.eos_token_id
    # every text ends with EOS and the right padding is EOS too: a pad-token search would
    # stop at the first EOS of the padding; the mask says where each sequence ends
    rows = [tok(t)["input_ids"] + [eos] for t in TEXTS]
    width = max(map(len, rows))
    ids = torch.tensor([r + [eos] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    with torch.no_grad():
        scores = reward_model_scores(rm, ids, mask)
        alone = torch.stack([rm(torch.tensor([r])).logits[0, 0] for r in rows])
    torch.testing.assert_close(scores, alone, rtol=1e-5, atol=1e-5)


def test_critic_from_reward_model_starts_as_the_reward_model(folders):
    _, _, rm_dir, _ = folders
    rm = load_reward_model(rm_dir)
    critic = load_critic(rm_dir, init_from="reward_model")
    torch.testing.assert_close(
        scalar_head(critic).weight.detach(), scalar_head(rm).weight, rtol=0, atol=0
    )
    assert torch.count_nonzero(scalar_head(critic).bias) == 0  # seq-cls head has no bias
    for side in ("left", "right"):
        batch = _batch(rm_dir, side)
        ids, mask = batch["input_ids"], batch["attention_mask"]
        with torch.no_grad():
            values = critic_values(critic, ids, mask)
            last = values[torch.arange(3), last_token_index(mask)[0]]
            # same weights; only the matmul shape differs ([B, L, H] vs [B, H]): float rounding
            torch.testing.assert_close(last, reward_model_scores(rm, ids, mask), rtol=0, atol=1e-6)


def test_critic_from_a_normalised_reward_model_starts_at_the_normalised_score(folders, tmp_path):
    """A reward model with a stored score normalisation (mean 2, std 4): the critic's value
    at the last token is (score - 2) / 4, the reward a run reads from the model."""
    _, _, rm_dir, _ = folders
    shutil.copytree(rm_dir, tmp_path / "rm")
    config = json.loads((tmp_path / "rm/config.json").read_text())
    config[SCORE_NORMALIZATION] = {"mean": 2.0, "std": 4.0, "n": 6}
    (tmp_path / "rm/config.json").write_text(json.dumps(config))
    rm = load_reward_model(rm_dir)
    critic = load_critic(tmp_path / "rm", init_from="reward_model")
    head = scalar_head(critic)
    torch.testing.assert_close(head.weight.detach(), scalar_head(rm).weight / 4, rtol=0, atol=0)
    assert head.bias.tolist() == [-0.5]  # (0 - 2) / 4
    batch = _batch(rm_dir, "right")
    ids, mask = batch["input_ids"], batch["attention_mask"]
    with torch.no_grad():
        last = critic_values(critic, ids, mask)[torch.arange(3), last_token_index(mask)[0]]
        expected = (reward_model_scores(rm, ids, mask) - 2) / 4
    torch.testing.assert_close(last, expected, rtol=0, atol=1e-6)


def test_wrong_folder_kinds_raise_with_the_fix(folders, tmp_path):
    _, actor_dir, rm_dir, _ = folders
    with pytest.raises(ValueError, match="ForSequenceClassification"):
        load_reward_model(actor_dir)
    with pytest.raises(ValueError, match="ForSequenceClassification"):
        load_critic(actor_dir, init_from="reward_model")
    with pytest.raises(ValueError, match="ForTokenClassification.*init_from='actor'"):
        load_critic(actor_dir, init_from="critic")
    with pytest.raises(ValueError, match="ForSequenceClassification: a reward model"):
        load_causal_lm(rm_dir)  # a reward model has no LM head: it would be random


def test_missing_folder_and_missing_config(tmp_path):
    missing = tmp_path / "nowhere"
    fixes = [
        (load_causal_lm, "proxima init-model --out"),
        (load_critic, "proxima init-model --out"),  # init_from="actor": an actor folder
        (load_reward_model, "AutoModelForSequenceClassification with num_labels=1"),
    ]
    for load, fix in fixes:
        with pytest.raises(FileNotFoundError, match=f"{missing} does not exist; .*{fix}"):
            load(missing)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="has no config.json.*Hugging Face model folder"):
        load_causal_lm(tmp_path / "empty")
    with pytest.raises(ValueError, match="unknown critic init_from='value'"):
        load_critic(tmp_path, init_from="value")


def test_describe_model_counts_bytes():
    layer = nn.Linear(3, 2)  # 3*2 weights + 2 biases = 8 float32 parameters = 32 bytes
    info = describe_model(layer)
    assert info["parameters"] == 8 and info["trainable_parameters"] == 8
    assert info["parameter_bytes"] == 32
    assert info["grad_and_adam_bytes"] == 96  # gradient + exp_avg + exp_avg_sq: 3 * 32
    assert info["dtype"] == "float32" and info["device"] == "cpu"
    layer.bias.requires_grad_(False)
    assert describe_model(layer)["trainable_parameters"] == 6
    assert describe_model(layer.half())["parameter_bytes"] == 16


@pytest.mark.parametrize("layout", ["sharded", "bin"])
def test_critic_from_reward_model_other_file_layouts(tmp_path, layout):
    # GPT-2: the seq-cls head is `score`, the token-cls head `classifier`, so the copy is
    # explicit; here from a sharded safetensors folder and from a pytorch_model.bin folder
    tok = build_char_tokenizer(ALPHABET)
    rm = build_tiny_reward_model("gpt2", tok, "nano", seed=4)
    if layout == "sharded":
        rm.save_pretrained(tmp_path, max_shard_size="20KB")
        assert (tmp_path / "model.safetensors.index.json").is_file()
    else:
        rm.config.save_pretrained(tmp_path)
        torch.save(rm.state_dict(), tmp_path / "pytorch_model.bin")
    critic = load_critic(tmp_path, init_from="reward_model")
    torch.testing.assert_close(critic.classifier.weight.detach(), rm.score.weight.detach())
    torch.testing.assert_close(
        critic.transformer.wte.weight.detach(), rm.transformer.wte.weight.detach()
    )
    assert torch.count_nonzero(critic.classifier.bias) == 0


def test_folder_problem_checks_files_before_loading(tmp_path):
    """What keeps a folder from being a model, found from its files: an empty folder,
    weights missing or truncated (from the safetensors header), a shard of an index missing,
    no tokenizer; a complete folder (single, sharded or .bin) has no problem."""
    from proxima.models import folder_problem

    tok = build_char_tokenizer(ALPHABET)
    model = build_tiny_model("gpt2", tok, "nano", max_positions=32, seed=1)
    good = tmp_path / "good"
    model.save_pretrained(good)
    tok.save_pretrained(good)
    assert folder_problem(good) is None
    assert folder_problem(tmp_path / "nope") == "does not exist"
    (tmp_path / "empty").mkdir()
    assert folder_problem(tmp_path / "empty") == "is empty"
    assert folder_problem(good / "config.json") == "is a file, not a model folder"

    sharded = tmp_path / "sharded"
    model.save_pretrained(sharded, max_shard_size="20KB")
    assert folder_problem(sharded, tokenizer=False) is None
    assert "has no tokenizer files" in folder_problem(sharded)
    shard = sorted(sharded.glob("model-*.safetensors"))[0]
    shard.unlink()
    assert folder_problem(sharded, tokenizer=False) == (
        f"lacks weight shards listed in model.safetensors.index.json: {shard.name}"
    )

    data = (good / "model.safetensors").read_bytes()
    (good / "model.safetensors").write_bytes(data[:-10])
    assert folder_problem(good) == (
        f"has a truncated model.safetensors ({len(data) - 10} bytes, its header promises "
        f"{len(data)})"
    )
    with pytest.raises(ValueError, match="has a truncated model.safetensors"):
        load_causal_lm(good)  # the loader checks too: no bare SafetensorError
    (good / "model.safetensors").write_bytes(b"\x01")
    assert (
        folder_problem(good)
        == "has a model.safetensors that is truncated or not safetensors (1 bytes)"
    )
    (good / "model.safetensors").unlink()
    assert folder_problem(good).startswith("holds no weights (model.safetensors, ")
    torch.save(model.state_dict(), good / "pytorch_model.bin")
    assert folder_problem(good) is None


def test_a_run_folder_or_a_reward_model_is_not_a_policy(tmp_path):
    """A `proxima train` run folder (its policy is in actor/), a checkpoint folder and a
    *ForSequenceClassification folder are named for what they are, with what to pass
    instead: before any weights load, and by the loader itself."""
    import json

    from proxima.models import folder_problem, policy_folder_problem

    tok = build_char_tokenizer(ALPHABET)
    actor = tmp_path / "run" / "actor"
    build_tiny_model("llama", tok, "nano", max_positions=32).save_pretrained(actor)
    tok.save_pretrained(actor)
    (tmp_path / "run" / "summary.json").write_text("{}")
    run = tmp_path / "run"
    expected = (
        "is a proxima run folder (summary.json, actor/), not a model folder: pass its trained "
        f"policy, {actor}, instead"
    )
    assert policy_folder_problem(run) == expected
    assert folder_problem(run) == expected  # what the start-up checks of every command say
    with pytest.raises(ValueError, match="not a model folder: pass its trained policy"):
        load_causal_lm(run)
    assert policy_folder_problem(actor) is None and folder_problem(actor) is None
    (run / "config.json").write_text('{"trainer": {}}')  # a run folder holds its own config
    assert policy_folder_problem(run) == expected

    ckpt = tmp_path / "run2" / "checkpoints" / "iter_10"
    (tmp_path / "run2").mkdir()
    (tmp_path / "run2" / "metrics.jsonl").write_text("")
    for n in (2, 10):  # iter_10 is the newest, though "iter_2" sorts after it as text
        target = tmp_path / "run2" / "checkpoints" / f"iter_{n}" / "actor"
        target.mkdir(parents=True)
        (target / "config.json").write_text((actor / "config.json").read_text())
    assert policy_folder_problem(tmp_path / "run2").endswith(
        f"has no final actor/ yet: pass the policy of its latest checkpoint, {ckpt / 'actor'}, "
        "instead"
    )
    (ckpt / "checkpoint.json").write_text("{}")
    assert policy_folder_problem(ckpt).startswith("is a proxima checkpoint folder (")

    rm = tmp_path / "rm"
    build_tiny_reward_model("llama", tok, "nano", max_positions=32).save_pretrained(rm)
    tok.save_pretrained(rm)
    (rm / "rm_summary.json").write_text(json.dumps({"config": {"model": {"actor_path": "SFT"}}}))
    problem = policy_folder_problem(rm)
    assert problem.startswith(
        "holds a LlamaForSequenceClassification: a reward model (a score head, no "
        "language-model head), which cannot generate text; as a reward source it belongs in "
        "`reward.model_path` (--reward-model). Pass a causal language model instead, e.g. the "
        "one it was trained from (SFT),"
    )
    assert folder_problem(rm) is None  # a sound folder: as reward.model_path it is right
    with pytest.raises(ValueError, match=f"model folder {rm} holds a LlamaForSequenceClass"):
        load_causal_lm(rm)


def test_a_long_text_gets_no_indexing_errors_warning_from_the_tokenizer(tmp_path, caplog):
    """proxima checks lengths itself, naming its keys; transformers' own warning is not
    shown on top."""
    from transformers.utils import logging as hf_logging

    tok = build_char_tokenizer(ALPHABET)
    tok.model_max_length = 8
    tok.save_pretrained(tmp_path)
    hf_logging.enable_propagation()  # its records to caplog
    try:
        assert len(load_tokenizer(tmp_path)("1+" * 20)["input_ids"]) > 8
        assert "indexing errors" not in caplog.text
        assert len(AutoTokenizer.from_pretrained(tmp_path)("1+" * 20)["input_ids"]) > 8
        assert "indexing errors" in caplog.text  # the test sees the warning where it is given
    finally:
        hf_logging.disable_propagation()


def test_a_critic_head_without_a_bias_cannot_take_a_normalised_mean():
    from proxima.models.loading import _set_head

    critic = nn.Module()
    critic.score = nn.Linear(4, 1, bias=False)
    _set_head(critic, {"weight": torch.ones(1, 4), "bias": torch.zeros(1)}, seed=0)  # no mean
    assert critic.score.weight.tolist() == [[1.0] * 4]
    with pytest.raises(ValueError, match=r"head has no bias .*\(model.critic_init=actor\)"):
        _set_head(critic, {"weight": torch.ones(1, 4), "bias": torch.tensor([-0.5])}, seed=0)
