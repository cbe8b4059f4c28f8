"""`proxima rm` end to end on a nano llama: SFT-style folder -> reward model -> PPO with it.

The pairs are sums "a+b=": chosen is the correct sum, rejected a wrong one. The held-out
pairs pair each prompt with a wrong answer never seen in training, so the reward model
must rank the correct sum first rather than remember the rejected strings.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from proxima.cli import main
from proxima.data.preferences import PreferenceDataset
from proxima.models import load_reward_model, load_tokenizer, reward_model_scores
from proxima.trainer.rm import all_pair_scores
from tests.e2e.conftest import arithmetic_pairs, write_jsonl

TRAIN_WRONG = 8  # wrong answers per prompt in training: 100 prompts x 8 = 800 pairs


def _rm_args(model: Path, data: Path, out: Path, *extra: str) -> list[str]:
    return ["rm", "--model", str(model), "--data", str(data), "--out", str(out), *extra]


@pytest.mark.slow
def test_rm_learns_sums_and_plugs_into_ppo(
    tmp_path, make_model, fast_overrides, capsys, keep_threads
):
    init = make_model("llama")
    train_file, held_file = arithmetic_pairs(tmp_path, TRAIN_WRONG)
    out = tmp_path / "rm"
    steps = ["--steps", "300", "--lr", "3e-3", "--batch-size", "32", "--max-length", "16"]
    steps += ["--threads", "1"]  # nano matrices: one thread is fastest, and immune to a busy CPU
    rc = main(_rm_args(init, train_file, out, "--eval-data", str(held_file), *steps))
    assert rc == 0
    printed = capsys.readouterr().out
    assert "eval preference accuracy: before" in printed and "train preference" in printed
    summary = json.loads((out / "rm_summary.json").read_text())
    assert summary["pairs"] == 800 and summary["eval_pairs"] == 100
    assert len(summary["curves"]["loss"]) == 300
    before, after = summary["eval_before"]["accuracy"], summary["eval_after"]["accuracy"]
    # Measured (seeds 0-3 of model and training): 0.54 -> 0.89, 0.45 -> 0.70, 0.46 -> 0.81,
    # 0.47 -> 0.73, i.e. a rise of 0.25 to 0.35; the test asks for less than half of that.
    assert after >= before + 0.12 and after >= 0.62, (before, after)
    assert summary["train_after"]["accuracy"] > summary["train_before"]["accuracy"]

    # The saved folder is a normal reward model: it loads and ranks held-out pairs the same.
    rm, tok = load_reward_model(out), load_tokenizer(out)
    held = PreferenceDataset(
        [json.loads(line) for line in held_file.read_text().splitlines()], tok, max_length=16
    )
    with torch.no_grad():
        chosen, rejected, _ = all_pair_scores(rm, held, tok.pad_token_id)
        one = held[0].chosen_ids  # one unpadded row scores like its padded batch row
        alone = reward_model_scores(rm, torch.tensor([one]), torch.ones(1, len(one)))
    assert float((chosen > rejected).float().mean()) == pytest.approx(after)
    torch.testing.assert_close(alone, chosen[:1], rtol=1e-5, atol=1e-5)

    # PPO with it: the reward model scores and also initialises the critic.
    run = tmp_path / "ppo"
    extra = ("reward.function=", f"reward.model_path={out}", "model.critic_init=reward_model")
    extra += ("trainer.threads=1",)
    assert main(["train", *fast_overrides(init, run, 2, *extra)]) == 0
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2


def test_rm_cli_errors_name_the_cause(tmp_path, make_model, capsys):
    init = make_model("llama")
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "1+1=", "good": "2", "rejected": "3"}])
    assert main(_rm_args(init, bad, tmp_path / "out")) == 2
    err = capsys.readouterr().err
    assert "no column 'chosen'" in err and "--chosen-key" in err
    assert not (tmp_path / "out").exists()  # nothing written before the data is checked
    # an existing model folder is never overwritten
    assert main(_rm_args(init, bad, init)) == 2
    assert "already holds a model" in capsys.readouterr().err
