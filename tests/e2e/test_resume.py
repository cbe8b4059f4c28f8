"""Resume equals an uninterrupted run (missing or broken in TRL #2657, OpenRLHF #928): run A
trains 4 iterations and saves at 2; run B resumes from A's iter_2 and must log the very same
metrics for steps 3-4 and end with the very same actor and critic weights. Also at an epoch
boundary of the prompt loader (verl PR #5725 trained 0 steps there), for a built-in task run
(no second SFT; the reference stays the initial actor), and "nothing to do" stops with a
message."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from proxima.cli import main
from proxima.config import load_config
from proxima.recipes import train
from tests.helpers import assert_same_weights, run_metrics

from .conftest import write_jsonl

pytestmark = pytest.mark.slow


def _run_a_and_b(tmp_path, make_model, fast_overrides, *extra: str) -> tuple[Path, Path]:
    """A: 4 iterations, checkpoints at 2 and 4. B: resume from A's iter_2 up to 4."""
    init = make_model("llama")
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    assert main(["train", *fast_overrides(init, run_a, 4, "trainer.save_every=2", *extra)]) == 0
    iter_2 = run_a / "checkpoints" / "iter_2"
    resume = f"trainer.resume_from={iter_2}"
    assert main(["train", *fast_overrides(init, run_b, 4, resume, *extra)]) == 0
    return run_a, run_b


def test_resume_equals_uninterrupted_run(tmp_path, make_model, fast_overrides, capsys):
    run_a, run_b = _run_a_and_b(tmp_path, make_model, fast_overrides, "trainer.threads=1")
    a, b = run_metrics(run_a), run_metrics(run_b)
    assert sorted(a) == [1, 2, 3, 4] and sorted(b) == [3, 4]  # B continues at step N+1
    for step in (3, 4):
        assert {"score", "kl", "actor/pg_loss", "critic/vf_loss"} <= b[step].keys()
        assert b[step] == a[step], step  # every metric, bit for bit
    assert a[3] != a[4]  # the comparison is not between constants
    for role in ("actor", "critic"):
        assert_same_weights(run_a / role, run_b / role)
    # keep_checkpoints=2: A keeps iter_2 and its final iter_4; B wrote its own final one
    assert sorted(p.name for p in (run_a / "checkpoints").iterdir()) == ["iter_2", "iter_4"]
    assert [p.name for p in (run_b / "checkpoints").iterdir()] == ["iter_4"]
    summary = json.loads((run_b / "summary.json").read_text())
    assert summary["resumed_from"] == str(run_a / "checkpoints" / "iter_2")
    assert summary["iterations"] == 4

    # nothing to do: A's run folder resolves to its latest checkpoint, iter_4
    capsys.readouterr()
    init = next(tmp_path.glob("init-llama-*"))
    for iterations in (4, 3):
        run_c = tmp_path / f"c{iterations}"
        argv = fast_overrides(init, run_c, iterations, f"trainer.resume_from={run_a}")
        assert main(["train", *argv]) == 2
        err = capsys.readouterr().err
        assert "nothing to do" in err and "iter_4 is at iteration 4" in err
        assert "Raise trainer.iterations above 4" in err
        assert not run_c.exists()  # stopped before writing anything


def test_resume_at_epoch_boundary_trains_the_rest(tmp_path, make_model, fast_overrides):
    # 8 prompts, 4 per iteration: 2 batches per epoch, so iteration 2 ends epoch 0 exactly
    rows = [{"prompt": f"{a}+{a}=", "answer": str(2 * a)} for a in range(8)]
    prompts = write_jsonl(tmp_path / "eight.jsonl", rows)
    run_a, run_b = _run_a_and_b(
        tmp_path, make_model, fast_overrides, f"data.train_path={prompts}", "trainer.threads=1"
    )
    state = torch.load(run_a / "checkpoints" / "iter_2" / "state.pt", weights_only=True)
    assert state["trainer"]["loader"] == {"epoch": 0, "position": 2, "seed": 42}  # boundary
    a, b = run_metrics(run_a), run_metrics(run_b)
    assert sorted(b) == [3, 4]  # the remaining iterations were trained, not 0
    assert b[3] == a[3] and b[4] == a[4]
    assert_same_weights(run_a / "actor", run_b / "actor")


