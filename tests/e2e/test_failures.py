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

from proxima.cli import main
from proxima.logging import read_metrics
from tests.helpers import assert_same_weights, run_metrics

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


def test_huge_learning_rate_stops_with_a_diagnosis_and_keeps_the_last_good_checkpoint(
    tmp_path, make_model, fast_overrides, capsys
):
    # The actor waits 2 iterations (critic warm-up), so checkpoints iter_1 and iter_2 hold the
    # initial policy; its updates at lr=10 collapse it (entropy ~0, KL of nats per token)
    # within an iteration or two, depending on the samples. Iteration k measures the policy
    # iteration k - 1 saved: with the first unhealthy one u, the run stops at u + 2
    # (guard.patience=3) and its result is checkpoint iter_(u - 2), the last one whose policy
    # was measured healthy.
    out = tmp_path / "run"
    extra = ["actor.optim.lr=10", "critic.warmup_iterations=2", "trainer.save_every=1"]
    assert main(["train", *fast_overrides(make_model(), out, 20, *extra)]) == 3
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("config: "))
    assert lines[start + 1] == f"run folder: {out}"  # printed at the start
    rows = read_metrics(out / "metrics.jsonl")
    entropy = {r["step"]: r["actor/entropy"] for r in rows if "actor/entropy" in r}
    assert min(entropy) == 3 and entropy[3] > 1.0  # the initial policy, measured
    u = min(k for k, v in entropy.items() if v < 1e-4)  # guard.min_entropy
    assert 4 <= u <= 6 and all(entropy[k] < 1e-4 for k in (u, u + 1, u + 2))
    summary = json.loads((out / "summary.json").read_text())
    div = summary["diverged"]
    assert div["iteration"] == u + 2 and div["metric"] == "actor/entropy"
    assert div["last_good_iteration"] == u - 2
    assert div["result"] == str(out / "checkpoints" / f"iter_{u - 2}")
    assert div["diagnosis"].startswith(
        f"diverged at iteration {u + 2}: actor/entropy {entropy[u + 2]:.3g} < guard.min_"
    )
    assert (
        f"for 3 consecutive iterations (since iteration {u}; guard.patience=3)" in div["diagnosis"]
    )
    assert "Likely fix: lower actor.optim.lr (now 10)" in div["diagnosis"]
    assert f"error: {div['diagnosis']}" in captured.err
    assert summary["iterations"] == u + 2
    # the unhealthy iterations were not saved; the result is iter_(u - 2)'s actor and critic
    saved = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert saved == [f"iter_{u - 2}", f"iter_{u - 1}"]
    for role in ("actor", "critic"):
        assert_same_weights(out / "checkpoints" / f"iter_{u - 2}" / role, out / role)


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


def test_sft_out_unwritable_or_full_is_named_and_left_without_a_cut_model(
    tmp_path, make_model, sft_file, capsys
):
    import resource

    model, blocker = make_model(), tmp_path / "a-file"
    blocker.write_text("")
    args = ["sft", "--model", str(model), "--data", str(sft_file), "--steps", "1"]
    assert main([*args, "--out", str(blocker / "o")]) == 2  # before the work
    assert f"`sft.out`={blocker / 'o'}: {blocker} is a file" in capsys.readouterr().err

    def cap() -> None:  # the model (about 70 kB) does not fit
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000))

    out, env = tmp_path / "o", {**os.environ, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "proxima.cli", *args, "--out", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, preexec_fn=cap)
    assert proc.returncode == 2, proc.stderr
    assert f"`sft.out`={out}: the model cannot be written (File too large" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


# --------------------------------------------------------------------------- errors mid-run


