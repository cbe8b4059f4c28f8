"""LoRA end to end (LoRA breaks the fast path in OpenRLHF #1081 and #1349):
`model.lora_rank=4` trains adapters on nano models, the reference is the actor with its
adapters disabled (the untouched base weights, no second copy), the run folder holds plain
merged models plus the adapters, and resume equals an uninterrupted run exactly, as for full
fine-tuning (tests/e2e/test_resume.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from proxima.cli import main
from proxima.config import load_config
from proxima.models import load_causal_lm
from proxima.models.forward import response_logits
from proxima.models.lora import AdapterDisabled, is_lora
from proxima.trainer.datasets import load_prompts
from proxima.trainer.ppo import PPOTrainer
from proxima.trainer.roles import load_roles
from tests.helpers import run_metrics

pytestmark = pytest.mark.slow

# one thread: two OpenMP threads on a busy 2-core machine made these runs 20x slower
LORA = ("model.lora_rank=4", "model.lora_alpha=8", "trainer.threads=1")


def _same_files(a: Path, b: Path, name: str) -> None:
    wa, wb = load_file(a / name), load_file(b / name)
    assert wa.keys() == wb.keys()
    assert [k for k in wa if not torch.equal(wa[k], wb[k])] == []


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_lora_run_writes_merged_models_and_adapters(
    arch, tmp_path, make_model, fast_overrides, capsys
):
    init = make_model(arch)
    out = tmp_path / "run"
    # exact KL: >= 0 for every sequence, so "> 0 once the actor moved" cannot flake
    argv = fast_overrides(init, out, 3, *LORA, "algorithm.kl_penalty=full")
    assert main(["train", *argv]) == 0
    assert "reference: the actor with its LoRA adapters disabled" in capsys.readouterr().out
    kl = [m["kl"] for _, m in sorted(run_metrics(out).items())]
    # iteration 1: B = 0, so actor == reference bit for bit; then the adapters have moved
    assert kl[0] == 0.0 and kl[1] > 0.0 and kl[2] > 0.0

    initial = AutoModelForCausalLM.from_pretrained(init, local_files_only=True).state_dict()
    actor = AutoModelForCausalLM.from_pretrained(out / "actor", local_files_only=True)
    trained = actor.state_dict()
    assert trained.keys() == initial.keys()  # a plain model: no lora_ or base_layer names
    assert [k for k in initial if not torch.equal(initial[k], trained[k])]
    critic = AutoModelForTokenClassification.from_pretrained(out / "critic", local_files_only=True)
    assert critic.config.num_labels == 1
    for name in ("actor_adapter", "critic_adapter"):
        config = json.loads((out / name / "adapter_config.json").read_text())
        assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8, "LORA")


def _ids() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.tensor([[0, 0, 5, 14, 6, 15], [5, 6, 14, 7, 8, 15]])  # "1+2=", "12+34="
    return ids, (ids != 0).long()


def test_reference_is_the_untouched_base(tmp_path, make_model, fast_overrides):
    init = make_model("llama")
    cfg = load_config(None, fast_overrides(init, tmp_path / "unused", 2, *LORA))
    device = torch.device("cpu")
    roles = load_roles(cfg, device)
    assert is_lora(roles.actor) and is_lora(roles.critic.model)
    assert isinstance(roles.reference, AdapterDisabled) and roles.reference.actor is roles.actor
    assert "shares the actor's weights, 0 MiB extra" in roles.report()
    trainer = PPOTrainer(
        cfg, roles, load_prompts(cfg, cfg.data.train_path, roles.tokenizer), device
    )
    for _ in range(2):
        metrics, _ = trainer.step()
        assert metrics["actor/skipped_steps"] == 0 and metrics["critic/skipped_steps"] == 0

    base = load_causal_lm(init, trainable=False)
    ids, mask = _ids()
    with torch.no_grad():
        want = response_logits(base, ids, mask, 3)
        assert torch.equal(response_logits(roles.reference, ids, mask, 3), want)
        assert not torch.allclose(response_logits(roles.actor, ids, mask, 3), want, atol=1e-4)
    # the frozen base weights inside the actor are the initial folder's, bit for bit
    inner = {
        k.replace(".base_layer", ""): v
        for k, v in roles.actor.get_base_model().state_dict().items()
        if "lora_" not in k
    }
    initial = base.state_dict()
    assert inner.keys() == initial.keys()
    assert [k for k in initial if not torch.equal(initial[k], inner[k])] == []


def test_critic_lora_off_and_explicit_reference(tmp_path, make_model, fast_overrides):
    init, other = make_model("llama"), make_model("llama", seed=1)
    extra = (*LORA, "model.critic_lora=false", f"model.reference_path={other}")
    cfg = load_config(None, fast_overrides(init, tmp_path / "unused", 1, *extra))
    roles = load_roles(cfg, torch.device("cpu"))
    assert is_lora(roles.actor) and not is_lora(roles.critic.model)
    assert all(p.requires_grad for p in roles.critic.model.parameters())  # full fine-tuning
    assert not isinstance(roles.reference, AdapterDisabled)  # the folder it was given
    assert not any(p.requires_grad for p in roles.reference.parameters())


def test_lora_resume_equals_uninterrupted_run(tmp_path, make_model, fast_overrides):
    init = make_model("llama")
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    assert main(["train", *fast_overrides(init, run_a, 4, "trainer.save_every=2", *LORA)]) == 0
    iter_2 = run_a / "checkpoints" / "iter_2"
    assert {p.name for p in iter_2.iterdir()} >= {
        "actor",
        "actor_adapter",
        "critic",
        "critic_adapter",
        "state.pt",
        "checkpoint.json",
    }
    resume = f"trainer.resume_from={iter_2}"
    assert main(["train", *fast_overrides(init, run_b, 4, resume, *LORA)]) == 0

    a, b = run_metrics(run_a), run_metrics(run_b)
    assert sorted(a) == [1, 2, 3, 4] and sorted(b) == [3, 4]
    for step in (3, 4):
        assert {"score", "kl", "actor/pg_loss", "critic/vf_loss"} <= b[step].keys()
        assert b[step] == a[step], step  # every metric, bit for bit
    assert a[3] != a[4] and a[3]["kl"] != 0.0
    for role in ("actor", "critic"):
        _same_files(run_a / role, run_b / role, "model.safetensors")
        _same_files(
            run_a / f"{role}_adapter", run_b / f"{role}_adapter", "adapter_model.safetensors"
        )


def test_lora_resume_refuses_another_rank(tmp_path, make_model, fast_overrides, capsys):
    init = make_model("llama")
    run_a = tmp_path / "a"
    assert main(["train", *fast_overrides(init, run_a, 1, *LORA)]) == 0
    capsys.readouterr()
    argv = fast_overrides(
        init,
        tmp_path / "b",
        2,
        "model.lora_rank=8",
        "model.lora_alpha=8",
        f"trainer.resume_from={run_a}",
    )
    assert main(["train", *argv]) == 2
    assert "model.lora_rank: checkpoint 4, this run 8" in capsys.readouterr().err


def test_shared_backbone_with_lora_resumes_exactly(tmp_path, make_model, fast_overrides):
    """critic.shared_backbone with LoRA: one adapted network, a value head beside it in
    value_head/ (no critic/), and resume equals the uninterrupted run bit for bit."""
    init = make_model("llama")
    shared = (*LORA, "critic.shared_backbone=true", "critic.warmup_iterations=1")
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    assert main(["train", *fast_overrides(init, run_a, 4, "trainer.save_every=2", *shared)]) == 0
    iter_2 = run_a / "checkpoints" / "iter_2"
    assert {p.name for p in iter_2.iterdir()} >= {"actor", "actor_adapter", "value_head"}
    assert not (iter_2 / "critic").exists() and not (run_a / "critic").exists()
    resume = f"trainer.resume_from={iter_2}"
    assert main(["train", *fast_overrides(init, run_b, 4, resume, *shared)]) == 0
    a, b = run_metrics(run_a), run_metrics(run_b)
    assert "actor/pg_loss" not in a[1] and "critic/vf_loss" in a[1]  # the head's warm-up
    for step in (3, 4):
        assert {"actor/pg_loss", "critic/vf_loss", "values_mean"} <= b[step].keys()
        assert b[step] == a[step], step
    _same_files(run_a / "value_head", run_b / "value_head", "model.safetensors")
    _same_files(run_a / "actor_adapter", run_b / "actor_adapter", "adapter_model.safetensors")