def _task_overrides(out: Path, iterations: int, *extra: str) -> list[str]:
    """The arithmetic task on a nano model: 2 SFT steps, 4 prompts x 2 samples."""
    return [
        "task.name=arithmetic",
        "task.size=nano",
        "task.sft_steps=2",
        "task.sft_batch_size=4",
        "task.n_train=16",
        "task.n_eval=4",
        "task.n_sft=8",
        "model.device=cpu",
        "data.train_batch_size=4",
        "data.max_prompt_length=16",
        "rollout.n=2",
        "rollout.max_response_length=4",
        "actor.ppo_mini_batch_size=8",
        "actor.ppo_micro_batch_size=8",
        "actor.optim.lr=1e-3",
        "critic.ppo_mini_batch_size=8",
        "critic.ppo_micro_batch_size=8",
        "critic.optim.lr=1e-3",
        f"trainer.iterations={iterations}",
        f"trainer.output_dir={out}",
        "trainer.tensorboard=false",
        "trainer.threads=1",
        *extra,
    ]


def test_task_run_extended_from_final_checkpoint(tmp_path):
    """A finished 2-iteration task run extended to 3 equals an uninterrupted 3-iteration
    run at step 3. The KL there compares the actor with the reference, so it only matches
    if the reference is still the task's initial (SFT) actor, not the checkpoint's."""
    first = Path(train(load_config(None, _task_overrides(tmp_path / "a", 2)))["run_dir"])
    cfg = load_config(None, _task_overrides(tmp_path / "b", 3, f"trainer.resume_from={first}"))
    extended = Path(train(cfg)["run_dir"])
    straight = Path(train(load_config(None, _task_overrides(tmp_path / "c", 3)))["run_dir"])

    assert not (extended / "task").exists()  # the task (and its SFT) was not prepared again
    config = json.loads((extended / "config.json").read_text())
    assert config["model"]["actor_path"] == str(first / "task" / "sft")
    assert config["data"]["eval_path"] == str(first / "task" / "eval.jsonl")
    b, c = run_metrics(extended), run_metrics(straight)
    train_b = {k: v for k, v in b[3].items() if not k.startswith("eval/")}
    train_c = {k: v for k, v in c[3].items() if not k.startswith("eval/")}
    assert train_b["kl"] != 0.0 and train_b == train_c
    assert_same_weights(straight / "actor", extended / "actor")


def test_cli_resume_continues_the_checkpoints_own_config(tmp_path, capsys):
    """`proxima train trainer.resume_from=RUN trainer.iterations=N` needs no YAML and no
    repeated overrides: the checkpoint's saved config is the base."""
    out = tmp_path / "run"
    small = [
        "task.n_train=128",
        "task.n_eval=16",
        "task.n_sft=64",
        "task.sft_steps=10",
        "trainer.tensorboard=false",
        "data.train_batch_size=8",
        "rollout.n=2",
        "actor.ppo_mini_batch_size=16",
        "actor.ppo_micro_batch_size=16",
        "critic.ppo_mini_batch_size=16",
        "critic.ppo_micro_batch_size=16",
    ]
    assert main(["train", f"trainer.output_dir={out}", "trainer.iterations=2", *small]) == 0
    capsys.readouterr()
    assert main(["train", f"trainer.resume_from={out}", "trainer.iterations=3"]) == 0
    printed = capsys.readouterr().out
    assert "config: the checkpoint's saved config" in printed
    # the evaluation where the run resumes is not the policy "before" training
    assert "[eval at resume, iteration 2] greedy: mean reward" in printed
    assert "held-out accuracy (greedy): at resume " in printed
    resumed = tmp_path / "run-2"
    summary = json.loads((resumed / "summary.json").read_text())
    assert "eval_at_resume" in summary and "eval_before" not in summary
    # step 2: the evaluation before the resumed segment; step 3: the one iteration trained
    assert sorted(run_metrics(resumed)) == [2, 3]
    assert "score" in run_metrics(resumed)[3] and "score" not in run_metrics(resumed)[2]
