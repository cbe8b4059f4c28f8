"""Packed rows (`model.packing`, `models.packing`): the padded batch's sequences end to end
in rows as wide as the longest, positions from 0 at each sequence, attention kept within
each sequence by the model (transformers builds the mask from the position ids).

Oracle: the padded passes (tests/models/test_forward.py checks those against each row run
alone). Every tiny architecture proxima builds, and a tiny Gemma 3 (sliding-window layers
beside full ones, as the `real` tier's model has): log-probs, entropy, values, reward
scores and gradients equal within 1e-5 in float32, plain, with LoRA and with the value head
on the actor. The controls show that a wrong mask or wrong positions would change them.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    Gemma3TextConfig,
    GenerationConfig,
)

from proxima.algos import logprobs_and_entropy
from proxima.config import ActorConfig, ConfigError, CriticConfig, ModelConfig
from proxima.models import ARCHITECTURES, build_char_tokenizer, build_tiny_model, tiny_config
from proxima.models.critic import PolicyValue, ValueHead, ValueModel, ValueObjective, new_value_head
from proxima.models.forward import (
    response_logits,
    response_logits_values,
    response_values,
    reward_model_scores,
)
from proxima.models.lora import add_lora
from proxima.models.packing import PackedRows, pack, packing_problem
from proxima.trainer.update import PolicyObjective
from proxima.types import packed_rows, token_budget_groups
from tests.oracles import ragged_experience

ALPHABET = "0123456789+="
VOCAB = len(ALPHABET) + 4
TEMPERATURE = 0.7
# 8 long-tailed rows: (prompt, response) lengths; packed by rows of 9 tokens they make
# 5 rows: [9] [8] [6 3] [6 2] [5 4]
PROMPT_LENS = [3, 2, 4, 1, 2, 3, 1, 4]
RESPONSE_LENS = [5, 4, 5, 3, 1, 2, 1, 2]
R = max(RESPONSE_LENS)
ARCHS = (*ARCHITECTURES, "gemma3")


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(ALPHABET)


def _gemma3_config(tok, **extra) -> Gemma3TextConfig:
    """A tiny Gemma 3: a sliding window of 3 tokens on its first layer, full attention on
    its second, so a window that crossed from one packed sequence into the next would show."""
    return Gemma3TextConfig(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        sliding_window=3,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=32,
        pad_token_id=tok.pad_token_id,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        attention_dropout=0.0,
        **extra,
    )


def _seeded(build, seed: int):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return build().float().eval()


def _actor(arch: str, tok, seed: int = 3):
    if arch == "gemma3":
        model = _seeded(lambda: AutoModelForCausalLM.from_config(_gemma3_config(tok)), seed)
        model.generation_config = GenerationConfig(pad_token_id=tok.pad_token_id)
        return model
    return build_tiny_model(arch, tok, "nano", max_positions=32, seed=seed).eval()


def _scalar_model(arch: str, tok, cls, seed: int):
    """A one-label token- (critic) or sequence-classification (reward) model of `arch`."""
    if arch == "gemma3":
        config = _gemma3_config(tok, num_labels=1)
    else:
        config = tiny_config(arch, tok, "nano", max_positions=32, num_labels=1)
    return _seeded(lambda: cls.from_config(config), seed)


def _batch(actor):
    return ragged_experience(actor, PROMPT_LENS, RESPONSE_LENS, TEMPERATURE, len(ALPHABET))


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


# --------------------------------------------------------------------------- the layout


def test_packed_rows_are_first_fit_longest_first():
    # longest first: 8 (1), 5 (2), 4 (4), 3 (0), 2 (3). Rows of 8: [8]; 5 opens a row; 4
    # does not fit beside 5 (9) and opens a third; 3 fills the second (5 + 3); 2 joins 4
    assert packed_rows([3, 8, 5, 2, 4], 8) == [[1], [2, 0], [4, 3]]
    assert packed_rows([9, 2], 8) == [[0], [1]]  # a sequence wider than the rows alone


def test_pack_lays_sequences_end_to_end_with_positions_from_zero():
    # row 0: 6 prompt + 3 response tokens; row 1: 2 + 2 (left pad 4, right pad 1); row 2:
    # 3 + 1. Rows of 9 (the longest): [row 0], [row 1, row 2] and one filler token
    pad = 0
    ids = torch.tensor(
        [
            [5, 6, 7, 8, 9, 10, 13, 14, 15],
            [pad, pad, pad, pad, 11, 12, 6, 7, pad],
            [pad, pad, pad, 4, 5, 6, 8, pad, pad],
        ]
    )
    mask = (ids != pad).long()
    rows = pack(ids, mask)
    assert rows.input_ids.tolist() == [
        [5, 6, 7, 8, 9, 10, 13, 14, 15],
        [11, 12, 6, 7, 4, 5, 6, 8, 11],  # the filler repeats the row's first token
    ]
    assert rows.position_ids.tolist() == [list(range(9)), [0, 1, 2, 3, 0, 1, 2, 3, 0]]
    assert rows.where[1].tolist() == [-1, -1, -1, -1, 9, 10, 11, 12, -1]
    assert rows.where[2].tolist() == [-1, -1, -1, 13, 14, 15, 16, -1, -1]
    # response token t of a row is predicted at the position before it: row 1's response
    # tokens (columns 6, 7) at flat places 10, 11; row 2's one token (column 6) at 15
    keep = torch.tensor([[True, True, True], [True, True, False], [True, False, False]])
    assert rows.predicting(keep).tolist() == [5, 6, 7, 10, 11, 15]
    assert rows.last_tokens().tolist() == [8, 12, 16]
    one = pack(ids, mask, one_row=True)  # flash-attention's layout: all in one row
    assert one.input_ids.shape == (1, 17) and one.position_ids[0, 9:13].tolist() == [0, 1, 2, 3]


def test_a_kept_token_after_a_position_left_out_is_refused():
    ids = torch.tensor([[4, 5, 6, 7]])
    mask = torch.tensor([[1, 1, 0, 1]])  # the response token's preceding position is masked
    with pytest.raises(ValueError, match="preceding position must be attended"):
        pack(ids, mask).predicting(torch.tensor([[True]]))


def test_a_packed_budget_counts_packed_rows():
    # lengths 6, 4, 4, 2, budget 12: [6] then 4 beside it in a second row of 6 (2 x 6 = 12);
    # the other 4 fits no row of the first group and a third row would make 18: a group of
    # its own; 2 fills the room the 4 left in the first group's second row. Padded, the
    # groups are [6, 4] (2 x 6) and [4, 2] (2 x 4).
    mask = torch.zeros((4, 6), dtype=torch.long)
    for row, n in enumerate([6, 4, 4, 2]):
        mask[row, :n] = 1
    assert token_budget_groups(mask, 12, packed=True) == [[0, 1, 3], [2]]
    assert token_budget_groups(mask, 12) == [[0, 1], [2, 3]]


# --------------------------------------------------------------------------- the passes


def _logprobs_entropy(model, exp, packed: bool):
    keep = exp.response_mask.bool()
    logits = response_logits(model, exp.input_ids, exp.attention_mask, R, TEMPERATURE, keep, packed)
    return logprobs_and_entropy(logits, exp.response_ids[keep])


@torch.no_grad()
@pytest.mark.parametrize("arch", ARCHS)
def test_logprobs_and_entropy_equal_the_padded_ones(arch, tok):
    actor = _actor(arch, tok)
    exp = _batch(actor)
    assert pack(exp.input_ids, exp.attention_mask).input_ids.shape == (5, 9)
    for got, want in zip(
        _logprobs_entropy(actor, exp, True), _logprobs_entropy(actor, exp, False), strict=True
    ):
        _close(got, want)


@torch.no_grad()
@pytest.mark.parametrize("arch", ARCHITECTURES)  # transformers has no Gemma 3 classifiers
def test_values_and_scores_equal_the_padded_ones(arch, tok):
    exp = _batch(_actor(arch, tok))
    ids, attn, keep = exp.input_ids, exp.attention_mask, exp.attention_mask[:, -R:].bool()
    critic = _scalar_model(arch, tok, AutoModelForTokenClassification, seed=4)
    _close(
        response_values(critic, ids, attn, R, packed=True) * keep,
        response_values(critic, ids, attn, R) * keep,
    )
    reward = _scalar_model(arch, tok, AutoModelForSequenceClassification, seed=5)
    scores = reward_model_scores(reward, ids, attn, packed=True)
    _close(scores, reward_model_scores(reward, ids, attn))
    assert len(set(scores.tolist())) == len(PROMPT_LENS)  # eight sequences, eight scores


@torch.no_grad()
@pytest.mark.parametrize("arch", ARCHS)
def test_the_value_head_on_the_actor_equals_the_padded_pass(arch, tok):
    actor = _actor(arch, tok)
    exp = _batch(actor)
    shared = PolicyValue(actor, new_value_head(actor, seed=6))
    keep = exp.response_mask.bool()
    args = (shared, exp.input_ids, exp.attention_mask, R, TEMPERATURE)
    got = response_logits_values(*args, keep=keep, packed=True)
    want = response_logits_values(*args, keep=keep)
    _close(got[0], want[0])
    _close(got[1] * keep, want[1] * keep)


def _lora(actor):
    """The actor with LoRA adapters that change its output (B drawn, not zero)."""
    model = add_lora(actor, ModelConfig(lora_rank=4, lora_alpha=8.0), "CAUSAL_LM", seed=1)
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model.eval()


@torch.no_grad()
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_lora_actor_equals_the_padded_pass(arch, tok):
    actor = _actor(arch, tok)
    exp = _batch(actor)
    lora = _lora(actor)
    for got, want in zip(
        _logprobs_entropy(lora, exp, True), _logprobs_entropy(lora, exp, False), strict=True
    ):
        _close(got, want)
    plain = _actor(arch, tok)  # the adapters change the result: they are in the pass
    assert not torch.allclose(
        _logprobs_entropy(plain, exp, True)[0], _logprobs_entropy(lora, exp, True)[0]
    )


# --------------------------------------------------------------------------- gradients


def _grads(model, objective, exp) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    loss, _ = objective(model, exp)
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_grads(got: dict, want: dict) -> None:
    assert got.keys() == want.keys() and want
    assert any(float(g.abs().max()) > 1e-4 for g in want.values())  # a real gradient
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-5, msg=name)


ACTOR = ActorConfig(entropy_coef=0.01, use_kl_loss=True, kl_loss_type="k3")


def _assert_packed_grads_equal(arch: str, role: str, tok, actor, exp) -> None:
    """The update's gradients of `role` on `exp` through packed rows equal the padded
    pass's: the actor, a value model, the value head on the actor, a LoRA actor."""
    critic_cfg = CriticConfig(vf_coef=0.7)
    if role == "critic":
        model = _scalar_model(arch, tok, AutoModelForTokenClassification, seed=4)
        make = lambda packed: ValueObjective(ValueModel(critic_cfg, model, "test"), packed)  # noqa: E731
    elif role == "shared":
        model = PolicyValue(actor, new_value_head(actor, seed=6))
        head = ValueHead(critic_cfg, model.value_head)
        make = lambda packed: PolicyObjective(ACTOR, TEMPERATURE, critic=head, packed=packed)  # noqa: E731
    else:
        model = _lora(actor) if role == "lora" else actor
        make = lambda packed: PolicyObjective(ACTOR, TEMPERATURE, packed=packed)  # noqa: E731
    _assert_same_grads(_grads(model, make(True), exp), _grads(model, make(False), exp))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("role", ["actor", "critic", "shared", "lora"])
