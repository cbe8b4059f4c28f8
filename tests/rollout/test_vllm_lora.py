"""A LoRA actor reaches vLLM as base + adapter (`VLLMEngine.update_adapter`), never as a
merged copy: greedy answers equal HF `generate` on the merged model and the same engine fed
the merged copy (`update_weights`), the engine's log-probs equal the trainer's scoring pass
on the peft model, the base is read once, and one adapter is loaded however many pushes came.
Where vLLM cannot apply the adapter (an adapter on the LM head) the push is the merged copy.

One LoRA-enabled engine serves the module (its own file: one vLLM engine per module)."""

from __future__ import annotations

import json

import pytest
import torch

from proxima.config import Config
from proxima.models import build_tiny_model
from proxima.models.lora import add_lora, export_adapter, merged_copy
from proxima.models.saving import export_weights
from proxima.rollout.engines import sync_weights
from proxima.rollout.experience import sequence_logprobs
from proxima.rollout.types import Sampling
from tests.rollout.test_engine_contract import (
    LOGPROB_TOL,
    MAX_NEW,
    _assert_same_generation,
    _batch,
    _hf,
    _model,
)

pytestmark = pytest.mark.vllm

RANK = 4  # vLLM takes 8 (its smallest max_lora_rank above 4)


def _cfg(model_dir, **extra) -> Config:
    return Config().replace(
        {
            "model.actor_path": str(model_dir),
            "model.dtype": "float32",
            "model.lora_rank": RANK,
            "model.lora_alpha": 8.0,
            "data.max_prompt_length": 16,
            "rollout.max_response_length": MAX_NEW,
            "rollout.name": "vllm",
            **extra,
        }
    )


@pytest.fixture(scope="module")
def tok():
    from proxima.models import build_char_tokenizer
    from tests.rollout.test_engine_contract import ALPHABET

    return build_char_tokenizer(ALPHABET)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok):
    out = tmp_path_factory.mktemp("lora-model")
    _model(tok, 0).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _actor(tok, model_dir, seed: int, **extra):
    """The LoRA actor on the saved base, its adapters moved off zero (an update landed)."""
    actor = add_lora(_model(tok, 0), _cfg(model_dir, **extra).model, "CAUSAL_LM").eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in actor.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return actor


@pytest.fixture(scope="module")
def engine(tok, model_dir):
    from proxima.rollout.vllm_engine import VLLMEngine

    built = VLLMEngine(_cfg(model_dir), tok, torch.device("cpu"))
    built.wake_up()
    yield built
    built.close()


def _greedy(tok) -> Sampling:
    return Sampling(MAX_NEW, (tok.eos_token_id,), greedy=True)


def test_engine_is_built_for_adapters(engine):
    assert engine.lora_rank == 8 and engine.adapters
    assert engine.loaded_adapters() == set()


def test_adapter_push_answers_as_the_merged_model(engine, tok, model_dir):
    actor = _actor(tok, model_dir, seed=1)
    merged = merged_copy(actor).eval()
    ids, mask = _batch(tok)
    want = _hf(merged, ids, mask, [tok.eos_token_id], greedy=True)
    base = _hf(_model(tok, 0), ids, mask, [tok.eos_token_id], greedy=True)
    assert not torch.equal(want.response_ids, base.response_ids)  # the adapter matters

    sync_weights(engine, actor, 1)
    assert engine.adapter is not None and engine.weight_version == 1
    by_adapter = engine.generate(ids, mask, _greedy(tok))
    _assert_same_generation(by_adapter, want)

    engine.update_weights(export_weights(actor), 2)  # the merged copy, on the same engine
    assert engine.adapter is None and engine.loaded_adapters() == set()
    _assert_same_generation(engine.generate(ids, mask, _greedy(tok)), want)

    sync_weights(engine, actor, 3)  # back to base + adapter: the base is pushed again
    assert engine.base_loaded and engine.adapter is not None
    _assert_same_generation(engine.generate(ids, mask, _greedy(tok)), want)


def test_logprobs_equal_the_trainers(engine, tok, model_dir):
    actor = _actor(tok, model_dir, seed=2)
    sync_weights(engine, actor, 4)
    ids, mask = _batch(tok)
    torch.manual_seed(0)
    gen = engine.generate(ids, mask, Sampling(MAX_NEW, (tok.eos_token_id,), n=2, logprobs=True))
    with torch.no_grad():
        trainer = sequence_logprobs(actor, gen, temperature=1.0, chunks=4)
    assert (gen.logprobs - trainer).abs().max().item() < LOGPROB_TOL
    assert gen.response_mask.sum() > len(gen.response_mask)  # more than one token each


def test_pushes_carry_the_adapter_alone_and_one_stays_loaded(engine, tok, model_dir):
    def never_read():
        raise AssertionError("the base weights were pushed again")
        yield  # pragma: no cover

    ids, mask = _batch(tok)
    sync_weights(engine, _actor(tok, model_dir, seed=3), 5)  # the base is loaded after this
    for version, seed in ((6, 4), (7, 5)):
        actor = _actor(tok, model_dir, seed=seed)
        engine.update_adapter(never_read(), export_adapter(actor), version)
        loaded = engine.loaded_adapters()
        assert loaded == {engine.adapter.lora_int_id}  # the previous one was removed
        folders = list(engine._adapter_root.iterdir())
        assert [f.name for f in folders] == [f"v{version}-{engine.adapter.lora_int_id}"]
        assert json.loads((folders[0] / "adapter_config.json").read_text())["r"] == RANK
        want = _hf(merged_copy(actor).eval(), ids, mask, [tok.eos_token_id], greedy=True)
        _assert_same_generation(engine.generate(ids, mask, _greedy(tok)), want)  # not cached


def test_adapter_rank_is_rounded_up_or_refused(model_dir, tok, tmp_path):
    from proxima.rollout.vllm_engine import adapter_rank

    assert adapter_rank(_cfg(model_dir)) == (8, None)
    assert adapter_rank(_cfg(model_dir, **{"model.lora_rank": 16})) == (16, None)
    assert adapter_rank(_cfg(model_dir, **{"model.lora_rank": 0})) == (0, None)
    rank, why = adapter_rank(_cfg(model_dir, **{"model.lora_rank": 1000}))
    assert rank == 0 and "ranks up to 512" in why
    gpt2 = tmp_path / "gpt2"
    build_tiny_model("gpt2", tok, "nano", max_positions=64).save_pretrained(gpt2)
    rank, why = adapter_rank(_cfg(gpt2))
    assert rank == 0 and "no LoRA support for GPT2LMHeadModel" in why


@pytest.mark.filterwarnings("ignore:Model .*tie_word_embeddings:UserWarning")
def test_an_adapter_vllm_cannot_apply_goes_merged(engine, tok, model_dir):
    """Last in the module: the engine takes merged pushes from then on."""
    from proxima.rollout.vllm_engine import MergedLoraPushWarning

    targets = {"model.lora_target_modules": ["q_proj", "lm_head"]}
    actor = _actor(tok, model_dir, seed=6, **targets)
    with pytest.warns(MergedLoraPushWarning, match="lm_head is not a linear layer of the back"):
        sync_weights(engine, actor, 8)
    assert engine.adapter is None and engine.loaded_adapters() == set()
    ids, mask = _batch(tok)
    want = _hf(merged_copy(actor).eval(), ids, mask, [tok.eos_token_id], greedy=True)
    _assert_same_generation(engine.generate(ids, mask, _greedy(tok)), want)
