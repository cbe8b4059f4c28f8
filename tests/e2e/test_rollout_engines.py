"""The trainer and its rollout engine: weights pushed after every actor update (never a rollout
from stale weights), the trust metric rollout/logprob_diff_* and its warning, the rollout
correction's weights, and `proxima train rollout.name=vllm` end to end (vLLM marker).

The fake engine serves from its own copy of the weights, started from perturbed ones, and
compares that copy with the actor's current weights at every rollout (tests/rollout)."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch

from proxima.cli import main
from proxima.config import ConfigError, load_config
from proxima.logging import read_metrics
from proxima.rollout.contract import LogprobMismatchWarning
from proxima.rollout.engines import check_engine
from proxima.rollout.hf_engine import HFEngine
from proxima.trainer.datasets import load_prompts
from proxima.trainer.evaluate import evaluate
from proxima.trainer.ppo import PPOTrainer
from proxima.trainer.roles import load_roles
from tests.rollout.fake_engine import FakeEngine, StaleWeightsError

pytestmark = pytest.mark.slow


def _trainer(make_model, fast_overrides, tmp_path, *extra: str, **fake):
    cfg = load_config(None, fast_overrides(make_model(), tmp_path / "run", 3, *extra))
    roles = load_roles(cfg, torch.device("cpu"))
    engine = FakeEngine(
        roles.actor, roles.tokenizer.pad_token_id, watch=lambda: roles.actor, **fake
    )
    prompts = load_prompts(cfg, cfg.data.train_path, roles.tokenizer)
    return PPOTrainer(cfg, roles, prompts, torch.device("cpu"), engine=engine), engine


VARIANTS = {
    "full": (),
    "lora": ("model.lora_rank=4", "model.lora_alpha=8", "actor.optim.lr=1e-2"),
    # one pass of the actor gives the old log-probs and the values (this engine is not hf)
    "shared": ("critic.shared_backbone=true", "actor.optim.lr=1e-2"),
}
LORA_SHARED = ("model.lora_rank=4", "model.lora_alpha=8", "critic.shared_backbone=true")


@pytest.mark.parametrize("variant", ["full", "lora", "shared"])
def test_every_rollout_samples_the_current_weights(make_model, fast_overrides, tmp_path, variant):
    trainer, engine = _trainer(make_model, fast_overrides, tmp_path, *VARIANTS[variant])
    before = {k: v.clone() for k, v in engine.inner.model.state_dict().items()}
    diffs = []
    for _ in range(3):
        metrics, _ = trainer.step()  # the engine raises StaleWeightsError on stale weights
        diffs.append(metrics["rollout/logprob_diff_mean"])
    # pushed before the first rollout and after every update (the last one too)
    assert engine.pushes == [0, 1, 2, 3] and engine.served == [0, 1, 2]
    after = engine.inner.model.state_dict()
    assert any(not torch.equal(before[k], after[k]) for k in before)  # pushes really landed
    # the fake engine is HF generate with the KV cache; the trainer's pass is a full forward
    assert max(diffs) < 1e-4 and metrics["rollout/logprob_diff_max"] < 1e-3
    # evaluation samples from the same, current weights
    items = list(load_prompts(trainer.cfg, trainer.cfg.data.train_path, trainer.roles.tokenizer))
    evaluate(trainer.synced_engine(), trainer.roles.tokenizer, items[:4], trainer.roles.reward,
             trainer.cfg.rollout, torch.device("cpu"))  # fmt: skip


def test_no_push_while_the_actor_waits_and_after_loading_weights(
    make_model, fast_overrides, tmp_path
):
    trainer, engine = _trainer(make_model, fast_overrides, tmp_path, "critic.warmup_iterations=1")
    trainer.step()  # critic warm-up: the actor is not updated, its weights stay version 0
    trainer.step()
    assert engine.pushes == [0, 1] and engine.served == [0, 0]
    trainer.save_models(tmp_path / "saved")
    trainer.load_models(tmp_path / "saved")  # new weights in place (resume): a new version
    trainer.step()
    assert engine.pushes == [0, 1, 2, 3] and engine.served == [0, 0, 2]


def test_a_missed_push_is_caught(make_model, fast_overrides, tmp_path, monkeypatch):
    trainer, _ = _trainer(make_model, fast_overrides, tmp_path)
    trainer.step()
    # no push from here on, neither the trainer's after an update nor sampling's before one
    monkeypatch.setattr(type(trainer.context), "sync_engine", lambda self: None)
    trainer.step()  # samples the weights pushed after step 1, then updates the actor
    with pytest.raises(StaleWeightsError, match="stale weights"):
        trainer.step()


def test_logprob_diff_is_measured_and_warns(make_model, fast_overrides, tmp_path):
    trainer, _ = _trainer(make_model, fast_overrides, tmp_path, logprob_shift=0.5)
    with pytest.warns(LogprobMismatchWarning, match="rollout.logprob_diff_warn=0.05"):
        metrics, _ = trainer.step()
    assert metrics["rollout/logprob_diff_mean"] == pytest.approx(0.5, abs=1e-4)
    assert metrics["rollout/logprob_diff_max"] == pytest.approx(0.5, abs=1e-3)


@pytest.mark.parametrize(("cap", "mean", "frac"), [(2.0, math.exp(0.3), 0.0), (1.2, 1.2, 1.0)])
def test_rollout_correction_weights(make_model, fast_overrides, tmp_path, cap, mean, frac):
    """The engine reports log-probs 0.3 below the trainer's: pi_old / mu = exp(0.3) = 1.35 on
    every token, under the cap 2 and truncated to 1.2 by the cap 1.2."""
    extra = ("algorithm.rollout_correction=token", f"algorithm.rollout_correction_cap={cap}")
    trainer, _ = _trainer(make_model, fast_overrides, tmp_path, *extra, logprob_shift=-0.3)
    metrics, _ = trainer.step()
    assert metrics["rollout/is_weight_mean"] == pytest.approx(mean, abs=1e-3)
    assert metrics["rollout/is_truncated_frac"] == frac


REJECT = "algorithm.rollout_rejection"
ICEPOP = ("algorithm.rollout_correction=token", "algorithm.rollout_correction_cap=5",
          f"{REJECT}=token", f"{REJECT}_threshold=5", f"{REJECT}_threshold_lower=0.5")  # fmt: skip


@pytest.mark.parametrize(
    ("extra", "rejected"),
    [
        ((f"{REJECT}=token",), 0.0),  # ratio 1.35 in verl's default band [1/2, 2]
        ((f"{REJECT}=token", f"{REJECT}_threshold=1.2"), 1.0),
        ((f"{REJECT}=sequence", f"{REJECT}_threshold=1.2"), 1.0),  # 1.35^n > 1.2
        ((f"{REJECT}=geometric",), 1.0),  # 1.35 outside verl's [1/1.001, 1.001]
        ((f"{REJECT}=geometric", f"{REJECT}_threshold=1.5"), 0.0),
        (ICEPOP, 0.0),  # IcePop: the ratio 1.35 in [0.5, 5] is the weight
    ],
)
def test_rollout_rejection_trains(make_model, fast_overrides, tmp_path, extra, rejected):
    """pi_old / mu = exp(0.3) = 1.35 on every token (as above): each rejection level keeps
    or rejects all of them, and an iteration with every token rejected still trains (the
    policy loss is 0, the metrics finite)."""
    trainer, _ = _trainer(make_model, fast_overrides, tmp_path, *extra, logprob_shift=-0.3)
    metrics, _ = trainer.step()
    assert metrics["rollout/rejected_token_frac"] == rejected
    assert metrics["rollout/rejected_seq_frac"] == rejected
    assert metrics["rollout/kl_k3"] == pytest.approx(math.expm1(0.3) - 0.3, abs=1e-4)
    assert metrics["rollout/seq_logratio_abs_max"] >= metrics["rollout/seq_logratio_mean"] > 0
    if extra == ICEPOP:
        assert metrics["rollout/is_weight_mean"] == pytest.approx(math.exp(0.3), abs=1e-3)
    if rejected:
        assert metrics["actor/pg_loss"] == 0.0
    assert all(math.isfinite(v) for v in metrics.values() if isinstance(v, float))


def test_hf_engine_serving_the_actor_never_reads_pushed_weights(make_model):
    from proxima.models import load_causal_lm

    def never_read():
        raise AssertionError("the hf engine read the weights it already serves")
        yield  # pragma: no cover

    engine = HFEngine(load_causal_lm(make_model()), pad_token_id=0, micro_batch_size=4)
    engine.update_weights(never_read(), version=7)
    assert engine.weight_version == 7


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_vllm_engine_without_vllm_stops_early(make_model, fast_overrides, tmp_path, capsys):
    argv = fast_overrides(make_model(), tmp_path / "run", 1, "rollout.name=vllm")
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err
    assert "`rollout.name=vllm` but vLLM cannot be imported" in err and "rollout.name=hf" in err
    assert not (tmp_path / "run").exists()  # stopped before anything was written


@pytest.mark.vllm
def test_vllm_engine_refuses_a_head_size_its_cpu_kernels_lack(make_model, fast_overrides, tmp_path):
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        pytest.skip("the head-size limit is the CPU build's")
    argv = fast_overrides(make_model("llama", "nano"), tmp_path / "run", 1, "rollout.name=vllm")
    with pytest.raises(ConfigError, match="head sizes .* has 16 .*rollout.name=hf"):
        check_engine(load_config(None, argv))
    assert main(["train", *argv]) == 2 and not (tmp_path / "run").exists()


@pytest.mark.vllm
@pytest.mark.parametrize("variant", ["full", "lora", "shared", "lora_shared"])
def test_train_with_the_vllm_engine(make_model, fast_overrides, tmp_path, monkeypatch, variant):
    """`proxima train rollout.name=vllm` on a small Llama (head size 32), full fine-tuning,
    LoRA (base + adapter pushed, no merged copy), the shared-backbone actor-critic, and both:
    runs, and vLLM's log-probs stay within float32 noise of the trainer's every iteration,
    so every push landed (stale weights would differ by far more once the actor moved)."""
    from proxima.rollout.vllm_engine import VLLMEngine

    pushes = []
    for method in ("update_weights", "update_adapter"):
        original = getattr(VLLMEngine, method)

        def record(self, *args, _method=method, _original=original):
            pushes.append((_method, args[-1]))
            return _original(self, *args)

        monkeypatch.setattr(VLLMEngine, method, record)
    out = tmp_path / "run"
    extra = VARIANTS.get(variant, LORA_SHARED + ("actor.optim.lr=1e-2",))
    argv = fast_overrides(
        make_model("llama", "small"),
        out,
        3,
        "rollout.name=vllm",
        "model.dtype=float32",
        "algorithm.kl_penalty=full",  # exact KL to the reference: > 0 once the actor moved
        *extra,
    )
    assert main(["train", *argv]) == 0
    rows = [r for r in read_metrics(out / "metrics.jsonl") if "rollout/logprob_diff_mean" in r]
    assert len(rows) == 3
    assert max(r["rollout/logprob_diff_max"] for r in rows) < 1e-3
    assert rows[0]["kl"] == 0.0 and rows[2]["kl"] > 0.0  # the actor did move
    summary = json.loads((out / "summary.json").read_text())
    assert summary["iterations"] == 3 and summary["config"]["rollout"]["name"] == "vllm"
    push = "update_adapter" if variant.startswith("lora") else "update_weights"
    assert pushes == [(push, v) for v in range(4)]  # before the first rollout, after each update


def test_the_vllm_context_length_is_what_check_lengths_allows(make_model, fast_overrides, tmp_path):
    """vLLM's max_model_len: the prompt budget + the tokens after the prompt (a whole episode
    with rollout.env), never past the model's positions (64 here), which vLLM refuses."""
    from proxima.rollout.vllm_engine import _context_length

    argv = fast_overrides(make_model(), tmp_path / "run", 1)
    assert _context_length(load_config(None, argv)) == 16 + 4
    cfg = load_config(None, [*argv, "data.max_prompt_length=256"])  # the default: > 64
    assert _context_length(cfg) == 64
    env = "rollout.env=proxima.tasks.tools:Calculator"
    cfg = load_config(None, [*argv, env, "rollout.env.max_episode_tokens=40"])
    assert _context_length(cfg) == 16 + 40