def test_gradients_equal_the_padded_ones(arch, role, tok):
    """The update's loss (policy loss, entropy bonus and KL loss; a value model's clipped
    value loss; both through the value head on the actor; the adapters of a LoRA actor)."""
    if role in ("lora", "critic") and arch == "gemma3":
        pytest.skip("LoRA on the tiny architectures proxima builds; no Gemma 3 classifier")
    actor = _actor(arch, tok)
    exp = _batch(actor)
    _assert_packed_grads_equal(arch, role, tok, actor, exp)


# --------------------------------------------------------------------------- controls


def _defective(monkeypatch, defect: str) -> None:
    """Packed rows passed to the model with one thing wrong: positions that run on across
    the sequences of a row (`positions`), or a 2D attention mask, with which transformers
    reads no packing and lets each token see the whole row before it (`mask`)."""
    right = PackedRows.inputs

    def inputs(self):
        out = right(self)
        if defect == "positions":
            width = self.input_ids.shape[1]
            out["position_ids"] = torch.arange(width).expand_as(self.input_ids)
        else:
            out["attention_mask"] = torch.ones_like(self.input_ids)
        return out

    monkeypatch.setattr(PackedRows, "inputs", inputs)


@torch.no_grad()
@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma3"])  # rotary, learned, windows
@pytest.mark.parametrize("defect", ["positions", "mask"])
def test_a_wrong_mask_or_wrong_positions_would_change_the_results(arch, defect, tok, monkeypatch):
    actor = _actor(arch, tok)
    exp = _batch(actor)
    want = _logprobs_entropy(actor, exp, False)[0]
    _defective(monkeypatch, defect)
    got = _logprobs_entropy(actor, exp, True)[0]
    assert float((got - want).abs().max()) > 1e-3
    assert problem_of(actor) is not None  # the start-up check sees it too


