"""Prompts -> responses (`generate_rollout`) -> raw scores (`score_rollout`): phase 1, shared by
training and evaluation (`collect` does both). Scores are the reward source's own output:
every shaping (normalisation, no-stop penalty, clipping, KL) is `algos.shape_rewards`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from proxima.config import RolloutConfig
from proxima.data import collate_prompts
from proxima.rollout.generate import Generation, generate_responses


@dataclass
class Rollout:
    gen: Generation
    prompts: list[str]  # [B] prompt text of each sequence
    responses: list[str]  # [B] decoded response (special tokens skipped)
    columns: dict[str, list]  # extra dataset columns, one entry per sequence
    group_ids: torch.Tensor  # [B] index of the prompt within the batch
    scores: torch.Tensor | None = None  # [B] raw reward score (set by score_rollout)


def stop_token_ids(tokenizer, cfg: RolloutConfig) -> list[int]:
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids += [int(i) for i in cfg.stop_token_ids if int(i) not in ids]
    if not ids:
        raise ValueError(
            "The tokenizer has no EOS token and `rollout.stop_token_ids` is empty: "
            "responses could never end. Set rollout.stop_token_ids=[ID]."
        )
    return ids


def _cat_generations(parts: list[Generation], pad_id: int) -> Generation:
    """Concatenate generation chunks whose response widths differ (pad on the right)."""
    r = max(p.response_mask.shape[1] for p in parts)

    def pad(t: torch.Tensor, width: int, value: int) -> torch.Tensor:
        return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)

    ids, attn, masks = [], [], []
    for p in parts:
        extra = r - p.response_mask.shape[1]
        ids.append(pad(p.input_ids, p.input_ids.shape[1] + extra, pad_id))
        attn.append(pad(p.attention_mask, p.attention_mask.shape[1] + extra, 0))
        masks.append(pad(p.response_mask, r, 0))
    return Generation(
        torch.cat(ids), torch.cat(attn), torch.cat(masks), torch.cat([p.stopped for p in parts])
    )


def generate_rollout(
    actor: torch.nn.Module,
    tokenizer,
    items: list,
    cfg: RolloutConfig,
    device: torch.device,
    *,
    greedy: bool = False,
    n: int | None = None,
) -> Rollout:
    """Generate `n` responses per prompt item (greedy or sampled), decoded; not scored."""
    n = cfg.n if n is None else n
    items = [it for it in items for _ in range(n)]
    group_ids = torch.arange(len(items) // n).repeat_interleave(n)
    batch = collate_prompts(items, tokenizer.pad_token_id)
    ids, mask = batch["input_ids"].to(device), batch["attention_mask"].to(device)
    stops = stop_token_ids(tokenizer, cfg)
    parts = [
        generate_responses(
            actor,
            ids[i : i + cfg.micro_batch_size],
            mask[i : i + cfg.micro_batch_size],
            max_new_tokens=cfg.max_response_length,
            stop_ids=stops,
            pad_token_id=tokenizer.pad_token_id,
            greedy=greedy,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
        )
        for i in range(0, len(items), cfg.micro_batch_size)
    ]
    gen = _cat_generations(parts, tokenizer.pad_token_id)
    responses = tokenizer.batch_decode(gen.response_ids.cpu(), skip_special_tokens=True)
    prompts = [it.text for it in items]
    columns = {k: [it.columns.get(k) for it in items] for k in items[0].columns}
    return Rollout(gen, prompts, responses, columns, group_ids)


def score_rollout(ro: Rollout, reward) -> Rollout:
    """Set `ro.scores` [B] float32: the reward source's raw score of each sequence."""
    gen = ro.gen
    ro.scores = reward(ro.prompts, ro.responses, ro.columns, gen.input_ids, gen.attention_mask)
    ro.scores = ro.scores.float()
    return ro


def collect(
    actor: torch.nn.Module,
    tokenizer,
    items: list,
    reward,
    cfg: RolloutConfig,
    device: torch.device,
    *,
    greedy: bool = False,
    n: int | None = None,
) -> Rollout:
    """`generate_rollout` then `score_rollout` (evaluation; training times them apart)."""
    ro = generate_rollout(actor, tokenizer, items, cfg, device, greedy=greedy, n=n)
    return score_rollout(ro, reward)
