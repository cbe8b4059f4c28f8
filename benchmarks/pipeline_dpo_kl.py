"""DPO at another beta on a finished `proxima pipeline` run's pairs, scored as the pipeline's
evaluate stage scores its policies (its held-out prompts and sampling seed): the gold, the
proxy and the KL to the SFT policy, so that DPO and PPO are compared at the same KL.

    python -m benchmarks.pipeline_dpo_kl RUN OUT BETA [key=value ...]
    python -m benchmarks.pipeline_dpo_kl RUN OUT 0.1 --policy RUN/dpo/actor   # score only

RUN: the pipeline's run folder (its summary.json, task/, pairs/, rm/); OUT: the DPO run
folder to write (its scores also go to OUT.json); extra overrides apply to the DPO run
(e.g. trainer.threads=1). Scoring RUN/dpo/actor at the run's own beta gives back the run's
`dpo` row of pipeline_eval.jsonl; `--smoke` runs a pipeline of nano models with DPO and
checks exactly that.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from proxima.config import load_config
from proxima.models import (
    load_causal_lm,
    load_reward_model,
    load_tokenizer,
    reward_model_scores,
    score_normalization,
)
from proxima.recipes.dpo import dpo as train_dpo
from proxima.recipes.pipeline import Pipeline
from proxima.rewards import FunctionReward, ModelReward
from proxima.trainer.datasets import load_prompts

# a pipeline of nano models with DPO, in seconds (the smoke run)
SMOKE_PIPELINE = [
    "task.size=nano", "task.n_train=64", "task.n_eval=8", "task.n_sft=32", "sft.steps=3",
    "sft.batch_size=16", "rm.steps=3", "rm.batch_size=16", "data.train_batch_size=4",
    "rollout.n=2", "actor.ppo_mini_batch_size=8", "actor.ppo_micro_batch_size=8",
    "critic.ppo_mini_batch_size=8", "critic.ppo_micro_batch_size=8",
    "critic.warmup_iterations=0", "trainer.iterations=2", "trainer.threads=1",
    "pipeline.eval_points=1", "pipeline.eval_samples=1", "pipeline.dpo=true",
    "dpo.batch_size=16", "dpo.max_length=64",
]  # fmt: skip


def smoke() -> None:
    """The run's own DPO policy, scored here, gives back its row of pipeline_eval.jsonl."""
    from proxima.cli import main as cli

    run = Path(tempfile.mkdtemp()) / "pipeline"
    assert cli(["pipeline", *SMOKE_PIPELINE, f"trainer.output_dir={run}"]) == 0
    rows = [json.loads(x) for x in (run / "pipeline_eval.jsonl").read_text().splitlines()]
    beta = json.loads((run / "summary.json").read_text())["config"]["dpo"]["beta"]
    row = score(run, run.parent / "again", beta, [], run / "dpo" / "actor")
    for key in ("gold_mean", "proxy_mean", "kl"):
        assert abs(row[key] - rows[-1][key]) < 1e-6, (key, row[key], rows[-1][key])
    print("smoke: the run's DPO row scored again, the same")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, nargs="?")
    ap.add_argument("out", type=Path, nargs="?")
    ap.add_argument("beta", type=float, nargs="?")
    ap.add_argument("overrides", nargs="*")
    ap.add_argument("--policy", type=Path, help="score this policy folder, train nothing")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    if a.smoke:
        return smoke()
    if a.beta is None:
        ap.error("RUN, OUT and BETA are needed")
    score(a.run, a.out, a.beta, a.overrides, a.policy)


def score(run: Path, out: Path, beta: float, overrides: list[str], policy: Path | None) -> dict:
    """DPO at `beta` on `run`'s pairs (unless `policy` is given), scored as its evaluate
    stage scores; the row is printed and written to OUT.json."""
    base = json.loads((run / "summary.json").read_text())["config"]
    # the SFT policy: the run's sft/ when it had demonstrations, else the model it started from
    sft = run / "sft" if (run / "sft").is_dir() else Path(base["model"]["actor_path"])
    changes = [
        f"model.actor_path={sft}",
        f"dpo.beta={beta}",
        f"dpo.out={out}",
        f"dpo.train_path={run / 'pairs/train.jsonl'}",
        f"dpo.eval_path={run / 'pairs/heldout.jsonl'}",
        *overrides,
    ]
    cfg = load_config(None, changes, base=base, command="dpo")
    began = time.perf_counter()
    if policy is None:
        train_dpo(cfg)
        policy = out / "actor"
    seconds = time.perf_counter() - began
    # the pipeline's evaluate stage, on this policy alone
    stage = Pipeline.__new__(Pipeline)
    stage.cfg, stage.device = cfg, torch.device("cpu")
    stage.tok = load_tokenizer(sft)
    stage.gold = FunctionReward.from_spec(cfg.pipeline.gold)
    stage.heldout = list(load_prompts(cfg, str(run / "task/heldout.jsonl"), stage.tok))
    rm = run / "rm"
    proxy = ModelReward(
        load_reward_model(rm),
        stage.tok,
        stage.tok,
        reward_model_scores,
        device=stage.device,
        batch_size=cfg.reward.batch_size,
        normalization=score_normalization(rm),
    )
    reference = load_causal_lm(sft, trainable=False)
    row = stage._scores(load_causal_lm(policy, trainable=False), reference, proxy)
    row.update(beta=beta, dpo_seconds=round(seconds, 1), policy=str(policy))
    print(json.dumps(row))
    out.with_suffix(".json").write_text(json.dumps(row, indent=1))
    return row


if __name__ == "__main__":
    main()
