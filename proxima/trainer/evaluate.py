"""Evaluation on held-out prompts: before, during and after training, and `proxima eval`."""

from __future__ import annotations

import torch

from proxima.config import RolloutConfig
from proxima.rollout.collect import collect
from proxima.rollout.engine import RolloutEngine
from proxima.trainer.dist import Dist


def _is_binary(scores: torch.Tensor) -> bool:
    return bool(((scores == 0) | (scores == 1)).all())


@torch.no_grad()
def _score_items(actor, tokenizer, items, reward, cfg, device, greedy, batch_size):
    """Scores [N], response lengths [N] and (prompt, response, score) of every item."""
    scores, lengths, samples = [], [], []
    for i in range(0, len(items), batch_size):
        ro = collect(
            actor, tokenizer, items[i : i + batch_size], reward, cfg, device, greedy=greedy, n=1
        )
        scores.append(ro.scores)
        lengths.append(ro.gen.response_mask.sum(1).float().cpu())
        samples += list(zip(ro.prompts, ro.responses, ro.scores.tolist(), strict=True))
    return torch.cat(scores).cpu(), torch.cat(lengths), samples


def _summary(s: torch.Tensor, ln: torch.Tensor, samples: list, greedy: bool) -> dict:
    out = {
        "mean_reward": float(s.mean()),
        "response_length": float(ln.mean()),
        "n": int(s.numel()),
        "greedy": greedy,
    }
    if _is_binary(s):
        out["accuracy"] = float(s.mean())
    out["samples"] = samples[:8]
    return out


def evaluate(
    actor: RolloutEngine | torch.nn.Module,
    tokenizer,
    items: list,
    reward,
    cfg: RolloutConfig,
    device: torch.device,
    *,
    greedy: bool = True,
    batch_size: int = 128,
    dist: Dist | None = None,
) -> dict:
    """Mean reward (and accuracy when every score is 0 or 1) of `actor` on `items`.

    `actor` is a rollout engine holding the actor's weights, or a model (the `hf` engine).
    Greedy by default; sampled evaluation uses the rollout's temperature / top_p / top_k.
    The score here is the reward source's raw output: no KL, no clipping, no stop penalty.
    With several processes each evaluates an equal share (the last items repeated to even
    the shares: FSDP2 generation needs every rank in every forward) and all get the result.
    """
    dist = dist or Dist()
    n, world = len(items), dist.world_size
    share = -(-n // world)
    padded = items + items[-1:] * (share * world - n)
    mine = padded[dist.rank * share : (dist.rank + 1) * share]
    s, ln, samples = dist.agree(
        lambda: _score_items(actor, tokenizer, mine, reward, cfg, device, greedy, batch_size),
        "evaluation",
    )
    if dist.active:
        s, ln = dist.gather_rows(s)[:n], dist.gather_rows(ln)[:n]
        samples = [x for part in dist.all_gather_object(samples) for x in part][:n]
    return _summary(s, ln, samples, greedy)


def evaluate_modes(
    engine: RolloutEngine | torch.nn.Module,
    tokenizer,
    items: list,
    reward,
    cfg,
    device: torch.device,
    dist: Dist | None = None,
) -> dict[str, dict]:
    """`evaluate` greedy, and sampled too with `eval.sampled`: {"greedy": ..., "sampled": ...}
    (cfg: the whole config: its rollout and eval sections)."""
    modes = {"greedy": True, "sampled": False} if cfg.eval.sampled else {"greedy": True}
    return {
        mode: evaluate(
            engine,
            tokenizer,
            items,
            reward,
            cfg.rollout,
            device,
            greedy=greedy,
            batch_size=cfg.eval.batch_size,
            dist=dist,
        )
        for mode, greedy in modes.items()
    }


def describe(results: dict[str, dict]) -> list[str]:
    """One line per mode: mean reward (and accuracy) on how many prompts."""
    lines = []
    for mode, res in results.items():
        acc = f", accuracy {res['accuracy']:.2%}" if "accuracy" in res else ""
        lines.append(f"{mode}: mean reward {res['mean_reward']:.4f}{acc} on {res['n']} prompts")
    return lines