def test_an_error_mid_run_keeps_a_checkpoint_the_summary_and_the_resume_command(
    tmp_path, make_model, fast_overrides, reward_spec, capsys
):
    """The reward raises at iteration 3 (trainer.save_every=0: no periodic checkpoint):
    iteration 2 is kept as a checkpoint, the summary says what failed, and resuming from
    it replays iteration 3 exactly as an uninterrupted run does (the failed iteration's
    loader position and random draws were put back)."""
    model = make_model()
    failing, whole, resumed = tmp_path / "failing", tmp_path / "whole", tmp_path / "resumed"
    bad = [f"reward.function={reward_spec('fails_at_call_3')}", "trainer.save_every=0"]
    assert main(["train", *fast_overrides(model, failing, 4, *bad)]) == 2
    err = capsys.readouterr().err
    assert "iteration 3 failed in phase `reward`: RewardError: reward function" in err
    assert "raised ValueError: scoring service down" in err
    kept = failing / "checkpoints" / "iter_2"
    assert f"kept: the checkpoint {kept}" in err
    assert f"resume with `proxima train trainer.resume_from={kept}`" in err
    assert "Traceback" not in err
    summary = json.loads((failing / "summary.json").read_text())
    assert summary["failed"]["iteration"] == 3 and summary["failed"]["phase"] == "reward"
    assert summary["failed"]["checkpoint"] == str(kept) and summary["iterations"] == 2
    assert (kept / "state.pt").is_file() and (failing / "actor" / "model.safetensors").is_file()

    assert main(["train", *fast_overrides(model, whole, 4)]) == 0
    again = [f"trainer.resume_from={kept}"]
    assert main(["train", *fast_overrides(model, resumed, 4, *again)]) == 0
    want, got = run_metrics(whole), run_metrics(resumed)
    assert sorted(got) == [3, 4] and got[3] == want[3] and got[4] == want[4]


def test_a_reward_function_that_calls_sys_exit_is_named_and_leaves_nothing(
    tmp_path, make_model, fast_overrides, reward_spec, capsys
):
    out = tmp_path / "runs" / "x"
    exits = [f"reward.function={reward_spec('exits')}"]
    assert main(["train", *fast_overrides(make_model(), out, 2, *exits)]) == 2
    err = capsys.readouterr().err
    assert "iteration 1 failed in phase `reward`" in err and "called sys.exit(5)" in err
    assert f"nothing was trained yet: the run folder {out} is removed" in err
    assert "Traceback" not in err and not out.exists()


def test_checkpoint_write_failing_on_a_full_disk_is_named(tmp_path, make_model, fast_overrides):
    """`ulimit -f 100` (kB): the models (about 70 kB each) fit, the checkpoint's state.pt
    does not. The write is named with its cause, the models of the completed iterations and
    the summary are kept."""
    import resource

    out = tmp_path / "run"
    argv = [sys.executable, "-m", "proxima.cli", "train", *fast_overrides(make_model(), out, 2)]

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, 100_000))

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, preexec_fn=limit)
    assert proc.returncode == 2, proc.stderr
    assert "iteration 2 failed in phase `checkpoint`" in proc.stderr
    assert f"writing the checkpoint {out / 'checkpoints' / 'iter_2'} failed" in proc.stderr
    assert "a full disk or a file-size limit (ulimit -f) is the usual cause" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not list((out / "checkpoints").glob("*iter_2*"))  # the partial write removed
    assert json.loads((out / "summary.json").read_text())["failed"]["phase"] == "checkpoint"


def _train_under_a_file_limit(argv: list[str], limit: int) -> subprocess.CompletedProcess:
    import resource

    def cap() -> None:  # Python ignores SIGXFSZ: a write past the limit raises EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    argv = [sys.executable, "-m", "proxima.cli", "train", *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(argv, capture_output=True, text=True, env=env, preexec_fn=cap)


def test_a_file_limit_at_any_point_keeps_every_file_whole_and_says_what_is_kept(
    tmp_path, make_model, fast_overrides
):
    """`ulimit -f 12` (kB): no model (about 70 kB) fits, metrics.jsonl fills up after a few
    iterations. The first error is said with its file, then what else could not be written
    and plainly that no checkpoint is kept; no file is left cut."""
    model, out = make_model(), tmp_path / "run"
    proc = _train_under_a_file_limit(fast_overrides(model, out, 40), 12_000)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr
    assert "Traceback" not in err
    first = re.search(r"error: iteration (\d+) failed in phase `logging`: .*metrics.jsonl", err)
    assert first, err
    assert "also not written: a checkpoint: writing the checkpoint" in err
    assert f"also not written: the models in {out}" in err
    assert f"kept: no checkpoint and no models (none could be written): the {first[1]}" in err
    assert "summary.json marked failed" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["failed"]["phase"] == "logging" and summary["failed"]["checkpoint"] is None
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == list(range(1, int(first[1])))
    for line in (out / "samples.jsonl").read_text().splitlines():
        json.loads(line)  # every line whole
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "memory_plan.json",
        "metrics.jsonl",
        "samples.jsonl",
        "summary.json",
    ]  # no cut actor/, no empty checkpoints/, no temporary file


