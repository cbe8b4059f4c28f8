"""One contract for every rollout engine: hf and the fake engine here, vLLM under the `vllm`
marker (`make test-vllm`). The reference is the hf engine in one micro-batch and the
trainer's own scoring pass (`sequence_logprobs`) on the same weights.

The model is a one-layer Llama with one 32-wide attention head (vLLM's CPU kernels need a
head size >= 32) and tied embeddings (an engine must take the LM head from the embedding).
One engine per engine kind serves the whole module (vLLM takes seconds to start); each test
first pushes the weights it needs.
"""

from __future__ import annotations

import pytest
import torch

from proxima.config import Config
from proxima.models import build_char_tokenizer, build_tiny_model
from proxima.models.saving import export_weights, load_named_weights
from proxima.rollout.contract import RolloutEngine
from proxima.rollout.experience import sequence_logprobs
from proxima.rollout.hf_engine import HFEngine
from proxima.rollout.types import Sampling
from tests.rollout.fake_engine import FakeEngine

ALPHABET = "0123456789+="
PROMPTS = ["12+34=", "7+8=", "99+1=", "5=", "3+3+3="]  # lengths differ: left padding
MAX_NEW = 8
LOGPROB_TOL = 1e-4  # float32 on both sides (measured: hf ~1e-6, vLLM CPU ~1e-6)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(ALPHABET)


def _model(tok, seed: int):
    return build_tiny_model(
        "llama",
        tok,
        "nano",
        max_positions=64,
        seed=seed,
        num_attention_heads=1,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        initializer_range=0.3,  # at 0.02 a tied one-layer model just repeats its last token
    ).eval()


@pytest.fixture(scope="module")
def models(tok):
    """Two different models of the same shape: the weights before and after an update."""
    return _model(tok, 0), _model(tok, 1)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tok, models):
    out = tmp_path_factory.mktemp("contract-model")
    models[0].save_pretrained(out)
    tok.save_pretrained(out)
    return out


ENGINES = ["hf", "fake", pytest.param("vllm", marks=pytest.mark.vllm)]


@pytest.fixture(scope="module", params=ENGINES)
def engine(request, tok, models, model_dir) -> RolloutEngine:
    name = request.param
    if name == "hf":
        built = HFEngine(_model(tok, 2), tok.pad_token_id, micro_batch_size=3)
    elif name == "fake":
        built = FakeEngine(models[0], tok.pad_token_id, micro_batch_size=3)
    else:
        from proxima.rollout.vllm_engine import VLLMEngine

        cfg = Config().replace(
            {
                "model.actor_path": str(model_dir),
                "model.dtype": "float32",
                "data.max_prompt_length": 16,
                "rollout.max_response_length": MAX_NEW,
                "rollout.name": "vllm",
            }
        )
        built = VLLMEngine(cfg, tok, torch.device("cpu"))
    built.wake_up()
    return built


def _batch(tok, prompts=PROMPTS):
    rows = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    width = max(map(len, rows))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def _push(engine, model, version: int) -> None:
    if isinstance(engine, HFEngine):  # it serves its model live: give that model the weights
        with torch.no_grad():
            load_named_weights(engine.model, export_weights(model), "the test's weights")
    engine.update_weights(export_weights(model), version)
    assert engine.weight_version == version


def _hf(model, ids, mask, stops, **kw):
    pad = build_char_tokenizer(ALPHABET).pad_token_id
    sampling = Sampling(MAX_NEW, tuple(stops), **kw)
    return HFEngine(model, pad, len(ids)).generate(ids, mask, sampling)


def _assert_same_generation(got, want):
    assert torch.equal(got.input_ids, want.input_ids)
    assert torch.equal(got.attention_mask, want.attention_mask)
    assert torch.equal(got.response_mask, want.response_mask)
    assert got.stopped.tolist() == want.stopped.tolist()


def tok_special_ids() -> set[int]:
    return set(build_char_tokenizer(ALPHABET).all_special_ids)


def _frequent_token(model, ids, mask) -> int:
    """A token greedy decoding emits in some rows but not all: a stop id that makes some
    responses stop early and others run to the limit."""
    out = _hf(model, ids, mask, [len(ALPHABET) + 100], greedy=True).response_ids  # no stop
    for t in out[:, 1:].flatten().tolist():
        if t in tok_special_ids():
            continue
        rows_with_t = (out == t).any(dim=1)
        if 0 < int(rows_with_t.sum()) < out.shape[0]:
            return t
    raise AssertionError("no token separates the rows; change the prompts or the seed")


def test_greedy_equals_hf_on_the_same_weights(engine, tok, models):
    _push(engine, models[0], 0)
    ids, mask = _batch(tok)
    stops = [tok.eos_token_id, _frequent_token(models[0], ids, mask)]
    sampling = Sampling(MAX_NEW, tuple(stops), greedy=True)
    got = engine.generate(ids, mask, sampling)
    _assert_same_generation(got, _hf(models[0], ids, mask, stops, greedy=True))
    assert got.logprobs is None  # not asked for


def test_output_follows_update_weights(engine, tok, models):
    ids, mask = _batch(tok)
    sampling = Sampling(MAX_NEW, (tok.eos_token_id,), greedy=True)
    for version, model in enumerate([models[1], models[0], models[1]], start=10):
        _push(engine, model, version)
        got = engine.generate(ids, mask, sampling)
        _assert_same_generation(got, _hf(model, ids, mask, [tok.eos_token_id], greedy=True))
    a = _hf(models[0], ids, mask, [tok.eos_token_id], greedy=True).response_ids
    assert not torch.equal(a, got.response_ids)  # the two models really answer differently


