"""Several prompt files at once (data.train_path and data.eval_path as lists): every batch
mixes the sets by data.train_weights, reward functions read each record's `dataset`, the
metrics report each set (data/<name>/share and score, eval/<name>/accuracy), the batch plan
shows the mix, and a resumed run continues each set where it was."""

from __future__ import annotations

from pathlib import Path

import pytest

from proxima.cli import main
from proxima.logging import read_metrics
from tests.helpers import run_metrics as _metrics

from .conftest import write_jsonl

pytestmark = pytest.mark.slow


def _files(tmp_path: Path, folder: str) -> str:
    """ones.jsonl (prompts 1+b=) and rest.jsonl (the others) under `folder`, as a list."""
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(10) for b in range(10)]
    (tmp_path / folder).mkdir()
    ones = write_jsonl(tmp_path / folder / "ones.jsonl", [r for r in rows if r["prompt"][0] == "1"])
    rest = write_jsonl(tmp_path / folder / "rest.jsonl", [r for r in rows if r["prompt"][0] != "1"])
    return f"data.{folder.rstrip('2')}_path=[{ones},{rest}]"


def test_two_sets_mixed_scored_and_reported_each(
    tmp_path, make_model, fast_overrides, reward_spec, capsys
):
    run = tmp_path / "run"
    argv = fast_overrides(
        make_model("llama"),
        run,
        2,
        _files(tmp_path, "train"),
        "data.train_weights=[1,1]",  # 4 prompts: 2 of each set, every batch
        _files(tmp_path, "eval"),
        f"reward.function={reward_spec('set_is_ones')}",
        "trainer.threads=1",
    )
    assert main(["train", *argv]) == 0
    out = capsys.readouterr().out
    assert "data  : 2 prompt sets, prompts per batch: ones 50% (2), rest 50% (2)" in out
    rows = read_metrics(run / "metrics.jsonl")
    train = [r for r in rows if "score" in r]
    assert len(train) == 2
    for r in train:  # the reward read each record's set
        assert r["data/ones/share"] == r["data/rest/share"] == 0.5
        assert r["data/ones/score"] == 1.0 and r["data/rest/score"] == 0.0
        assert r["score"] == 0.5
    final = [r for r in rows if "eval/accuracy" in r][-1]
    assert final["eval/ones/accuracy"] == 1.0 and final["eval/rest/accuracy"] == 0.0
    assert final["eval/accuracy"] == pytest.approx(0.1)  # 10 of the 100 prompts are "ones"
    # `proxima eval` on the same two files reports each
    eval_files = _files(tmp_path, "eval2").split("=", 1)[1]
    flags = ["--data", eval_files, "--reward", reward_spec("set_is_ones"), "--device", "cpu"]
    assert main(["eval", "--model", str(run / "actor"), *flags, "--max-new-tokens", "2"]) == 0
    out = capsys.readouterr().out
    assert "greedy [ones]: mean reward 1.0000, accuracy 100.00% on 10" in out
    assert "greedy [rest]: mean reward 0.0000, accuracy 0.00% on 90" in out
    limits = ["--max-prompts", "4", "--max-new-tokens", "2"]
    assert main(["eval", "--model", str(run / "actor"), *flags, *limits]) == 0
    out = capsys.readouterr().out  # at most 4 of each file: both sets still reported
    assert "greedy [ones]: mean reward 1.0000, accuracy 100.00% on 4" in out
    assert "greedy [rest]: mean reward 0.0000, accuracy 0.00% on 4" in out


def test_a_mixed_run_resumes_exactly(tmp_path, make_model, fast_overrides):
    init = make_model("llama")
    mix = (_files(tmp_path, "train"), "data.train_weights=[0.6,0.4]", "trainer.threads=1")
    run_a, run_b = tmp_path / "a", tmp_path / "b"
    assert main(["train", *fast_overrides(init, run_a, 4, "trainer.save_every=2", *mix)]) == 0
    resume = f"trainer.resume_from={run_a / 'checkpoints' / 'iter_2'}"
    assert main(["train", *fast_overrides(init, run_b, 4, resume, *mix)]) == 0
    a, b = _metrics(run_a), _metrics(run_b)
    assert sorted(b) == [3, 4]
    for step in (3, 4):
        assert "data/ones/share" in b[step] and b[step] == a[step], step
    shares = {a[s]["data/ones/share"] for s in a}  # 4 x 0.6 = 2.4 prompts: 2 or 3 a batch
    assert shares == {0.5, 0.75}  # the draws differ between batches