def problem_of(model, scores: bool = False) -> str | None:
    return packing_problem(model, scores=scores)


@torch.no_grad()
@pytest.mark.parametrize("arch", ARCHS)
def test_every_model_kind_passes_the_start_up_check(arch, tok):
    actor = _actor(arch, tok)
    assert problem_of(actor) is None
    assert problem_of(PolicyValue(actor, new_value_head(actor, seed=6))) is None
    if arch == "gemma3":  # transformers has no Gemma 3 classifiers
        return
    assert problem_of(_lora(actor)) is None
    critic = _scalar_model(arch, tok, AutoModelForTokenClassification, seed=4)
    assert problem_of(critic) is None
    reward = _scalar_model(arch, tok, AutoModelForSequenceClassification, seed=5)
    assert problem_of(reward, scores=True) is None


@torch.no_grad()
def test_the_eager_attention_takes_packed_rows(tok):
    eager = build_tiny_model("llama", tok, "nano", max_positions=32, seed=3)
    eager.config._attn_implementation = "eager"
    exp = _batch(eager.eval())
    assert problem_of(eager) is None
    for got, want in zip(
        _logprobs_entropy(eager, exp, True), _logprobs_entropy(eager, exp, False), strict=True
    ):
        _close(got, want)


class _Unpacking(torch.nn.Module):
    """A model whose forward reads no packing: it always builds its own plain causal mask
    (what a model without transformers' packed position ids support does)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def get_base_model(self):
        return self.model

    def forward(self, input_ids, attention_mask=None, **kw):
        mask = torch.ones_like(input_ids) if attention_mask is None else attention_mask
        return self.model(input_ids=input_ids, attention_mask=mask, **kw)


@torch.no_grad()
def test_a_model_that_reads_no_packing_is_refused_or_left_padded_before_the_run(tok):
    """model.packing=true refuses a model that reads no packing; unset, every pass of the
    run takes padded rows, the reward model's too, and the roles' report says why."""
    from proxima.rewards import FunctionReward, ModelReward
    from proxima.trainer.roles import Roles, check_packing

    actor = _actor("llama", tok)
    problem = problem_of(_Unpacking(actor))
    assert problem is not None and "does not keep packed sequences apart" in problem
    rm = _scalar_model("llama", tok, AutoModelForSequenceClassification, seed=5)
    reward = ModelReward(rm, tok, tok, reward_model_scores)
    good = Roles(tok, actor, None, None, reward, None)
    check_packing(good, required=False)
    assert good.packed and reward.packed and "layout" not in good.report()
    bad = dataclasses.replace(good, teacher=_Unpacking(_actor("qwen2", tok)), packed=False)
    reward.packed = False
    with pytest.raises(
        ConfigError,
        match=r"`model.packing=true`, but the teacher .* "
        r"Set model.packing=false",
    ):
        check_packing(bad)
    check_packing(bad, required=False)
    assert not bad.packed and not reward.packed
    assert "layout   : padded rows (model.packing unset): the teacher cannot take packed " in (
        bad.report()
    )
    function = FunctionReward(lambda prompts, responses, **_: [0.0] * len(prompts), "f")
    check_packing(dataclasses.replace(good, reward=function, packed=False))


@pytest.mark.parametrize("role", ["actor", "critic", "shared"])
def test_right_aligned_micro_batches_by_a_packed_budget_give_the_padded_gradients(role):
    """The long half of the batch (rank 0's of 2) in micro-batches by a budget of 12 tokens
    in packed rows, right-aligned and trimmed: [9] [8] [6, 4], where the 4-token row's
    prompt starts inside the response columns: the gradients of fixed padded ones."""
    from proxima.trainer.dist import Dist
    from tests.distributed.common import MODES, global_batch, mini_batch_grads, models

    for mode in MODES:
        grads = []
        for tokens, packed in ((0, False), (12, True)):
            actor, critic = models()
            exp = global_batch(actor).select([0, 1, 2, 3])
            model = critic if role == "critic" else actor
            grads.append(
                mini_batch_grads(
                    model, role, mode, exp, Dist(), 1, micro_tokens=tokens, packed=packed
                )
            )
        _assert_same_grads(grads[1], grads[0])


def test_a_packed_micro_batch_with_no_real_response_token_still_backwards():
    """Responses left out of the loss (rollout.mask_truncated) can fill a micro-batch: its
    packed pass projects no position, its loss is 0 and the gradient the others'."""
    from proxima.trainer.dist import Dist
    from tests.distributed.common import global_batch, mini_batch_grads, models

    exp = global_batch(models()[0])
    masked = exp.response_mask.clone()
    masked[[0, 2]] = 0  # the two longest rows: the first micro-batch of a budget of 18
    exp = dataclasses.replace(exp, response_mask=masked)
    grads = [
        mini_batch_grads(
            models()[0], "actor", "token-mean", exp, Dist(), 1, micro_tokens=18, packed=packed
        )
        for packed in (False, True)
    ]
    _assert_same_grads(grads[1], grads[0])


# --------------------------------------------------------------------------- shared prompts

# the samples of one prompt: rows 0-2 share a prompt of 3 tokens, rows 3-4 one of 2, rows
# 5-6 one of 4; row 7 is alone. Groups as packed sequences: [3 | 5 2 4] 14 tokens,
# [2 | 3 3] 8, [4 | 1 5] 10, [1 | 2] 3: rows of 14, [14] [10 3] [8]
SHARED_PROMPTS = [3, 3, 3, 2, 2, 4, 4, 1]
SHARED_RESPONSES = [5, 2, 4, 3, 3, 1, 5, 2]
GROUPS = [[0, 1, 2], [3, 4], [5, 6], [7]]


def _shared_batch(actor):
    exp = ragged_experience(actor, SHARED_PROMPTS, SHARED_RESPONSES, TEMPERATURE, len(ALPHABET))
    ids, p = exp.input_ids.clone(), exp.input_ids.shape[1] - R
    for group in GROUPS:
        ids[group, :p] = ids[group[0], :p]
    ids[1, p] = ids[0, p]  # two responses that start alike stay each their own
    return dataclasses.replace(exp, input_ids=ids)


def _shared_rows(model, exp):
    from proxima.models.forward import _packed_rows

    return _packed_rows(model, exp.input_ids, exp.attention_mask, R)


def test_a_prompt_is_laid_once_for_its_samples(tok):
    from proxima.models.packing import pack_shared, prompt_groups

    exp = _shared_batch(_actor("llama", tok))
    ids, attn, p = exp.input_ids, exp.attention_mask, exp.input_ids.shape[1] - R
    assert prompt_groups(ids, attn, p) == GROUPS
    rows = pack_shared(ids, attn, p, torch.bool)
    assert rows.input_ids.shape == (3, 14)
    where = rows.where
    assert torch.equal(where[0, p - 3 : p], torch.arange(0, 3))  # the prompt, once
    assert torch.equal(where[1, p - 3 : p], where[0, p - 3 : p])
    assert torch.equal(where[2, p - 3 : p], where[0, p - 3 : p])
    assert where[0, p:].tolist() == [3, 4, 5, 6, 7]  # then each response in turn
    assert where[1, p : p + 2].tolist() == [8, 9] and where[2, p : p + 4].tolist() == [
        10,
        11,
        12,
        13,
    ]
    # each response's positions follow its prompt's
    assert rows.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 3, 4, 3, 4, 5, 6]
    mask = rows.attention_mask[0, 0]
    assert mask[9].nonzero()[:, 0].tolist() == [0, 1, 2, 8, 9]  # its prompt and itself
    assert mask[3].nonzero()[:, 0].tolist() == [0, 1, 2, 3]
    assert pack_shared(ids[[0, 3, 5, 7]], attn[[0, 3, 5, 7]], p, torch.bool) is None


