"""The critic V(s_t): one interface, two shapes, chosen once by `build_critic`.

- `ValueModel`: a value network of its own (DeepSpeed-Chat, InstructGPT): a Hugging Face
  *ForTokenClassification with one label (its classifier is the value head), trained as the
  `critic` role with its own optimizer, epochs and mini-batches (`critic.*`), saved as
  `critic/`.
- `ValueHead`: a Linear(hidden, 1) on the actor's final hidden state, V(s_t) = W_v h_t + b_v:
  one network with a policy head and a value head (the shared parameterisation of PPO,
  Schulman et al. 2017, arXiv:1707.06347 section 5; TRL's former
  AutoModelForCausalLMWithValueHead). The actor module becomes a `PolicyValue`: the policy
  and the head in one nn.Module, so DDP and FSDP2 treat the head like any parameter. It is
  trained in the actor's steps on loss = actor loss + vf_coef x value loss, the head an
  optimizer group of its own at `critic.optim`, and saved as `value_head/` beside `actor/`.

The head reads h_t exactly where the LM head does: a forward pre-hook on the LM head records
its input (`HeadInput`), which works for every architecture, through peft, DDP, FSDP2 and
the KV-cached decode of `generate`, and keeps h_t in the autograd graph (the value loss
trains the backbone too).

The rest of proxima asks a critic for the objective of each role it trains in
(`objectives`: a head adds its value loss to the actor's, a value model has an objective of
its own, `ValueObjective`), for the model it trains as a role of its own (`model`), for its
value-loss terms (`value_terms`) and for a line of description; the module-level functions
`optimizer_groups`, `save_module`, `load_module` and `read_module` treat every trained
module alike, a plain model or a `PolicyValue`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.utils import ModelOutput

from proxima.algos import value_loss
from proxima.config import Config, ConfigError, CriticConfig, OptimConfig
from proxima.config.roles import CRITIC_STARTS, role_plan
from proxima.models.forward import response_values
from proxima.models.loading import DTYPES, load_critic, new_head_weight
from proxima.models.lora import add_lora
from proxima.models.saving import load_role, read_role_weights, save_role
from proxima.models.unwrap import base_model
from proxima.types import Experience

VALUE_HEAD_FOLDER = "value_head"
# a trained role's loss and stats on a micro-batch, from one pass of its module
# (`trainer.update.run_epochs`)
Objective = Callable[[nn.Module, Experience], tuple[torch.Tensor, dict[str, float]]]


# --------------------------------------------------------------------------- the head


def lm_head(model: nn.Module) -> nn.Module:
    """The LM head (output embeddings) of a causal LM, inside every wrapper."""
    inner = base_model(model)
    head = inner.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(inner).__name__} has no LM head (get_output_embeddings)")
    return head


def new_value_head(
    actor: nn.Module,
    seed: int,
    dtype: torch.dtype = torch.float32,
    device="cpu",
    init: str = "random",
) -> nn.Linear:
    """Linear(hidden, 1) as a new critic's head (`critic.head_init`): random, weight ~
    N(0, 1/sqrt(hidden+1)), reproducible given `seed` without touching the global RNG; or
    zero, weight 0. Bias 0 either way."""
    hidden = lm_head(actor).weight.shape[-1]
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        head = nn.Linear(hidden, 1)  # its default init draws too: inside the fork
        head.weight.copy_(new_head_weight((1, hidden), init))
        head.bias.zero_()
    return head.to(device=device, dtype=dtype)


class HeadInput:
    """Context manager recording the input of `model`'s LM head on every call (one per
    forward pass; one per decode step in `generate`): `.calls` holds them in order, [B, L, H]
    each (L: the positions the head projects; `logits_to_keep` may cut it)."""

    def __init__(self, model: nn.Module) -> None:
        self.head = lm_head(model)
        self.calls: list[torch.Tensor] = []
        self._handle = None

    def _record(self, module, args) -> None:
        self.calls.append(args[0])

    def __enter__(self) -> HeadInput:
        # first among the head's hooks: it sees the input before another hook changes it
        # (`models.forward` packs the response positions)
        self._handle = self.head.register_forward_pre_hook(self._record, prepend=True)
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()


def value_of(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """[..., H] hidden states -> [...] float32 values."""
    return head(hidden.to(head.weight.dtype))[..., 0].float()


@dataclass
class PolicyValueOutput(ModelOutput):
    """A PolicyValue's forward: the policy's loss (when given labels) and logits, and the
    values `vpreds` [B, R] of the positions asked for."""

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    vpreds: torch.Tensor | None = None


class PolicyValue(nn.Module):
    """The actor with a value head on its final hidden state, as one module.

    `forward` is the policy's (its output: logits, loss, ...); given `value_span` (which
    positions of the LM head's input to value, e.g. `slice(-R - 1, -1)` for the R response
    tokens), the output also holds `vpreds` [B, R]; a tensor of N flat places (row x L +
    column; packed rows, `models.packing`) gives them as [N]. `values_only` (the critic's warm-up):
    the policy runs without gradient, so only the head learns. `generate` is the policy's;
    `generate(..., with_values=True)` also returns the values of the states the tokens are
    sampled from, computed inside the call (where FSDP2 holds the head's shards gathered).
    """

    def __init__(self, policy: nn.Module, value_head: nn.Linear) -> None:
        super().__init__()
        self.policy = policy
        self.value_head = value_head

    def forward(
        self,
        *args,
        value_span: slice | torch.Tensor | None = None,
        values_only: bool = False,
        **kw,
    ):
        grad = torch.is_grad_enabled() and not values_only
        if value_span is None:
            with torch.set_grad_enabled(grad):
                return self.policy(*args, **kw)
        with HeadInput(self.policy) as seen, torch.set_grad_enabled(grad):
            out = self.policy(*args, **kw)
        hidden = seen.calls[-1]
        if isinstance(value_span, torch.Tensor):
            hidden = hidden.flatten(0, 1)[value_span]
        else:
            hidden = hidden[:, value_span]
        values = value_of(self.value_head, hidden)
        return PolicyValueOutput(loss=out.loss, logits=out.logits, vpreds=values)

    def generate(self, *args, with_values: bool = False, **kwargs):
        """The policy's `generate`; `with_values`: (sequences, values [B, n]), the values of
        the states the n response tokens were sampled from (the last position of each
        decode step's LM head input)."""
        if not with_values:
            return self.policy.generate(*args, **kwargs)
        with HeadInput(self.policy) as seen:
            out = self.policy.generate(*args, **kwargs)
        n = out.shape[1] - kwargs["input_ids"].shape[1]
        steps = torch.cat([h[:, -1:] for h in seen.calls[:n]], dim=1)
        return out, value_of(self.value_head, steps)

    def get_base_model(self) -> nn.Module:
        """The Hugging Face model (peft's accessor, which `models.unwrap.base_model` uses)."""
        return base_model(self.policy)


def generate_with_values(model: nn.Module, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """`model.generate(**kwargs)` and the values of the sampled states: only an actor with a
    value head (a PolicyValue) has values to give while it generates."""
    return check_policy_value(model).generate(**kwargs, with_values=True)


def check_policy_value(model: nn.Module) -> PolicyValue:
    """`model`, which must be the actor with a value head to give values while it generates."""
    if not isinstance(model, PolicyValue):
        raise ValueError(
            "values during generation need the actor with a value head (the critic on the "
            f"actor's backbone); got a {type(model).__name__}"
        )
    return model


def policy_of(module: nn.Module) -> nn.Module:
    """The policy a module serves: the actor itself, or the one inside a PolicyValue."""
    return module.policy if isinstance(module, PolicyValue) else module


# --------------------------------------------------------------------------- the critic


class Critic:
    """What PPO asks of its value function (`ValueModel` or `ValueHead`)."""

    model: nn.Module | None  # the model it trains as a role of its own

    def __init__(self, cfg: CriticConfig) -> None:
        self.cfg = cfg

    def value_terms(
        self, values: torch.Tensor, mb: Experience
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The clipped value loss of a micro-batch (`critic.cliprange_value`,
        `critic.loss_agg_mode`) and its stats (vf_loss, vf_clipfrac, vpred_mean; the
        explained variance is the trainer's, over the whole batch)."""
        loss, stats = value_loss(
            values,
            mb.values,
            mb.returns,
            mb.response_mask,
            cliprange_value=self.cfg.cliprange_value or None,
            agg=self.cfg.loss_agg_mode,
        )
        stats = {k: float(v) for k, v in stats.items() if k != "explained_variance"}
        stats["vf_loss"] = float(loss.detach())
        return loss, stats

    def objectives(self, actor: Objective) -> dict[str, Objective]:
        """The objective of each role trained with this critic, by role name, given the
        actor's objective without a critic (a frozen dataclass with `critic` and `packed`
        fields, `trainer.update.PolicyObjective`)."""
        raise NotImplementedError

    def describe(self) -> str:
        raise NotImplementedError


class ValueModel(Critic):
    """A value network of its own, trained as the `critic` role."""

    def __init__(self, cfg: CriticConfig, model: nn.Module, source: str) -> None:
        super().__init__(cfg)
        self.model, self.source = model, source

    def objectives(self, actor: Objective) -> dict[str, Objective]:
        """The actor's objective as given; the critic role's, the value loss (its passes
        packed as the actor's are)."""
        return {"actor": actor, "critic": ValueObjective(self, packed=actor.packed)}

    def describe(self) -> str:
        return f"a value model of its own, initialised from {self.source}"


@dataclass(frozen=True)
class ValueObjective:
    """A value model's loss on a micro-batch: its clipped value loss. `packed`
    (`model.packing`): its pass takes packed rows."""

    critic: Critic
    packed: bool = False

    def during_warmup(self) -> ValueObjective:
        return self  # the critic's warm-up is what it trains in

    def __call__(self, model: nn.Module, mb: Experience):
        r = mb.response_mask.shape[1]
        values = response_values(model, mb.input_ids, mb.attention_mask, r, self.packed)
        return self.critic.value_terms(values, mb)


class ValueHead(Critic):
    """A value head on the actor's final hidden state, trained in the actor's steps."""

    model = None

    def __init__(self, cfg: CriticConfig, head: nn.Linear) -> None:
        super().__init__(cfg)
        self.head = head

    def objectives(self, actor: Objective) -> dict[str, Objective]:
        """The actor's objective with this head's value loss added (no role of its own)."""
        return {"actor": replace(actor, critic=self)}

    def describe(self) -> str:
        n = sum(p.numel() for p in self.head.parameters())
        return (
            f"a value head ({n} params) on the actor's backbone, trained in the actor's "
            f"steps (loss + {self.cfg.vf_coef:g} x value loss)"
        )


# A critic on the actor trains in the actor's steps, on the actor's schedule of epochs and
# mini-batches, clipped with the actor: these critic keys must keep their default or equal
# the actor's (they would be ignored); the model.* keys below name a value model of its own.
ACTOR_STEP_KEYS = ("ppo_epochs", "ppo_mini_batch_size", "ppo_micro_batch_size", "shuffle")
VALUE_MODEL_KEYS = ("model.critic_path", "model.critic_init", "model.critic_lora")


def _get(node, dotted: str):
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def check_critic(cfg: Config) -> None:
    """Refuse, naming them, the options the configured critic cannot use (ConfigError):
    with critic.shared_backbone the estimator must use a critic, and the keys that would
    give the head steps, a clip or a model of its own must be left alone."""
    c = cfg.critic
    if not c.shared_backbone:
        return
    why = []
    if not cfg.uses_critic:
        why.append(f"the estimator `{cfg.algorithm.adv_estimator}` uses no critic")
    defaults = Config()
    unused = [k for k in VALUE_MODEL_KEYS if _get(cfg, k) != _get(defaults, k)]
    if unused:
        keys = ", ".join(f"`{k}`={_get(cfg, k)!r}" for k in unused)
        why.append(f"{keys} configure a separate critic model, which it has none of")
    for key in (*ACTOR_STEP_KEYS, "optim.grad_clip"):
        mine, theirs = _get(c, key), _get(cfg.actor, key)
        if mine != _get(defaults.critic, key) and mine != theirs:
            why.append(
                f"`critic.{key}`={mine!r} would be ignored: the value head trains in the "
                f"actor's steps (`actor.{key}`={theirs!r})"
            )
    if c.vf_coef <= 0:
        why.append(f"`critic.vf_coef`={c.vf_coef} would never train the value head (0.5 to 1)")
    if why:
        raise ConfigError(
            "`critic.shared_backbone=true` (a value head on the actor): "
            + "; ".join(why)
            + ". Fix those keys, or set critic.shared_backbone=false for a value model of its "
            "own."
        )


def build_critic(
    cfg: Config, actor: nn.Module, device: torch.device
) -> tuple[nn.Module, Critic | None]:
    """The critic the role plan names (`config.roles`), and the actor module that carries it:
    `actor` itself, or for a value head a PolicyValue around it. No critic (None) for the
    critic-free estimators."""
    dtype, plan = DTYPES[cfg.model.dtype], role_plan(cfg)
    if plan.critic_on_actor:
        head = new_value_head(
            actor, seed=cfg.trainer.seed, dtype=dtype, device=device, init=cfg.critic.head_init
        )
        return PolicyValue(actor, head), ValueHead(cfg.critic, head)
    if not plan.critic_model:
        return actor, None
    model = load_critic(
        plan.critic_folder,
        dtype=dtype,
        device=device,
        init_from=plan.critic_init,
        seed=cfg.trainer.seed,
        head_init=cfg.critic.head_init,
    )
    if plan.critic_lora:
        model = add_lora(model, cfg.model, "TOKEN_CLS", seed=cfg.trainer.seed + 1)
    start = f"{CRITIC_STARTS[plan.critic_init]}, {plan.critic_folder}"
    return actor, ValueModel(cfg.critic, model, start)


# --------------------------------------------------------------------------- trained modules


def optimizer_groups(
    module: nn.Module, name: str, optim: OptimConfig, critic_optim: OptimConfig
) -> list[tuple[str, list[nn.Parameter], OptimConfig]]:
    """(name, trainable parameters, optimizer settings) of each optimizer group of a trained
    module: one for a plain model (`name` at `optim`), two for a PolicyValue (the policy at
    `optim`, its value head as `critic` at `critic_optim`)."""

    def trainable(m: nn.Module) -> list[nn.Parameter]:
        return [p for p in m.parameters() if p.requires_grad]

    if isinstance(module, PolicyValue):
        return [
            (name, trainable(module.policy), optim),
            ("critic", trainable(module.value_head), critic_optim),
        ]
    return [(name, trainable(module), optim)]


def _part(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix) :]: v for k, v in state.items() if k.startswith(prefix)}


def save_module(
    module: nn.Module, tokenizer, parent: Path, name: str, state: dict | None = None
) -> None:
    """A trained module's folders in `parent`: a plain model as the HF folder `name/` (+ its
    LoRA adapter, `models.saving.save_role`); a PolicyValue as `name/` and `value_head/`.
    `state`: the module's whole state dict where the module holds only its shard (FSDP2)."""
    if not isinstance(module, PolicyValue):
        save_role(module, tokenizer, parent, name, state_dict=state)
        return
    policy_state = _part(state, "policy.") if state is not None else None
    save_role(module.policy, tokenizer, parent, name, state_dict=policy_state)
    head = _part(state, "value_head.") if state is not None else module.value_head.state_dict()
    folder = Path(parent) / VALUE_HEAD_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in head.items()}, folder / "model.safetensors"
    )
    about = {
        "hidden_size": int(head["weight"].shape[-1]),
        "reads": "the actor's final hidden state (the input of its LM head)",
        "value": "weight @ h + bias",
    }
    (folder / "config.json").write_text(json.dumps(about, indent=2) + "\n")


def _head_weights(parent: Path) -> dict[str, torch.Tensor]:
    file = Path(parent) / VALUE_HEAD_FOLDER / "model.safetensors"
    if not file.is_file():
        raise FileNotFoundError(
            f"{file} is missing: this checkpoint holds no value head of a shared-backbone "
            "critic. Resume with the critic.shared_backbone setting it was written with."
        )
    return load_file(file)


def read_module(module: nn.Module, parent: Path, name: str) -> dict[str, torch.Tensor]:
    """The whole state dict `save_module` wrote for `module`, read from `parent` (every rank
    reads it under FSDP2 and keeps its shard)."""
    weights = read_role_weights(parent, name)
    if not isinstance(module, PolicyValue):
        return weights
    out = {f"policy.{k}": v for k, v in weights.items()}
    out.update({f"value_head.{k}": v for k, v in _head_weights(parent).items()})
    return out


def load_module(module: nn.Module, parent: Path, name: str) -> None:
    """`save_module`'s weights back into `module`, in place (its optimizer keeps them)."""
    if not isinstance(module, PolicyValue):
        load_role(module, parent, name)
        return
    load_role(module.policy, parent, name)
    file = Path(parent) / VALUE_HEAD_FOLDER / "model.safetensors"
    weights = _head_weights(parent)
    try:
        module.value_head.load_state_dict(weights)
    except RuntimeError as err:
        raise ValueError(
            f"the value head in {file} does not fit this run's actor: {err}. Resume with the "
            "model the checkpoint was written with."
        ) from err
