"""Forward passes shared by scoring and training: `response_logits` (full or packed at the
kept positions) and `response_values`.

Oracles: the same rows run alone without any padding (so neither positions nor attention
can be affected by pads), the model's own full-sequence forward, and `critic_values`.
"""

from __future__ import annotations

import pytest
import torch

from proxima.algos import (
    POLICY_LOSSES,
    PolicyLossOptions,
    aggregate_loss,
    entropy_from_logits,
    kl_full,
    logprobs_from_logits,
)
from proxima.config import ActorConfig
from proxima.config.sections import PolicyLossConfig
from proxima.models import (
    ARCHITECTURES,
    build_char_tokenizer,
    build_tiny_model,
    load_critic,
)
from proxima.models.critic import PolicyValue, new_value_head
from proxima.models.forward import (
    response_logits,
    response_logits_values,
    response_logprobs,
    response_values,
    unpack,
)
from proxima.trainer.update import PolicyObjective
from tests.oracles import critic_values, ragged_experience

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


# --------------------------------------------------------------------------- packed logits


def _keep(mask: torch.Tensor) -> torch.Tensor:
    return mask[:, -R:].bool()  # row 1's right pad is not kept


@torch.no_grad()
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_packed_logits_are_the_kept_positions(actor, temperature):
    # the head sees only the kept positions ([N, H]) and returns their logits, row-major
    ids, mask = _batch()
    keep = _keep(mask)
    seen = []
    head = actor.get_output_embeddings()
    handle = head.register_forward_hook(lambda m, args, out: seen.append(args[0].shape[:-1]))
    try:
        packed = response_logits(actor, ids, mask, R, temperature, keep)
    finally:
        handle.remove()
    assert seen == [(5,)] and packed.shape == (5, len(ALPHABET) + 4)
    full = response_logits(actor, ids, mask, R, temperature)
    torch.testing.assert_close(packed, full[keep], atol=1e-6, rtol=1e-6)
    assert response_logits(actor, ids, mask, R).shape == (2, R, len(ALPHABET) + 4)  # hook gone


@torch.no_grad()
def test_response_logprobs_zero_outside_the_mask(actor):
    ids, mask = _batch()
    got = response_logprobs(actor, ids, mask, ids[:, -R:], 0.7)
    full = logprobs_from_logits(response_logits(actor, ids, mask, R, 0.7), ids[:, -R:])
    torch.testing.assert_close(got, full * _keep(mask), atol=1e-6, rtol=1e-6)
    assert got[1, 2] == 0.0 and bool((got[_keep(mask)] < 0).all())


@torch.no_grad()
def test_packing_without_an_lm_head_selects_afterwards(actor, monkeypatch):
    # a model that does not name its output embeddings: the full logits, then the positions
    ids, mask = _batch()
    keep = _keep(mask)
    expected = response_logits(actor, ids, mask, R, 0.7, keep)
    monkeypatch.setattr(type(actor), "get_output_embeddings", lambda self: None)
    torch.testing.assert_close(response_logits(actor, ids, mask, R, 0.7, keep), expected)


def test_unpack_places_values_and_gradients():
    keep = torch.tensor([[True, False, True], [False, True, False]])
    packed = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    out = unpack(packed, keep)
    assert out.tolist() == [[1.0, 0.0, 2.0], [0.0, 3.0, 0.0]]
    (out * torch.tensor([[1.0, 5.0, 2.0], [7.0, 3.0, 9.0]])).sum().backward()
    assert packed.grad.tolist() == [1.0, 2.0, 3.0]


@torch.no_grad()
def test_policy_value_packed_logits_keep_every_value(actor):
    # the value head reads the head's input before the positions are packed
    ids, mask = _batch()
    both = PolicyValue(actor, new_value_head(actor, seed=1))
    keep = _keep(mask)
    logits, values = response_logits_values(both, ids, mask, R, 0.7, keep=keep)
    full_logits, full_values = response_logits_values(both, ids, mask, R, 0.7)
    assert values.shape == (2, R)
    torch.testing.assert_close(values, full_values)
    torch.testing.assert_close(logits, full_logits[keep], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("loss_mode", sorted(POLICY_LOSSES))
def test_the_actor_loss_and_gradients_are_those_of_the_full_logits(loss_mode):
    """PolicyObjective projects only the response_mask's positions: its loss (policy loss,
    entropy bonus, exact KL loss) and its gradients are those of the [B, R, V] logits."""
    tok = build_char_tokenizer(ALPHABET)
    actor = build_tiny_model("llama", tok, "nano", max_positions=32, seed=7)
    reference = build_tiny_model("llama", tok, "nano", max_positions=32, seed=8).eval()
    mb = ragged_experience(actor, [3, 2, 4, 1], [5, 4, 1, 3], 0.7, len(ALPHABET))
    cfg = ActorConfig(
        entropy_coef=0.01,
        use_kl_loss=True,
        kl_loss_type="full",
        loss_agg_mode="seq-mean-token-mean",
        policy_loss=PolicyLossConfig(loss_mode=loss_mode, dro_beta=0.05),
    )
    got_loss, _ = PolicyObjective(cfg, 0.7, reference=reference)(actor, mb)
    got = torch.autograd.grad(got_loss, list(actor.parameters()))

    # the same terms, written out on the full logits
    r, mask, agg = mb.response_mask.shape[1], mb.response_mask, cfg.loss_agg_mode
    logits = response_logits(actor, mb.input_ids, mb.attention_mask, r, 0.7)
    with torch.no_grad():
        ref_logits = response_logits(reference, mb.input_ids, mb.attention_mask, r, 0.7)
    chosen = POLICY_LOSSES[loss_mode]
    options = PolicyLossOptions(
        clip_ratio_low=0.2,
        clip_ratio_high=0.2,
        clip_ratio_c=cfg.clip_ratio_c or None,
        **{k: getattr(cfg.policy_loss, k) for k in chosen.options},
    )
    lp = logprobs_from_logits(logits, mb.response_ids)
    pg, _ = chosen(lp, mb.old_logprobs, mb.advantages, mask, agg, options, None)
    want_loss = (
        pg
        - 0.01 * aggregate_loss(entropy_from_logits(logits), mask, agg)
        + cfg.kl_loss_coef * aggregate_loss(kl_full(logits, ref_logits), mask, agg)
    )
    want = torch.autograd.grad(want_loss, list(actor.parameters()))
    assert r == 5
    torch.testing.assert_close(got_loss, want_loss, atol=1e-6, rtol=1e-5)
    assert any(float(g.abs().sum()) > 0 for g in want)
    for (name, _), g, w in zip(actor.named_parameters(), got, want, strict=True):
        torch.testing.assert_close(g, w, atol=1e-6, rtol=1e-5, msg=name)
