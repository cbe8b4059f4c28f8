"""The tiny-model factory: configs match the tokenizer, no dropout, deterministic seeds."""

from __future__ import annotations

import pytest
import torch

from proxima.models import (
    ARCHITECTURES,
    SIZES,
    build_char_tokenizer,
    build_tiny_model,
    build_tiny_reward_model,
    init_model,
    load_causal_lm,
    load_tokenizer,
)

ALPHABET = "0123456789+= "


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(ALPHABET)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_config_matches_tokenizer_and_size(arch, tok):
    model = build_tiny_model(arch, tok, "nano", max_positions=64)
    cfg = model.config
    assert cfg.vocab_size == len(tok) == 4 + len(ALPHABET)
    assert (cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id) == (0, 1, 2)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads) == (32, 1, 2)
    assert cfg.max_position_embeddings == 64
    assert cfg.tie_word_embeddings is False
    gen = model.generation_config
    assert (gen.pad_token_id, gen.eos_token_id) == (0, 2)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    dropouts = {k: v for k, v in cfg.to_dict().items() if "dropout" in k or k.endswith("_pdrop")}
    assert dropouts and all(v == 0 for v in dropouts.values()), dropouts
    # untied: the output layer is its own tensor
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight


def test_sizes_table():
    assert SIZES["nano"] == {"hidden": 32, "layers": 1, "heads": 2, "intermediate": 128}
    assert SIZES["tiny"]["hidden"] < SIZES["small"]["hidden"]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_seeded_build_is_deterministic_and_leaves_global_rng(arch, tok):
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a = build_tiny_model(arch, tok, "nano", seed=7)
    assert torch.equal(torch.rand(3), expected_next)  # fork_rng: caller's stream untouched
    b = build_tiny_model(arch, tok, "nano", seed=7)
    c = build_tiny_model(arch, tok, "nano", seed=8)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not all(torch.equal(sa[k], sc[k]) for k in sa)


def test_generic_overrides_apply_to_gpt2(tok):
    # GPT-2 names its width n_embd; the generic name goes through its attribute map
    model = build_tiny_model("gpt2", tok, "nano", hidden_size=16, num_hidden_layers=2)
    assert (model.config.n_embd, model.config.n_layer) == (16, 2)


def test_reward_model_has_one_label(tok):
    rm = build_tiny_reward_model("llama", tok, "nano")
    assert rm.config.num_labels == 1
    assert rm.score.weight.shape == (1, 32)


def test_unknown_choices(tok):
    with pytest.raises(ValueError, match="unknown architecture 'bert'.*llama"):
        build_tiny_model("bert", tok)
    with pytest.raises(ValueError, match="unknown size 'huge'.*nano"):
        build_tiny_model("llama", tok, "huge")


def test_init_model_char_round_trip(tmp_path):
    out = init_model(tmp_path / "m", "qwen2", "nano", alphabet=ALPHABET, max_positions=32)
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    tok = load_tokenizer(out)
    assert tok("1+1=")["input_ids"] == [5, 14, 5, 15]  # '1'=4+1, '+'=4+10, '='=4+11
    assert tok.model_max_length == 32
    model = load_causal_lm(out)
    assert model.config.model_type == "qwen2" and model.config.vocab_size == len(tok)


def test_init_model_bpe_and_errors(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello world\n" * 10)
    out = init_model(tmp_path / "b", "gpt2", "nano", text_file=text, vocab_size=270)
    assert load_causal_lm(out).config.vocab_size == len(load_tokenizer(out)) <= 270
    with pytest.raises(FileExistsError, match="already holds a model") as err:
        init_model(out, "gpt2", "nano", text_file=text, vocab_size=270)
    assert "delete that one first (from Python, init_model(..., overwrite=True)" in str(err.value)
    init_model(out, "llama", "nano", alphabet="ab", overwrite=True)
    assert load_causal_lm(out).config.model_type == "llama"
    with pytest.raises(ValueError, match="alphabet=.*text_file="):
        init_model(tmp_path / "none")


def test_init_model_refuses_two_tokenizer_sources_and_no_positions(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("ab\n")
    with pytest.raises(ValueError, match="got both alphabet and text_file; pass one"):
        init_model(tmp_path / "m", alphabet="ab", text_file=text)
    with pytest.raises(ValueError, match="max_positions=0 must be positive"):
        init_model(tmp_path / "m", alphabet="ab", max_positions=0)
    assert not (tmp_path / "m").exists()
