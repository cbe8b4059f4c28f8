"""`proxima` end to end on nano models: init-model -> train -> outputs; config errors; run
folders never overwritten; eval; sft. Everything stays in tmp_path, nothing is downloaded."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

from proxima.cli import main
from proxima.config import Config, load_config
from proxima.data import collate_sft
from proxima.models import ARCHITECTURES, load_causal_lm, load_tokenizer
from proxima.trainer.datasets import load_prompts, load_sft
from proxima.trainer.ppo import PPOTrainer
from proxima.trainer.roles import load_roles

pytestmark = pytest.mark.slow

SUMMARY_KEYS = {"config", "iterations", "wall_seconds", "phase_seconds"}


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _changed(before: dict, after: dict) -> list[str]:
    """Names present in both whose tensors differ."""
    return [k for k in before.keys() & after.keys() if not torch.equal(before[k], after[k])]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_train_writes_run_folder(arch, tmp_path, make_model, fast_overrides):
    init = make_model(arch)
    out = tmp_path / "run"
    assert main(["train", *fast_overrides(init, out, 2)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert SUMMARY_KEYS <= summary.keys() and summary["iterations"] == 2
    assert summary["config"]["model"]["actor_path"] == str(init)
    mem = summary["memory"]  # the measured peak beside the plan's
    assert mem["device"] == "cpu" and mem["peak_gib"] > 0 and mem["planned_peak_gib"] > 0
    metrics = _lines(out / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(0.0 <= m["score"] <= 1.0 for m in metrics)  # the fraction-of-sevens reward
    assert len(_lines(out / "samples.jsonl")) == 2 * 2  # trainer.log_samples x iterations
    assert (out / "curves.png").stat().st_size > 0

    initial = _weights(AutoModelForCausalLM.from_pretrained(init, local_files_only=True))
    actor = AutoModelForCausalLM.from_pretrained(out / "actor", local_files_only=True)
    critic = AutoModelForTokenClassification.from_pretrained(out / "critic", local_files_only=True)
    assert actor.config.model_type == critic.config.model_type == arch
    assert critic.config.num_labels == 1
    assert _changed(initial, _weights(actor))
    # the critic's backbone started as the actor's: shared names (the LM head excluded) moved
    critic_w = _weights(critic)
    shared = initial.keys() & critic_w.keys()
    assert len(shared) > 4 and _changed(initial, critic_w)


def test_reference_frozen_while_actor_and_critic_train(tmp_path, make_model, fast_overrides):
    init = make_model("llama")
    cfg = load_config(None, fast_overrides(init, tmp_path / "unused", 2))
    device = torch.device("cpu")
    roles = load_roles(cfg, device)
    trainer = PPOTrainer(
        cfg, roles, load_prompts(cfg, cfg.data.train_path, roles.tokenizer), device
    )
    models = {"actor": roles.actor, "reference": roles.reference, "critic": roles.critic.model}
    start = {name: _weights(model) for name, model in models.items()}
    for _ in range(2):
        metrics, _ = trainer.step()
        assert metrics["actor/skipped_steps"] == 0 and metrics["critic/skipped_steps"] == 0
    assert _changed(start["actor"], _weights(roles.actor))
    assert _changed(start["critic"], _weights(roles.critic.model))
    assert not _changed(start["reference"], _weights(roles.reference))
    # and the reference is still exactly the initial folder's model
    initial = _weights(load_causal_lm(init, trainable=False))
    assert initial.keys() == start["reference"].keys()
    assert not _changed(initial, _weights(roles.reference))


def test_unknown_config_key_returns_2_and_names_it(capsys):
    assert main(["train", "task.name=", "model.actor_path=x", "trainer.iteration=3"]) == 2
    err = capsys.readouterr().err
    assert "trainer.iteration" in err and "trainer.iterations" in err  # key and suggestion


def test_second_run_into_same_dir_goes_to_dash_2(tmp_path, make_model, fast_overrides):
    init = make_model("llama")
    out = tmp_path / "run"
    assert main(["train", *fast_overrides(init, out, 1)]) == 0
    first = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    assert main(["train", *fast_overrides(init, out, 2)]) == 0
    second = out.with_name("run-2")
    assert json.loads((second / "summary.json").read_text())["iterations"] == 2
    assert len(_lines(second / "metrics.jsonl")) == 2
    # the first run folder is untouched: same files, same bytes, one metrics line
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()} == first
    assert len(_lines(out / "metrics.jsonl")) == 1


def test_eval_prints_accuracy(tmp_path, make_model, prompt_file, reward_spec, capsys):
    # the first 20 prompts are "0+b=" and "1+b=" (b < 10); the 0/1 reward is 1 exactly for
    # prompts starting with "1", whatever the model writes: accuracy 10 / 20 = 50%
    init = make_model("gpt2")
    out = tmp_path / "eval.json"
    rc = main(
        [
            "eval",
            "--model",
            str(init),
            "--data",
            str(prompt_file),
            "--reward",
            reward_spec("prompt_starts_with_1"),
            "--max-prompts",
            "20",
            "--max-new-tokens",
            "3",
            "--device",
            "cpu",
            "--out",
            str(out),
        ]
    )
    assert rc == 0
    assert re.search(
        r"greedy: mean reward 0\.5000, accuracy 50\.00% on 20 prompts", capsys.readouterr().out
    )
    result = json.loads(out.read_text())["greedy"]
    assert result["accuracy"] == 0.5 and result["n"] == 20


def test_eval_takes_a_run_folder_and_writes_json_lines(
    tmp_path, make_model, fast_overrides, prompt_file, reward_spec, capsys
):
    """--model RUN evaluates the run's actor/, as chat and export take a run folder; an
    --out ending in .jsonl gets one JSON line per evaluation mode."""
    run = tmp_path / "run"
    assert main(["train", *fast_overrides(make_model(), run, 1)]) == 0
    out = tmp_path / "eval.jsonl"
    flags = ["--data", str(prompt_file), "--reward", reward_spec("prompt_starts_with_1")]
    flags += ["--max-prompts", "4", "--max-new-tokens", "2", "--device", "cpu", "--out", str(out)]
    assert main(["eval", "--model", str(run), *flags, "eval.sampled=true"]) == 0
    assert f"evaluating the trained policy of {run}: {run / 'actor'}" in capsys.readouterr().out
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["mode"] for r in lines] == ["greedy", "sampled"] and lines[0]["n"] == 4


def test_eval_needs_exactly_one_reward(make_model, prompt_file, capsys):
    init = make_model("llama")
    assert main(["eval", "--model", str(init), "--data", str(prompt_file)]) == 2
    assert "--reward" in capsys.readouterr().err


def _sft_loss(folder: Path, data: Path) -> float:
    """Mean next-token loss of the model in `folder` on all 100 SFT records."""
    cfg = Config()  # default prompt / response columns
    tok = load_tokenizer(folder)
    model = load_causal_lm(folder, trainable=False)
    records = list(load_sft(cfg, data, tok, 16))
    with torch.no_grad():
        return float(model(**collate_sft(records, tok.pad_token_id)).loss)


def test_sft_writes_loadable_model(tmp_path, make_model, sft_file):
    init = make_model("qwen2")
    out = tmp_path / "sft"
    rc = main(
        [
            "sft",
            "--model",
            str(init),
            "--data",
            str(sft_file),
            "--out",
            str(out),
            "--steps",
            "30",
            "--lr",
            "3e-3",
            "--batch-size",
            "16",
            "--max-length",
            "16",
            "--device",
            "cpu",
        ]
    )
    assert rc == 0
    model = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert model.config.model_type == "qwen2"
    assert load_tokenizer(out).pad_token_id == 0
    # 30 steps at lr 3e-3 on one-character answers: the loss must clearly fall
    assert _sft_loss(out, sft_file) < _sft_loss(init, sft_file) - 0.3


def test_sft_takes_a_yaml_and_overrides_like_train(tmp_path, make_model, sft_file):
    """One config path for every command: `proxima sft my.yaml sft.steps=2` (flags are
    only short names of keys)."""
    init = make_model("llama")
    yaml_file = tmp_path / "sft.yaml"
    yaml_file.write_text(
        f"model: {{actor_path: '{init}', device: cpu}}\n"
        f"data: {{sft_path: '{sft_file}'}}\n"
        f"sft: {{out: '{tmp_path / 'out'}', steps: 50, max_length: 16}}\n"
    )
    assert main(["sft", str(yaml_file), "sft.steps=2", "sft.lr=1e-3"]) == 0
    assert (tmp_path / "out" / "config.json").is_file()
    # the folder now holds a model: a second run refuses to overwrite it, naming the cause
    assert main(["sft", str(yaml_file), "sft.steps=2"]) == 2


def test_overrides_without_yaml_train_the_given_model(
    tmp_path, make_model, prompt_file, reward_spec, capsys
):
    # `proxima train model.actor_path=A data.train_path=D reward.function=F` (no YAML, no
    # task.name) must either train A on D, or stop and say that the built-in example's
    # task would replace them; silently training another model on other data is wrong.
    init = make_model("gpt2")
    out = tmp_path / "run"
    rc = main(
        [
            "train",
            f"model.actor_path={init}",
            f"data.train_path={prompt_file}",
            f"reward.function={reward_spec('fn')}",
            "model.device=cpu",
            "task.size=nano",
            "task.sft_steps=0",
            "task.n_train=16",
            "task.n_eval=4",
            "task.n_sft=4",
            "task.sft_batch_size=4",
            "data.train_batch_size=4",
            "rollout.n=2",
            "rollout.max_response_length=4",
            "actor.ppo_mini_batch_size=8",
            "actor.ppo_micro_batch_size=8",
            "critic.ppo_mini_batch_size=8",
            "critic.ppo_micro_batch_size=8",
            "trainer.iterations=1",
            f"trainer.output_dir={out}",
            "trainer.tensorboard=false",
        ]
    )
    if rc == 2:
        assert "task.name" in capsys.readouterr().err
        return
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["config"]["model"]["actor_path"] == str(init)
    assert summary["config"]["data"]["train_path"] == str(prompt_file)
    actor = AutoModelForCausalLM.from_pretrained(out / "actor", local_files_only=True)
    assert actor.config.model_type == "gpt2"


def test_sft_refuses_to_overwrite_a_model(make_model, sft_file, tmp_path, capsys):
    model = make_model("llama")
    # the init folder already holds a model: `proxima sft --out` there must not replace it
    before = (model / "model.safetensors").read_bytes()
    rc = main(
        ["sft", "--model", str(model), "--data", str(sft_file), "--out", str(model), "--steps", "1"]
    )
    assert rc == 2 and "already holds a model" in capsys.readouterr().err
    assert (model / "model.safetensors").read_bytes() == before


def test_the_held_out_line_reports_accuracy_only_where_both_evaluations_have_it():
    from proxima.cli import held_out_line

    binary = {"mean_reward": 0.25, "accuracy": 0.25}
    summary = {"eval_before": binary, "eval_after": {"mean_reward": 0.5, "accuracy": 0.5}}
    assert held_out_line(summary) == "held-out accuracy (greedy): before 0.2500 -> after 0.5000"
    # rewards of 0 and 1 alone before training, a fractional one after (found on a GPU run)
    summary = {
        "eval_before": {"mean_reward": 0.0, "accuracy": 0.0},
        "eval_after": {"mean_reward": 0.0925},
    }
    assert held_out_line(summary) == "held-out mean_reward (greedy): before 0.0000 -> after 0.0925"
    resumed = {"eval_at_resume": binary, "eval_after": binary}
    assert held_out_line(resumed) == "held-out accuracy (greedy): at resume 0.2500 -> after 0.2500"
    assert held_out_line({"eval_after": binary}) is None
