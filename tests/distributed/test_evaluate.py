"""Evaluation under `torchrun --nproc_per_node 2`: each rank answers its share of the
held-out prompts (7: the shares evened by repeating the last one), and the evaluation's
metrics, the answers' drift/* among them, are one process's."""

from __future__ import annotations

import json

import pytest

from proxima.cli import main
from tests.distributed.conftest import torchrun

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def _eval_rows(run) -> dict[int, dict]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("eval/")} for r in rows}


def test_two_processes_evaluate_as_one(make_model, fast_overrides, prompt_file, tmp_path):
    model = make_model("llama")
    one, two = tmp_path / "one", tmp_path / "two"

    def overrides(out, *extra):
        return fast_overrides(
            model,
            out,
            2,
            "rollout.top_k=1",  # greedy sampling too: both runs see the same answers
            "trainer.threads=1",
            f"data.eval_path={prompt_file}",
            "eval.every=1",
            "eval.max_prompts=7",
            *extra,
        )

    assert main(["train", *overrides(one)]) == 0
    torchrun(["-m", "proxima", "train", *overrides(two, "trainer.strategy=ddp")])
    a, b = _eval_rows(one), _eval_rows(two)
    assert a.keys() == b.keys() and "eval/drift/distinct_2" in a[0]
    for step in a:
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-7), step
