"""Set-up checks that need model folders but no model: a critic (or reference) from a
folder with another vocabulary stops before any model loads, naming the key."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from proxima.config import Config, ConfigError
from proxima.models import (
    build_bpe_tokenizer,
    build_char_tokenizer,
    build_tiny_model,
    build_tiny_reward_model,
    config_vocab_size,
    load_tokenizer,
    vocabulary_difference,
)
from proxima.models import critic as critic_module
from proxima.trainer import checks, device, roles

ALPHABET = "0123456789+="


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Actor and reward model on the character tokenizer, a reward model and a causal LM on
    a BPE tokenizer, and a copy of the BPE causal LM without its tokenizer files."""
    root = tmp_path_factory.mktemp("vocab")
    char = build_char_tokenizer(ALPHABET)
    (root / "text.txt").write_text("12+34=46\n" * 50)
    bpe = build_bpe_tokenizer(root / "text.txt", vocab_size=280)
    out = {}
    for name, tok, build in [
        ("actor", char, lambda t: build_tiny_model("llama", t, "nano", max_positions=32)),
        ("rm", char, lambda t: build_tiny_reward_model("llama", t, "nano", max_positions=32)),
        ("bpe_rm", bpe, lambda t: build_tiny_reward_model("llama", t, "nano", max_positions=32)),
        ("bpe_lm", bpe, lambda t: build_tiny_model("llama", t, "nano", max_positions=32)),
        ("bare_lm", bpe, lambda t: build_tiny_model("llama", t, "nano", max_positions=32)),
    ]:
        build(tok).save_pretrained(root / name)
        if name != "bare_lm":
            tok.save_pretrained(root / name)
        out[name] = str(root / name)
    return out


def _cfg(folders, **changes) -> Config:
    base = {
        "model.actor_path": folders["actor"],
        "data.train_path": "p.jsonl",
        "reward.model_path": folders["rm"],
    }
    return Config().replace({**base, **changes})


def test_vocabulary_difference_names_a_token():
    char = build_char_tokenizer(ALPHABET)
    assert vocabulary_difference(char, build_char_tokenizer(ALPHABET)) is None
    # "0123..." vs "1023...": ids 4 and 5 swap; same size, one token numbered otherwise
    why = vocabulary_difference(char, build_char_tokenizer("1023456789+="))
    assert why == "16 tokens there, 16 in the policy's; e.g. token '0' is id 5 there, id 4 here"


@pytest.mark.parametrize(
    ("changes", "key"),
    [
        ({"model.critic_init": "reward_model", "reward.model_path": "bpe_rm"}, "model.critic_init"),
        ({"model.critic_path": "bpe_lm"}, "model.critic_path"),
        ({"model.critic_path": "bare_lm"}, "model.critic_path"),  # no tokenizer: vocab_size
        ({"model.reference_path": "bpe_lm"}, "model.reference_path"),
    ],
)
def test_other_vocabulary_stops_before_any_model_loads(folders, monkeypatch, changes, key):
    changes = {k: folders.get(v, v) for k, v in changes.items()}
    cfg = _cfg(folders, **changes)

    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the vocabulary check")

    for module, loader in (
        (roles, "load_causal_lm"),
        (critic_module, "load_critic"),
        (roles, "load_reward_model"),
    ):
        monkeypatch.setattr(module, loader, no_model)
    with pytest.raises(ConfigError) as err:
        roles.load_roles(cfg, torch.device("cpu"))
    msg = str(err.value)
    assert msg.startswith(f"`{key}") and "another vocabulary than the policy" in msg
    assert "would read the policy's token ids as other tokens. Fix:" in msg
    if "bare_lm" in str(changes):
        rows = len(load_tokenizer(folders["bpe_lm"]))  # the BPE's size, < the asked 280
        assert f"an embedding table of {rows} rows, the actor's 16" in msg


