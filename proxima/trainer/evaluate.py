"""Evaluation on held-out prompts: before, during and after training, and `proxima eval`;
scores and KL to a reference of sampled responses (`scores_and_kl`, `proxima pipeline`)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

from proxima.algos import logprobs_from_logits, mean_at_k, pass_at_k_table
from proxima.config import RolloutConfig
from proxima.models.forward import response_logits
from proxima.rollout.collect import collect, generate_rollout, score_rollout
from proxima.rollout.engine import RolloutEngine
from proxima.rollout.generate import Generation
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


def _share(items: list, dist: Dist) -> list:
    """This rank's equal share of `items`, the last item repeated to even the shares (FSDP2
    generation needs every rank in every forward)."""
    share = -(-len(items) // dist.world_size)
    padded = items + items[-1:] * (share * dist.world_size - len(items))
    return padded[dist.rank * share : (dist.rank + 1) * share]


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
    n, mine = len(items), _share(items, dist)
    s, ln, samples = dist.agree(
        lambda: _score_items(actor, tokenizer, mine, reward, cfg, device, greedy, batch_size),
        "evaluation",
    )
    if dist.active:
        s, ln = dist.gather_rows(s)[:n], dist.gather_rows(ln)[:n]
        samples = [x for part in dist.all_gather_object(samples) for x in part][:n]
    return _summary(s, ln, samples, greedy)


@torch.no_grad()
def _score_k(actor, tokenizer, items, reward, cfg, device, n, batch_size):
    """Scores [N, n] of n sampled responses to each item."""
    per_call = max(1, batch_size // n)
    rows = []
    for i in range(0, len(items), per_call):
        ro = collect(actor, tokenizer, items[i : i + per_call], reward, cfg, device, n=n)
        rows.append(ro.scores.float().cpu().reshape(-1, n))
    return torch.cat(rows)


def _k_summary(scores: torch.Tensor) -> dict:
    """mean@n, and pass@k for k = 1..n when every score is 0 or 1 (1 = correct)."""
    n = scores.shape[1]
    out: dict = {"n": n}
    if _is_binary(scores):
        out.update({f"pass@{k}": v for k, v in pass_at_k_table(scores == 1).items()})
    out[f"mean@{n}"] = mean_at_k(scores)
    return out


def evaluate_k(
    actor: RolloutEngine | torch.nn.Module,
    tokenizer,
    items: list,
    reward,
    cfg: RolloutConfig,
    device: torch.device,
    *,
    n: int,
    batch_size: int = 128,
    dist: Dist | None = None,
) -> dict:
    """`n` sampled responses per prompt (at rollout.temperature / top_p / top_k): mean@n and
    the unbiased pass@k of Chen et al. 2021 for every k <= n (when the scores are 0/1), over
    all prompts and, when the prompts have a `data_source` column, per source
    (`by_source`). Shared over processes as `evaluate`."""
    dist = dist or Dist()
    count, mine = len(items), _share(items, dist)
    scores = dist.agree(
        lambda: _score_k(actor, tokenizer, mine, reward, cfg, device, n, batch_size),
        "evaluation",
    )
    if dist.active:
        scores = dist.gather_rows(scores)
    scores = scores[:count]
    out = _k_summary(scores)
    sources = [it.columns.get("data_source") for it in items]
    if any(src is not None for src in sources):
        rows = defaultdict(list)
        for i, src in enumerate(sources):
            rows[str(src)].append(i)
        out["by_source"] = {src: _k_summary(scores[idx]) for src, idx in sorted(rows.items())}
    return out


def evaluate_modes(
    engine: RolloutEngine | torch.nn.Module,
    tokenizer,
    items: list,
    reward,
    cfg,
    device: torch.device,
    dist: Dist | None = None,
) -> dict[str, dict]:
    """`evaluate` greedy, and sampled too with `eval.sampled`: {"greedy": ..., "sampled": ...},
    and with `eval.n` > 1 `evaluate_k` as "pass@k" (cfg: the whole config: its rollout and
    eval sections)."""
    modes = {"greedy": True, "sampled": False} if cfg.eval.sampled else {"greedy": True}
    runs = {
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
    if cfg.eval.n > 1:
        runs["pass@k"] = evaluate_k(
            engine,
            tokenizer,
            items,
            reward,
            cfg.rollout,
            device,
            n=cfg.eval.n,
            batch_size=cfg.eval.batch_size,
            dist=dist,
        )
    return runs


def describe(results: dict[str, dict]) -> list[str]:
    """One line per mode: mean reward (and accuracy) on how many prompts."""
    lines = []
    for mode, res in results.items():
        if mode == "pass@k":
            lines.append(f"{mode}: " + _k_line(res))
            for src, part in res.get("by_source", {}).items():
                lines.append(f"{mode} [{src}]: " + _k_line(part))
            continue
        acc = f", accuracy {res['accuracy']:.2%}" if "accuracy" in res else ""
        lines.append(f"{mode}: mean reward {res['mean_reward']:.4f}{acc} on {res['n']} prompts")
    return lines


def _k_line(res: dict) -> str:
    keys = [k for k in res if k.startswith(("pass@", "mean@"))]
    return ", ".join(f"{k} {res[k]:.4f}" for k in keys) + f" ({res['n']} samples per prompt)"


@torch.no_grad()
def sequence_logprob(
    model: torch.nn.Module, gen: Generation, temperature: float = 1.0
) -> torch.Tensor:
    """[B] float32: the sum over each response's tokens of log pi(token) under `model` (at the
    sampling temperature), for the sequences of `gen`."""
    width = gen.response_mask.shape[1]
    logits = response_logits(model, gen.input_ids, gen.attention_mask, width, temperature)
    logp = logprobs_from_logits(logits.float(), gen.response_ids)
    return (logp * gen.response_mask).sum(dim=1)


@torch.no_grad()
def scores_and_kl(
    actor: torch.nn.Module,
    reference: torch.nn.Module,
    tokenizer,
    items: list,
    sources: dict[str, Callable[..., torch.Tensor]],
    cfg: RolloutConfig,
    device: torch.device,
    *,
    n: int,
    batch_size: int = 128,
) -> dict[str, torch.Tensor]:
    """`n` sampled responses of `actor` per item (rollout.temperature / top_p / top_k):
    each source's score [N * n] by name, and "kl" [N * n], the sampled estimate of
    KL(actor || reference) per response, log pi(y) - log pi_ref(y) summed over its tokens
    (its mean is unbiased for the KL between the two policies' response distributions)."""
    per_call = max(1, batch_size // n)
    out: dict[str, list[torch.Tensor]] = {name: [] for name in [*sources, "kl"]}
    for i in range(0, len(items), per_call):
        ro = generate_rollout(actor, tokenizer, items[i : i + per_call], cfg, device, n=n)
        for name, source in sources.items():
            out[name].append(score_rollout(ro, source).cpu())
        kl = sequence_logprob(actor, ro.gen, cfg.temperature)
        out["kl"].append((kl - sequence_logprob(reference, ro.gen, cfg.temperature)).cpu())
    return {name: torch.cat(parts) for name, parts in out.items()}