def test_stop_tokens_end_the_mask_and_pad_after(engine, tok, models):
    _push(engine, models[0], 0)
    ids, mask = _batch(tok)
    stop = _frequent_token(models[0], ids, mask)
    torch.manual_seed(0)
    gen = engine.generate(ids, mask, Sampling(MAX_NEW, (tok.eos_token_id, stop), greedy=True))
    r = gen.response_mask.shape[1]
    assert gen.input_ids.shape == (len(PROMPTS), ids.shape[1] + r)
    assert torch.equal(gen.input_ids[:, : ids.shape[1]], ids)  # prompts untouched, left-padded
    assert torch.equal(gen.attention_mask[:, -r:], gen.response_mask)
    for row, m, stopped in zip(
        gen.response_ids.tolist(), gen.response_mask.tolist(), gen.stopped, strict=True
    ):
        n_real = sum(m)
        assert m == [1] * n_real + [0] * (r - n_real)  # a prefix: up to the first stop
        assert row[n_real:] == [tok.pad_token_id] * (r - n_real)
        stops_in = [i for i, t in enumerate(row[:n_real]) if t in (tok.eos_token_id, stop)]
        assert bool(stopped) == bool(stops_in)
        if stopped:  # the stop token is the last real token, and the first stop
            assert stops_in == [n_real - 1]
        else:
            assert n_real == MAX_NEW
    assert gen.stopped.any() and not gen.stopped.all()


def test_n_samples_per_prompt_are_grouped_and_distinct(engine, tok, models):
    _push(engine, models[0], 0)
    ids, mask = _batch(tok)
    torch.manual_seed(0)
    gen = engine.generate(ids, mask, Sampling(MAX_NEW, (tok.eos_token_id,), n=4))
    assert gen.input_ids.shape[0] == 4 * len(PROMPTS)
    p = ids.shape[1]
    for i in range(len(PROMPTS)):
        group = gen.input_ids[4 * i : 4 * i + 4]
        assert torch.equal(group[:, :p], ids[i].expand(4, -1))  # prompt i, n times
        assert len({tuple(r) for r in group[:, p:].tolist()}) > 1  # not four copies


@pytest.mark.parametrize(
    "params",
    [{"top_k": 1}, {"top_p": 1e-6}, {"temperature": 1e-4}],
    ids=["top_k=1", "top_p=1e-6", "temperature=1e-4"],
)
def test_sampling_options_that_collapse_to_greedy(engine, tok, models, params):
    """top_k=1, a tiny top_p and a tiny temperature all leave one candidate per step: the
    output is the greedy one, whatever the random draws."""
    _push(engine, models[0], 0)
    ids, mask = _batch(tok)
    torch.manual_seed(0)
    got = engine.generate(ids, mask, Sampling(MAX_NEW, (tok.eos_token_id,), **params))
    _assert_same_generation(got, _hf(models[0], ids, mask, [tok.eos_token_id], greedy=True))


def test_logprobs_of_a_truncated_distribution(engine, tok, models):
    """With top_k=1 the sampling distribution is one token with probability 1: the engine's
    log-probs (after top-k renormalisation) are 0, where the trainer's are not."""
    _push(engine, models[0], 0)
    ids, mask = _batch(tok)
    torch.manual_seed(0)
    gen = engine.generate(ids, mask, Sampling(MAX_NEW, (tok.eos_token_id,), top_k=1, logprobs=True))
    assert gen.logprobs.abs().max() < 1e-5
    trainer = sequence_logprobs(models[0], gen, 1.0, 8)
    assert (trainer * gen.response_mask).abs().max() > 0.1


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_match_the_trainers_within_tolerance(engine, tok, models, temperature):
    _push(engine, models[1], 3)
    ids, mask = _batch(tok)
    torch.manual_seed(0)
    sampling = Sampling(MAX_NEW, (tok.eos_token_id,), temperature=temperature, n=2, logprobs=True)
    gen = engine.generate(ids, mask, sampling)
    want = sequence_logprobs(models[1], gen, temperature, 8)
    assert gen.logprobs.shape == want.shape
    assert (gen.logprobs[gen.response_mask == 0] == 0).all()
    diff = (gen.logprobs - want).abs() * gen.response_mask
    assert float(diff.max()) < LOGPROB_TOL, float(diff.max())


@pytest.mark.gpu
@pytest.mark.vllm
def test_sleep_releases_gpu_memory_and_wake_up_serves_again(engine, tok, models):
    """CUDA only (vLLM's CPU build ignores sleep mode): sleep frees the KV cache and offloads
    the weights; after wake_up the engine answers as before."""
    if engine.name != "vllm" or not engine.sleep_mode:
        pytest.skip("sleep mode is vLLM's, on a platform that supports it")
    _push(engine, models[0], 0)
    ids, mask = _batch(tok)
    sampling = Sampling(MAX_NEW, (tok.eos_token_id,), greedy=True)
    want = engine.generate(ids, mask, sampling)
    free_awake, _ = torch.cuda.mem_get_info()
    engine.sleep()
    free_asleep, _ = torch.cuda.mem_get_info()
    assert free_asleep > free_awake
    engine.wake_up()
    _assert_same_generation(engine.generate(ids, mask, sampling), want)
