"""The engine registry (`rollout.engines`): one class per `rollout.name`, each answering
its own checks, memory share and log-prob exactness; the unknown name refused; an engine
built outside proxima answered by the base class."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from proxima.config import ConfigError, load_config
from proxima.config.choices import ENGINES as ENGINE_NAMES
from proxima.models import build_char_tokenizer, build_tiny_model
from proxima.rollout.engines import (
    ENGINES,
    EngineSpec,
    HFSpec,
    VLLMSpec,
    build_engine,
    check_engine,
    engine_spec,
    spec_of,
)
from proxima.rollout.hf_engine import HFEngine

BASE = ["model.actor_path=m", "data.train_path=p.jsonl", "reward.function=f.py:fn"]
FP32 = ["model.dtype=float32", "model.mixed_precision=no"]
GiB = 2**30


def cfg(*overrides: str):
    return load_config(None, BASE + list(overrides))


def test_the_registry_holds_the_names_rollout_name_takes():
    assert tuple(ENGINES) == ENGINE_NAMES  # the config's choices are the registry's names
    for name in ENGINE_NAMES:  # each name builds its own class, which knows its name
        assert engine_spec(name).name == name
    assert type(engine_spec("hf")) is HFSpec and type(engine_spec("vllm")) is VLLMSpec


def test_an_unknown_engine_is_refused_with_the_names_there_are():
    with pytest.raises(ConfigError, match=r"`rollout.name`='sglang' .* Use one of: hf, vllm"):
        engine_spec("sglang")


def test_a_built_engine_is_answered_by_its_class_or_the_base_one():
    class Fake:
        name = "fake"

    assert type(spec_of(Fake())) is EngineSpec and spec_of(Fake()).name == "fake"
    assert type(spec_of("vllm")) is VLLMSpec
    fake = spec_of(Fake())
    assert not fake.serves_actor and fake.logprob_fixes == ()
    assert fake.logprobs_differ(cfg()) == "the fake engine has its own kernels"
    assert fake.held_memory(cfg(), 10, 4, None) == {}


def test_what_each_engine_answers():
    hf, vllm = engine_spec("hf"), engine_spec("vllm")
    assert hf.serves_actor and not vllm.serves_actor
    assert hf.logprob_fixes == () and vllm.logprob_fixes == ("rollout.vllm.dtype=float32",)
    assert vllm.logprobs_differ(cfg(*FP32)) == "the vllm engine has its own kernels"


@pytest.mark.parametrize(
    ("overrides", "why"),
    [
        (FP32, ""),
        (["model.dtype=bfloat16"], "not float32"),
        ([*FP32, "rollout.top_k=5"], "top_k / top_p renormalise"),
        ([*FP32, "rollout.top_p=0.9"], "top_k / top_p renormalise"),
        ([*FP32, "algorithm.rollout_correction=token"], "rollout_rejection compare the two"),
        ([*FP32, "algorithm.rollout_rejection=geometric"], "rollout_rejection compare the two"),
    ],
)
def test_the_hf_engine_log_probs_are_exact_only_where_nothing_differs(overrides, why):
    got = engine_spec("hf").logprobs_differ(cfg(*overrides))
    assert why in got if why else got == ""


def test_the_hf_engine_is_told_apart_by_the_actors_generation_config():
    from transformers import GenerationConfig

    hf, c = engine_spec("hf"), cfg(*FP32)
    assert hf.logprobs_differ(c, GenerationConfig(eos_token_id=2, top_k=0)) == ""
    rep = GenerationConfig(repetition_penalty=1.3)
    assert hf.logprobs_differ(c, rep) == "the actor's generation_config sets repetition_penalty"


def test_memory_shares(monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    hf, vllm = engine_spec("hf"), engine_spec("vllm")
    assert hf.held_memory(cfg(), 1000, 4, None) == {}
    # a CPU: its weights in the actor's dtype (vllm.dtype=auto) and the 1 GiB of KV cache
    # proxima has vLLM reserve when VLLM_CPU_KVCACHE_SPACE is unset
    assert vllm.held_memory(cfg(), 1000, 4, None) == {
        "vllm weights": 4000,
        "vllm kv cache": 1 * GiB,
    }
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1.5")
    half = vllm.held_memory(cfg("rollout.vllm.dtype=bfloat16"), 1000, 4, None)
    assert half == {"vllm weights": 2000, "vllm kv cache": 3 * GiB // 2}
    # a GPU: its share of the device
    share = vllm.held_memory(cfg("rollout.vllm.gpu_memory_utilization=0.25"), 1000, 4, 8 * GiB)
    assert share == {"vllm engine": 2 * GiB}


def test_the_kv_cache_planned_is_the_one_the_engine_sets(monkeypatch):
    """The memory plan runs before the engine is built, while VLLM_CPU_KVCACHE_SPACE is still
    unset: it counts the reservation the engine then asks vLLM for, not vLLM's own default."""
    from proxima.rollout.vllm_engine import _colocated_env

    for key in (
        "VLLM_CPU_KVCACHE_SPACE",
        "VLLM_ENABLE_V1_MULTIPROCESSING",
        "RANK",
        "LOCAL_RANK",
        "WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
    ):
        monkeypatch.setenv(key, "unset")  # so that the undo removes what the engine sets
        monkeypatch.delenv(key)
    planned = engine_spec("vllm").held_memory(cfg(), 1000, 4, None)["vllm kv cache"]
    _colocated_env()
    assert float(os.environ["VLLM_CPU_KVCACHE_SPACE"]) * GiB == planned
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")  # the user's own setting wins in both
    _colocated_env()
    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert engine_spec("vllm").held_memory(cfg(), 1000, 4, None)["vllm kv cache"] == 3 * GiB


def test_the_hf_engine_builds_around_the_actor_and_always_runs():
    c = cfg("rollout.micro_batch_size=3")
    check_engine(c)  # nothing to check
    tok = build_char_tokenizer("0123456789+=")
    actor = build_tiny_model("llama", tok, "nano", max_positions=32)
    engine = build_engine(c, actor, tok, torch.device("cpu"))
    assert isinstance(engine, HFEngine) and engine.name == "hf"
    assert spec_of(engine).serves_actor


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_vllm_missing_stops_its_check_with_the_fix():
    with pytest.raises(ConfigError, match="`rollout.name=vllm` but vLLM cannot be imported"):
        check_engine(cfg("rollout.name=vllm"))
