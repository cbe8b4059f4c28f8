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
(https://github.com/volcengine/verl/blob/main/verl/trainer/ppo/core_algos.py), one estimator
per name of verl's ``AdvantageEstimator``. They have no value function; as in verl their
``returns`` equal their ``advantages``, except reinforce_plus_plus, whose returns are the
discounted returns before whitening, and remax and the optimal token baselines, whose returns
are the returns-to-go. One estimator is proxima's own: ``distill`` (on-policy
distillation, ``algos.distill``: the teacher's per-token log-ratio, no outcome; verl has no
estimator of that name, its distillation is an option of the actor's loss).

Some estimators read more than the shared inputs: the extra per-batch inputs of
``EXTRA_INPUTS`` (a greedy response's score for remax, the rollout policy's log-probs and
sum of squared probabilities for the optimal token baseline, ...). ``Estimator.needs`` names
those an estimator cannot do without (a missing one is a ValueError naming it),
``Estimator.inputs`` all those it reads (the optional ones too).

Group statistics use ``group_ids`` [B], the prompt id of each row; rows of a group need not
be adjacent. Every row is a member of its group, a row with no real token too, with outcome
0 (what lies outside the mask is ignored): verl sums each row over all its positions and
counts every row of a prompt, so its groups are the same. A group with a single member
(rollout.n = 1) has no baseline to compare against; as in verl, its mean is taken as 0 and
its std as 1, so its advantage is its raw outcome (REINFORCE without a baseline; grpo
divides it by 1 + eps). That is rarely intended with a group estimator, so it warns
(``SingletonGroupWarning``, shown once per calling line under Python's default warning
filter). Values on masked positions are 0 in every output, where verl leaves some nonzero
(returns-to-go on holes, GAE's carried advantage): the losses never read them.
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ._checks import check_same_shape, select
from .distill import teacher_advantages
from .masked import masked_whiten

# Added to the group std in grpo (verl's epsilon) so identical outcomes do not divide by 0.
GRPO_EPS = 1e-6


# The extra per-batch inputs an estimator may read besides token_rewards, response_mask,
# values, gamma and group_ids, with what each holds; ``compute_advantages`` takes each as a
# keyword (None by default) and a trainer supplies those ``Estimator.inputs`` names.
EXTRA_INPUTS: dict[str, str] = {
    "reward_baselines": "[B] score of a greedy response to the same prompt (ReMax)",
    "old_logprobs": "[B, T] log-probs of the sampled tokens under the rollout policy",
    "sum_pi_squared": (
        "[B, T] sum over the vocabulary of pi^2 at each response position, rollout policy"
    ),
    "is_weights": "[B, T] rollout importance weights",
    "score_components": "[B, K] per-response reward components (K columns)",
    "teacher_logprobs": "[B, T] log-probs of the sampled tokens under a frozen teacher",
}


@dataclass(frozen=True)
class Estimator:
    """An entry of ``ADVANTAGE_ESTIMATORS``: calling it calls ``fn``. ``critic``: it needs
    values V(s_t) from a critic; ``options``: its own keyword options (config field names
    of the ``algorithm`` section); ``needs``: the ``EXTRA_INPUTS`` it cannot run without."""

    name: str
    fn: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    critic: bool = False
    options: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()

    @property
    def inputs(self) -> tuple[str, ...]:
        """Every ``EXTRA_INPUTS`` name it reads: ``needs`` and the optional ones (e.g.
        is_weights for optimal_token_baseline, score_components for gdpo)."""
        accepted = inspect.signature(self.fn).parameters
        return tuple(name for name in EXTRA_INPUTS if name in accepted)

    def __call__(self, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fn(*args, **kwargs)


ADVANTAGE_ESTIMATORS: dict[str, Estimator] = {}


def register_advantage(
    name: str,
    *,
    critic: bool = False,
    options: tuple[str, ...] = (),
    needs: tuple[str, ...] = (),
):
    """Decorator: add ``fn`` to ``ADVANTAGE_ESTIMATORS`` under ``name`` (verl's
    ``algorithm.adv_estimator`` names). ``needs``: the ``EXTRA_INPUTS`` it requires, each a
    keyword parameter of ``fn``."""

    def register(fn):
        accepted = inspect.signature(fn).parameters
        wrong = [n for n in needs if n not in EXTRA_INPUTS or n not in accepted]
        if wrong:
            raise ValueError(
                f"register_advantage({name!r}): needs {wrong} must be among "
                f"{list(EXTRA_INPUTS)} and parameters of the function"
            )
        ADVANTAGE_ESTIMATORS[name] = Estimator(name, fn, critic, tuple(options), tuple(needs))
        return fn

    return register


def _require(where: str, **inputs: torch.Tensor | None) -> None:
    """Raise ValueError naming the first extra input that is None."""
    for name, value in inputs.items():
        if value is None:
            raise ValueError(
                f"{where}: needs {name}, {EXTRA_INPUTS[name]}; pass {name}=... "
                f"(ADVANTAGE_ESTIMATORS[{where!r}].needs lists the inputs it requires)"
            )


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


@register_advantage("gae", critic=True, options=("lam", "whiten_advantages", "whiten_shift_mean"))
def gae(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 0.95,
    whiten_advantages: bool = False,
    whiten_shift_mean: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``compute_gae``, the advantages whitened over the batch (``masked_whiten``) when
    ``whiten_advantages``: the actor's step then does not depend on the reward's scale;
    with ``whiten_shift_mean=False`` only the scale changes (the batch's mean advantage is
    kept, TRL's ``shift_mean=False``). The returns, the critic's targets, are never
    whitened. Returns (advantages, returns) [B, T]."""
    if values is None:
        free = [n for n, e in ADVANTAGE_ESTIMATORS.items() if not e.critic]
        raise ValueError(
            "compute_advantages: 'gae' needs values from a critic; pass values=..., or use a "
            f"critic-free estimator: {', '.join(free)}"
        )
    advantages, returns = compute_gae(token_rewards, values, response_mask, gamma, lam)
    if whiten_advantages:
        advantages = masked_whiten(advantages, response_mask, shift_mean=whiten_shift_mean)
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


def _group_index(group_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(group [B] in 0..G-1, G) from arbitrary prompt ids [B]."""
    _, group = torch.unique(group_ids, return_inverse=True)
    return group, int(group.max()) + 1 if group.numel() else 0


def _group_sum(values: torch.Tensor, group: torch.Tensor, n_groups: int) -> torch.Tensor:
    """Sum of values [B, ...] over the rows of each group: [G, ...]."""
    out = values.new_zeros((n_groups, *values.shape[1:]))
    return out.index_add_(0, group, values)


def _group_stats(outcome: torch.Tensor, group_ids: torch.Tensor):
    """Per-row (group mean, group unbiased std, group size) over all rows, [B] each.

    Groups with fewer than two members get mean 0 and std 1, as verl's
    ``compute_grpo_outcome_advantage`` does for a group of one
    (https://github.com/volcengine/verl/blob/main/verl/trainer/ppo/core_algos.py).
    """
    group, n_groups = _group_index(group_ids)
    size = _group_sum(torch.ones_like(outcome), group, n_groups)
    mean = _group_sum(outcome, group, n_groups) / size.clamp(min=1)
    ssd = _group_sum((outcome - mean[group]) ** 2, group, n_groups)
    std = (ssd / (size - 1).clamp(min=1)).sqrt()
    several = size > 1
    mean = torch.where(several, mean, 0.0)
    std = torch.where(several, std, 1.0)
    return mean[group], std[group], size[group]


_RAW_OUTCOME = (
    "their advantage is the raw outcome with no group baseline (as in verl: mean 0, std 1 "
    "for a group of one)"
)


def _warn_singletons(
    where: str, size: torch.Tensor, has_tokens: torch.Tensor, result: str = _RAW_OUTCOME
) -> None:
    """Warn when a row with real tokens is alone in its group (size, has_tokens: [B])."""
    if bool((has_tokens & (size == 1)).any()):
        warnings.warn(
            f"{where}: some groups hold a single response, so {result}; sample several "
            "responses per prompt (rollout.n > 1) for a group baseline",
            SingletonGroupWarning,
            stacklevel=4,  # past this helper, the estimator and its torch.no_grad wrapper
        )


def _check_group_ids(where: str, group_ids: torch.Tensor | None, shape: torch.Size) -> None:
    if group_ids is None:
        raise ValueError(
            f"{where}: needs group_ids, the prompt id of each row ([B] integer tensor); "
            "sample several responses per prompt (rollout.n > 1) and pass their prompt ids"
        )
    if group_ids.shape != shape[:1]:
        raise ValueError(
            f"{where}: shape mismatch: group_ids {list(group_ids.shape)} vs token_rewards "
            f"{list(shape)}; group_ids must be one prompt id per row, shape [B]"
        )


def _outcome_and_groups(token_rewards, response_mask, group_ids, where):
    """Sequence outcomes [B] (sum of token rewards over real tokens), the real-token mask
    [B, T], which rows have a real token [B]; checks group_ids."""
    rewards, real = _prepare(token_rewards, response_mask, where)
    _check_group_ids(where, group_ids, rewards.shape)
    return rewards.sum(dim=-1), real, real.any(dim=-1)


def _broadcast(per_row: torch.Tensor, real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Put one value per row [B] on every real token [B, T]; returns (advantages, returns)."""
    advantages = select(per_row.unsqueeze(-1).expand(real.shape), real)
    return advantages, advantages.clone()


def _per_row(where: str, name: str, x: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A [B] float32 input, checked against token_rewards' shape."""
    if x.shape != shape[:1]:
        raise ValueError(
            f"{where}: shape mismatch: {name} {list(x.shape)} vs token_rewards "
            f"{list(shape)}; {name} must be one value per row, shape [B]"
        )
    return x.detach().float()


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
    subtraction (Dr. GRPO, arXiv:2503.20783). Same value on every real token of a row; a
    group of one gets outcome / (1 + eps) (mean 0, std 1, as in verl). Also registered as
    ``grpo_vectorized``, verl's vectorised implementation of the same values. Returns
    (advantages, returns=advantages), [B, T].
    """
    outcome, real, has_tokens = _outcome_and_groups(token_rewards, response_mask, group_ids, "grpo")
    mean, std, size = _group_stats(outcome, group_ids)
    _warn_singletons("grpo", size, has_tokens)
    advantage = outcome - mean
    if norm_adv_by_std_in_grpo:
        advantage = advantage / (std + eps)
    return _broadcast(advantage, real)


# verl's grpo_vectorized computes grpo's values (group_mean_std with eps 0, the same
# singleton rule); tests/algos/test_verl_estimators.py checks it against both.
register_advantage("grpo_vectorized", options=("norm_adv_by_std_in_grpo",))(grpo)


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
    its raw outcome (as verl's ``compute_rloo_outcome_advantage``; ``rloo_vectorized``
    gives it 0). Returns (advantages, returns=advantages), [B, T].
    """
    outcome, real, has_tokens = _outcome_and_groups(token_rewards, response_mask, group_ids, "rloo")
    mean, _, size = _group_stats(outcome, group_ids)
    _warn_singletons("rloo", size, has_tokens)
    # A group of one has mean 0 (see _group_stats) and scale 1: A = outcome.
    scale = torch.where(size > 1, size / (size - 1).clamp(min=1), 1.0)
    return _broadcast(scale * (outcome - mean), real)


@register_advantage("rloo_vectorized")
@torch.no_grad()
def rloo_vectorized(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RLOO as verl's ``compute_rloo_vectorized_outcome_advantage`` computes it: ``rloo``'s
    A_i = outcome_i - mean of the other members, except that a group of one gets 0 (verl
    multiplies by [n > 1]) where ``rloo`` gives the raw outcome: no baseline, no update.
    Returns (advantages, returns=advantages), [B, T].
    """
    outcome, real, has_tokens = _outcome_and_groups(
        token_rewards, response_mask, group_ids, "rloo_vectorized"
    )
    mean, _, size = _group_stats(outcome, group_ids)
    _warn_singletons("rloo_vectorized", size, has_tokens, "their advantage is 0 (as in verl)")
    scale = torch.where(size > 1, size / (size - 1).clamp(min=1), 0.0)
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
    """REINFORCE++ with a group baseline (arXiv:2501.03262): outcome - group mean on every
    real token, whitened over the batch.

    A group of one has mean 0 (as in verl), so its raw outcome enters the whitening. Returns
    (advantages, returns=advantages), [B, T].
    """
    where = "reinforce_plus_plus_baseline"
    outcome, real, has_tokens = _outcome_and_groups(token_rewards, response_mask, group_ids, where)
    mean, _, size = _group_stats(outcome, group_ids)
    _warn_singletons(where, size, has_tokens)
    centred, _ = _broadcast(outcome - mean, real)
    advantages = masked_whiten(centred, real)
    return advantages, advantages.clone()


@register_advantage("remax", needs=("reward_baselines",))
@torch.no_grad()
def remax(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    reward_baselines: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """ReMax (Li et al. 2023, arXiv:2310.10505): REINFORCE with the reward of the greedy
    response as baseline.

    A_t = G_t - b, G_t = sum of the rewards of the real tokens from t on (undiscounted:
    verl's ``compute_remax_outcome_advantage`` reads no gamma, nor does this), b =
    ``reward_baselines`` [B], the score of a greedy (argmax-decoded) response to the same
    prompt, which the trainer generates and scores. With the score on the last token,
    A = score - greedy score on every token. Returns (advantages, returns=G), [B, T].
    """
    rewards, real = _prepare(token_rewards, response_mask, "remax")
    _require("remax", reward_baselines=reward_baselines)
    baseline = _per_row("remax", "reward_baselines", reward_baselines, rewards.shape)
    returns = rewards.flip(-1).cumsum(-1).flip(-1)
    advantages = select(returns - baseline.unsqueeze(-1), real)
    return advantages, select(returns, real)


@register_advantage("opo")
@torch.no_grad()
def opo(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """OPO, On-Policy RL with Optimal reward baseline (Hao et al. 2025, arXiv:2505.23585):
    outcome minus the length-weighted group mean.

    A_i = outcome_i - b, b = sum_j L_j outcome_j / sum_j L_j over the group, L_j the number
    of real tokens of row j (the paper's optimal baseline, with the squared gradient norm
    taken proportional to the length). A group of one has b = 0 (verl); a group whose rows
    are all empty has b = 0 here, where verl divides 0 by 0 (its NaN only lands on masked
    positions). Same value on every real token. Returns (advantages, returns=advantages).
    """
    outcome, real, has_tokens = _outcome_and_groups(token_rewards, response_mask, group_ids, "opo")
    group, n_groups = _group_index(group_ids)
    length = real.sum(dim=-1).to(outcome.dtype)
    size = _group_sum(torch.ones_like(outcome), group, n_groups)
    weighted = _group_sum(length * outcome, group, n_groups)
    total_length = _group_sum(length, group, n_groups)
    baseline = torch.where(
        (size > 1) & (total_length > 0), weighted / total_length.clamp(min=1), 0.0
    )
    _warn_singletons("opo", size[group], has_tokens)
    return _broadcast(outcome - baseline[group], real)


@register_advantage("grpo_passk", options=("norm_adv_by_std_in_grpo",))
@torch.no_grad()
def grpo_passk(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor | None = None,
    norm_adv_by_std_in_grpo: bool = True,
    eps: float = GRPO_EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pass@k GRPO, the leave-one-out advantage of the max of the group (Tang et al. 2025,
    arXiv:2503.19595, as verl's ``compute_grpo_passk_outcome_advantage`` cites it).

    Only the best response of each group gets an advantage: r_max - r_second (its outcome
    minus the best of the others: the group's max without it), divided by (group std + eps)
    when ``norm_adv_by_std_in_grpo`` (unbiased std over the whole group); every other row
    gets 0. A tie for the max gives r_max - r_second = 0, so the whole group gets 0. Needs
    at least two responses per prompt: a group of one is a ValueError (as in verl). Same
    value on every real token. Returns (advantages, returns=advantages), [B, T].
    """
    outcome, real, _ = _outcome_and_groups(token_rewards, response_mask, group_ids, "grpo_passk")
    group, n_groups = _group_index(group_ids)
    size = _group_sum(torch.ones_like(outcome), group, n_groups)
    if bool((size < 2).any()):
        alone = torch.unique(group_ids[(size < 2)[group]]).tolist()
        raise ValueError(
            "grpo_passk: needs at least 2 responses per prompt (rollout.n >= 2); the groups "
            f"{alone[:10]} hold one"
        )
    lowest = torch.full((n_groups,), -torch.inf, dtype=outcome.dtype, device=outcome.device)
    best = lowest.scatter_reduce(0, group, outcome, "amax")
    at_best = outcome == best[group]
    n_best = _group_sum(at_best.to(outcome.dtype), group, n_groups)
    below = torch.where(at_best, -torch.inf, outcome)
    second = torch.where(n_best > 1, best, lowest.scatter_reduce(0, group, below, "amax"))
    gap = best - second
    if norm_adv_by_std_in_grpo:
        _, std, _ = _group_stats(outcome, group_ids)
        gap = gap[group] / (std + eps)
    else:
        gap = gap[group]
    return _broadcast(torch.where(at_best & (n_best[group] == 1), gap, 0.0), real)


@register_advantage("gpg")
@torch.no_grad()
def gpg(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GPG, Group Policy Gradient (Chu et al. 2025, arXiv:2504.02546): alpha (outcome - group
    mean) / F_norm, no division by the std.

    As verl's ``compute_gpg_outcome_advantage``: alpha = B / M with B the number of rows of
    the batch and M the number of rows whose outcome is nonzero (at least 1); F_norm = 1
    (verl's trainer never sets its f_norm, and its alpha argument is overwritten, so
    neither is an option here). The paper's correction counts as valid the samples of groups
    whose rewards are not all equal; verl counts nonzero outcomes instead, and so does this,
    for parity. A group of one has mean 0 (verl). Same value on every real token. Returns
    (advantages, returns=advantages), [B, T]; use with the ``gpg`` policy loss.
    """
    outcome, real, has_tokens = _outcome_and_groups(token_rewards, response_mask, group_ids, "gpg")
    mean, _, size = _group_stats(outcome, group_ids)
    _warn_singletons("gpg", size, has_tokens)
    alpha = outcome.shape[0] / max(int(torch.count_nonzero(outcome)), 1)
    return _broadcast(alpha * (outcome - mean), real)


@register_advantage("gdpo", options=("norm_adv_by_std_in_grpo", "gdpo_reward_weights"))
@torch.no_grad()
def gdpo(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor | None = None,
    score_components: torch.Tensor | None = None,
    norm_adv_by_std_in_grpo: bool = True,
    gdpo_reward_weights: Sequence[float] = (),
    eps: float = GRPO_EPS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDPO, Group reward-Decoupled normalisation Policy Optimization (arXiv:2601.05242):
    each reward component normalised in its group on its own, then summed, then whitened.

    A_k = (c_k - group mean of c_k) / (group std of c_k + eps) for each column k of
    ``score_components`` [B, K] (grpo per component, mean 0 and std 1 for a group of one;
    no division when ``norm_adv_by_std_in_grpo`` is False); A = sum_k w_k A_k with
    ``gdpo_reward_weights`` (empty = all 1, else one weight per column), put on every real
    token and whitened over the batch's real tokens (``masked_whiten``). Without
    score_components the outcome (summed token rewards) is the single component, as in
    verl. A row with no real token has 0 in every component (its outcome is 0 in every
    estimator); verl reads the component it placed outside that row's mask. Returns
    (advantages, returns=advantages), [B, T].
    """
    outcome, real, has_tokens = _outcome_and_groups(token_rewards, response_mask, group_ids, "gdpo")
    if score_components is None:
        components = outcome.unsqueeze(-1)
    else:
        shape = score_components.shape
        if score_components.dim() != 2 or shape[0] != outcome.shape[0] or shape[1] == 0:
            raise ValueError(
                f"gdpo: shape mismatch: score_components {list(score_components.shape)} vs "
                f"token_rewards {list(token_rewards.shape)}; score_components must be "
                "[B, K], one column per reward component (K >= 1)"
            )
        components = select(score_components.detach().float(), has_tokens.unsqueeze(-1))
    n_components = components.shape[1]
    if len(gdpo_reward_weights) == 0:
        weights = [1.0] * n_components
    elif len(gdpo_reward_weights) == n_components:
        weights = [float(w) for w in gdpo_reward_weights]
    else:
        raise ValueError(
            f"gdpo: gdpo_reward_weights has {len(gdpo_reward_weights)} weights for "
            f"{n_components} reward components; give one per column of score_components "
            "(or none for equal weights)"
        )
    total = torch.zeros_like(outcome)
    for k, weight in enumerate(weights):
        mean, std, size = _group_stats(components[:, k], group_ids)
        normalised = components[:, k] - mean
        if norm_adv_by_std_in_grpo:
            normalised = normalised / (std + eps)
        total = total + weight * normalised
    _warn_singletons("gdpo", size, has_tokens)
    centred, _ = _broadcast(total, real)
    advantages = masked_whiten(centred, real)
    return advantages, advantages.clone()


def _token_inputs(where, token_rewards, response_mask, old_logprobs, sum_pi_squared, is_weights):
    """Returns-to-go G [B, T] and cumulative path variance W [B, T] (float32, 0 off the
    mask) of the optimal token baseline, and the real-token mask."""
    rewards, real = _prepare(token_rewards, response_mask, where)
    _require(where, old_logprobs=old_logprobs, sum_pi_squared=sum_pi_squared)
    per_token = {"old_logprobs": old_logprobs, "sum_pi_squared": sum_pi_squared}
    if is_weights is not None:
        per_token["is_weights"] = is_weights
    check_same_shape(where, token_rewards=token_rewards, **per_token)
    logprobs = select(old_logprobs.detach().float(), real)
    pi_squared = select(sum_pi_squared.detach().float(), real)
    # w_t = 1 - 2 pi_t + sum_v pi_v^2 = ||e_{y_t} - pi||^2, verl's order of operations.
    w = 1 - 2 * torch.exp(logprobs) + pi_squared
    if is_weights is not None:
        w = w * select(is_weights.detach().float(), real) ** 2
    cumulative = select(w, real).cumsum(dim=-1)
    returns = rewards.flip(-1).cumsum(-1).flip(-1)
    return select(returns, real), select(cumulative, real), real


def _token_baseline(returns, cumulative, counts, group_ids, member, handle_zero_tail, eps):
    """B_t = sum_i G_it W_it / (sum_i W_it + eps) over the members of each group, per
    position t ([B, L] inputs, 0 where ``counts`` [B, L] is False); 0 for a group of one
    member and rows that are not members. ``handle_zero_tail``: the longest member, when it
    is the only one that long, gets 0 from the second longest member's length on."""
    group, n_groups = _group_index(group_ids)
    size = _group_sum(member.to(returns.dtype), group, n_groups)
    weight = torch.where(counts & member.unsqueeze(-1), cumulative, 0.0)
    numerator = _group_sum(returns * weight, group, n_groups)
    denominator = _group_sum(weight, group, n_groups) + eps
    baseline = (numerator / denominator)[group]
    has_baseline = member & (size[group] > 1)
    baseline = torch.where(has_baseline.unsqueeze(-1), baseline, 0.0)
    if handle_zero_tail:
        length = torch.where(member, counts.sum(dim=-1), -1)
        none = torch.full((n_groups,), -1, dtype=length.dtype, device=length.device)
        longest = none.scatter_reduce(0, group, length, "amax")
        is_longest = member & (length == longest[group])
        n_longest = _group_sum(is_longest.long(), group, n_groups)
        second = none.scatter_reduce(0, group, torch.where(is_longest, -1, length), "amax")
        tail_row = has_baseline & is_longest & (n_longest[group] == 1)
        position = torch.arange(returns.shape[-1], device=returns.device)
        tail = tail_row.unsqueeze(-1) & (position >= second[group].unsqueeze(-1))
        baseline = torch.where(tail, 0.0, baseline)
    return baseline


_NO_TOKEN_BASELINE = "their advantage is the return-to-go with no baseline (as in verl)"


@register_advantage(
    "optimal_token_baseline",
    options=("handle_zero_tail",),
    needs=("old_logprobs", "sum_pi_squared"),
)
@torch.no_grad()
def optimal_token_baseline(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Optimal Token Baseline (Li et al. 2026, arXiv:2602.07078): a baseline per position,
    the group's returns-to-go weighted by each response's cumulative gradient-norm proxy.

    G_t: return-to-go (sum of the real tokens' rewards from t on, undiscounted as in verl's
    ``compute_optimal_token_baseline_advantage``); w_t = 1 - 2 pi_t + sum_v pi_v^2 (the
    logit-gradient proxy ||e_{y_t} - pi||^2, pi_t = exp(old_logprobs), sum_pi_squared from
    the rollout policy), times ``is_weights``^2 when given; W_t = sum of w over the real
    tokens up to t. B_t = sum_i G_it W_it / (sum_i W_it + 1e-8) over the rows of the group
    that are real at position t (column t of the [B, T] batch), A_t = G_t - B_t. Every row
    is a group member (an empty one adds nothing to the sums, but counts in the size and
    lengths, as in verl); a group of one has no baseline: A = G. ``handle_zero_tail``
    (verl's default, True): the group's longest response, if no other is as long, gets no
    baseline from the second longest's length on (where it alone has tokens). Returns
    (advantages, returns=G), [B, T].
    """
    where = "optimal_token_baseline"
    returns, cumulative, real = _token_inputs(
        where, token_rewards, response_mask, old_logprobs, sum_pi_squared, is_weights
    )
    _check_group_ids(where, group_ids, returns.shape)
    member = torch.ones(real.shape[0], dtype=torch.bool, device=real.device)
    baseline = _token_baseline(returns, cumulative, real, group_ids, member, handle_zero_tail, eps)
    group, n_groups = _group_index(group_ids)
    size = _group_sum(member.long(), group, n_groups)[group]
    _warn_singletons(where, size, real.any(dim=-1), _NO_TOKEN_BASELINE)
    return select(returns - baseline, real), returns


@register_advantage(
    "tir_optimal_token_baseline",
    options=("handle_zero_tail",),
    needs=("old_logprobs", "sum_pi_squared"),
)
@torch.no_grad()
def tir_optimal_token_baseline(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    handle_zero_tail: bool = True,
    eps: float = 1e-8,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``optimal_token_baseline`` for multi-turn (tool-integrated) responses, as verl's
    ``compute_multi_turn_optimal_token_baseline_advantage`` (arXiv:2602.07078).

    The same G, W and B = sum_i G W / (sum_i W + 1e-8), but position t is the t-th real
    token of each response, not column t: the holes of the mask (tool outputs, observation
    tokens) are skipped before responses are aligned, and ``handle_zero_tail`` counts in
    real tokens. Rows with no real token are no group members here (verl); a group of one
    member has no baseline. Without holes and empty rows it equals optimal_token_baseline.
    Returns (advantages, returns=G), [B, T].
    """
    where = "tir_optimal_token_baseline"
    returns, cumulative, real = _token_inputs(
        where, token_rewards, response_mask, old_logprobs, sum_pi_squared, is_weights
    )
    _check_group_ids(where, group_ids, returns.shape)
    batch, width = real.shape
    # The t-th real token of a row goes to column t; the others to a spare last column.
    rank = torch.where(real, real.long().cumsum(dim=-1) - 1, width)
    packed_returns, packed_cumulative = (
        x.new_zeros(batch, width + 1).scatter_(1, rank, x)[:, :width] for x in (returns, cumulative)
    )
    length = real.sum(dim=-1)
    packed = torch.arange(width, device=real.device) < length.unsqueeze(-1)
    member = length > 0
    baseline = _token_baseline(
        packed_returns, packed_cumulative, packed, group_ids, member, handle_zero_tail, eps
    )
    packed_advantages = torch.cat([packed_returns - baseline, baseline.new_zeros(batch, 1)], dim=-1)
    advantages = select(packed_advantages.gather(1, rank), real)
    group, n_groups = _group_index(group_ids)
    members = _group_sum(member.long(), group, n_groups)[group]
    _warn_singletons(where, members, member, _NO_TOKEN_BASELINE)
    return advantages, returns


@register_advantage(
    "distill",
    options=("distill_coef", "distill_clip"),
    needs=("old_logprobs", "teacher_logprobs"),
)
@torch.no_grad()
def distill(
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    old_logprobs: torch.Tensor | None = None,
    teacher_logprobs: torch.Tensor | None = None,
    distill_coef: float = 1.0,
    distill_clip: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """On-policy distillation alone: advantages = returns = ``algos.teacher_advantages`` of
    the teacher's and the old log-probs (distill_coef x (teacher - old), each log-ratio
    clamped to distill_clip first when > 0). The token rewards (a score, a KL penalty) are
    not read: only their shape is checked."""
    check_same_shape("distill", token_rewards=token_rewards, response_mask=response_mask)
    _require("distill", old_logprobs=old_logprobs, teacher_logprobs=teacher_logprobs)
    adv = teacher_advantages(
        teacher_logprobs, old_logprobs, response_mask, distill_coef, distill_clip
    )
    return adv, adv.clone()


def compute_advantages(
    name: str,
    token_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: torch.Tensor | None = None,
    gamma: float = 1.0,
    group_ids: torch.Tensor | None = None,
    *,
    reward_baselines: torch.Tensor | None = None,
    old_logprobs: torch.Tensor | None = None,
    sum_pi_squared: torch.Tensor | None = None,
    is_weights: torch.Tensor | None = None,
    score_components: torch.Tensor | None = None,
    teacher_logprobs: torch.Tensor | None = None,
    **options,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The estimator ``name`` of ``ADVANTAGE_ESTIMATORS`` on these inputs.

    values, gamma, group_ids and the ``EXTRA_INPUTS`` (reward_baselines, old_logprobs,
    sum_pi_squared, is_weights, score_components, teacher_logprobs) are passed to the
    estimators that take them (values only matter for gae); one of the estimator's ``needs``
    left None is a ValueError naming it. ``options`` are the estimator's own (e.g. ``lam`` for gae,
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
    extra = {
        "reward_baselines": reward_baselines,
        "old_logprobs": old_logprobs,
        "sum_pi_squared": sum_pi_squared,
        "is_weights": is_weights,
        "score_components": score_components,
        "teacher_logprobs": teacher_logprobs,
    }
    for need in estimator.needs:
        if extra[need] is None:
            raise ValueError(
                f"compute_advantages: estimator {name!r} needs {need}, {EXTRA_INPUTS[need]}; "
                f"pass {need}=... (Estimator.needs: {list(estimator.needs)})"
            )
    accepted = inspect.signature(estimator.fn).parameters
    shared = {"values": values, "gamma": gamma, "group_ids": group_ids, **extra}
    kwargs = {key: value for key, value in shared.items() if key in accepted}
    return estimator(token_rewards, response_mask, **kwargs, **options)
