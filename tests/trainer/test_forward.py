"""Forward passes shared by scoring and training: `response_logits` and `response_values`.

Oracles: the same rows run alone without any padding (so neither positions nor attention
can be affected by pads), the model's own full-sequence forward, and `critic_values`.
"""

from __future__ import annotations

import pytest
import torch

from proxima.algos import logprobs_from_logits
from proxima.models import (
    ARCHITECTURES,
    build_char_tokenizer,
    build_tiny_model,
    load_critic,
)
from proxima.models.forward import response_logits, response_values
from tests.oracles import critic_values

ALPHABET = "0123456789+="
PAD = 0
# Two rows: a 6-token prompt and a 2-token prompt (left-padded by 4 in the batch); both have
# 3 response positions, the second response has 2 real tokens and one right pad.
PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12]]
RESPONSES = [[13, 14, 15], [6, 7]]
R = 3


def _row(i: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row i alone, no padding at all: ids [1, P_i + r_i], mask all ones."""
    ids = torch.tensor([PROMPTS[i] + RESPONSES[i]])
    return ids, torch.ones_like(ids)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Both rows: prompts left-padded to P = 6, responses right-padded to R = 3."""
    p = max(len(x) for x in PROMPTS)
    ids, mask = [], []
    for prompt, resp in zip(PROMPTS, RESPONSES, strict=True):
        lpad, rpad = p - len(prompt), R - len(resp)
        ids.append([PAD] * lpad + prompt + resp + [PAD] * rpad)
        mask.append([0] * lpad + [1] * (len(prompt) + len(resp)) + [0] * rpad)
    return torch.tensor(ids), torch.tensor(mask)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(ALPHABET)


@pytest.fixture(scope="module", params=ARCHITECTURES)
def actor(request, tok):
    model = build_tiny_model(request.param, tok, "nano", max_positions=32, seed=3)
    return model.eval()


@pytest.fixture(scope="module", params=ARCHITECTURES)
def critic(request, tok, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"critic-{request.param}")
    build_tiny_model(request.param, tok, "nano", max_positions=32, seed=4).save_pretrained(folder)
    tok.save_pretrained(folder)
    return load_critic(folder, init_from="actor", seed=5).eval()


@torch.no_grad()
def test_response_logits_match_full_forward(actor):
    # unpadded row 0: position P + t - 1 predicts response token t, so the R response logits
    # are the full forward's logits at positions P - 1 .. P + R - 2
    ids, mask = _row(0)
    p = len(PROMPTS[0])
    full = actor(input_ids=ids, attention_mask=mask).logits
    got = response_logits(actor, ids, mask, R)
    assert got.shape == (1, R, len(ALPHABET) + 4)
    torch.testing.assert_close(got, full[:, p - 1 : p + R - 1], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_left_padding_does_not_change_response_logprobs(actor):
    ids, mask = _batch()
    logits = response_logits(actor, ids, mask, R)  # [2, R, V]
    logprobs = logprobs_from_logits(logits, ids[:, -R:])  # [2, R]
    for i in range(2):
        alone_ids, alone_mask = _row(i)
        r = len(RESPONSES[i])  # row 1: only its 2 real response tokens exist when alone
        alone = response_logits(actor, alone_ids, alone_mask, r)
        torch.testing.assert_close(logits[i, :r], alone[0], atol=1e-5, rtol=1e-5)
        alone_lp = logprobs_from_logits(alone, alone_ids[:, -r:])
        torch.testing.assert_close(logprobs[i, :r], alone_lp[0], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_padding_check_is_sensitive(tok):
    # Control for GPT-2 (absolute position embeddings): the left-padded row run without
    # position ids taken from the mask (pads counted as positions) gives other logits, so the
    # invariance above is not vacuous. RoPE models (llama, qwen2, gpt_neox) need no control:
    # rotary attention depends only on position differences, which a uniform shift keeps.
    gpt2 = build_tiny_model("gpt2", tok, "nano", max_positions=32, seed=3).eval()
    ids, mask = _batch()
    shifted = gpt2(input_ids=ids[1:], attention_mask=mask[1:]).logits[:, -R - 1 : -1]
    fixed = response_logits(gpt2, ids[1:], mask[1:], R)
    assert not torch.allclose(shifted[:, :2], fixed[:, :2], atol=1e-4)


@torch.no_grad()
@pytest.mark.parametrize("temperature", [0.5, 1.7])
def test_temperature_divides_logits(actor, temperature):
    ids, mask = _batch()
    plain = response_logits(actor, ids, mask, R)
    scaled = response_logits(actor, ids, mask, R, temperature=temperature)
    torch.testing.assert_close(scaled, plain / temperature, atol=1e-6, rtol=1e-6)
    assert not torch.allclose(scaled, plain)


@torch.no_grad()
def test_response_values_shape_and_alignment(critic):
    ids, mask = _batch()
    p = ids.shape[1] - R
    values = response_values(critic, ids, mask, R)
    assert values.shape == (2, R) and values.dtype == torch.float32
    # value of response token t is read at position P + t - 1 (the state before emitting t)
    every = critic_values(critic, ids, mask)  # [2, P + R]
    torch.testing.assert_close(values, every[:, p - 1 : -1], atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_response_values_ignore_left_padding(critic):
    ids, mask = _batch()
    values = response_values(critic, ids, mask, R)
    alone_ids, alone_mask = _row(1)
    alone = response_values(critic, alone_ids, alone_mask, len(RESPONSES[1]))
    torch.testing.assert_close(values[1, :2], alone[0], atol=1e-5, rtol=1e-5)
