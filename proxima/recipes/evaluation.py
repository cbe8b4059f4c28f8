"""`proxima eval`: the mean reward (and accuracy, for a 0/1 reward) of `model.actor_path` on
the prompts of `data.eval_path`, greedy and, with `eval.sampled`, sampled; written to
`eval.out` as JSON when set (JSON lines for a .jsonl file)."""

from __future__ import annotations

import json
from pathlib import Path

from proxima.config import Config
from proxima.logging import write_atomic
from proxima.models import load_causal_lm, load_tokenizer
from proxima.recipes.common import process_setup, writable_file
from proxima.rollout.agent import check_agent
from proxima.rollout.engines import build_engine, sync_weights
from proxima.rollout.environments import check_env
from proxima.trainer.checks import check_lengths, check_model_folders, check_token_ids
from proxima.trainer.datasets import held_out_items
from proxima.trainer.evaluate import describe, evaluate_modes
from proxima.trainer.roles import build_reward


def evaluate_policy(cfg: Config) -> dict[str, dict]:
    """{"greedy": results, "sampled": results} (see `trainer.evaluate.evaluate`). A run or
    checkpoint folder as `model.actor_path` (--model) means its trained policy, actor/, as
    `proxima chat` and `export` take it."""
    given = Path(cfg.model.actor_path)
    if (given / "actor" / "config.json").is_file():
        cfg = cfg.replace({"model.actor_path": str(given / "actor")})
        print(f"evaluating the trained policy of {given}: {given / 'actor'}")
    check_model_folders(cfg, "eval")
    check_env(cfg)  # rollout.env: multi-turn episodes with the environment
    check_agent(cfg)  # rollout.agent: episodes played by an agent program
    out = writable_file(cfg.eval.out, "`eval.out`") if cfg.eval.out else None
    device = process_setup(cfg)
    tok = load_tokenizer(cfg.model.actor_path)
    check_token_ids(tok, cfg.model.actor_path, "model.actor_path")
    items = held_out_items(cfg, tok)
    check_lengths(cfg, items)
    actor = load_causal_lm(cfg.model.actor_path, device=device, trainable=False)
    reward = build_reward(cfg, tok, device)
    engine = sync_weights(build_engine(cfg, actor, tok, device), actor, version=0)
    results = evaluate_modes(engine, tok, items, reward, cfg, device)
    print("\n".join(describe(results)))
    if out is not None:
        write_atomic(out, _results_text(results, out))
    return results


def _results_text(results: dict[str, dict], out: Path) -> str:
    """The results as one JSON document, or for a `.jsonl` file as JSON lines: one line per
    evaluation mode, `{"mode": "greedy", "mean_reward": ..., "samples": [...]}`."""
    if out.suffix != ".jsonl":
        return json.dumps(results, indent=2)
    return "".join(json.dumps({"mode": mode, **res}) + "\n" for mode, res in results.items())