@pytest.mark.vllm
@pytest.mark.parametrize("name", ["hf", "vllm"])
def test_both_engines_train_the_same_config(make_model, fast_overrides, tmp_path, name):
    """One config, both engines: a prompt budget past the model's positions (the default
    data.max_prompt_length=256 with a 64-position model) once stopped vLLM alone."""
    out = tmp_path / name
    argv = fast_overrides(make_model("llama", "small"), out, 2, f"rollout.name={name}")
    assert main(["train", *argv, "data.max_prompt_length=256"]) == 0
    assert json.loads((out / "summary.json").read_text())["iterations"] == 2


@pytest.mark.vllm
def test_eval_with_vllm_answers_as_hf(make_model, prompt_file, reward_spec, tmp_path):
    """`proxima eval rollout.name=vllm`: greedy answers, hence scores, equal the hf engine's."""
    init = make_model("llama", "small")
    results = {}
    for name in ("hf", "vllm"):
        out = tmp_path / f"{name}.json"
        argv = ["eval", "--model", str(init), "--data", str(prompt_file), "--reward"]
        argv += [reward_spec("fn"), "--max-prompts", "20", "--max-new-tokens", "6"]
        argv += ["--device", "cpu", "--out", str(out), f"rollout.name={name}"]
        assert main([*argv, "data.max_prompt_length=16", "model.dtype=float32"]) == 0
        results[name] = json.loads(out.read_text())["greedy"]
    assert results["vllm"]["samples"] == results["hf"]["samples"]
    assert results["vllm"]["mean_reward"] == results["hf"]["mean_reward"]