@torch.no_grad()
@pytest.mark.parametrize("arch", ARCHS)
def test_shared_prompts_give_the_padded_logprobs_and_entropy(arch, tok):
    actor = _actor(arch, tok)
    exp = _shared_batch(actor)
    # a sliding window cannot take the 4D mask: Gemma 3 packs every row's prompt
    assert (_shared_rows(actor, exp).attention_mask is None) == (arch == "gemma3")
    for got, want in zip(
        _logprobs_entropy(actor, exp, True), _logprobs_entropy(actor, exp, False), strict=True
    ):
        _close(got, want)


@torch.no_grad()
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_shared_prompts_give_the_padded_values(arch, tok):
    actor = _actor(arch, tok)
    exp = _shared_batch(actor)
    ids, attn, keep = exp.input_ids, exp.attention_mask, exp.attention_mask[:, -R:].bool()
    critic = _scalar_model(arch, tok, AutoModelForTokenClassification, seed=4)
    assert _shared_rows(critic, exp).attention_mask is not None
    _close(
        response_values(critic, ids, attn, R, packed=True) * keep,
        response_values(critic, ids, attn, R) * keep,
    )
    shared = PolicyValue(actor, new_value_head(actor, seed=6))
    args = (shared, ids, attn, R, TEMPERATURE)
    got = response_logits_values(*args, keep=keep, packed=True)
    want = response_logits_values(*args, keep=keep)
    _close(got[0], want[0])
    _close(got[1] * keep, want[1] * keep)


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("role", ["actor", "critic", "shared", "lora"])
def test_shared_prompts_give_the_padded_gradients(arch, role, tok):
    """A prompt's keys and values read by all its samples: its gradient is the sum of
    theirs, as when each row carries its own copy."""
    actor = _actor(arch, tok)
    exp = _shared_batch(actor)
    _assert_packed_grads_equal(arch, role, tok, actor, exp)


