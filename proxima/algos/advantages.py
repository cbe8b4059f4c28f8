"""Advantages and returns: GAE (with a critic) and the critic-free estimators.

All functions take per-token rewards [B, T] (from ``token_rewards``) and a response_mask
[B, T]; they return (advantages [B, T], returns [B, T]) in float32, zero where the mask is 0,
and are computed without gradients (inputs are detached).

Every estimator is in one registry, ``ADVANTAGE_ESTIMATORS`` (GAE too), each entry called as
``fn(token_rewards, response_mask, **inputs, **options)``: the shared inputs it takes
(``values``, ``group_ids``, ``gamma``) and its own options, named as the ``algorithm.*``
config fields that set them (so a trainer passes them by name and never asks which
estimator it runs). ``compute_advantages`` dispatches by name.

The critic-free estimators score a sequence by its outcome, the sum
of its token rewards over real tokens, and follow verl 0.9.1's ``core_algos.py``
(https://github.com/volcengine/verl/blob/main/verl/trainer/ppo/core_algos.py). They have no
value function; as in verl their ``returns`` equal their ``advantages``, except
reinforce_plus_plus, whose returns are the discounted returns before whitening.
Group statistics (grpo, rloo, reinforce_plus_plus_baseline) use ``group_ids`` [B], the
prompt id of each row; rows of a group need not be adjacent. Only rows with at least one
real token count as group members. A group with a single member (rollout.n = 1) has no
baseline to compare against; as in verl, its mean is taken as 0 and its std as 1, so its
advantage is its raw outcome (REINFORCE without a baseline; grpo divides it by 1 + eps).
That is rarely intended with a group estimator, so it warns (``SingletonGroupWarning``,
shown once per calling line under Python's default warning filter).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ._checks import check_same_shape, select
from .masked import masked_whiten

# Added to the group std in grpo (verl's epsilon) so identical outcomes do not divide by 0.
GRPO_EPS = 1e-6


@dataclass(frozen=True)
class Estimator:
    """An entry of ``ADVANTAGE_ESTIMATORS``: calling it calls ``fn``. ``critic``: it needs
    values V(s_t) from a critic; ``options``: its own keyword options (config field names
    of the ``algorithm`` section)."""

    name: str
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    critic: bool = False
    options: tuple[str, ...] = ()

    def __call__(self, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fn(*args, **kwargs)


ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {}


def register_advantage(name: str, *, critic: bool = False, options: tuple[str, ...] = ()):
    """Decorator: add ``fn`` to ``ADVANTAGE_ESTIMATORS`` under ``name`` (verl's
    ``algorithm.adv_estimator`` names)."""

    def register(fn):
        ADVANTAGE_ESTIMATORS[name] = Estimator(name, fn, critic, options)
        return fn

    return register


class SingletonGroupWarning(UserWarning):
    """A group estimator met groups of one response: their advantage is the raw outcome."""


def _prepare(token_rewards: torch.Tensor, response_mask: torch.Tensor, where: str):
    check_same_shape(where, token_rewards=token_rewards, response_mask=response_mask)
    real = response_mask.detach() != 0
    return select(token_rewards.detach().float(), real), real


@torch.no_grad()
def compute_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation (Schulman et al. 2016, arXiv:1506.02438).

    Backward over real tokens: delta_t = r_t + gamma V_{t+1} - V_t and
    A_t = delta_t + gamma lam A_{t+1}, with V and A after the last real token equal to 0.
    Masked positions are skipped: their rewards and values are ignored, the "next value" of
    the last real token before a hole is the value of the next real token after it, and the
    running advantage carries across the hole unchanged. returns = advantages + values.

    token_rewards, values, response_mask: [B, T]. Returns (advantages, returns), [B, T]
    float32, zero where the mask is 0. No whitening here (see ``masked_whiten``).
    """
    rewards, real = _prepare(token_rewards, response_mask, "compute_gae")
    check_same_shape("compute_gae", token_rewards=token_rewards, values=values)
    values = select(values.detach().float(), real)
    advantages = torch.zeros_like(rewards)
    next_value = rewards.new_zeros(rewards.shape[0])
    running = rewards.new_zeros(rewards.shape[0])
    # T is the response length (small): loop over it, vectorised over the batch.
    for t in reversed(range(rewards.shape[-1])):
        here = real[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * running
        advantages[:, t] = torch.where(here, advantage, 0.0)
        next_value = torch.where(here, values[:, t], next_value)
        running = torch.where(here, advantage, running)
    returns = select(advantages + values, real)
    return advantages, returns


@register_advantage("gae", critic=True, options=("lam", "whiten_advantages"))
def gae(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 0.95,
    whiten_advantages: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``compute_gae``, the advantages whitened over the batch (``masked_whiten``) when
    ``whiten_advantages``: the actor's step then does not depend on the reward's scale. The
    returns, the critic's targets, are never whitened. Returns (advantages, returns) [B, T]."""
    if values is None:
        free = [n for n, e in ADVANTAGE_ESTIMATORS.items() if not e.critic]
        raise ValueError(
            "compute_advantages: 'gae' needs values from a critic; pass values=..., or use a "
            f"critic-free estimator: {', '.join(free)}"
        )
    advantages, returns = compute_gae(token_rewards, values, response_mask, gamma, lam)
    if whiten_advantages:
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


@torch.no_grad()
def discounted_returns(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> torch.Tensor:
    """Return-to-go G_t = r_t + gamma G_{t+1} over real tokens (holes skipped); [B, T] float32."""
    rewards, real = _prepare(token_rewards, response_mask, "discounted_returns")
    returns = torch.zeros_like(rewards)
    running = rewards.new_zeros(rewards.shape[0])
    for t in reversed(range(rewards.shape[-1])):
        running = torch.where(real[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(real[:, t], running, 0.0)
    return returns


def _group_stats(outcome: torch.Tensor, group_ids: torch.Tensor, member: torch.Tensor):
    """Per-row (group mean, group unbiased std, group size) over the member rows [B] each.

    Groups with fewer than two members get mean 0 and std 1, as verl's
    ``compute_grpo_outcome_advantage`` does for a group of one
    (https://github.com/volcengine/verl/blob/main/verl/trainer/ppo/core_algos.py).
    """
    _, group = torch.unique(group_ids, return_inverse=True)
    weight = member.to(outcome.dtype)
    n_groups = int(group.max()) + 1 if group.numel() else 0
    size = outcome.new_zeros(n_groups).index_add_(0, group, weight)
    total = outcome.new_zeros(n_groups).index_add_(0, group, outcome * weight)
    mean = total / size.clamp(min=1)
    sq_dev = ((outcome - mean[group]) ** 2) * weight
    ssd = outcome.new_zeros(n_groups).index_add_(0, group, sq_dev)
    std = (ssd / (size - 1).clamp(min=1)).sqrt()
    several = size > 1
    mean = torch.where(several, mean, 0.0)
    std = torch.where(several, std, 1.0)
    return mean[group], std[group], size[group]


def _warn_singletons(where: str, size: torch.Tensor, member: torch.Tensor) -> None:
    """Warn when some member row is alone in its group (size [B], member [B] bool)."""
    if bool((member & (size == 1)).any()):
        warnings.warn(
            f"{where}: some groups hold a single response, so their advantage is the raw "
            "outcome with no group baseline (as in verl: mean 0, std 1 for a group of one); "
            "sample several responses per prompt (rollout.n > 1) for a group baseline",
            SingletonGroupWarning,
            stacklevel=4,  # past this helper, the estimator and its torch.no_grad wrapper
        )


def _outcome_and_groups(token_rewards, response_mask, group_ids, where):
    """Sequence outcomes [B] (sum of token rewards), real-token mask, member rows, checks."""
    rewards, real = _prepare(token_rewards, response_mask, where)
    if group_ids is None:
        raise ValueError(
            f"{where}: needs group_ids, the prompt id of each row ([B] integer tensor); "
            "sample several responses per prompt (rollout.n > 1) and pass their prompt ids"
        )
    if group_ids.shape != rewards.shape[:1]:
        raise ValueError(
            f"{where}: shape mismatch: group_ids {list(group_ids.shape)} vs token_rewards "
            f"{list(rewards.shape)}; group_ids must be one prompt id per row, shape [B]"
        )
    return rewards.sum(dim=-1), real, real.any(dim=-1)


def _broadcast(per_row: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Put one value per row [B] on every real token [B, T]; returns (advantages, returns)."""
    advantages = select(per_row.unsqueeze(-1).expand(real.shape), real)
    return advantages, advantages.clone()


@register_advantage("grpo", options=("norm_adv_by_std_in_grpo",))
@torch.no_grad()
def grpo(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor | None = None,
    norm_adv_by_std_in_grpo: bool = True,
    eps: float = GRPO_EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO (Shao et al. 2024, arXiv:2402.03300): (outcome - group mean) / (group std + eps).

    std is the unbiased group std; ``norm_adv_by_std_in_grpo=False`` keeps only the mean
    subtraction
    (Dr. GRPO, arXiv:2503.20783). Same value on every real token of a row; a group of one
    gets outcome / (1 + eps) (mean 0, std 1, as in verl). Returns
    (advantages, returns=advantages), [B, T].
    """
    outcome, real, member = _outcome_and_groups(token_rewards, response_mask, group_ids, "grpo")
    mean, std, size = _group_stats(outcome, group_ids, member)
    _warn_singletons("grpo", size, member)
    advantage = outcome - mean
    if norm_adv_by_std_in_grpo:
        advantage = advantage / (std + eps)
    return _broadcast(advantage, real)


@register_advantage("rloo")
@torch.no_grad()
def rloo(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE leave-one-out (Ahmadian et al. 2024, arXiv:2402.14740).

    A_i = outcome_i - mean of the other members' outcomes = n / (n - 1) (outcome_i - mean).
    Same value on every real token of a row; a group of one has no other member and gets
    its raw outcome (as verl's ``compute_rloo_outcome_advantage``). Returns
    (advantages, returns=advantages), [B, T].
    """
    outcome, real, member = _outcome_and_groups(token_rewards, response_mask, group_ids, "rloo")
    mean, _, size = _group_stats(outcome, group_ids, member)
    _warn_singletons("rloo", size, member)
    # A group of one has mean 0 (see _group_stats) and scale 1: A = outcome.
    scale = torch.where(size > 1, size / (size - 1).clamp(min=1), 1.0)
    return _broadcast(scale * (outcome - mean), real)


@register_advantage("reinforce_plus_plus")
@torch.no_grad()
def reinforce_plus_plus(
    token_rewards: torch.Tensor, response_mask: torch.Tensor, gamma: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): discounted return-to-go, whitened over the batch.

    G_t = r_t + gamma G_{t+1} over real tokens; advantages = ``masked_whiten`` of G over all
    real tokens. Returns (advantages, returns=G), [B, T]: the returns are the discounted
    returns before whitening, as verl's ``compute_reinforce_plus_plus_outcome_advantage``.
    """
    returns = discounted_returns(token_rewards, response_mask, gamma)
    advantages = masked_whiten(returns, response_mask != 0)
    return advantages, returns


@register_advantage("reinforce_plus_plus_baseline")
@torch.no_grad()
def reinforce_plus_plus_baseline(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ with a group baseline: outcome - group mean on every real token, whitened.

    A group of one has mean 0 (as in verl), so its raw outcome enters the whitening. Returns
    (advantages, returns=advantages), [B, T].
    """
    where = "reinforce_plus_plus_baseline"
    outcome, real, member = _outcome_and_groups(token_rewards, response_mask, group_ids, where)
    mean, _, size = _group_stats(outcome, group_ids, member)
    _warn_singletons(where, size, member)
    centred, _ = _broadcast(outcome - mean, real)
    advantages = masked_whiten(centred, real)
    return advantages, advantages.clone()


def compute_advantages(
    name: str,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    group_ids: torch.Tensor | None = None,
    **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The estimator ``name`` of ``ADVANTAGE_ESTIMATORS`` on these inputs.

    values, gamma and group_ids are passed to the estimators that take them (values only
    matter for gae); ``options`` are the estimator's own (e.g. ``lam`` for gae,
    ``norm_adv_by_std_in_grpo`` for grpo), an option it does not have is an error.
    Returns (advantages, returns), [B, T].
    """
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(
            f"unknown advantage estimator {name!r}; valid names: {', '.join(ADVANTAGE_ESTIMATORS)}"
        )
    estimator = ADVANTAGE_ESTIMATORS[name]
    unknown = set(options) - set(estimator.options)
    if unknown:
        raise ValueError(
            f"compute_advantages: estimator {name!r} got unknown options {sorted(unknown)}; "
            f"it accepts {sorted(estimator.options)}"
        )
    accepted = inspect.signature(estimator.fn).parameters
    shared = {"values": values, "gamma": gamma, "group_ids": group_ids}
    kwargs = {key: value for key, value in shared.items() if key in accepted}
    return estimator(token_rewards, response_mask, **kwargs, **options)
