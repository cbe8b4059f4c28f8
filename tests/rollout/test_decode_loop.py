"""The hf engine's decode loop (`rollout.decode.decode_loop`) against HF `generate` (the
loop's fallback) on the same weights: greedy tokens, masks and stop flags equal, log-probs
and values within float rounding; the inverse-CDF draw picks tokens with their
probabilities; rows that end leave the batch; and where the loop does not apply. Every
test runs with the prompts prefilled in one pass and in groups of similar length."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import proxima.rollout.decode as decode
import proxima.rollout.hf_engine as hf_engine
from proxima.algos import logprobs_from_logits
from proxima.models import ARCHITECTURES
from proxima.models.critic import PolicyValue
from proxima.models.forward import response_logits, response_logits_values
from proxima.models.tiny import build_tiny_model
from proxima.models.tokenizers import build_char_tokenizer
from proxima.rollout.decode import inverse_cdf_draw, loop_applies
from proxima.rollout.hf_engine import HFEngine
from proxima.rollout.types import Sampling

pytestmark = pytest.mark.usefixtures("one_thread")

ALPHABET = "0123456789+="
PROMPTS = ["12+34=", "7+8=", "99+1=", "5=", "3+3+3=", "8=", "1+1=", "64+2="]
MAX_NEW = 10


@pytest.fixture(autouse=True, params=[12, 2048], ids=["prefill-groups", "one-prefill"])
def prefill_tokens(request, monkeypatch):
    """Every test with the prompts prefilled in groups of similar length (12 padded tokens
    each: groups of 2, 2, 3 and 1 rows, 6, 5, 4 and 2 tokens wide) and in one pass."""
    monkeypatch.setattr(decode, "PREFILL_TOKENS", request.param)
    return request.param


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(ALPHABET)


@pytest.fixture(scope="module")
def model(tok):
    return build_tiny_model(
        "llama", tok, "nano", max_positions=64, seed=5, initializer_range=0.5
    ).eval()


def _batch(tok):
    rows = [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    width = max(map(len, rows))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    return ids, mask


def _run(model, tok, loop: bool, monkeypatch, stops, rows: int = 0, **kw):
    """The engine on PROMPTS, in micro-batches of `rows` rows (0: one micro-batch)."""
    reason = "" if loop else "the test asks for HF generate"
    monkeypatch.setattr(hf_engine, "loop_applies", lambda m: reason)
    ids, mask = _batch(tok)
    engine = HFEngine(model, tok.pad_token_id, rows or len(PROMPTS) * kw.get("n", 1), tok)
    return engine.generate(ids, mask, Sampling(MAX_NEW, tuple(stops), **kw))


def _splitting_stop(model, tok, monkeypatch) -> int:
    """A token greedy decoding emits in some rows, at different steps, but not in all: as a
    stop id it ends rows at different steps (the loop compacts its batch) and leaves some
    running to the limit."""
    out = _run(model, tok, False, monkeypatch, [tok.eos_token_id], greedy=True).response_ids
    for t in out[:, 1:].flatten().tolist():
        if t in tok.all_special_ids:
            continue
        hit = (out == t).any(dim=1)
        if 1 < int(hit.sum()) < out.shape[0]:
            return t
    raise AssertionError("no token splits the rows; change the prompts or the seed")


def test_greedy_equals_hf_generate(model, tok, monkeypatch):
    stop = _splitting_stop(model, tok, monkeypatch)
    kw = dict(stops=[stop, tok.eos_token_id], greedy=True, logprobs=True)
    got = _run(model, tok, True, monkeypatch, **kw)
    want = _run(model, tok, False, monkeypatch, **kw)
    assert torch.equal(got.input_ids, want.input_ids)
    assert torch.equal(got.response_mask, want.response_mask)
    assert got.stopped.tolist() == want.stopped.tolist()
    assert 0 < int(got.stopped.sum()) < len(PROMPTS)  # some ended, some ran to the limit
    assert torch.allclose(got.logprobs, want.logprobs, atol=1e-5)
    assert bool((got.logprobs[got.response_mask == 0] == 0).all())


def test_sampled_logprobs_are_the_trainers(model, tok, monkeypatch):
    torch.manual_seed(0)
    stop = _splitting_stop(model, tok, monkeypatch)
    gen = _run(model, tok, True, monkeypatch, [stop], temperature=0.7, logprobs=True)
    r = gen.response_ids.shape[1]
    with torch.no_grad():
        logits = response_logits(model, gen.input_ids, gen.attention_mask, r, 0.7)
    trainer = logprobs_from_logits(logits, gen.response_ids) * gen.response_mask
    assert torch.allclose(gen.logprobs, trainer, atol=1e-5)
    assert float(gen.response_mask.sum()) > len(PROMPTS)


def test_values_of_the_decode_steps_are_the_critics(model, tok, monkeypatch):
    head = nn.Linear(model.config.hidden_size, 1)
    torch.nn.init.normal_(head.weight, std=0.5)
    actor = PolicyValue(model, head)
    stop = _splitting_stop(model, tok, monkeypatch)
    kw = dict(stops=[stop], greedy=True, values=True)
    got = _run(actor, tok, True, monkeypatch, **kw)
    want = _run(actor, tok, False, monkeypatch, **kw)
    assert torch.equal(got.response_ids, want.response_ids)
    assert torch.allclose(got.values, want.values, atol=1e-5)
    r = got.response_ids.shape[1]
    with torch.no_grad():
        _, scored = response_logits_values(actor, got.input_ids, got.attention_mask, r)
    assert torch.allclose(got.values, scored * got.response_mask, atol=1e-5)
    with pytest.raises(ValueError, match="value head"):
        _run(model, tok, True, monkeypatch, [stop], values=True)


def test_stop_strings_end_rows_as_in_hf_generate(model, tok, monkeypatch):
    free = _run(model, tok, False, monkeypatch, [tok.eos_token_id], greedy=True)
    texts = [tok.decode(r) for r in free.response_ids[:, :4].tolist()]
    string = next(t[1:3] for t in texts if t[1:3] and sum(t[1:3] in x for x in texts) >= 2)
    kw = dict(stops=[tok.eos_token_id], greedy=True, stop_strings=(string,))
    got = _run(model, tok, True, monkeypatch, **kw)
    want = _run(model, tok, False, monkeypatch, **kw)
    assert torch.equal(got.response_ids, want.response_ids)
    assert torch.equal(got.response_mask, want.response_mask)
    assert got.stopped.tolist() == want.stopped.tolist()
    assert any(got.stopped.tolist())


def test_rows_that_end_leave_the_batch(model, tok, monkeypatch, prefill_tokens):
    stop = _splitting_stop(model, tok, monkeypatch)
    shapes = []
    hook = model.model.register_forward_pre_hook(
        lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    try:
        gen = _run(model, tok, True, monkeypatch, [stop], greedy=True)
    finally:
        hook.remove()
    # the prefill: prompts of 6, 6, 5, 5, 4, 4, 2 and 2 tokens, whole or in groups cut to
    # their longest prompt
    prefill = [(2, 6), (2, 5), (3, 4), (1, 2)] if prefill_tokens == 12 else [(8, 6)]
    assert shapes[: len(prefill)] == prefill
    widths = [rows for rows, width in shapes[len(prefill) :]]
    assert set(w for _, w in shapes[len(prefill) :]) == {1}
    assert widths[0] == len(PROMPTS)
    running = len(PROMPTS) - int(gen.stopped.sum())
    assert widths[-1] < len(PROMPTS) and widths[-1] >= running
    assert widths == sorted(widths, reverse=True)


def test_copies_of_a_prompt_are_prefilled_once(model, tok, monkeypatch, prefill_tokens):
    stop = _splitting_stop(model, tok, monkeypatch)
    shapes = []
    hook = model.model.register_forward_pre_hook(
        lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)), with_kwargs=True
    )
    kw = dict(stops=[stop, tok.eos_token_id], greedy=True, logprobs=True, n=3)
    try:
        got = _run(model, tok, True, monkeypatch, **kw)
    finally:
        hook.remove()
    # the 8 prompts once each (as in test_rows_that_end_leave_the_batch), then 24 rows decode
    prefill = [(2, 6), (2, 5), (3, 4), (1, 2)] if prefill_tokens == 12 else [(8, 6)]
    assert shapes[: len(prefill)] == prefill and shapes[len(prefill)] == (24, 1)
    want = _run(model, tok, False, monkeypatch, **kw)
    assert torch.equal(got.input_ids, want.input_ids)
    assert torch.equal(got.response_mask, want.response_mask)
    assert got.stopped.tolist() == want.stopped.tolist()
    assert torch.allclose(got.logprobs, want.logprobs, atol=1e-5)


@pytest.mark.parametrize("rows", [24, 5], ids=["one-micro-batch", "copies-split"])
def test_sampling_with_a_prompt_prefilled_once_is_as_with_each_copy(model, tok, monkeypatch, rows):
    # the same draws in the same rows as prefilling every copy (the rows' order kept), also
    # where a micro-batch boundary splits a prompt's copies
    kw = dict(stops=[tok.eos_token_id], temperature=1.5, logprobs=True, n=3, rows=rows)
    torch.manual_seed(3)
    got = _run(model, tok, True, monkeypatch, **kw)
    every = lambda ids, mask: (torch.arange(len(ids)), torch.arange(len(ids)))  # noqa: E731
    monkeypatch.setattr(decode, "distinct_rows", every)
    torch.manual_seed(3)
    want = _run(model, tok, True, monkeypatch, **kw)
    assert torch.equal(got.response_ids, want.response_ids)
    assert torch.allclose(got.logprobs, want.logprobs, atol=1e-5)
    sampled = got.response_ids.view(len(PROMPTS), 3, -1)
    assert any(not torch.equal(s[0], s[1]) for s in sampled)  # copies sample apart


def test_distinct_rows():
    ids = torch.tensor([[0, 5, 6], [1, 2, 3], [0, 5, 6], [0, 0, 6], [1, 2, 3]])
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [0, 1, 1], [1, 1, 1]])
    first, prompt_of = decode.distinct_rows(ids, mask)
    assert first.tolist() == [0, 1, 3] and prompt_of.tolist() == [0, 1, 0, 2, 1]


def test_inverse_cdf_draw_draws_by_probability(monkeypatch):
    torch.manual_seed(0)
    p = torch.tensor([0.0, 0.5, 0.3, 0.0, 0.15, 0.05, 0.0])
    # unnormalised weights (x 4) draw as their normalised probabilities
    draws = inverse_cdf_draw((4 * p).expand(200_000, -1).contiguous())
    freq = torch.bincount(draws, minlength=7).float() / draws.numel()
    # binomial standard error at 200,000 draws is at most 0.0012: 5 of them
    assert torch.allclose(freq, p, atol=0.006), freq
    assert int(torch.isin(draws, torch.tensor([0, 3, 6])).sum()) == 0  # probability 0: never
    one = torch.tensor([[0.0, 0.0, 1.0, 0.0]]).expand(1000, -1).contiguous()
    assert bool((inverse_cdf_draw(one) == 2).all())
    nan = torch.tensor([[0.5, float("nan"), 0.5], [float("inf"), 1.0, 0.0]])
    assert bool(((inverse_cdf_draw(nan) >= 0) & (inverse_cdf_draw(nan) < 3)).all())
    # u at either end of [0, 1): the first and the last token of positive probability
    for u, token in ((0.0, 1), (1.0 - 2.0**-53, 5)):
        monkeypatch.setattr(torch, "rand", lambda shape, u=u, **kw: torch.full(shape, u, **kw))
        assert inverse_cdf_draw(p[None]).tolist() == [token]


def test_suppressed_tokens_are_never_drawn(tok, monkeypatch):
    model = build_tiny_model("llama", tok, "nano", max_positions=64, seed=4).eval()
    ones = tok.convert_tokens_to_ids(["1", "2"])
    model.generation_config.suppress_tokens = ones
    torch.manual_seed(0)
    gen = _run(model, tok, True, monkeypatch, [tok.eos_token_id], temperature=2.0, logprobs=True)
    assert not bool(torch.isin(gen.response_ids, torch.tensor(ones)).any())
    with torch.no_grad():  # the log-probs are those of the distribution without them
        logits = response_logits(model, gen.input_ids, gen.attention_mask, MAX_NEW, 2.0)
    logits[..., ones] = float("-inf")
    want = logprobs_from_logits(logits, gen.response_ids) * gen.response_mask
    assert torch.allclose(gen.logprobs, want, atol=1e-5)


def test_where_the_loop_does_not_apply(tok):
    model = build_tiny_model("llama", tok, "nano", max_positions=64, seed=4)
    assert loop_applies(model) == ""
    model.generation_config.suppress_tokens = [1]
    assert loop_applies(model) == ""
    model.generation_config.repetition_penalty = 1.3
    assert "repetition_penalty" in loop_applies(model)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_architecture_decodes_as_hf_generate(tok, arch, monkeypatch):
    # absolute positions (gpt2) and rotary ones: the joined prefill caches hold each row's
    # keys and values where one pass would
    model = build_tiny_model(arch, tok, "nano", max_positions=64, seed=5, initializer_range=0.5)
    kw = dict(stops=[tok.eos_token_id], greedy=True, logprobs=True)
    got = _run(model.eval(), tok, True, monkeypatch, **kw)
    want = _run(model, tok, False, monkeypatch, **kw)
    assert torch.equal(got.input_ids, want.input_ids)
    assert torch.allclose(got.logprobs, want.logprobs, atol=1e-5)
