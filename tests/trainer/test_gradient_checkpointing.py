"""`model.gradient_checkpointing`: the forward keeps far fewer activations for the backward
(measured through autograd's saved-tensor hooks), and the gradients of actor, critic and the
shared backbone are those without it, in every loss aggregation mode."""

from __future__ import annotations

import pytest
import torch

from proxima.models.loading import checkpoint_activations
from proxima.trainer.dist import Dist
from tests.distributed.common import MODES, global_batch, mini_batch_grads, models


def _model(role: str, checkpointed: bool) -> torch.nn.Module:
    actor, critic = models()
    model = critic if role == "critic" else actor
    if checkpointed:
        checkpoint_activations(model)
    return model


@pytest.mark.parametrize("role", ["actor", "critic"])
def test_the_forward_saves_fewer_activations(role):
    def saved_bytes(model: torch.nn.Module) -> int:
        total = 0

        def pack(t: torch.Tensor) -> torch.Tensor:
            nonlocal total
            total += t.numel() * t.element_size()
            return t

        model.train()
        ids = torch.randint(0, 10, (4, 24))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids).logits.sum().backward()
        return total

    plain, checkpointed = saved_bytes(_model(role, False)), saved_bytes(_model(role, True))
    assert checkpointed < 0.5 * plain, (checkpointed, plain)


@pytest.mark.parametrize("role", ["actor", "critic", "shared"])
@pytest.mark.parametrize("mode", MODES)
def test_the_gradients_are_unchanged(role, mode):
    grads = []
    for checkpointed in (False, True):
        exp = global_batch(models()[0])
        model = _model(role, checkpointed)
        grads.append(mini_batch_grads(model, role, mode, exp, Dist(), world=1))
    want, got = grads
    assert want.keys() == got.keys() and any(g.abs().sum() > 0 for g in want.values())
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-7, rtol=1e-6, msg=name)
