"""Shared by the multi-process tests and the workers torchrun starts: a fixed, ragged global
batch and the gradients one mini-batch of it produces through `run_epochs`."""

from __future__ import annotations

import dataclasses

import torch
from transformers import AutoModelForTokenClassification

from proxima.algos import AGG_MODES
from proxima.config import ActorConfig, CriticConfig, OptimConfig
from proxima.models import build_char_tokenizer, build_tiny_model, tiny_config
from proxima.models.critic import PolicyValue, ValueHead, ValueModel, ValueObjective, new_value_head
from proxima.models.unwrap import unwrap
from proxima.trainer.dist import Dist, wrap_trained
from proxima.trainer.optim import TrainedRole
from proxima.trainer.update import PolicyObjective, run_epochs
from proxima.types import Experience
from tests.oracles import ragged_experience

ALPHABET = "0123456789+="
TEMPERATURE = 0.7
# 8 rows: the first 4 (rank 0 of 2) have long responses, the last 4 (rank 1) short ones,
# so a loss normalised per rank instead of globally would be visibly wrong
PROMPT_LENS = [3, 2, 4, 1, 2, 3, 1, 4]
RESPONSE_LENS = [5, 4, 5, 3, 1, 2, 1, 2]
MODES = AGG_MODES


def models() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A nano Llama actor and a nano GPT-2 critic, the same on every rank (seeded)."""
    tok = build_char_tokenizer(ALPHABET)
    actor = build_tiny_model("llama", tok, "nano", max_positions=32, seed=7)
    config = tiny_config("gpt2", tok, "nano", max_positions=32, num_labels=1)
    torch.manual_seed(8)
    critic = AutoModelForTokenClassification.from_config(config)
    return actor, critic


def global_batch(actor: torch.nn.Module, shared: bool = False) -> Experience:
    """The 8 rows of PROMPT_LENS and RESPONSE_LENS; `shared`: rows 2k and 2k + 1 the two
    samples of one prompt (row 2k's), so each rank's half holds two prompts' samples."""
    exp = ragged_experience(actor, PROMPT_LENS, RESPONSE_LENS, TEMPERATURE, len(ALPHABET))
    if not shared:
        return exp
    ids, attn, p = exp.input_ids.clone(), exp.attention_mask.clone(), exp.prompt_length
    ids[1::2, :p], attn[1::2, :p] = ids[::2, :p], attn[::2, :p]
    return dataclasses.replace(exp, input_ids=ids, attention_mask=attn)


# two turns per episode, ids of ALPHABET's characters (4 ...); the first 4 episodes (rank 0 of
# 2) long, the last 4 (rank 1) short; each ends with EOS (2)
EPISODE_ACTIONS = [
    [[4, 5, 6, 7], [8, 9, 10], [11, 12, 13, 4], [5, 6, 7], [8], [9], [10], [11]],
    [[12, 13, 2], [4, 5, 2], [6, 2], [7, 8, 9, 2], [2], [10, 2], [2], [11, 2]],
]


def episode_batch(actor: torch.nn.Module) -> Experience:
    """The global batch as multi-turn episodes (tests/rollout/scripted.py's scripted policy
    against its TwoTurns environment: two actions around an observation of 2 tokens whose
    response_mask is 0), with old log-probs from the actor plus noise and random
    advantages, values, returns and reference log-probs, as `ragged_experience`."""
    from proxima.algos import logprobs_from_logits
    from proxima.config import EnvConfig, RolloutConfig
    from proxima.data import PromptItem
    from proxima.models.forward import response_logits
    from proxima.rollout.collect import generate_rollout
    from tests.rollout.scripted import ScriptedEngine, spec

    tok = build_char_tokenizer(ALPHABET)
    items = [PromptItem("p", list(range(4, 4 + n))) for n in PROMPT_LENS]
    cfg = RolloutConfig(env=EnvConfig(spec("TwoTurns"), max_turn_tokens=4, max_episode_tokens=16))
    cpu = torch.device("cpu")
    gen = generate_rollout(ScriptedEngine(EPISODE_ACTIONS), tok, items, cfg, cpu, n=1).gen
    r, mask = gen.response_mask.shape[1], gen.response_mask
    with torch.no_grad():
        logits = response_logits(actor, gen.input_ids, gen.attention_mask, r, TEMPERATURE)
        current = logprobs_from_logits(logits, gen.response_ids)
    noise = torch.Generator().manual_seed(1)
    draw = lambda: torch.randn(mask.shape, generator=noise)  # noqa: E731
    return Experience(
        input_ids=gen.input_ids,
        attention_mask=gen.attention_mask,
        response_mask=mask,
        old_logprobs=(current + 0.3 * draw()) * mask,
        ref_logprobs=(current + 0.5 * draw()) * mask,
        values=draw() * mask,
        returns=draw() * mask,
        advantages=draw() * mask,
        group_ids=torch.arange(mask.shape[0]),
    )


class GradCapture(TrainedRole):
    """A trained role whose optimizer step records the (synchronised, whole) gradients."""

    grads: dict[str, torch.Tensor]

    def step(self) -> tuple[float, bool]:
        self.grads = {}
        for name, p in unwrap(self.model).named_parameters():
            if p.grad is not None:
                g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
                self.grads[name] = g.detach().cpu().clone()
                p.grad = None
        return 0.0, True


def mini_batch_grads(
    model: torch.nn.Module,
    role: str,
    mode: str,
    exp: Experience,
    dist: Dist,
    world: int,
    device: torch.device | None = None,
    micro_tokens: int = 0,
    packed: bool = False,
) -> dict[str, torch.Tensor]:
    """Gradients of one global mini-batch (all of `exp` across the `world` ranks; this rank
    holds `exp`, its share) with micro-batches of 2 (or by a budget of `micro_tokens`
    tokens: `ppo_max_tokens_per_micro`), through `run_epochs`; `packed`: the objectives'
    passes through packed rows (`model.packing`). Role `shared`:
    the actor with a value head on its backbone (critic.shared_backbone): one module."""
    size = exp.batch_size * world
    sec_cls = CriticConfig if role == "critic" else ActorConfig
    sec = sec_cls(
        optim=OptimConfig(lr=0.0),
        ppo_mini_batch_size=size,
        ppo_micro_batch_size=2,
        ppo_max_tokens_per_micro=micro_tokens,
        shuffle=False,
        loss_agg_mode=mode,
    )
    fsdp = None
    if dist.strategy == "fsdp2":
        from proxima.config import FSDPConfig

        fsdp = FSDPConfig()
    device = device or torch.device("cpu")
    model = model.to(device)
    critic_sec = CriticConfig(loss_agg_mode=mode, vf_coef=0.7)
    if role == "shared":
        model = PolicyValue(model, new_value_head(model, seed=3, device=device))
        objective = PolicyObjective(
            sec, TEMPERATURE, critic=ValueHead(critic_sec, model.value_head), packed=packed
        )
    elif role == "actor":
        objective = PolicyObjective(sec, TEMPERATURE, packed=packed)
    else:
        objective = ValueObjective(ValueModel(critic_sec, model, "test"), packed=packed)
    wrapped = wrap_trained(model, dist, device, fsdp)
    captured = GradCapture(role, wrapped, sec, total_steps=1, dist=dist)
    gen = torch.Generator().manual_seed(0)
    run_epochs(captured, exp.to(device), objective, generator=gen, dist=dist)
    return captured.grads
