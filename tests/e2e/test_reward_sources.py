"""`reward.sources`: a function and a reward model with weights in one run; each source's
raw score logged (reward/<name>, samples.jsonl), the score their weighted sum, a source
standardised and clipped on its own; gdpo reads the sources as its components; mistakes in
the list named before anything loads."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from proxima.cli import main
from proxima.logging import read_metrics
from proxima.models import build_tiny_reward_model, load_tokenizer

pytestmark = pytest.mark.slow


def _rm(model: Path, root: Path) -> Path:
    tok = load_tokenizer(model)
    out = root / "rm"
    build_tiny_reward_model("llama", tok, size="nano", seed=1).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _sources(reward_spec, rm: Path, *more: str) -> str:
    return (
        f"reward.sources=[{{name: sevens, function: '{reward_spec('fn')}', weight: 2.0}}, "
        f"{{name: rm, model_path: '{rm}', weight: 0.5, clip: 0.01{''.join(more)}}}]"
    )


def test_a_function_and_a_reward_model_weighted(fast_overrides, make_model, reward_spec, tmp_path):
    model = make_model()
    rm = _rm(model, tmp_path)
    out = tmp_path / "run"
    args = fast_overrides(model, out, 2, "reward.function=", _sources(reward_spec, rm))
    assert main(["train", *args]) == 0
    rows = read_metrics(out / "metrics.jsonl")
    assert {"reward/sevens", "reward/rm"} <= set(rows[-1])
    samples = [json.loads(x) for x in (out / "samples.jsonl").read_text().splitlines()]
    for s in samples:  # the logged score is 2 x sevens + 0.5 x clip(rm, 0.01)
        rm_part = max(-0.01, min(0.01, s["reward/rm"]))
        assert s["score"] == pytest.approx(2 * s["reward/sevens"] + 0.5 * rm_part, abs=1e-6)
    assert any(abs(s["reward/rm"]) > 0.01 for s in samples), "the clip must bind somewhere"


def test_a_standardised_source_resumes_with_its_statistics(
    fast_overrides, make_model, reward_spec, tmp_path
):
    model = make_model()
    rm = _rm(model, tmp_path)
    extra = ("reward.function=", _sources(reward_spec, rm, ", normalize: true"))
    full, first = tmp_path / "full", tmp_path / "first"
    assert main(["train", *fast_overrides(model, full, 3, *extra)]) == 0
    assert main(["train", *fast_overrides(model, first, 2, *extra)]) == 0
    state = torch.load(first / "checkpoints" / "iter_2" / "state.pt", weights_only=True)
    assert state["trainer"]["source_moments"]["rm"]["count"] > 0
    resumed = tmp_path / "resumed"
    args = fast_overrides(model, resumed, 3, *extra, f"trainer.resume_from={first}")
    assert main(["train", *args]) == 0
    a, b = read_metrics(full / "metrics.jsonl"), read_metrics(resumed / "metrics.jsonl")
    assert a[-1]["score"] == b[-1]["score"] and a[-1]["reward/rm"] == b[-1]["reward/rm"]


def test_gdpo_takes_the_sources_as_its_components(
    fast_overrides, make_model, reward_spec, tmp_path
):
    model = make_model()
    rm = _rm(model, tmp_path)
    out = tmp_path / "run"
    args = fast_overrides(
        model,
        out,
        2,
        "reward.function=",
        _sources(reward_spec, rm),
        "algorithm.adv_estimator=gdpo",
        "rollout.n=4",
        "actor.ppo_mini_batch_size=16",
    )
    assert main(["train", *args]) == 0
    row = read_metrics(out / "metrics.jsonl")[-1]
    assert math.isfinite(row["actor/pg_loss"])


def test_a_run_scores_through_proxima_serve_reward(
    fast_overrides, make_model, reward_spec, tmp_path
):
    """`proxima serve-reward` in a subprocess on a free port, a run scoring through it (with
    a local function beside it): the remote source's scores are the function's own."""
    import subprocess
    import sys

    server = subprocess.Popen(
        [sys.executable, "-m", "proxima", "serve-reward", reward_spec("fn"), "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        line = server.stdout.readline()
        url = next(w for w in line.split() if w.startswith("http://")).rstrip(".,)")
        out = tmp_path / "run"
        sources = (
            f"reward.sources=[{{name: remote, url: '{url}', timeout_s: 10}}, "
            f"{{name: local, function: '{reward_spec('fn')}', weight: 0.0}}]"
        )
        model = make_model()
        assert main(["train", *fast_overrides(model, out, 2, "reward.function=", sources)]) == 0
    finally:
        server.terminate()
        server.wait(timeout=10)
    rows = read_metrics(out / "metrics.jsonl")
    assert rows[-1]["reward/remote"] == rows[-1]["reward/local"]  # the same function, twice
    assert rows[-1]["reward/remote/requests"] >= 1


def test_a_dead_reward_server_stops_the_run_before_anything_loads(
    fast_overrides, make_model, tmp_path, capsys
):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "run"
    sources = f"reward.sources=[{{name: judge, url: 'http://127.0.0.1:{port}', retries: 0}}]"
    assert main(["train", *fast_overrides(make_model(), out, 2, "reward.function=", sources)]) == 2
    err = capsys.readouterr().err
    assert "connection refused" in err and "proxima serve-reward" in err
    assert not out.exists()


def test_a_source_that_always_falls_back_is_said_and_stops_the_run(
    fast_overrides, make_model, tmp_path, capsys
):
    (tmp_path / "bad.py").write_text(
        "def score(prompts, responses):\n    raise OSError('db down')\n"
    )
    sources = (
        "reward.sources=[{name: sevens, function: "
        f"{tmp_path / 'bad.py'}:score, on_error: fallback, fallback: 0.0}}]"
    )
    out = tmp_path / "run"
    args = fast_overrides(make_model(), out, 5, "reward.function=", sources, "guard.patience=2")
    assert main(["train", *args]) == 3
    err = capsys.readouterr().err
    assert "warning: iteration 1: 100% of the samples were scored reward/sevens's fallback; " in err
    assert "fallback; first: sample 0 (" in err and "raised OSError: db down" in err
    assert "every sample was scored reward/sevens's fallback (the source failed), for 2" in err
    rows = read_metrics(out / "metrics.jsonl")
    assert [r["reward/sevens/fallback_share"] for r in rows] == [1.0, 1.0]
