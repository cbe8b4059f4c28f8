"""Phase 6, the update: micro-batching never changes a mini-batch's gradient, NaN steps are
skipped, and mini-batches cover every sequence once per epoch.

Oracle for the gradient tests: the same loss on the whole mini-batch in one micro-batch
(micro = mini = 4), against accumulation over micro-batches of 1 and 2 weighted by
`micro_weight`.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForTokenClassification

from proxima.config import ActorConfig, CriticConfig, OptimConfig
from proxima.models import build_char_tokenizer, build_tiny_model, tiny_config
from proxima.models.critic import ValueHead, ValueModel, ValueObjective
from proxima.trainer.optim import TrainedRole
from proxima.trainer.update import (
    PolicyObjective,
    micro_weight,
    mini_batches,
    run_epochs,
)
from proxima.types import Experience
from tests.oracles import ragged_experience

ALPHABET = "0123456789+="
PAD = 0
TEMPERATURE = 0.8
PROMPT_LENS = [3, 1, 2, 3]  # P = 3, rows 1 and 2 left-padded
RESPONSE_LENS = [5, 2, 4, 1]  # R = 5, ragged: 12 real response tokens in all
AGG_MODES = [
    "token-mean",
    "token-sum",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
]


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(ALPHABET)


@pytest.fixture(scope="module")
def actor(tok):
    return build_tiny_model("llama", tok, "nano", max_positions=32, seed=7)


@pytest.fixture(scope="module")
def critic(tok):
    config = tiny_config("gpt2", tok, "nano", max_positions=32, num_labels=1)
    torch.manual_seed(8)
    return AutoModelForTokenClassification.from_config(config)


def make_experience(actor: torch.nn.Module, seed: int = 0) -> Experience:
    return ragged_experience(
        actor, PROMPT_LENS, RESPONSE_LENS, TEMPERATURE, len(ALPHABET), seed=seed
    )


def accumulated_grads(
    model, exp: Experience, micro: int, loss_fn, mode: str, weight=micro_weight
) -> dict[str, torch.Tensor]:
    """Gradient of one mini-batch (= exp) accumulated over micro-batches of `micro` rows."""
    model.zero_grad(set_to_none=True)
    for mb in exp.split(micro):
        loss, _ = loss_fn(mb)
        (loss * weight(mb, exp, mode)).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


def assert_same_grads(a: dict, b: dict) -> None:
    assert a.keys() == b.keys() and a
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("mode", AGG_MODES)
@pytest.mark.parametrize("extras", [False, True], ids=["pg", "pg+entropy+kl"])
def test_actor_gradient_independent_of_micro_batch_size(actor, mode, extras):
    exp = make_experience(actor)
    cfg = ActorConfig(
        loss_agg_mode=mode,
        entropy_coef=0.01 if extras else 0.0,
        use_kl_loss=extras,
        kl_loss_coef=0.1,
    )
    loss_fn = lambda mb: PolicyObjective(cfg, TEMPERATURE)(actor, mb)  # noqa: E731
    whole = accumulated_grads(actor, exp, 4, loss_fn, mode)
    assert any(g.abs().max() > 1e-4 for g in whole.values())  # a real, non-zero gradient
    for micro in (1, 2):
        assert_same_grads(accumulated_grads(actor, exp, micro, loss_fn, mode), whole)


@pytest.mark.parametrize("mode", AGG_MODES)
def test_critic_gradient_independent_of_micro_batch_size(critic, mode):
    exp = make_experience(build_tiny_model("llama", build_char_tokenizer(ALPHABET), "nano"))
    objective = ValueObjective(ValueModel(CriticConfig(loss_agg_mode=mode), critic, "test"))
    loss_fn = lambda mb: objective(critic, mb)  # noqa: E731
    whole = accumulated_grads(critic, exp, 4, loss_fn, mode)
    assert any(g.abs().max() > 1e-4 for g in whole.values())
    for micro in (1, 2):
        assert_same_grads(accumulated_grads(critic, exp, micro, loss_fn, mode), whole)


def test_equal_micro_weights_would_differ(actor):
    # Control: with ragged rows, weighting each micro-batch's token-mean equally (1 / n) is
    # not the mini-batch token-mean (row 0 has 5 tokens, row 3 has 1), so the gradient check
    # above can detect a wrong `micro_weight`.
    exp = make_experience(actor)
    cfg = ActorConfig(loss_agg_mode="token-mean")
    loss_fn = lambda mb: PolicyObjective(cfg, TEMPERATURE)(actor, mb)  # noqa: E731
    whole = accumulated_grads(actor, exp, 4, loss_fn, "token-mean")
    naive = accumulated_grads(
        actor,
        exp,
        1,
        loss_fn,
        "token-mean",
        weight=lambda mb, mini, mode: mb.batch_size / mini.batch_size,
    )
    assert any(not torch.allclose(naive[n], whole[n], atol=1e-6) for n in whole)


def test_micro_weight_values(actor):
    exp = make_experience(actor)
    first, last = exp.split(1)[0], exp.split(1)[3]
    # token-mean: share of the 12 real tokens (5 and 1); seq modes: share of the 4 rows
    assert micro_weight(first, exp, "token-mean") == pytest.approx(5 / 12)
    assert micro_weight(last, exp, "token-mean") == pytest.approx(1 / 12)
    assert micro_weight(first, exp, "seq-mean-token-mean") == pytest.approx(1 / 4)
    assert micro_weight(first, exp, "token-sum") == 1.0  # sums add up as they are


# --------------------------------------------------------------------------- run_epochs


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _nan_loss(model, mb: Experience):
    total = sum(p.sum() for p in model.parameters())
    return total * float("nan"), {"pg_loss": float("nan")}


def _finite_loss(model, mb: Experience):
    return sum(p.square().sum() for p in model.parameters()) * 1e-3, {"pg_loss": 1.0}


def _run(model, exp, objective, mini_size: int, grad_clip: float = 1.0) -> dict:
    sec = ActorConfig(
        optim=OptimConfig(lr=1e-2, grad_clip=grad_clip),
        ppo_epochs=1,
        ppo_mini_batch_size=mini_size,
        ppo_micro_batch_size=2,
        shuffle=True,
        loss_agg_mode="token-mean",
    )
    return run_epochs(
        TrainedRole("actor", model, sec, total_steps=10),
        exp,
        objective,
        generator=torch.Generator().manual_seed(0),
    )


@pytest.mark.parametrize("grad_clip", [1.0, 0.0])
def test_run_epochs_skips_nan_step(tok, grad_clip):
    model = build_tiny_model("llama", tok, "nano", max_positions=32, seed=9)
    exp = make_experience(model)
    before = _params(model)
    out = _run(model, exp, _nan_loss, mini_size=4, grad_clip=grad_clip)
    assert out["skipped_steps"] == 1.0
    for name, p in model.named_parameters():
        assert torch.equal(p, before[name]), name
        assert p.grad is None  # the NaN gradient is not carried into the next step


def test_run_epochs_skips_only_the_nan_step(tok):
    # two mini-batches of 2: the first loss is NaN (skipped), the second finite (applied)
    model = build_tiny_model("llama", tok, "nano", max_positions=32, seed=9)
    exp = make_experience(model)
    before = _params(model)
    calls = {"n": 0}

    def loss(m, mb):
        calls["n"] += 1
        return (_nan_loss if calls["n"] == 1 else _finite_loss)(m, mb)

    out = _run(model, exp, loss, mini_size=2)
    assert calls["n"] == 2 and out["skipped_steps"] == 1.0
    assert any(not torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert all(torch.isfinite(p).all() for p in model.parameters())


# --------------------------------------------------------------------------- mini_batches


def _rows_experience(b: int) -> Experience:
    ids = torch.arange(b).unsqueeze(1).repeat(1, 3)  # row i holds i: identifies the row
    mask = torch.ones(b, 2, dtype=torch.long)
    return Experience(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        response_mask=mask,
        old_logprobs=torch.zeros(b, 2),
        group_ids=torch.arange(b),
    )


def _epochs(exp, size, epochs, shuffle, seed=0) -> list[list[list[int]]]:
    gen = torch.Generator().manual_seed(seed)
    return [
        [mb.group_ids.tolist() for mb in mini_batches(exp, size, shuffle, gen)]
        for _ in range(epochs)
    ]


def test_mini_batches_cover_every_row_once_per_epoch():
    exp = _rows_experience(12)
    epochs = _epochs(exp, 4, 3, shuffle=True)
    assert len(epochs) == 3
    for minis in epochs:
        assert [len(m) for m in minis] == [4, 4, 4]
        assert sorted(i for m in minis for i in m) == list(range(12))
    orders = [[i for m in minis for i in m] for minis in epochs]
    assert any(o != list(range(12)) for o in orders)  # shuffled ...
    assert len({tuple(o) for o in orders}) == 3  # ... anew every epoch
    assert _epochs(exp, 4, 3, shuffle=True) == epochs  # and reproducible from the generator


def test_mini_batches_keep_rows_together_and_order_without_shuffle():
    exp = _rows_experience(6)
    gen = torch.Generator().manual_seed(1)
    for mb in mini_batches(exp, 3, True, gen):
        assert torch.equal(mb.input_ids[:, 0], mb.group_ids)  # fields selected consistently
    assert _epochs(exp, 3, 2, shuffle=False) == [[[0, 1, 2], [3, 4, 5]]] * 2


# --------------------------------------------------------------------------- target_kl


def _kl_run(model, exp, epochs: int, target_kl: float) -> dict:
    sec = ActorConfig(
        optim=OptimConfig(lr=1e-3),
        ppo_epochs=epochs,
        ppo_mini_batch_size=2,
        ppo_micro_batch_size=2,
        target_kl=target_kl,
    )
    calls = []

    def loss(m, mb):
        out = PolicyObjective(sec, TEMPERATURE)(m, mb)
        calls.append(out[1]["approx_kl"])
        return out

    stats = run_epochs(
        TrainedRole("actor", model, sec, total_steps=16),
        exp,
        loss,
        generator=torch.Generator().manual_seed(0),
        target_kl=target_kl,
    )
    return {**stats, "calls": calls}


def test_target_kl_stops_the_remaining_epochs(tok):
    """4 rows, mini-batches of 2 -> 2 optimizer steps per epoch. The rollout's old
    log-probs are the actor's plus 0.3 N(0, 1) noise, so the first epoch's approx_kl, mean of
    0.5 (log-ratio)^2, is about 0.5 * 0.09 = 0.045 (measured below, not assumed)."""
    model = build_tiny_model("llama", tok, "nano", max_positions=32, seed=9)
    exp = make_experience(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    stopped = _kl_run(model, exp, epochs=4, target_kl=0.01)
    first_epoch_kl = sum(stopped["calls"][:2]) / 2  # one micro-batch per mini-batch
    assert first_epoch_kl > 0.01
    assert stopped["calls"][2:] == []  # epochs 2-4 never ran
    assert stopped["early_stopped"] == 1.0 and stopped["optimizer_steps"] == 2.0

    model.load_state_dict(state)
    full = _kl_run(model, exp, epochs=4, target_kl=10.0)  # a bound the KL never reaches
    assert full["early_stopped"] == 0.0 and full["optimizer_steps"] == 8.0
    assert full["calls"][:2] == stopped["calls"]  # same first epoch, the same shuffle

    model.load_state_dict(state)
    off = _kl_run(model, exp, epochs=4, target_kl=0.0)
    assert "early_stopped" not in off and off["optimizer_steps"] == 8.0

    model.load_state_dict(state)
    last = _kl_run(model, exp, epochs=1, target_kl=0.01)  # nothing left to stop
    assert last["early_stopped"] == 0.0 and last["optimizer_steps"] == 2.0


def test_the_critic_builds_the_objectives_it_trains_in():
    """A value head adds its loss to the actor's objective (no role of its own); a value
    model keeps the actor's as it is and trains in an objective of its own."""
    actor = PolicyObjective(ActorConfig(), TEMPERATURE)
    head = ValueHead(CriticConfig(), torch.nn.Linear(4, 1))
    assert head.objectives(actor) == {
        "actor": PolicyObjective(ActorConfig(), TEMPERATURE, critic=head)
    }
    model = ValueModel(CriticConfig(), torch.nn.Linear(4, 1), "test")
    assert model.objectives(actor) == {"actor": actor, "critic": ValueObjective(model)}
