"""Phase 1a: the actor writes responses (HF `generate` with the KV cache).

One small interface, `generate_responses`, so another engine (a lean sampling loop, vLLM)
can stand behind it later.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Generation:
    input_ids: torch.Tensor  # [B, P + R] prompt (left-padded) + response (right-padded)
    attention_mask: torch.Tensor  # [B, P + R]
    response_mask: torch.Tensor  # [B, R] up to and including the first stop token
    stopped: torch.Tensor  # [B] bool: the response ended with a stop token

    @property
    def response_ids(self) -> torch.Tensor:
        return self.input_ids[:, -self.response_mask.shape[1] :]


def response_mask_after_stop(
    response_ids: torch.Tensor, stop_ids: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask of tokens up to and including the first stop token, and whether one occurred.

    response_ids: [B, R]. Returns (mask [B, R] long, stopped [B] bool). Everything after the
    first stop token (padding, or tokens a batch-mate kept generating) is masked out.
    """
    is_stop = torch.isin(response_ids, torch.tensor(stop_ids, device=response_ids.device))
    # number of stop tokens strictly before position t; a token is kept while that is 0
    before = torch.cumsum(is_stop.long(), dim=1) - is_stop.long()
    return (before == 0).long(), is_stop.any(dim=1)


def synced_generation(model: torch.nn.Module) -> bool:
    """An FSDP2-sharded model in a multi-process job: every forward all-gathers the layers
    from all ranks, so a rank whose responses have all ended must keep stepping until every
    rank has (transformers' `synced_gpus`), else the ranks' collectives fall out of step
    (transformers #33483)."""
    import torch.distributed as tdist
    from torch.distributed.fsdp import FSDPModule

    multi = tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1
    return multi and isinstance(model, FSDPModule)


@torch.no_grad()
def generate_responses(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    max_new_tokens: int,
    stop_ids: list[int],
    pad_token_id: int,
    greedy: bool = False,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
) -> Generation:
    """Sample (or greedily decode) responses to left-padded prompts [B, P]."""
    was_training = model.training
    model.eval()
    sampling = (
        {"do_sample": False}
        if greedy
        else {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": top_k}
    )
    out = model.generate(
        input_ids=prompt_ids,
        attention_mask=prompt_mask,
        max_new_tokens=max_new_tokens,
        eos_token_id=stop_ids,
        pad_token_id=pad_token_id,
        use_cache=True,
        synced_gpus=synced_generation(model),
        **sampling,
    )
    model.train(was_training)
    response_ids = out[:, prompt_ids.shape[1] :]
    mask, stopped = response_mask_after_stop(response_ids, stop_ids)
    # tokens after the first stop become padding so they can never leak into a forward pass
    response_ids = torch.where(
        mask.bool(), response_ids, torch.full_like(response_ids, pad_token_id)
    )
    return Generation(
        input_ids=torch.cat([prompt_ids, response_ids], dim=1),
        attention_mask=torch.cat([prompt_mask.long(), mask], dim=1),
        response_mask=mask,
        stopped=stopped,
    )