@torch.no_grad()
def test_shared_prompts_under_eager_attention(tok):
    eager = build_tiny_model("llama", tok, "nano", max_positions=32, seed=3).eval()
    eager.config._attn_implementation = "eager"
    exp = _shared_batch(eager)
    assert _shared_rows(eager, exp).attention_mask.dtype == torch.float32
    for got, want in zip(
        _logprobs_entropy(eager, exp, True), _logprobs_entropy(eager, exp, False), strict=True
    ):
        _close(got, want)


@torch.no_grad()
@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # rotary and learned positions
def test_responses_that_saw_each_other_would_change_the_results(arch, tok, monkeypatch):
    import proxima.models.packing as packing

    actor = _actor(arch, tok)
    exp = _shared_batch(actor)
    want = _logprobs_entropy(actor, exp, False)[0]
    right = packing.pack_shared

    def leaky(*args):  # each token sees every earlier one of its group's tokens
        rows = right(*args)
        causal = torch.ones_like(rows.attention_mask[0, 0]).tril()
        seg = rows.attention_mask.any(dim=-2, keepdim=True) & causal
        return dataclasses.replace(rows, attention_mask=seg | rows.attention_mask)

    monkeypatch.setattr(packing, "pack_shared", leaky)
    import proxima.models.forward as forward

    monkeypatch.setattr(forward, "pack_shared", leaky)
    got = _logprobs_entropy(actor, exp, True)[0]
    assert float((got - want).abs().max()) > 1e-3


