"""A user's own agent program through the CLI, nothing in proxima changed: a file with a
function written against the official `openai` client, named by `rollout.agent`, `proxima
train` (the function gives every reward: no reward.function) for two PPO iterations, its
episodes in samples.jsonl (two calls each, merged into one row, whose recorded log-probs the
trainer's first forward pass reproduces), the env metrics in metrics.jsonl, and evaluation
of whole episodes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from proxima.cli import main
from proxima.logging import read_metrics

pytest.importorskip("openai")
pytestmark = pytest.mark.slow

AGENT = '''
import openai


def agent(base_url, row):
    """Call 1 writes up to 2 tokens; call 2 continues it after an "=" (token ids: the row
    is one); reward 1 for the right sum."""
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0)
    first = client.completions.create(model="policy", prompt=row["prompt"], max_tokens=2)
    equals = first.prompt_token_ids[-1]  # the prompt ends with "="
    ids = first.prompt_token_ids + first.choices[0].token_ids + [equals]
    second = client.completions.create(model="policy", prompt=ids, max_tokens=3)
    return float(second.choices[0].text == row["answer"])
'''


def test_agent_program_trains_and_evaluates(
    tmp_path: Path, make_model, fast_overrides, prompt_file
):
    (tmp_path / "my_agent.py").write_text(AGENT)
    init, run = make_model("llama"), tmp_path / "run"
    extra = (
        f"rollout.agent={tmp_path / 'my_agent.py'}:agent",
        "rollout.agent.max_context_tokens=24",
        "reward.function=",
        f"data.eval_path={prompt_file}",
        "eval.max_prompts=8",
        "trainer.threads=1",
    )
    assert main(["train", *fast_overrides(init, run, 2, *extra)]) == 0
    rows = {r["step"]: r for r in read_metrics(run / "metrics.jsonl")}
    assert rows[1]["env/turns"] == 2.0 and rows[1]["env/done"] == 1.0
    assert rows[1]["env/errors"] == 0.0 and rows[1]["env/timeouts"] == 0.0
    assert rows[1]["actor/optimizer_steps"] == 1.0
    # the recorded log-probs are the trainer's over the merged rows (nothing re-tokenized)
    assert rows[1]["actor/first_logratio_abs"] < 1e-5
    assert rows[2]["eval/turns"] == 2.0
    sample = json.loads((run / "samples.jsonl").read_text().splitlines()[0])
    episode = sample["episode"]
    assert episode["end"] == "done" and [t["trained"] for t in episode["turns"]] == [True, True]
    assert (run / "actor" / "config.json").is_file()