def test_a_teacher_with_another_tokenizer_is_refused_naming_both(folders, monkeypatch):
    # on-policy distillation scores the student's token ids with the teacher: another
    # tokenizer would score other tokens; refused before any weights load
    def no_model(*args, **kwargs):
        raise AssertionError("a model was loaded before the vocabulary check")

    monkeypatch.setattr(roles, "load_causal_lm", no_model)
    cfg = _cfg(
        folders,
        **{
            "model.teacher_path": folders["bpe_lm"],
            "algorithm.adv_estimator": "distill",
            "reward.model_path": "",
        },
    )
    with pytest.raises(ConfigError) as err:
        roles.load_roles(cfg, torch.device("cpu"))
    msg = str(err.value)
    assert msg.startswith(f"`model.teacher_path`: {folders['bpe_lm']} has another vocabulary")
    assert f"(model.actor_path={folders['actor']})" in msg
    assert "teacher and student must share one tokenizer" in msg
    checks.check_vocabularies(  # the same tokenizer passes
        _cfg(folders, **{"model.teacher_path": folders["actor"]}),
        load_tokenizer(folders["actor"]),
    )


def test_same_vocabulary_passes(folders):
    for changes in (
        {"model.critic_init": "reward_model"},
        {"model.critic_path": folders["actor"]},
        # another vocabulary but a critic-free estimator: no critic reads the ids
        {"model.critic_path": folders["bpe_lm"], "algorithm.adv_estimator": "grpo"},
    ):
        checks.check_vocabularies(_cfg(folders, **changes), load_tokenizer(folders["actor"]))


def test_bare_folder_vocab_size_from_config(folders):
    assert config_vocab_size(folders["bare_lm"]) == len(load_tokenizer(folders["bpe_lm"]))
    config = json.loads((Path(folders["actor"]) / "config.json").read_text())
    assert config_vocab_size(folders["actor"]) == config["vocab_size"] == 16  # 4 special + 12


def test_the_roles_report_names_where_each_role_comes_from(folders):
    cfg = _cfg(folders, **{"model.critic_init": "reward_model"})
    report = roles.load_roles(cfg, torch.device("cpu")).report()
    assert f"reward   : the reward model {folders['rm']}" in report
    assert f"initialised from the reward model (backbone and head), {folders['rm']}" in report
    assert "reference: " in report and "frozen" in report
    head = cfg.replace({"model.critic_init": "actor", "critic.shared_backbone": True})
    assert (
        "a value head (33 params) on the actor's backbone"
        in roles.load_roles(head, torch.device("cpu")).report()
    )


def test_a_tokenizer_far_smaller_than_the_embedding_table_is_warned_about(tmp_path):
    """16 tokens for 100 rows: the policy can sample 84 ids that no token stands for; a
    few rows of padding (16 tokens for 17 rows) are common and pass quietly."""
    tok = build_char_tokenizer(ALPHABET)
    for rows, warns in ((100, True), (17, False)):
        folder = tmp_path / f"rows{rows}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps({"vocab_size": rows}))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            checks.check_token_ids(tok, str(folder), "model.actor_path")
        gaps = [w for w in caught if issubclass(w.category, checks.VocabularyGapWarning)]
        assert bool(gaps) == warns, rows
        if warns:
            assert "has 16 tokens for 100 embedding rows" in str(gaps[0].message)
            assert "sample 84 ids that decode to no text" in str(gaps[0].message)


@pytest.mark.parametrize("name", ["foo", "xpu", "mps", "cuda:x"])
def test_a_device_proxima_cannot_use_is_named_by_its_key(name):
    if name == "mps" and torch.backends.mps.is_available():
        pytest.skip("this machine has an Apple GPU")
    with pytest.raises(ValueError, match=rf"`rollout.devices`={name} is not a device .* cpu, cuda"):
        device.resolve_device(name, key="rollout.devices")
    assert device.resolve_device("cpu") == torch.device("cpu")
