"""Evaluation on held-out prompts: before, during and after training, and `proxima eval`."""

from __future__ import annotations

import torch

from proxima.config import RolloutConfig
from proxima.rollout.collect import collect
from proxima.rollout.engine import RolloutEngine


def _is_binary(scores: torch.Tensor) -> bool:
    return bool(((scores == 0) | (scores == 1)).all())


@torch.no_grad()
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
) -> dict:
    """Mean reward (and accuracy when every score is 0 or 1) of `actor` on `items`.

    `actor` is a rollout engine holding the actor's weights, or a model (the `hf` engine).
    Greedy by default; sampled evaluation uses the rollout's temperature / top_p / top_k.
    The score here is the reward source's raw output: no KL, no clipping, no stop penalty.
    """
    scores, lengths, samples = [], [], []
    for i in range(0, len(items), batch_size):
        ro = collect(
            actor, tokenizer, items[i : i + batch_size], reward, cfg, device, greedy=greedy, n=1
        )
        scores.append(ro.scores)
        lengths.append(ro.gen.response_mask.sum(1).float().cpu())
        samples += list(zip(ro.prompts, ro.responses, ro.scores.tolist(), strict=True))
    s, ln = torch.cat(scores), torch.cat(lengths)
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
