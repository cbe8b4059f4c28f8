"""Evaluation on held-out prompts: before, during and after training, and `proxima eval`;
scores and KL to a reference of sampled responses (`scores_and_kl`, `proxima pipeline`).

In multi-turn episodes (`rollout.env`) a whole episode is played with the environment and
its reward is its return (the turn rewards plus the reward source's score, when one is
set); `accuracy` is then the share of episodes whose return reaches the environment class's
`max_reward` (when it has one; else, as for single responses, the mean of 0/1 rewards), and
`turns` / `multi_turn` the mean turns per episode and the share with more than one."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace

import torch

from proxima.algos import dominated, mean_at_k, pass_at_k_table, wordless
from proxima.config import RolloutConfig
from proxima.data.mixing import DATASET_COLUMN
from proxima.models.forward import response_logprobs
from proxima.rollout.collect import collect, generate_rollout, reward_args, score_rollout
from proxima.rollout.contract import RolloutEngine
from proxima.rollout.environments import load_env_class
from proxima.rollout.types import Generation
from proxima.trainer.dist import Dist
from proxima.trainer.drift import drift_metrics

NO_TOKEN = -1  # in `_tokens`: a position outside the response mask


def _is_binary(scores: torch.Tensor) -> bool:
    return bool(((scores == 0) | (scores == 1)).all())


def _tokens(gen: Generation) -> torch.Tensor:
    """[B, R] int64: the response tokens, NO_TOKEN outside the response mask."""
    ids = gen.response_ids.long().cpu()
    return torch.where(gen.response_mask.cpu() != 0, ids, torch.full_like(ids, NO_TOKEN))


def _scored(ro, reward) -> tuple[torch.Tensor, torch.Tensor]:
    """[B] the reward source's score of each response and [B, K] the raw score of each of
    `reward.sources` (`WeightedReward`; K = 0 for a single source), from one call of each."""
    if hasattr(reward, "scored"):
        total, parts = reward.scored(*reward_args(ro))
        return total.float(), parts.float().cpu()
    return score_rollout(ro, reward), torch.zeros(len(ro.responses), 0)


@torch.no_grad()
def _score_items(actor, tokenizer, items, reward, cfg, device, greedy, batch_size):
    """Rewards [N] (an episode's return), response lengths [N], turns [N] (1 for single
    responses), (prompt, response, reward[, episode]) of every item, its response
    tokens [N, R] (`_tokens`) and each reward source's raw score [N, K] (`_scored`)."""
    scores, lengths, turns, samples, tokens, parts = [], [], [], [], [], []
    for i in range(0, len(items), batch_size):
        ro = generate_rollout(
            actor, tokenizer, items[i : i + batch_size], cfg, device, greedy=greedy, n=1
        )
        score, part = _scored(ro, reward)
        ro = replace(ro, scores=score)
        parts.append(part)
        total = ro.total_rewards()
        scores.append(total)
        lengths.append(ro.gen.response_mask.sum(1).float().cpu())
        episodes = ro.episodes or [None] * len(ro.prompts)
        turns.append(torch.tensor([len(e["turns"]) if e else 1 for e in episodes]).float())
        rows = zip(ro.prompts, ro.responses, total.tolist(), episodes, strict=True)
        samples += [row if row[3] is not None else row[:3] for row in rows]
        tokens.append(_tokens(ro.gen))
    width = max(t.shape[1] for t in tokens)
    tokens = torch.cat(
        [torch.nn.functional.pad(t, [0, width - t.shape[1]], value=NO_TOKEN) for t in tokens]
    )
    return (
        torch.cat(scores).cpu(),
        torch.cat(lengths),
        torch.cat(turns),
        samples,
        tokens,
        torch.cat(parts),
    )