def test_a_shared_prompt_that_costs_more_is_not_taken(tok):
    # one-token prompts and long responses: sharing saves a token a sample and widens the
    # rows (attention grows with the square of their width)
    actor = _actor("llama", tok)
    exp = ragged_experience(actor, [1] * 8, [12] * 8, TEMPERATURE, len(ALPHABET))
    ids, attn = exp.input_ids.clone(), exp.attention_mask
    ids[:, :1] = ids[0, :1]
    from proxima.models.forward import _packed_rows
    from proxima.models.packing import pack_shared, rows_cost

    shared = pack_shared(ids, attn, 1, torch.bool)
    assert shared.input_ids.shape == (1, 97)  # 1 + 8 x 12, against 8 rows of 13
    config = actor.config
    assert rows_cost(shared, config) > rows_cost(pack(ids, attn), config)
    assert _packed_rows(actor, ids, attn, 12).attention_mask is None


class _No4DMask(torch.nn.Module):
    """A model that drops a 4D attention mask (reads packing from the position ids only)."""

    def __init__(self, model) -> None:
        super().__init__()
        self.model = model

    def get_base_model(self):
        return self.model

    def forward(self, input_ids, attention_mask=None, **kw):
        if attention_mask is not None and attention_mask.dim() == 4:
            attention_mask = None
        return self.model(input_ids=input_ids, attention_mask=attention_mask, **kw)


@torch.no_grad()
def test_the_start_up_check_tries_shared_prompts(tok):
    from proxima.models.packing import shares_prompts

    actor = _actor("llama", tok)
    assert problem_of(actor) is None and shares_prompts(actor)
    dropping = _No4DMask(_actor("qwen2", tok))
    assert problem_of(dropping) is None  # packed rows alone are read right
    assert not shares_prompts(dropping)  # so its passes pack every row's prompt
    exp = _shared_batch(dropping.model)
    assert _shared_rows(dropping, exp).attention_mask is None
    assert not shares_prompts(_actor("gemma3", tok))  # a sliding window