@pytest.mark.vllm
def test_one_engine_over_several_processes_is_refused(make_model, fast_overrides, tmp_path):
    argv = fast_overrides(make_model("llama", "small"), tmp_path / "run", 1, "rollout.name=vllm")
    cfg = load_config(None, [*argv, "rollout.vllm.tensor_model_parallel_size=2"])
    with pytest.raises(ConfigError, match=r"tensor_model_parallel_size`=2: .*Set it to 1"):
        check_engine(cfg)


@pytest.mark.vllm
@pytest.mark.parametrize("strategy", ["ddp", "fsdp2", "ddp+lora"])
def test_vllm_on_every_process(make_model, fast_overrides, tmp_path, strategy):
    """`torchrun --nproc_per_node 2 ... rollout.name=vllm`: each process runs its own engine
    on its share of the prompts (vLLM's data parallelism under an external launcher) and
    gets the actor's weights after every update (FSDP2: gathered from the shards; a LoRA
    actor: base once, then its adapter, each process from its own folder). The greedy
    evaluation before training equals one process's, and every engine's log-probs stay
    within float32 noise of the trainer's while the actor moves."""
    import subprocess
    import sys

    model = make_model("llama", "small")
    eval_file = tmp_path / "eval.jsonl"
    eval_file.write_text("".join(json.dumps({"prompt": f"{a}+{a}="}) + "\n" for a in range(10)))
    runs = {}
    for nproc in (1, 2):
        out = tmp_path / f"run{nproc}"
        argv = fast_overrides(
            model,
            out,
            3,
            "rollout.name=vllm",
            f"trainer.strategy={strategy.split('+')[0] if nproc == 2 else 'auto'}",
            f"data.eval_path={eval_file}",
            "trainer.threads=1",
            "algorithm.kl_penalty=full",
            *(VARIANTS["lora"] if strategy.endswith("+lora") else ()),
        )
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        launch += ["--nproc_per_node", str(nproc), "-m", "proxima", "train", *argv]
        proc = subprocess.run(launch, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "merged copy instead" not in proc.stderr  # a LoRA actor went as its adapter
        runs[nproc] = json.loads((out / "summary.json").read_text())
        rows = [r for r in read_metrics(out / "metrics.jsonl") if "rollout/logprob_diff_max" in r]
        assert len(rows) == 3 and max(r["rollout/logprob_diff_max"] for r in rows) < 1e-3
        assert rows[-1]["kl"] > 0.0  # the actor moved, and the engines followed it
    assert runs[2]["world_size"] == 2
    assert runs[2]["eval_before"]["samples"] == runs[1]["eval_before"]["samples"]
