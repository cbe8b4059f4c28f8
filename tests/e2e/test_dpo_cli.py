"""`proxima dpo` end to end on a nano llama: the held-out implicit-reward accuracy rises, the
run folder holds a policy that `proxima eval` and `proxima train` read, LoRA saves a plain
folder, and every bad input is refused by its key before a model loads.

The pairs are sums "a+b=": chosen is the correct sum, rejected a wrong one. The held-out
pairs pair each prompt with a wrong answer never seen in training, so the policy must
prefer the correct sum rather than only avoid the rejected strings it was shown.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import proxima.recipes.dpo as dpo_recipe
from proxima.cli import main
from proxima.models import load_causal_lm
from proxima.models.folders import policy_folder_problem
from tests.e2e.conftest import arithmetic_pairs

TRAIN_WRONG = 4  # wrong answers per prompt in training: 100 prompts x 4 = 400 pairs


@pytest.fixture
def pair_files(tmp_path: Path) -> tuple[Path, Path]:
    """400 training pairs and 100 held-out pairs (one unseen wrong answer per prompt)."""
    return arithmetic_pairs(tmp_path, TRAIN_WRONG)


def _dpo_args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    fast = ["--lr", "3e-3", "--batch-size", "32", "--max-length", "16", "--threads", "1"]
    return ["dpo", "--model", str(model), "--data", str(data), "--out", str(out), *fast, *extra]


@pytest.mark.slow
def test_dpo_raises_held_out_accuracy_and_saves_a_policy(
    tmp_path, make_model, pair_files, prompt_file, reward_spec, capsys, keep_threads
):
    init = make_model("llama")
    train_file, held_file = pair_files
    out = tmp_path / "dpo"
    rc = main(_dpo_args(init, train_file, out, "--eval-data", str(held_file), "--epochs", "3"))
    assert rc == 0
    printed = capsys.readouterr().out
    assert "eval pairs, implicit-reward accuracy: before 0.0000 -> after" in printed
    summary = json.loads((out / "summary.json").read_text())
    assert summary["pairs"] == 400 and summary["eval_pairs"] == 100 and summary["steps"] == 36
    before, after = summary["eval_before"], summary["eval_after"]
    assert before["rewards/accuracies"] == 0.0 and before["rewards/margins"] == 0.0
    # Measured (seeds 0-3 of the model and the training): held-out accuracy 0.74, 0.82,
    # 0.81, 0.81 and mean margin 0.17, 0.17, 0.16, 0.19; the test asks for a clear share
    # above chance (0.5) and half the smallest margin.
    assert after["rewards/accuracies"] >= 0.62, after
    assert after["rewards/margins"] >= 0.08, after
    assert after["logratio_per_token"] != 0.0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 37))
    assert (out / "curves.png").is_file()

    # The policy is a plain HF folder that the other commands read.
    actor = out / "actor"
    assert policy_folder_problem(actor) is None and load_causal_lm(actor) is not None
    assert "pass its trained policy" in policy_folder_problem(out)
    evaluated = [
        "eval", "--model", str(actor), "--data", str(prompt_file), "--reward", reward_spec(),
        "--max-prompts", "4", "--max-new-tokens", "2", "--threads", "1",
    ]  # fmt: skip
    assert main(evaluated) == 0
    assert main(["config", f"model.actor_path={actor}"]) == 0


@pytest.mark.slow
def test_dpo_with_lora_saves_the_merged_policy(tmp_path, make_model, pair_files, keep_threads):
    init = make_model("llama")
    out = tmp_path / "lora"
    lora = ["model.lora_rank=4", "model.lora_alpha=8", "dpo.loss_type=ipo"]
    assert main(_dpo_args(init, pair_files[0], out, *lora)) == 0
    summary = json.loads((out / "summary.json").read_text())
    # Measured: 0.73 of the first 256 training pairs ordered after one epoch (12 steps).
    assert summary["train_after"]["rewards/accuracies"] >= 0.6
    assert not (out / "actor" / "adapter_config.json").exists()
    assert (out / "actor_adapter" / "adapter_config.json").is_file()
    merged, base = load_causal_lm(out / "actor"), load_causal_lm(init)
    changed = [
        n for n, p in merged.state_dict().items() if not torch.equal(p, base.state_dict()[n])
    ]
    assert changed  # the adapters were merged into the weights


@pytest.fixture
def no_model_load(monkeypatch):
    """Fail the test if `proxima dpo` gets as far as loading the policy."""

    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the bad input was refused")

    monkeypatch.setattr(dpo_recipe, "load_actor", refuse)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["dpo.loss_type=hinge"], "`dpo.loss_type` must be one of sigmoid, ipo"),
        (["dpo.beta=0"], "`dpo.beta` must be positive"),
        (["dpo.label_smoothing=0.5"], "`dpo.label_smoothing` is cDPO's label-flip"),
        (["dpo.loss_type=ipo", "dpo.label_smoothing=0.1"], "set dpo.label_smoothing=0"),
        (["dpo.eval_every=-1"], "`dpo.eval_every` must be >= 0"),
        (["--batch-size", "1000"], "lower `dpo.batch_size`"),
        (["--chosen-key", "better"], "Set `proxima dpo --chosen-key` to the column"),
        (["--max-length", "4"], "raise --max-length"),
        (["--eval-data", "missing.jsonl"], "`dpo.eval_path`"),
        (["model.reference_path=elsewhere"], "unset model.reference_path"),
    ],
)
def test_bad_input_is_refused_by_its_key_before_the_model_loads(
    extra, message, tmp_path, make_model, pair_files, capsys, no_model_load
):
    out = tmp_path / "run"
    assert main(_dpo_args(make_model("llama"), pair_files[0], out, *extra)) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert not (out / "metrics.jsonl").exists()


def test_missing_sources_and_a_used_folder_are_refused(
    tmp_path, make_model, pair_files, capsys, no_model_load
):
    init = make_model("llama")
    assert main(["dpo", "--data", str(pair_files[0]), "--out", str(tmp_path / "a")]) == 2
    assert "`model.actor_path` is empty" in capsys.readouterr().err
    assert main(["dpo", "--model", str(init), "--out", str(tmp_path / "b")]) == 2
    assert "`dpo.train_path` is empty" in capsys.readouterr().err
    used = tmp_path / "used"
    used.mkdir()
    (used / "notes.txt").write_text("mine")
    assert main(_dpo_args(init, pair_files[0], used)) == 2
    assert "`dpo.out`" in capsys.readouterr().err and (used / "notes.txt").read_text() == "mine"
