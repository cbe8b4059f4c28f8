"""Run guards end to end: nothing lost on Ctrl-C (a real `proxima train` subprocess gets SIGINT,
writes a checkpoint and the summary, and the run resumes), divergence caught (a huge
learning rate on a nano model stops with a diagnosis and keeps the last good checkpoint),
and every bad input answered before the run folder is created or a model is loaded."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from proxima.cli import main
from proxima.logging import read_metrics

pytestmark = pytest.mark.slow


def _lines(path: Path) -> int:
    return len(path.read_text().splitlines()) if path.is_file() else 0


def test_sigint_writes_a_checkpoint_and_the_summary_then_resumes(
    tmp_path, make_model, fast_overrides
):
    model, out = make_model(), tmp_path / "run"
    argv = [sys.executable, "-m", "proxima.cli", "train", *fast_overrides(model, out, 1000)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True
    )
    deadline = time.monotonic() + 120
    while _lines(out / "metrics.jsonl") < 1 and proc.poll() is None:
        assert time.monotonic() < deadline, "the run did not start training"
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr  # 128 + SIGINT
    assert "SIGINT received: finishing this iteration" in stderr
    assert "Traceback" not in stderr
    found = re.search(r"stopped at iteration (\d+) \(SIGINT\); resume with `(.*)`", stdout)
    assert found, stdout
    n = int(found.group(1))
    assert found.group(2) == f"proxima train trainer.resume_from={out}"
    assert 1 <= n < 1000
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] == {"signal": "SIGINT", "iteration": n, "exit_status": 130}
    assert summary["iterations"] == n and "eval_after" not in summary
    assert (out / "checkpoints" / f"iter_{n}" / "state.pt").is_file()
    assert (out / "actor" / "model.safetensors").is_file()  # the result so far
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(1, n + 1))

    resumed = tmp_path / "resumed"
    argv = [f"trainer.resume_from={out}", f"trainer.iterations={n + 1}"]
    assert main(["train", *argv, f"trainer.output_dir={resumed}"]) == 0
    assert [r["step"] for r in read_metrics(resumed / "metrics.jsonl")] == [n + 1]


def _weights(folder: Path) -> dict[str, torch.Tensor]:
    return load_file(folder / "model.safetensors")


def test_huge_learning_rate_stops_with_a_diagnosis_and_keeps_the_last_good_checkpoint(
    tmp_path, make_model, fast_overrides, capsys
):
    # The actor waits 2 iterations (critic warm-up), so checkpoints iter_1 and iter_2 hold the
    # initial policy; its first update at lr=10 collapses it (entropy 0, KL ~3 nats per
    # token). Iteration 4 is the first to measure the collapsed policy (the one saved at
    # iteration 3); 4, 5, 6 are unhealthy: the run stops at 6 with iter_2 as its result.
    out = tmp_path / "run"
    extra = ["actor.optim.lr=10", "critic.warmup_iterations=2", "trainer.save_every=1"]
    assert main(["train", *fast_overrides(make_model(), out, 20, *extra)]) == 3
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("config: "))
    assert lines[start + 1] == f"run folder: {out}"  # printed at the start
    summary = json.loads((out / "summary.json").read_text())
    div = summary["diverged"]
    assert div["iteration"] == 6 and div["metric"] == "actor/entropy"
    assert div["last_good_iteration"] == 2
    assert div["result"] == str(out / "checkpoints" / "iter_2")
    assert div["diagnosis"].startswith("diverged at iteration 6: actor/entropy 0 < guard.min_")
    assert "for 3 consecutive iterations (since iteration 4; guard.patience=3)" in div["diagnosis"]
    assert "Likely fix: lower actor.optim.lr (now 10)" in div["diagnosis"]
    assert f"error: {div['diagnosis']}" in captured.err
    assert summary["iterations"] == 6
    # the unhealthy iterations were not saved; the result is iter_2's actor and critic
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["iter_2", "iter_3"]
    for role in ("actor", "critic"):
        good, kept = _weights(out / "checkpoints" / "iter_2" / role), _weights(out / role)
        assert good.keys() == kept.keys() and all(torch.equal(good[k], kept[k]) for k in good)
    rows = read_metrics(out / "metrics.jsonl")
    assert rows[3]["actor/entropy"] < 1e-4 and rows[2]["actor/entropy"] > 1.0


def test_non_finite_policy_stops_at_once(tmp_path, make_model, fast_overrides, capsys):
    # lr=1e30: the first update leaves weights around 1e30 (finite), whose logits overflow:
    # sampling at iteration 2 meets inf/nan probabilities
    out = tmp_path / "run"
    argv = fast_overrides(make_model(), out, 5, "actor.optim.lr=1e30")
    assert main(["train", *argv]) == 3
    err = capsys.readouterr().err
    assert "diverged at iteration 2: the actor's outputs are not finite (inf/nan)" in err
    assert "Likely fix: lower actor.optim.lr (now 1e+30)" in err
    assert "no checkpoint was written before it" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["diverged"]["result"] is None and not (out / "actor").exists()


def _truncated(model: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "truncated"
    folder.mkdir()
    for f in model.iterdir():
        (folder / f.name).write_bytes(f.read_bytes())
    data = (model / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[: len(data) // 2])
    return folder


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("prompt_key", "`data.train_path`: record 0 has no column 'question'"),
        ("reward_file", "`reward.function`: reward function spec 'missing.py:fn': file"),
        ("reward_name", "`reward.function`: reward function spec '{rewards}:nope': "),
        ("empty_model", "`model.actor_path`: {empty} is empty. Point `model.actor_path` at"),
        ("truncated", "`model.actor_path`: {truncated} has a truncated model.safetensors ("),
        ("no_tokenizer", "`model.actor_path`: {bare} has no tokenizer files ("),
        ("batch", "`data.train_path` holds 100 usable records, fewer than one batch of"),
        ("output_dir", "`trainer.output_dir`={file}/run: cannot create the run folder"),
    ],
)
def test_failed_starts_leave_nothing_behind(
    tmp_path, make_model, fast_overrides, reward_spec, capsys, case, message
):
    model, out = make_model(), tmp_path / "runs" / "x"
    empty = tmp_path / "empty"
    empty.mkdir()
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        (bare / name).write_bytes((model / name).read_bytes())
    file = tmp_path / "a_file"
    file.write_text("")
    rewards = reward_spec().rsplit(":", 1)[0]
    extra = {
        "prompt_key": ["data.prompt_key=question"],
        "reward_file": ["reward.function=missing.py:fn"],
        "reward_name": [f"reward.function={rewards}:nope"],
        "empty_model": [f"model.actor_path={empty}"],
        "truncated": [f"model.actor_path={_truncated(model, tmp_path)}"],
        "no_tokenizer": [f"model.actor_path={bare}"],
        "batch": [
            "data.train_batch_size=128",
            "actor.ppo_mini_batch_size=16",
            "critic.ppo_mini_batch_size=16",
        ],
        "output_dir": [f"trainer.output_dir={file}/run"],
    }[case]
    assert main(["train", *fast_overrides(model, out, 2, *extra)]) == 2
    err = capsys.readouterr().err
    paths = {"empty": empty, "truncated": tmp_path / "truncated", "bare": bare, "file": file}
    assert message.format(rewards=rewards, **paths) in err
    assert "Traceback" not in err
    assert not (tmp_path / "runs").exists()  # no run folder, no litter


def test_sft_and_eval_errors_name_their_own_keys(tmp_path, make_model, sft_file, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    args = ["--data", str(sft_file), "--out", str(tmp_path / "o"), "--steps", "1"]
    assert main(["sft", "--model", str(empty), *args]) == 2
    assert f"`model.actor_path`: {empty} is empty" in capsys.readouterr().err
    model = make_model()
    assert main(["sft", "--model", str(model), *args, "--batch-size", "500"]) == 2
    err = capsys.readouterr().err
    assert "`data.sft_path` holds 100 usable records, fewer than one batch of " in err
    assert "`sft.batch_size`=500; lower `sft.batch_size`" in err
    assert main(["eval", "--model", str(model), "--data", "none.jsonl", "--reward", "x.py:f"])
    assert "`data.eval_path`: dataset not found: none.jsonl" in capsys.readouterr().err