def _share(items: list, dist: Dist) -> list:
    """This rank's equal share of `items`, the last item repeated to even the shares (FSDP2
    generation needs every rank in every forward)."""
    share = -(-len(items) // dist.world_size)
    padded = items + items[-1:] * (share * dist.world_size - len(items))
    return padded[dist.rank * share : (dist.rank + 1) * share]


def max_reward(cfg: RolloutConfig) -> float | None:
    """The best return of an episode (`max_reward` of the environment class), or None."""
    env = cfg.episodes == "env"
    best = getattr(load_env_class(cfg.env.cls), "max_reward", None) if env else None
    return None if best is None else float(best)


def _summary(
    s: torch.Tensor,
    ln: torch.Tensor,
    turns: torch.Tensor,
    samples: list,
    greedy: bool,
    best,
    tokens: torch.Tensor,
) -> dict:
    out = {
        "mean_reward": float(s.mean()),
        "response_length": float(ln.mean()),
        "n": int(s.numel()),
        "greedy": greedy,
    }
    # the training iterations' drift/* of these responses (no reference pass: no ref_logprob)
    texts = [row[1] for row in samples]
    out.update(
        drift_metrics(tokens.clamp(min=0), tokens != NO_TOKEN, dominated(texts), wordless(texts))
    )
    if best is not None:
        out["accuracy"] = float((s >= best - 1e-6).float().mean())
    elif _is_binary(s):
        out["accuracy"] = float(s.mean())
    if len(samples[0]) == 4:  # episodes
        out["turns"] = float(turns.mean())
        out["multi_turn"] = float((turns > 1).float().mean())
        failed = [row[3] for row in samples if row[3]["end"] in ("error", "timeout")]
        out["failed_episodes"] = len(failed) / len(samples)
        errors = [t["error"] for e in failed for t in e["turns"] if "error" in t]
        if errors:
            out["first_error"] = errors[0]
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
    """Mean reward (and accuracy when every score is 0 or 1) of `actor` on `items`, also per
    source (`by_source`) when the prompts have a `data_source` column, and per file of
    several `data.eval_path` files; the answers' drift/* (`trainer.drift.drift_metrics`:
    repetition, dominated share, distinct-n), per source the per-answer shares only.

    `actor` is a rollout engine holding the actor's weights, or a model (the `hf` engine).
    Greedy by default; sampled evaluation uses the rollout's temperature / top_p / top_k.
    The score here is the reward source's raw output: no KL, no clipping, no stop penalty.
    With several processes each evaluates an equal share (the last items repeated to even
    the shares: FSDP2 generation needs every rank in every forward) and all get the result.
    """
    dist = dist or Dist()
    n, mine = len(items), _share(items, dist)
    s, ln, turns, samples, tokens, parts = dist.agree(
        lambda: _score_items(actor, tokenizer, mine, reward, cfg, device, greedy, batch_size),
        "evaluation",
    )
    if dist.active:
        s, ln, turns = (dist.gather_rows(t)[:n] for t in (s, ln, turns))
        if parts.shape[1]:
            parts = dist.gather_rows(parts)[:n]
        tokens = dist.gather_rows(tokens, pad_value=NO_TOKEN)[:n]
        samples = [x for part in dist.all_gather_object(samples) for x in part][:n]
    best = max_reward(cfg)
    out = _summary(s, ln, turns, samples, greedy, best, tokens)
    # each of reward.sources' raw score, a weight-0 judge's included: reward/<name>
    for k, name in enumerate(getattr(reward, "names", [])[: parts.shape[1]]):
        out[f"reward/{name}"] = float(parts[:, k].mean())
    rows = _by_source(items)
    if rows:
        out["by_source"] = {
            src: _summary(
                s[idx], ln[idx], turns[idx], [samples[i] for i in idx], greedy, best, tokens[idx]
            )
            for src, idx in rows.items()
        }
        for part in out["by_source"].values():  # distinct-n of a few answers says little
            del part["samples"], part["drift/distinct_1"], part["drift/distinct_2"]
    return out


def _by_source(items: list) -> dict[str, list[int]]:
    """The rows of each prompt set (the `dataset` column of several `data.eval_path` files)
    and of each value of the prompts' `data_source` column (verl's name: the dataset, task
    or constraint kind a prompt comes from), in sorted order; {} without either."""
    rows = defaultdict(list)
    for i, it in enumerate(items):
        keys = (it.columns.get(DATASET_COLUMN), it.columns.get("data_source"))
        for key in dict.fromkeys(str(k) for k in keys if k is not None):
            rows[key].append(i)
    return dict(sorted(rows.items()))


@torch.no_grad()
def _score_k(actor, tokenizer, items, reward, cfg, device, n, batch_size):
    """Scores [N, n] of n sampled responses to each item."""
    per_call = max(1, batch_size // n)
    rows = []
    for i in range(0, len(items), per_call):
        ro = collect(actor, tokenizer, items[i : i + per_call], reward, cfg, device, n=n)
        rows.append(ro.total_rewards().float().cpu().reshape(-1, n))
    return torch.cat(rows)


def _k_summary(scores: torch.Tensor, best: float | None = None) -> dict:
    """mean@n, and pass@k for k = 1..n when every score is 0 or 1 (1 = correct), or, for
    episodes whose environment has a `max_reward`, a return reaching it is correct."""
    n = scores.shape[1]
    out: dict = {"n": n}
    if best is not None:
        out.update({f"pass@{k}": v for k, v in pass_at_k_table(scores >= best - 1e-6).items()})
    elif _is_binary(scores):
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
    best = max_reward(cfg)
    out = _k_summary(scores, best)
    parts = _by_source(items)
    if parts:
        out["by_source"] = {src: _k_summary(scores[idx], best) for src, idx in parts.items()}
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
        if "turns" in res:
            acc += f", {res['turns']:.2f} turns, {res['multi_turn']:.0%} with several"
        lines.append(f"{mode}: mean reward {res['mean_reward']:.4f}{acc} on {res['n']} prompts")
        sources = {k.removeprefix("reward/"): v for k, v in res.items() if k.startswith("reward/")}
        if sources:  # each of reward.sources' own mean, a weight-0 judge's included
            parts = ", ".join(f"{name} {v:.4f}" for name, v in sources.items())
            lines.append(f"{mode}: by reward source: {parts}")
        if "drift/dominated" in res:  # what the reward does not show: degenerate answers
            lines.append(
                f"{mode}: drift: {res['drift/dominated']:.0%} of the answers mostly one word, "
                f"{res['drift/empty']:.0%} with no word, "
                f"repetition {res['drift/repetition']:.3f}, "
                f"distinct-2 {res['drift/distinct_2']:.3f}"
            )
        if res.get("failed_episodes"):
            lines.append(
                f"{mode}: warning: {res['failed_episodes']:.0%} of the episodes ended on an "
                f"environment error or timeout (first: {res.get('first_error', '?')})"
            )
        for src, part in res.get("by_source", {}).items():
            acc = f", accuracy {part['accuracy']:.2%}" if "accuracy" in part else ""
            lines.append(
                f"{mode} [{src}]: mean reward {part['mean_reward']:.4f}{acc} on {part['n']}"
            )
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
    ids, attn = gen.input_ids, gen.attention_mask
    logp = response_logprobs(model, ids, attn, gen.response_ids, temperature)
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
