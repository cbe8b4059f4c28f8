"""LoRA roles (proxima.models.lora) on nano models: what trains, the adapter-disabled
reference, merging, saving and loading back.

Oracles: the base model as built (a second build from the same seed), the merged model,
and tensors compared one by one.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from proxima.config import ConfigError, ModelConfig, load_config
from proxima.models import build_char_tokenizer, build_tiny_model, load_critic
from proxima.models.forward import _accepts_logits_to_keep, response_logits, response_values
from proxima.models.lora import (
    AdapterDisabled,
    adapter_problem,
    add_lora,
    backbone_linear_names,
    export_adapter,
    is_lora,
    load_adapter_weights,
    merged_copy,
)
from proxima.models.saving import export_base_weights, export_weights, save_role
from proxima.rollout.hf_engine import HFEngine
from proxima.rollout.types import Sampling

ALPHABET = "0123456789+="
LORA = ModelConfig(lora_rank=4)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(ALPHABET)


def _base(tok, arch: str = "llama"):
    return build_tiny_model(arch, tok, "nano", max_positions=32, seed=0)


def _actor(tok, arch: str = "llama", seed: int = 0):
    return add_lora(_base(tok, arch), LORA, "CAUSAL_LM", seed=seed)


def _critic_folder(tok, tmp_path, arch: str = "llama"):
    folder = tmp_path / f"{arch}-base"
    _base(tok, arch).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _critic(folder):
    return add_lora(load_critic(folder, seed=0), LORA, "TOKEN_CLS", seed=1)


@torch.no_grad()
def _perturb(model, scale: float = 0.1, seed: int = 3) -> None:
    """Move every trainable tensor, as training would (B starts at 0: a fresh adapter is a
    no-op, so without this the comparisons below would hold trivially)."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        if p.requires_grad:
            p.add_(scale * torch.randn(p.shape, generator=gen))


def _batch():
    # "1+2=" left-padded and "12+34=" (char ids: pad 0, "0".."9" 4..13, "+" 14, "=" 15)
    ids = torch.tensor([[0, 0, 5, 14, 6, 15], [5, 6, 14, 7, 8, 15]])
    return ids, (ids != 0).long()


def test_backbone_linear_names_exclude_heads(tok):
    assert backbone_linear_names(_base(tok, "llama")) == [
        "down_proj",
        "gate_proj",
        "k_proj",
        "o_proj",
        "q_proj",
        "up_proj",
        "v_proj",
    ]
    assert backbone_linear_names(_base(tok, "gpt2")) == ["c_attn", "c_fc", "c_proj"]  # Conv1D


