"""The scoring passes through packed rows (`model.packing`): old log-probs, sum pi^2, the
exact KL, a value model's values, the value head's, the reward model's scores and a whole
`build_experience` (reference, critic, teacher) equal the padded passes', in fixed chunks
and by a token budget (which then counts packed rows), also with the samples of a prompt laid
once (`models.packing.pack_shared`)."""

from __future__ import annotations

import dataclasses

import torch

from proxima.config import AlgorithmConfig, CriticConfig, RolloutConfig
from proxima.models.critic import ValueModel
from proxima.models.forward import reward_model_scores
from proxima.rewards.model import ModelReward
from proxima.rollout.experience import (
    Chunks,
    build_experience,
    sequence_logprobs,
)
from proxima.rollout.plan import ScoringPlan
from proxima.types import SORTED
from tests.distributed.common import TEMPERATURE, models
from tests.rollout.scoring_passes import assert_close, assert_passes_equal, ragged_generation

PADDED = Chunks(8)
PACKED = (
    Chunks(8, packed=True),
    Chunks(3, packed=True),
    Chunks(8, 18, packed=True),
    Chunks(3, SORTED, packed=True),
)


def _other(seed: int) -> torch.nn.Module:
    """The actor's architecture with other weights (a reference, a teacher)."""
    model, _ = models()
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def test_every_scoring_pass_equals_the_padded_one():
    actor, critic, gen = ragged_generation()
    for chunks in PACKED:
        assert_passes_equal(actor, _other(1), critic, gen, chunks, PADDED)
    assert sequence_logprobs(actor, gen, TEMPERATURE, PACKED[0]).abs().sum() > 0


def test_scoring_passes_with_a_prompt_laid_once_equal_the_padded_ones():
    from proxima.models.forward import _packed_rows

    actor, critic, gen = ragged_generation(shared=True)
    r = gen.response_mask.shape[1]
    for model in (actor, critic):  # the pairs' prompts are laid once
        assert _packed_rows(model, gen.input_ids, gen.attention_mask, r).attention_mask is not None
    for chunks in PACKED:  # by a budget: a prompt's samples may land apart, laid each
        assert_passes_equal(actor, _other(1), critic, gen, chunks, PADDED)


def test_reward_model_scores_with_a_prompt_laid_once_equal_the_padded_ones():
    from proxima.models import build_char_tokenizer
    from proxima.rewards.model import shared_columns
    from tests.distributed.common import ALPHABET

    _, critic, gen = ragged_generation(shared=True)
    tok = build_char_tokenizer(ALPHABET)  # the policy's: its ids are scored as they are
    ids, mask = gen.input_ids, gen.attention_mask
    prompts = [f"prompt {i // 2}" for i in range(ids.shape[0])]
    p = ids.shape[1] - gen.response_mask.shape[1]
    assert shared_columns(prompts, ids, mask) >= p
    assert shared_columns([f"prompt {i}" for i in range(ids.shape[0])], ids, mask) is None
    masks = []
    hook = critic.base_model.register_forward_pre_hook(
        lambda m, a, kw: masks.append(kw.get("attention_mask")), with_kwargs=True
    )

    def scores(tokens: int, packed: bool) -> torch.Tensor:
        source = ModelReward(
            critic, tok, tok, reward_model_scores, batch_size=8, max_tokens=tokens, packed=packed
        )
        return source(prompts, [""] * len(prompts), {}, ids, mask)

    try:
        want = scores(0, False)
        for tokens in (0, SORTED, 18):
            masks.clear()
            assert_close(scores(tokens, True), want)
            if tokens != 18:  # by a budget a prompt's samples may land apart
                assert any(m is not None and m.dim() == 4 for m in masks)  # laid once
    finally:
        hook.remove()


def test_reward_model_scores_through_packed_rows_equal_the_padded_ones():
    _, critic, gen = ragged_generation()
    ids, mask = gen.input_ids, gen.attention_mask

    def scores(tokens: int, packed: bool) -> torch.Tensor:
        source = ModelReward(
            critic, None, None, reward_model_scores, batch_size=3, max_tokens=tokens, packed=packed
        )
        return source._score_in_chunks(ids, mask)

    want = scores(0, False)
    assert len(set(want.tolist())) == 8  # eight different sequences, eight scores
    for tokens in (0, 18):
        torch.testing.assert_close(scores(tokens, True), want, rtol=0, atol=1e-5)


def test_a_whole_experience_equals_the_padded_one():
    """Old log-probs, reference, a value model, a teacher, the KL: `build_experience` with
    `packed` (what `model.packing` sets) against without."""
    actor, critic_model, gen = ragged_generation()
    gen = dataclasses.replace(gen, stopped=torch.ones(gen.input_ids.shape[0], dtype=torch.bool))
    critic = ValueModel(CriticConfig(), critic_model, "test")
    plan = ScoringPlan(old_logprobs="actor", values="critic", kl="k1", why="test", teacher=True)
    common = dict(
        actor=actor,
        reference=_other(1),
        critic=critic,
        algorithm=AlgorithmConfig(),
        teacher=_other(2),
    )
    made = {}
    for packed, tokens in ((False, 0), (True, 0), (True, 18)):
        rollout = RolloutConfig(temperature=TEMPERATURE, max_tokens_per_micro=tokens)
        made[(packed, tokens)] = build_experience(
            gen,
            torch.arange(8.0),
            torch.arange(8),
            plan,
            rollout=rollout,
            packed=packed,
            **common,
        )
    want = made[(False, 0)]
    for key in ((True, 0), (True, 18)):
        got = made[key]
        for f in dataclasses.fields(want):
            a, b = getattr(got, f.name), getattr(want, f.name)
            if isinstance(b, torch.Tensor):
                assert_close(a.float(), b.float())
    assert want.teacher_logprobs is not None and want.values is not None