def test_a_file_limit_before_training_leaves_no_run_folder(tmp_path, make_model, fast_overrides):
    out = tmp_path / "run"
    proc = _train_under_a_file_limit(fast_overrides(make_model(), out, 2), 2_000)
    assert proc.returncode == 2, proc.stderr
    assert f"cannot write {out / 'config.json'} (File too large)" in proc.stderr
    assert f"Nothing was trained: the run folder {out} is removed" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


def test_a_summary_that_cannot_be_written_is_not_called_marked(
    tmp_path, make_model, fast_overrides, reward_spec, monkeypatch, capsys
):
    import errno

    import proxima.recipes.ppo as recipe

    def full(path, text):
        if Path(path).name == "summary.json":
            raise OSError(errno.ENOSPC, f"cannot write {path} (No space left on device)")
        recipe_write(path, text)

    recipe_write = recipe.write_atomic
    monkeypatch.setattr(recipe, "write_atomic", full)
    out, bad = tmp_path / "run", [f"reward.function={reward_spec('fails_at_call_3')}"]
    assert main(["train", *fast_overrides(make_model(), out, 4, *bad)]) == 2
    err = capsys.readouterr().err
    assert "also not written: summary.json (cannot write" in err
    assert "no summary.json could be written" in err and "marked failed" not in err
    assert not (out / "summary.json").exists()


def test_a_result_that_cannot_be_written_points_at_the_checkpoint_holding_it(
    tmp_path, make_model, fast_overrides, monkeypatch, capsys
):
    import errno

    import proxima.recipes.ppo as recipe

    def full(dest, write):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(recipe, "write_whole", full)
    out = tmp_path / "run"
    assert main(["train", *fast_overrides(make_model(), out, 2)]) == 2
    err = capsys.readouterr().err
    final = out / "checkpoints" / "iter_2"
    assert "the result of iteration 2 could not be written: OSError: cannot write the models" in err
    assert f"kept: the checkpoint {final}, which holds the trained models" in err
    assert "Traceback" not in err and (final / "actor" / "model.safetensors").is_file()
    assert json.loads((out / "summary.json").read_text())["failed"]["checkpoint"] == str(final)


# --------------------------------------------------------------------------- start-up checks


def test_a_tokenizer_larger_than_the_embedding_table_stops_before_loading(
    tmp_path, make_model, fast_overrides, capsys
):
    from proxima.models import build_char_tokenizer

    model, out = make_model(), tmp_path / "runs" / "x"
    build_char_tokenizer("0123456789+=abcdefgh").save_pretrained(model)  # 24 tokens, 16 rows
    assert main(["train", *fast_overrides(model, out, 2)]) == 2
    err = capsys.readouterr().err
    assert "has 24 tokens but the model's embedding table has 16 rows" in err
    assert "resize_token_embeddings" in err and not (tmp_path / "runs").exists()


def test_prompt_and_response_longer_than_the_positions_stop_before_loading(
    tmp_path, fast_overrides, capsys
):
    model = tmp_path / "gpt2-8"
    alphabet = "0123456789+="
    args = ["--arch", "gpt2", "--size", "nano", "--alphabet", alphabet, "--max-positions", "8"]
    assert main(["init-model", "--out", str(model), *args]) == 0
    out = tmp_path / "runs" / "x"
    long = ["rollout.max_response_length=16"]
    assert main(["train", *fast_overrides(model, out, 2, *long)]) == 2
    err = capsys.readouterr().err
    assert "+ `rollout.max_response_length`=16 = " in err and "exceed the 8 of" in err
    assert "Traceback" not in err and not (tmp_path / "runs").exists()


def test_a_damaged_checkpoint_is_named_with_the_one_before_it(
    tmp_path, make_model, fast_overrides, capsys
):
    model, run = make_model(), tmp_path / "run"
    assert main(["train", *fast_overrides(model, run, 2, "trainer.save_every=1")]) == 0
    weights = run / "checkpoints" / "iter_2" / "actor" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    again = tmp_path / "again"
    resume = [f"trainer.resume_from={run}", "trainer.iterations=3"]
    assert main(["train", *fast_overrides(model, again, 3, *resume)]) == 2
    err = capsys.readouterr().err
    assert f"the checkpoint {run / 'checkpoints' / 'iter_2'} is damaged" in err
    assert "model.safetensors" in err and "truncated" in err
    assert f"trainer.resume_from={run / 'checkpoints' / 'iter_1'}" in err
    assert "Traceback" not in err and not again.exists()
    state = run / "checkpoints" / "iter_1" / "state.pt"
    state.write_bytes(state.read_bytes()[:500])
    resume = [f"trainer.resume_from={run / 'checkpoints' / 'iter_1'}", "trainer.iterations=3"]
    assert main(["train", *fast_overrides(model, again, 3, *resume)]) == 2
    assert "state.pt is truncated or not a checkpoint's state" in capsys.readouterr().err