def test_only_lora_params_train_in_the_actor(tok):
    actor = _actor(tok)
    trainable = {n: p.numel() for n, p in actor.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # llama nano (hidden 32, intermediate 128, 1 layer), r = 4: A is [4, in], B is [out, 4]
    # q, k, v, o: 32 -> 32, 4*32 + 32*4 = 256 each = 1024; gate, up: 32 -> 128,
    # 4*32 + 128*4 = 640 each = 1280; down: 128 -> 32, 4*128 + 32*4 = 640.  Total 2944.
    assert sum(trainable.values()) == 2944
    assert len(trainable) == 2 * 7


def test_critic_trains_lora_and_its_whole_head(tok, tmp_path):
    critic = _critic(_critic_folder(tok, tmp_path))
    trainable = sorted(n for n, p in critic.named_parameters() if p.requires_grad)
    head = [n for n in trainable if "lora_" not in n]
    assert head == [
        "base_model.model.score.modules_to_save.default.bias",
        "base_model.model.score.modules_to_save.default.weight",
    ]
    assert len(trainable) - len(head) == 2 * 7  # A and B of the 7 backbone linear layers


def test_add_lora_is_seeded_and_leaves_the_global_rng(tok):
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a, b, c = _actor(tok, seed=0), _actor(tok, seed=0), _actor(tok, seed=1)
    assert torch.equal(torch.rand(1), expected_next)  # adding adapters drew nothing globally
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    lora_a = [k for k in sa if ".lora_A." in k]
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not any(torch.equal(sa[k], sc[k]) for k in lora_a)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_adapter_disabled_is_exactly_the_base(tok, arch):
    base, actor = _base(tok, arch), _actor(tok, arch)
    reference = AdapterDisabled(actor)
    assert list(reference.parameters()) == []  # a view: no second copy of the weights
    ids, mask = _batch()
    with torch.no_grad():
        before = response_logits(actor, ids, mask, 3)
        _perturb(actor)
        after = response_logits(actor, ids, mask, 3)
        ref = response_logits(reference, ids, mask, 3)
        want = response_logits(base, ids, mask, 3)
    assert torch.equal(before, want)  # B = 0 at the start: the actor is the base
    assert not torch.allclose(after, want, atol=1e-3)  # the adapters now matter
    assert torch.equal(ref, want)  # bit for bit: adapters off is the base model
    # the adapters are back on (and trainable) after the reference's forward
    assert torch.equal(response_logits(actor, ids, mask, 3).detach(), after)
    assert any(p.requires_grad for p in actor.parameters())


def test_adapter_disabled_needs_a_lora_model(tok):
    with pytest.raises(ValueError, match="LoRA actor"):
        AdapterDisabled(_base(tok))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_merged_copy_matches_and_leaves_the_adapters(tok, arch):
    actor = _actor(tok, arch)
    _perturb(actor)
    ids, mask = _batch()
    merged = merged_copy(actor)
    assert not is_lora(merged) and is_lora(actor)
    assert not any("lora_" in n for n in merged.state_dict())
    with torch.no_grad():
        lora_logits = response_logits(actor, ids, mask, 3)
        merged_logits = response_logits(merged, ids, mask, 3)
    # W + (alpha / r) B A in one matrix: equal up to float rounding
    torch.testing.assert_close(merged_logits, lora_logits, atol=1e-5, rtol=0)
    assert any(".lora_B." in n for n in actor.state_dict())  # the original is untouched


def test_logits_to_keep_passes_through_the_peft_model(tok, monkeypatch):
    actor = _actor(tok)
    _perturb(actor)
    assert _accepts_logits_to_keep(actor) and _accepts_logits_to_keep(AdapterDisabled(actor))
    seen = []
    inner = actor.get_base_model()
    original = inner.forward
    monkeypatch.setattr(inner, "forward", lambda *a, **k: seen.append(k) or original(*a, **k))
    ids, mask = _batch()
    with torch.no_grad():
        got = response_logits(actor, ids, mask, 3)
        want = response_logits(merged_copy(actor), ids, mask, 3)
    assert seen[0]["logits_to_keep"] == 4  # response length 3 + 1
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_generate_on_the_peft_model_equals_the_merged_model(tok):
    actor = _actor(tok)
    _perturb(actor, scale=0.5)
    ids, mask = _batch()
    greedy = Sampling(max_new_tokens=4, stop_ids=(tok.eos_token_id,), greedy=True)
    got = HFEngine(actor, 0, len(ids)).generate(ids, mask, greedy)
    want = HFEngine(merged_copy(actor), 0, len(ids)).generate(ids, mask, greedy)
    assert torch.equal(got.input_ids, want.input_ids)
    assert actor.training  # generation restores train mode


def test_save_role_writes_merged_folder_and_adapter_that_load_back(tok, tmp_path):
    folder = _critic_folder(tok, tmp_path)
    actor, critic = _actor(tok), _critic(folder)
    _perturb(actor)
    _perturb(critic, seed=4)
    save_role(actor, tok, tmp_path / "out", "actor")
    save_role(critic, tok, tmp_path / "out", "critic")
    out = tmp_path / "out"
    for name in ("actor", "critic"):
        assert (out / name / "tokenizer.json").is_file()
        assert (out / f"{name}_adapter" / "adapter_config.json").is_file()
    ids, mask = _batch()
    plain_actor = AutoModelForCausalLM.from_pretrained(out / "actor", local_files_only=True)
    plain_critic = AutoModelForTokenClassification.from_pretrained(
        out / "critic", local_files_only=True
    )
    with torch.no_grad():
        torch.testing.assert_close(
            response_logits(plain_actor, ids, mask, 3),
            response_logits(actor, ids, mask, 3),
            atol=1e-5,
            rtol=0,
        )
        torch.testing.assert_close(
            response_values(plain_critic, ids, mask, 3),
            response_values(critic, ids, mask, 3),
            atol=1e-5,
            rtol=0,
        )
    # a freshly built LoRA model + the adapter folder = the saved model, bit for bit
    for name, saved, fresh in (
        ("actor", actor, _actor(tok)),
        ("critic", critic, _critic(folder)),
    ):
        load_adapter_weights(fresh, out / f"{name}_adapter", name)
        a, b = saved.state_dict(), fresh.state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_base_and_adapter_exports_rebuild_the_actor(tok, arch, tmp_path):
    """What an engine that applies adapters gets: the base weights under the plain model's
    names (the same tensors, no copy) and the adapter as peft saves it, which loads back
    onto a fresh actor bit for bit."""
    actor = _actor(tok, arch)
    _perturb(actor)
    base = dict(export_base_weights(actor))
    plain = dict(export_weights(_base(tok, arch)))
    assert base.keys() == plain.keys() and all(torch.equal(base[k], plain[k]) for k in base)
    inner = actor.get_base_model().state_dict()
    assert any(base[k].data_ptr() == v.data_ptr() for k in base for v in inner.values())
    adapter = export_adapter(actor)
    assert adapter.rank == 4 and adapter.tensors and all(".lora_" in k for k in adapter.tensors)
    assert sorted(adapter.config["target_modules"]) == backbone_linear_names(_base(tok, arch))
    adapter.save(tmp_path / "adapter")
    fresh = _actor(tok, arch, seed=5)
    load_adapter_weights(fresh, tmp_path / "adapter", "actor")
    a, b = actor.state_dict(), fresh.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert adapter_problem(actor) is None


@pytest.mark.filterwarnings("ignore:Model .*tie_word_embeddings:UserWarning")
def test_adapter_problem_names_what_an_engine_cannot_apply(tok):
    on_head = add_lora(_base(tok), ModelConfig(lora_rank=4, lora_target_modules=["lm_head"]),
                       "CAUSAL_LM")  # fmt: skip
    assert adapter_problem(on_head) == "lm_head is not a linear layer of the backbone"
    on_embedding = ModelConfig(lora_rank=4, lora_target_modules=["embed_tokens", "q_proj"])
    problem = adapter_problem(add_lora(_base(tok), on_embedding, "CAUSAL_LM"))
    assert problem == "model.embed_tokens is not a linear layer of the backbone"


def test_load_adapter_weights_errors_name_the_fix(tok, tmp_path):
    with pytest.raises(FileNotFoundError, match="model.lora_"):
        load_adapter_weights(_actor(tok), tmp_path, "actor")
    save_role(_actor(tok), tok, tmp_path, "actor")
    rank8 = add_lora(_base(tok), ModelConfig(lora_rank=8), "CAUSAL_LM")
    with pytest.raises(ValueError, match="model.lora_\\* settings"):
        load_adapter_weights(rank8, tmp_path / "actor_adapter", "actor")


def test_add_lora_unknown_target_names_the_key(tok):
    cfg = ModelConfig(lora_rank=4, lora_target_modules=["nope"])
    with pytest.raises(ValueError, match="model.lora_target_modules.*q_proj"):
        add_lora(_base(tok), cfg, "CAUSAL_LM")


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("model.lora_rank=-1", "model.lora_rank"),
        ("model.lora_alpha=0", "model.lora_alpha"),
        ("model.lora_dropout=1.0", "model.lora_dropout"),
        ("model.lora_dropout=-0.1", "model.lora_dropout"),
    ],
)
def test_config_rejects_bad_lora_values(override, key):
    with pytest.raises(ConfigError, match=key):
        load_config(None, ["task.name=arithmetic", override])


def test_config_lora_defaults_mean_full_fine_tuning():
    m = load_config(None, ["task.name=arithmetic"]).model
    assert (m.lora_rank, m.lora_alpha, m.lora_dropout, m.lora_target_modules) == (0, 16.0, 0.0, [])
    assert m.critic_lora is True
