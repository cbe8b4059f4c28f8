"""The built-in arithmetic task: splits, verifier, SFT stopping rule."""

import re

import pytest

from proxima.data import SFTDataset
from proxima.models import build_char_tokenizer, build_tiny_model
from proxima.tasks.arithmetic import ALPHABET, make_splits, reward
from proxima.trainer.sft import sft_train


def test_splits_are_disjoint_sized_and_seeded():
    sizes = {"eval": 50, "val": 20, "sft": 100, "train": 300}
    a = make_splits(2, sizes, seed=3)
    assert {k: len(v) for k, v in a.items()} == sizes
    seen = [set(v) for v in a.values()]
    assert sum(len(s) for s in seen) == len(set().union(*seen))  # no pair in two splits
    assert a == make_splits(2, sizes, seed=3)
    assert a["eval"] != make_splits(2, sizes, seed=4)["eval"]


def test_splits_too_large_names_the_keys():
    with pytest.raises(ValueError, match=r"task.n_eval \+ task.n_sft \+ task.n_train"):
        make_splits(1, {"eval": 50, "train": 60}, seed=0)


def test_fewer_demonstrations_than_one_sft_batch_name_the_task_keys(capsys):
    from proxima.cli import main

    assert main(["config", "task.name=arithmetic", "task.n_sft=16"]) == 2
    err = capsys.readouterr().err
    assert "`task.n_sft`=16 demonstrations are fewer than one batch" in err
    assert "`task.sft_batch_size`=64" in err and "data.train_batch_size" not in err
    assert main(["config", "task.name=arithmetic", "task.n_sft=16", "task.sft_steps=0"]) == 0


def test_reward_is_exact_match():
    out = reward(
        ["1+2=", "9+9=", "5+5=", "0+0="], ["3", " 18 ", "100", ""], answer=["3", "18", "10", "0"]
    )
    assert out == [1.0, 1.0, 0.0, 0.0]


def test_sft_stops_when_the_rule_says_so():
    tok = build_char_tokenizer(ALPHABET)
    model = build_tiny_model("llama", tok, size="nano")
    records = [{"prompt": f"{i}+1=", "response": str(i + 1)} for i in range(20)]
    data = SFTDataset(records, tok, max_length=16)
    asked = []

    def stop(step: int) -> bool:
        asked.append(step)
        return step >= 6

    losses = sft_train(
        model, tok, data, steps=50, lr=1e-3, batch_size=4, stop_fn=stop, check_every=3
    )
    assert asked == [3, 6] and len(losses) == 6


@pytest.mark.slow
def test_default_example_pipeline_runs_small(tmp_path):
    """The default example's whole path (data, tiny model, SFT with its stopping rule,
    evaluation before/after, PPO) on a small budget; the full run is `make run`."""
    import json

    from proxima.cli import main
    from proxima.cli.args import default_config_path

    out = tmp_path / "run"
    code = main(
        [
            "train",
            str(default_config_path()),
            f"trainer.output_dir={out}",
            "trainer.iterations=3",
            "task.n_train=256",
            "task.n_eval=32",
            "task.n_sft=128",
            "task.sft_steps=20",
            "task.sft_check_every=10",
            "eval.every=2",
            "trainer.tensorboard=false",
        ]
    )
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["iterations"] == 3
    assert summary["task"]["sft_steps"] in (10, 20)  # stopped at a check, or ran them all
    for key in ("eval_before", "eval_after"):
        assert summary[key]["n"] == 32 and 0.0 <= summary[key]["accuracy"] <= 1.0
    assert set(summary["phase_seconds"]) >= {"generate", "score", "update"}
    assert summary["config"]["model"]["actor_path"].endswith("task/sft")


def test_sft_says_its_progress_in_a_log_file(monkeypatch, capsys):
    """Without a terminal (stderr captured here, as in a log file) the bar is hidden; a
    line says the step and loss at the first step, then every LINE_EVERY_S seconds, and at
    the last step."""
    from proxima import logging as plog

    tok = build_char_tokenizer(ALPHABET)
    model = build_tiny_model("llama", tok, size="nano")
    records = [{"prompt": f"{i}+1=", "response": str(i + 1)} for i in range(20)]
    data = SFTDataset(records, tok, max_length=16)
    sft_train(model, tok, data, steps=3, lr=1e-3, batch_size=4)
    said = capsys.readouterr().out
    assert re.findall(r"sft step (\d)/3 \| loss [\d.]+ \| \d+ s", said) == ["1", "3"]
    monkeypatch.setattr(plog, "LINE_EVERY_S", 0.0)
    sft_train(model, tok, data, steps=3, lr=1e-3, batch_size=4)
    assert re.findall(r"sft step (\d)/3", capsys.readouterr().out) == ["1", "2", "3"]