# --------------------------------------------------------------------------- the rest


def test_iterations_whose_steps_are_all_skipped_are_unhealthy(
    tmp_path, make_model, fast_overrides, reward_spec, capsys
):
    """A score of 1e30, unclipped: the critic's value loss is not finite, every one of its
    steps is skipped; the guard stops the run instead of reporting success."""
    huge = [
        f"reward.function={reward_spec('huge')}",
        "algorithm.clip_reward_value=0",
        "guard.patience=2",
    ]
    out = tmp_path / "run"
    assert main(["train", *fast_overrides(make_model(), out, 5, *huge)]) == 3
    err = capsys.readouterr().err
    assert "every optimizer step of the critic was skipped (1 of 1" in err
    assert "algorithm.clip_reward_value" in err


def test_interruptions_outside_the_loop_say_what_happened(
    tmp_path, make_model, sft_file, monkeypatch, capsys
):
    import proxima.cli as cli
    import proxima.recipes.sft as sft_recipe

    def ctrl_c(*args, **kwargs):
        raise KeyboardInterrupt()  # Python's own: no message

    monkeypatch.setattr(cli, "cmd_config", ctrl_c)
    assert main(["config"]) == 130
    assert "aborted: interrupted" in capsys.readouterr().err

    def term(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # the command's handler turns it into an error

    monkeypatch.setattr(cli, "cmd_config", term)
    assert main(["config"]) == 143
    assert "aborted: SIGTERM received" in capsys.readouterr().err

    monkeypatch.setattr(sft_recipe, "sft_train", ctrl_c)
    out = tmp_path / "sft"
    args = ["--model", str(make_model()), "--data", str(sft_file), "--out", str(out)]
    assert main(["sft", *args]) == 130
    err = capsys.readouterr().err
    assert f"SFT interrupted (Ctrl-C): nothing was written to {out}" in err

    monkeypatch.setattr(sft_recipe, "sft_train", term)  # SIGTERM keeps its exit status
    assert main(["sft", *args]) == 143
    assert "SFT interrupted (SIGTERM received)" in capsys.readouterr().err


@pytest.mark.parametrize("signum, status", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_during_the_imports_is_an_interruption(
    tmp_path, monkeypatch, capsys, signum, status
):
    """A signal while torch and transformers import is held until they are in, then said
    as at any other point of the start-up (not as an ImportError or a
    SystemError from inside the import machinery)."""
    import proxima.cli as cli

    name = f"signals_on_import_{int(signum)}"
    (tmp_path / f"{name}.py").write_text(
        f"import os, signal\nos.kill(os.getpid(), {int(signum)})\nfinished = True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "STACK", (name, "json"))
    called = []
    monkeypatch.setattr(cli, "cmd_config", lambda ns: called.append(ns) or 0)
    assert main(["config"]) == status
    assert f"aborted: {signal.Signals(signum).name} received" in capsys.readouterr().err
    assert not called
    assert sys.modules[name].finished  # the import itself ran to its end
    # a signal later in the start-up (here: in the command) says the same
    monkeypatch.setattr(cli, "cmd_config", lambda ns: os.kill(os.getpid(), signum))
    assert main(["config"]) == status
    assert f"aborted: {signal.Signals(signum).name} received" in capsys.readouterr().err


def test_a_signal_anywhere_in_the_start_up_is_said_the_same_way(
    tmp_path, make_model, fast_overrides
):
    """A real `proxima train` gets SIGINT or SIGTERM at three points of its start-up: during
    the imports (1 s in), once the config is read, and once the models are loaded and the
    run folder is made; every time the signal's exit status and words, and never a
    traceback. (In the loop: `test_sigint_writes_a_checkpoint_and_the_summary_then_resumes`;
    before Python runs proxima's first line, the interpreter's own handling applies.)"""
    model = make_model()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    points = [
        (1.0, signal.SIGINT),
        ("config: ", signal.SIGTERM),
        ("run folder: ", signal.SIGINT),
    ]
    for k, (point, signum) in enumerate(points):
        out = tmp_path / f"run{k}"
        argv = [sys.executable, "-m", "proxima.cli", "train", *fast_overrides(model, out, 1000)]
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        seen = b""
        if isinstance(point, float):
            time.sleep(point)
        else:  # read the output up to the line that marks the point
            while not any(line.startswith(point.encode()) for line in seen.splitlines()):
                chunk = proc.stdout.readline()
                assert chunk, f"ended before {point!r}: {seen.decode()}"
                seen += chunk
        proc.send_signal(signum)
        stdout, stderr = proc.communicate(timeout=120)
        stderr, name = stderr.decode(), signal.Signals(signum).name
        assert proc.returncode == 128 + signum, (point, stderr)
        assert "Traceback" not in stderr, (point, stderr)
        said = f"aborted: {name} received" in stderr
        if point == "run folder: ":  # the loop may have begun: then it stops after iteration 1
            said = said or f"{name} received: finishing this iteration" in stderr
        assert said, (point, stderr)


def test_a_signal_once_the_run_folder_is_made_leaves_nothing(
    tmp_path, make_model, fast_overrides, monkeypatch, capsys
):
    """SIGINT as the plans are printed (config.json and memory_plan.json are written by
    then): the run folder goes, as with any start that trains nothing."""
    import proxima.recipes.ppo as recipe
    from proxima.launch import Interrupted

    def interrupted(*args, **kwargs):
        raise Interrupted("SIGINT received", signal.SIGINT)

    monkeypatch.setattr(recipe, "batch_plan", interrupted)
    out = tmp_path / "run"
    assert main(["train", *fast_overrides(make_model(), out, 2)]) == 130
    assert "aborted: SIGINT received" in capsys.readouterr().err
    assert not out.exists()


def test_a_failed_task_preparation_leaves_no_run_folder(tmp_path, monkeypatch, capsys):
    import errno

    import proxima.recipes as recipes

    def broken(cfg, run_dir):
        (run_dir / "task").mkdir()
        raise ValueError("the warm start broke (raised on purpose by the test)")

    monkeypatch.setattr(recipes, "prepare_task", broken)
    out = tmp_path / "runs" / "task"
    assert main(["train", f"trainer.output_dir={out}", "trainer.threads=1"]) == 2
    err = capsys.readouterr().err
    assert "the warm start broke" in err and f"removed {out}" in err
    assert not out.exists()

    def full(cfg, run_dir):  # a full disk as the task writes its data: the folder named
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(recipes, "prepare_task", full)
    assert main(["train", f"trainer.output_dir={out}", "trainer.threads=1"]) == 2
    err = capsys.readouterr().err
    assert f"the task `arithmetic` could not write its data and model into {out / 'task'}" in err
    assert "(No space left on device; a full disk" in err and not out.exists()


def test_eval_checks_the_positions_too(tmp_path, prompt_file, reward_spec, capsys):
    model = tmp_path / "gpt2-8"
    args = ["--arch", "gpt2", "--size", "nano", "--alphabet", "0123456789+=", "--max-positions"]
    assert main(["init-model", "--out", str(model), *args, "8"]) == 0
    evaluate = ["eval", "--model", str(model), "--data", str(prompt_file)]
    assert main([*evaluate, "--reward", reward_spec(), "--max-new-tokens", "16"]) == 2
    assert "exceed the 8 of `model.actor_path`" in capsys.readouterr().err


def test_an_evaluation_that_fails_keeps_the_iteration_it_followed(
    tmp_path, make_model, fast_overrides, reward_spec, prompt_file, capsys
):
    """Calls 1, 2, 3 of the reward: the evaluation before, iteration 1's scoring, the
    evaluation after iteration 1 (eval.every=1), which raises: iteration 1 is complete and
    kept as a checkpoint."""
    out = tmp_path / "run"
    extra = [
        f"reward.function={reward_spec('fails_at_call_3')}",
        f"data.eval_path={prompt_file}",
        "eval.every=1",
        "eval.max_prompts=4",
    ]
    assert main(["train", *fast_overrides(make_model(), out, 3, *extra)]) == 2
    err = capsys.readouterr().err
    assert "iteration 1 failed in phase `evaluation`: RewardError" in err
    assert f"kept: the checkpoint {out / 'checkpoints' / 'iter_1'}" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["iterations"] == 1 and "eval_before" in summary


def test_sigterm_during_the_evaluation_after_training_exits_143(
    tmp_path, make_model, fast_overrides, reward_spec, prompt_file, capsys
):
    """Calls 1, 2, 3 of the reward: the evaluation before, iteration 1's scoring, the
    evaluation after training, during which SIGTERM arrives: the run is complete and kept,
    and the exit status says the signal, as a stopped run's does."""
    out = tmp_path / "run"
    extra = [
        f"reward.function={reward_spec('sigterm_at_call_3')}",
        f"data.eval_path={prompt_file}",
        "eval.max_prompts=4",
    ]
    assert main(["train", *fast_overrides(make_model(), out, 1, *extra)]) == 143
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped"] == {"signal": "SIGTERM", "iteration": 1, "exit_status": 143}
    assert "eval_after" not in summary and (out / "actor" / "model.safetensors").is_file()
    said = capsys.readouterr().out
    assert "evaluation after training interrupted" in said
    assert "every iteration was trained, the evaluation after training skipped (SIGTERM)" in said


def test_an_evaluation_before_training_that_fails_leaves_nothing(
    tmp_path, make_model, fast_overrides, reward_spec, prompt_file, capsys
):
    out = tmp_path / "runs" / "x"
    extra = [f"reward.function={reward_spec('exits')}", f"data.eval_path={prompt_file}"]
    assert main(["train", *fast_overrides(make_model(), out, 3, *extra)]) == 2
    err = capsys.readouterr().err
    assert "the evaluation before training failed: RewardError" in err
    assert "called sys.exit(5)" in err and not out.exists()


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.is_file() else []


@pytest.mark.parametrize(
    "signals, status, said",
    [
        ((signal.SIGINT,), 130, "stopped at iteration"),
        ((signal.SIGINT, signal.SIGINT), 130, "aborted: second SIGINT"),
        ((signal.SIGTERM,), 143, "stopped at iteration"),
        ((signal.SIGTERM, signal.SIGTERM), 143, "aborted: second SIGTERM"),
    ],
    ids=["SIGINT", "SIGINT-twice", "SIGTERM", "SIGTERM-twice"],
)
def test_every_signal_ends_a_run_with_rollout_workers(
    tmp_path, make_model, fast_overrides, signals, status, said
):
    """A run sampling 256 batches ahead with one rollout worker (a burst of requests and of
    results larger than the pipes hold) ends on each signal with its exit status, and its
    worker with it: stopped after the iteration, or at once on a second signal."""
    out = tmp_path / "run"
    extra = ("rollout.max_staleness=256", "rollout.workers=1")
    argv = [
        sys.executable,
        "-m",
        "proxima.cli",
        "train",
        *fast_overrides(make_model(), out, 1000, *extra),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True
    )
    try:
        deadline = time.monotonic() + 120
        while _lines(out / "metrics.jsonl") < 1 and proc.poll() is None:
            assert time.monotonic() < deadline, "the run did not start training"
            time.sleep(0.2)
        workers = _children(proc.pid)
        assert workers, "no rollout worker"
        for signum in signals:
            proc.send_signal(signum)
            time.sleep(0.5)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:  # failed: its worker dies with it (PR_SET_PDEATHSIG)
            proc.kill()
            proc.communicate()
    assert proc.returncode == status, stderr
    assert said in stdout + stderr, stderr
    assert "Traceback" not in stderr, stderr
    time.sleep(0.5)
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()]


@pytest.mark.parametrize("where", ["load_roles", "_start_logging"])
def test_a_signal_at_start_up_removes_a_built_in_tasks_run_folder(
    tmp_path, monkeypatch, capsys, where
):
    """Ctrl-C after a built-in task's preparation and before the first iteration (while the
    models load, or once config.json and memory_plan.json are written): the run folder the
    command made, the task's preparation in it, is removed."""
    from proxima.recipes import ppo

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt("SIGINT received")

    if where == "load_roles":
        monkeypatch.setattr(ppo, "load_roles", interrupted)
    else:
        monkeypatch.setattr(ppo.PPORecipe, "_start_logging", interrupted)
    out = tmp_path / "run"
    args = ["task.size=nano", "task.sft_steps=2", "trainer.iterations=2", "trainer.threads=1"]
    assert main(["train", *args, f"trainer.output_dir={out}"]) == 130
    assert "aborted: SIGINT received" in capsys.readouterr().err
    assert not out.exists()
