"""The policy losses, one registry (``POLICY_LOSSES``) under verl 0.9.1's
``actor.policy_loss.loss_mode`` names, every loss one function of one signature:

    fn(log_prob, old_log_prob, advantages, response_mask, agg, options, is_weights)
        -> (0-dim loss, stats)

with the tensors [B, T], ``agg`` the aggregation mode (``masked.aggregate_loss``),
``options`` a ``PolicyLossOptions`` (the clip ratios and the ``actor.policy_loss.*`` fields;
each loss reads only those it needs) and ``is_weights`` [B, T] or None. This is verl's
``register_policy_loss`` with its config
(https://github.com/volcengine/verl/blob/main/verl/trainer/ppo/core_algos.py); the log-probs
come first here, the old ones second.

Formulas: PPO (Schulman et al. 2017, arXiv:1707.06347) as written in DeepSpeed-Chat's
``actor_loss_fn``
(https://github.com/microsoft/DeepSpeedExamples/blob/master/applications/DeepSpeed-Chat/dschat/rlhf/ppo_trainer.py);
the dual clip of Ye et al. 2020 (arXiv:1912.09729), the clamped log-ratio and the stats as
in verl's ``compute_policy_loss_vanilla``; the other losses follow verl's
``compute_policy_loss_<name>`` exactly, which ``tests/algos/test_verl_parity.py`` checks
against verl itself, values and gradients.

Shared conventions:
  - Values on padding never reach the loss or the gradient (selected away, not multiplied by
    0), so NaN or -inf log-probs there are harmless; verl multiplies by the mask.
  - A response_mask with no real token gives loss 0 with a zero gradient, all stats 0 and an
    ``EmptyMaskWarning``; verl gives NaN in token-mean and the seq-mean modes (this is the
    one deliberate difference every loss shares).
  - ``is_weights`` [B, T] (rollout-correction weights, verl's ``rollout_is_weights``) are
    constants multiplying the per-token loss before aggregation, as verl applies them
    (``geo_mean``: their per-row geometric mean multiplies the row's loss, as verl).
  - Stats are detached 0-dim float tensors under proxima's names for verl's metrics:
    ``actor/pg_clipfrac`` -> ``clipfrac``, ``actor/ppo_kl`` -> ``ppo_kl``,
    ``actor/pg_clipfrac_lower`` -> ``clipfrac_lower`` (each docstring says what they count
    for that loss). Metrics verl reports as a constant 0 "for compatibility" are left out.
  - The log-ratio is clamped to [-20, 20] before ``exp`` where verl clamps it (vanilla, sapo,
    cispo, dppo_tv, dppo_kl) and left as is where verl does not (gspo's token ratios,
    clip_cov, kl_cov, geo_mean), so those follow verl also on huge ratios (``exp`` of a
    float32 log-ratio above 88.7 is inf).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ._checks import (
    check_ratio_clips,
    check_same_shape,
    detached_stats,
    select,
    warn_if_empty,
    weighted,
)
from .masked import AGG_MODES, aggregate_loss, masked_max, masked_mean

# The log-ratio is clamped before exp so exp never overflows (verl clamps to [-20, 20]).
LOG_RATIO_BOUND = 20.0
# dppo_tv / dppo_kl: the cap on the truncated importance ratio when clip_ratio_c is None
# (verl's default for dppo when its config has no clip_ratio_c).
DPPO_DEFAULT_CLIP_RATIO_C = 20.0
# gspo: upper bound of the sequence log-ratio before exp (verl's).
GSPO_LOG_RATIO_MAX = 10.0
# dppo_kl: added to 1 - p and 1 - p_old inside the binary KL's log (verl's).
BINARY_KL_EPS = 1e-8
# geo_mean: added to the is_weights before their log (verl's).
GEO_MEAN_IS_EPS = 1e-10

Stats = dict[str, torch.Tensor]


@dataclass(frozen=True)
class PolicyLossOptions:
    """The options of the policy losses, one object for all of them (verl's actor config):
    the clip ratios (``actor.clip_ratio*``) and the ``actor.policy_loss.*`` fields, under
    those names and with their defaults. Each loss reads only the ones it needs; the
    registry entry lists the ``actor.policy_loss.*`` ones it reads (``PolicyLoss.options``).
    """

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = 3.0  # the dual clip's bound (vanilla); None disables it
    clip_cov_ratio: float = 0.0002
    clip_cov_lb: float = 1.0
    clip_cov_ub: float = 5.0
    kl_cov_ratio: float = 0.0002
    ppo_kl_coef: float = 0.1
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    dro_beta: float = 0.0


DEFAULT_OPTIONS = PolicyLossOptions()
PolicyLossFn = Callable[..., tuple[torch.Tensor, Stats]]


@dataclass(frozen=True)
class PolicyLoss:
    """An entry of ``POLICY_LOSSES``: calling it calls ``fn`` (the module's signature).
    ``options``: the ``actor.policy_loss.*`` fields of ``PolicyLossOptions`` it reads (the
    clip ratios aside), so the config can refuse one set for a loss that ignores it."""

    name: str
    fn: PolicyLossFn
    options: tuple[str, ...] = ()

    def __call__(self, *args, **kwargs) -> tuple[torch.Tensor, Stats]:
        return self.fn(*args, **kwargs)


POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str, *, options: tuple[str, ...] = ()):
    """Decorator: add a policy loss (the module's signature) to ``POLICY_LOSSES`` under
    ``name`` (verl's ``actor.policy_loss.loss_mode`` names), reading ``options``."""

    def register(fn):
        POLICY_LOSSES[name] = PolicyLoss(name, fn, options)
        return fn

    return register


@register_policy_loss("vanilla")
def policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    agg: str = "token-mean",
    options: PolicyLossOptions = DEFAULT_OPTIONS,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """Clipped PPO surrogate loss with the dual clip for negative advantages (``vanilla``).

    Per token (PPO, arXiv:1707.06347): r = exp(log_prob - old_log_prob) with the log-ratio
    clamped to [-20, 20], and loss = max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))
    (clip_ratio_high > clip_ratio_low: DAPO's clip-higher). Dual clip (arXiv:1912.09729): where
    A < 0 the loss is further capped at -A * clip_ratio_c (must be > 1; None disables).
    The per-token loss [B, T] is reduced with ``aggregate_loss(..., agg)``. Optional
    ``is_weights`` [B, T] (constants, e.g. ``truncated_is_weights``) multiply the per-token
    loss after clipping, as verl applies its rollout importance weights.

    All of log_prob, old_log_prob, advantages, response_mask are [B, T]. Returns
    (0-dim loss, stats) with detached 0-dim stats: ``clipfrac`` (share of tokens where the
    clipped term is strictly larger), ``clipfrac_lower`` (share where the dual clip binds),
    ``ppo_kl`` = mean(-clamp(new - old, -20, 20)) (the clamped log-ratio the loss uses, as
    verl's ``ppo_kl``), ``approx_kl`` = mean(0.5 (new - old)^2) (unclamped), ``ratio_mean``,
    ``ratio_max`` (means and max over real tokens).

    A response_mask with no real token gives loss 0 (finite, zero gradient, in every ``agg``
    mode; verl gives NaN), all stats 0, and an ``EmptyMaskWarning`` per call.
    """
    check_same_shape(
        "policy_loss",
        log_prob=log_prob,
        old_log_prob=old_log_prob,
        advantages=advantages,
        response_mask=response_mask,
    )
    low, high = options.clip_ratio_low, options.clip_ratio_high
    clip_ratio_c = options.clip_ratio_c
    check_ratio_clips("policy_loss", low, high)
    if clip_ratio_c is not None and not clip_ratio_c > 1:
        raise ValueError(
            f"policy_loss: clip_ratio_c must be > 1 (dual clip lower bound), got "
            f"{clip_ratio_c}; use e.g. 3.0, or None to disable the dual clip"
        )
    mask = response_mask
    warn_if_empty("policy_loss", mask)
    # Padding may hold -inf log-probs; zero it before exp so no NaN reaches the gradients.
    log_ratio = select(log_prob - old_log_prob, mask)
    adv = select(advantages, mask)
    clamped_log_ratio = log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(clamped_log_ratio)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1 - low, 1 + high)
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)
    dual_binds = torch.zeros_like(mask, dtype=torch.bool)
    if clip_ratio_c is not None:
        loss_cap = -adv * clip_ratio_c
        dual_binds = (adv < 0) & (loss_mat > loss_cap)
        loss_mat = torch.where(dual_binds, loss_cap, loss_mat)
    if is_weights is not None:
        check_same_shape("policy_loss", is_weights=is_weights, response_mask=mask)
    loss_mat = weighted(loss_mat, is_weights, mask)
    loss = aggregate_loss(loss_mat, mask, agg)
    stats = detached_stats(
        clipfrac=masked_mean((loss_clipped > loss_unclipped).float(), mask),
        clipfrac_lower=masked_mean(dual_binds.float(), mask),
        ppo_kl=masked_mean(-clamped_log_ratio, mask),
        approx_kl=masked_mean(0.5 * log_ratio.square(), mask),
        ratio_mean=masked_mean(ratio, mask),
        ratio_max=masked_max(ratio, mask),
    )
    return loss, stats


def _inputs(
    where: str,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    is_weights: torch.Tensor | None,
    agg: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Check shapes and agg, warn on an empty mask, return (log_prob, old_log_prob,
    advantages) with 0 on padding."""
    check_same_shape(
        where,
        log_prob=log_prob,
        old_log_prob=old_log_prob,
        advantages=advantages,
        response_mask=response_mask,
    )
    if is_weights is not None:
        check_same_shape(where, is_weights=is_weights, response_mask=response_mask)
    if agg not in AGG_MODES:
        raise ValueError(
            f"{where}: unknown loss aggregation mode {agg!r}; valid modes: {', '.join(AGG_MODES)}"
        )
    warn_if_empty(where, response_mask, stacklevel=4)  # the caller of the loss
    mask = response_mask
    return select(log_prob, mask), select(old_log_prob, mask), select(advantages, mask)


def _check_nonnegative(where: str, what: str, low: float, high: float) -> None:
    if not (low >= 0 and high >= 0):
        raise ValueError(
            f"{where}: clip_ratio_low and clip_ratio_high ({what}) must be >= 0, got "
            f"low={low}, high={high}"
        )


def _row_count(mask: torch.Tensor) -> torch.Tensor:
    """Real tokens per row [B], at least 1 (an empty row's sums are 0, so 0 / 1 = 0)."""
    return (mask != 0).sum(dim=-1).clamp(min=1)


@register_policy_loss("gspo")
def gspo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    agg: str = "token-mean",
    options: PolicyLossOptions = DEFAULT_OPTIONS,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """GSPO, Group Sequence Policy Optimization (Zheng et al. 2025, arXiv:2507.18071).

    The importance ratio is the row's: log s_i = mean over the row's real tokens of
    (log_prob - old_log_prob) (not clamped). Per token, s_it = exp(min(10, log_prob -
    sg[log_prob] + sg[log s_i])) (value s_i, gradient s_i d log_prob), and
    loss = max(-A s_it, -A clip(s_it, 1 - clip_ratio_low, 1 + clip_ratio_high)), reduced
    with ``aggregate_loss(..., agg)``. The paper averages per sequence
    (``agg="seq-mean-token-mean"``); verl (and so proxima) takes the configured ``agg``.
    The paper's clip ranges are small (e.g. 3e-4 / 4e-4). No dual clip: ``clip_ratio_c``
    is not used.

    Stats: ``clipfrac`` (share of real tokens where the clipped term is strictly larger),
    ``ppo_kl`` = mean(old_log_prob - log_prob) (not clamped). verl's constant-0
    ``pg_clipfrac_lower`` is left out.
    """
    where = "gspo_loss"
    check_ratio_clips(where, options.clip_ratio_low, options.clip_ratio_high)
    mask = response_mask
    lp, old, adv = _inputs(where, log_prob, old_log_prob, advantages, mask, is_weights, agg)
    log_ratio = lp - old
    seq_log_ratio = log_ratio.sum(dim=-1) / _row_count(mask)
    log_s = lp - lp.detach() + seq_log_ratio.detach().unsqueeze(-1)
    s = torch.exp(log_s.clamp(max=GSPO_LOG_RATIO_MAX))
    loss_unclipped = -adv * s
    loss_clipped = -adv * s.clamp(1 - options.clip_ratio_low, 1 + options.clip_ratio_high)
    loss_mat = weighted(torch.maximum(loss_unclipped, loss_clipped), is_weights, mask)
    loss = aggregate_loss(loss_mat, mask, agg)
    stats = detached_stats(
        clipfrac=masked_mean((loss_clipped > loss_unclipped).float(), mask),
        ppo_kl=masked_mean(-log_ratio, mask),
    )
    return loss, stats


@register_policy_loss("sapo", options=("tau_pos", "tau_neg"))
def sapo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    agg: str = "token-mean",
    options: PolicyLossOptions = DEFAULT_OPTIONS,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """SAPO, Soft Adaptive Policy Optimization (Gao et al. 2025, arXiv:2511.20347).

    A smooth gate instead of a hard clip: per token r = exp(clamp(log_prob - old_log_prob,
    -20, 20)), tau = ``tau_pos`` where A > 0 else ``tau_neg``, and
    loss = -A * (4 / tau) * sigmoid(tau (r - 1)) (its gradient is -A * 4 r sigmoid'(...),
    -A r at r = 1, fading as r leaves 1). Always reduced per sequence
    (``seq-mean-token-mean``) whatever ``agg`` says (it is only checked), as verl. The clip
    ratios and ``clip_ratio_c`` are not used.

    Stats: ``ppo_kl`` = mean of the clamped old_log_prob - log_prob. verl's constant-0
    ``pg_clipfrac`` and ``pg_clipfrac_lower`` are left out.
    """
    where = "sapo_loss"
    tau_pos, tau_neg = options.tau_pos, options.tau_neg
    if not (tau_pos > 0 and tau_neg > 0):
        raise ValueError(f"{where}: tau_pos and tau_neg must be > 0, got {tau_pos}, {tau_neg}")
    mask = response_mask
    lp, old, adv = _inputs(where, log_prob, old_log_prob, advantages, mask, is_weights, agg)
    log_ratio = (lp - old).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    as_tensor = dict(dtype=adv.dtype, device=adv.device)
    tau = torch.where(
        adv > 0, torch.as_tensor(tau_pos, **as_tensor), torch.as_tensor(tau_neg, **as_tensor)
    )
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    loss_mat = weighted(-gate * adv, is_weights, mask)
    loss = aggregate_loss(loss_mat, mask, "seq-mean-token-mean")
    return loss, detached_stats(ppo_kl=masked_mean(-log_ratio, mask))


@register_policy_loss("cispo")
def cispo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    agg: str = "token-mean",
    options: PolicyLossOptions = DEFAULT_OPTIONS,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """CISPO, clipped IS-weight policy optimization (MiniMax-M1, arXiv:2506.13585).

    The importance weight is clipped and detached, so every token keeps a gradient:
    r = exp(clamp(log_prob - old_log_prob, -20, 20)) and
    loss = -sg[clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high)] * A * log_prob, reduced
    with ``aggregate_loss(..., agg)``. (The paper leaves the lower bound open, i.e. a large
    ``clip_ratio_low`` below 1.) ``clip_ratio_c`` is not used.

    Stats: ``clipfrac`` (share of real tokens whose ratio is outside the range),
    ``ppo_kl`` (clamped, as vanilla). verl's constant-0 ``pg_clipfrac_lower`` is left out.
    """
    where = "cispo_loss"
    check_ratio_clips(where, options.clip_ratio_low, options.clip_ratio_high)
    mask = response_mask
    lp, old, adv = _inputs(where, log_prob, old_log_prob, advantages, mask, is_weights, agg)
    log_ratio = (lp - old).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    clipped = ratio.clamp(1 - options.clip_ratio_low, 1 + options.clip_ratio_high)
    loss_mat = weighted(-clipped.detach() * adv * lp, is_weights, mask)
    loss = aggregate_loss(loss_mat, mask, agg)
    stats = detached_stats(
        clipfrac=masked_mean((ratio != clipped).float(), mask),
        ppo_kl=masked_mean(-log_ratio, mask),
    )
    return loss, stats


@register_policy_loss("gpg")
def gpg_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    agg: str = "token-mean",
    options: PolicyLossOptions = DEFAULT_OPTIONS,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """GPG, Group Policy Gradient (Chu et al. 2025, arXiv:2504.02546): the plain policy
    gradient, loss = -A * log_prob per token, reduced with ``aggregate_loss(..., agg)``. No
    ratio and no clip (the clip ratios and ``clip_ratio_c`` are not used); the paper's
    corrected advantage is the advantage estimator's business, not the loss's.

    Stats: ``ppo_kl`` = mean(old_log_prob - log_prob) (verl's gpg reports no stats).
    """
    where = "gpg_loss"
    mask = response_mask
    lp, old, adv = _inputs(where, log_prob, old_log_prob, advantages, mask, is_weights, agg)
    loss = aggregate_loss(weighted(-lp * adv, is_weights, mask), mask, agg)
    return loss, detached_stats(ppo_kl=masked_mean(old - lp, mask))


@register_policy_loss("clip_cov", options=("clip_cov_ratio", "clip_cov_lb", "clip_cov_ub"))
def clip_cov_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    agg: str = "token-mean",
    options: PolicyLossOptions = DEFAULT_OPTIONS,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """Clip-Cov (Cui et al. 2025, The Entropy Mechanism of RL for Reasoning LMs,
    arXiv:2505.22617): PPO's clipped surrogate, with the gradient of a few high-covariance
    tokens cut to keep the entropy up.

    Per token r = exp(log_prob - old_log_prob) (not clamped, as verl) and
    loss = max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high)) (no dual clip:
    ``clip_ratio_c`` is not used). Covariance per real token:
    cov = (A - mean A) (log_prob - mean log_prob) (means over the batch's real tokens).
    Candidates: real tokens the PPO clip leaves alone with clip_cov_lb < cov < clip_cov_ub.
    Of those, max(int(clip_cov_ratio * n_real), 1) chosen at random (all of them if fewer)
    have their loss set to 0 (no gradient; they still count in the aggregation).

    The draw is verl's: the candidates in row-major order, permuted by ``torch.randperm``
    from torch's default CPU generator (one draw when there is at least one candidate, none
    otherwise), the first ones of the permutation kept; with the same RNG state the same
    tokens are cut as in verl, on any device. Difference: a cut token contributes exactly 0
    (verl multiplies by 0, which gives NaN if that token's loss overflowed to inf).

    Stats: ``clipfrac`` = share of real tokens cut (verl's ``pg_clipfrac`` for clip_cov),
    ``ppo_kl`` = mean(old_log_prob - log_prob).
    """
    where = "clip_cov_loss"
    check_ratio_clips(where, options.clip_ratio_low, options.clip_ratio_high)
    if not options.clip_cov_ratio > 0:
        raise ValueError(f"{where}: clip_cov_ratio must be > 0, got {options.clip_cov_ratio}")
    mask = response_mask
    lp, old, adv = _inputs(where, log_prob, old_log_prob, advantages, mask, is_weights, agg)
    log_ratio = lp - old
    ratio = torch.exp(log_ratio)
    loss_unclipped = -adv * ratio
    loss_clipped = -adv * ratio.clamp(1 - options.clip_ratio_low, 1 + options.clip_ratio_high)
    real = mask != 0
    with torch.no_grad():
        lp_d = lp.detach()
        cov = (adv - masked_mean(adv, mask)) * (lp_d - masked_mean(lp_d, mask))
        candidates = real & ~(loss_clipped > loss_unclipped) & (cov > options.clip_cov_lb)
        candidates &= cov < options.clip_cov_ub
        positions = torch.nonzero(candidates)
        cut = torch.zeros_like(real)
        if len(positions) > 0:
            n_cut = max(int(options.clip_cov_ratio * int(real.sum())), 1)
            order = torch.randperm(len(positions)).to(positions.device)
            chosen = positions[order[: min(n_cut, len(positions))]]
            cut[chosen[:, 0], chosen[:, 1]] = True
    loss_mat = torch.maximum(loss_unclipped, loss_clipped)
    loss_mat = torch.where(cut, torch.zeros_like(loss_mat), loss_mat)
    loss = aggregate_loss(weighted(loss_mat, is_weights, mask), mask, agg)
    stats = detached_stats(
        clipfrac=masked_mean(cut.float(), mask), ppo_kl=masked_mean(-log_ratio, mask)
    )
    return loss, stats


@register_policy_loss("kl_cov", options=("kl_cov_ratio", "ppo_kl_coef"))
def kl_cov_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    agg: str = "token-mean",
    options: PolicyLossOptions = DEFAULT_OPTIONS,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """KL-Cov (Cui et al. 2025, The Entropy Mechanism of RL for Reasoning LMs,
    arXiv:2505.22617): the unclipped surrogate, plus a KL penalty on the tokens of highest
    covariance.

    Per token r = exp(log_prob - old_log_prob) (not clamped, as verl) and loss = -A r (no
    clip: the clip ratios and ``clip_ratio_c`` are not used). Covariance per real token:
    cov = (A - mean A) (log_prob - mean log_prob) (means over the batch's real tokens). The
    k = max(1, int(kl_cov_ratio * n_real)) real tokens of largest cov get
    loss = -A r + ppo_kl_coef * |log_prob - old_log_prob| instead.

    The top k are picked as verl does (the real tokens in row-major order, their cov and
    ``torch.topk`` computed on the CPU), so ties go the same way as in verl on any device.

    Stats: ``kl_abs`` = mean |log_prob - old_log_prob| (what verl's kl_cov reports as
    ``actor/ppo_kl``; renamed because it is not the ``ppo_kl`` of the other losses),
    ``ppo_kl`` = mean(old_log_prob - log_prob).
    """
    where = "kl_cov_loss"
    if not 0 < options.kl_cov_ratio <= 1:
        raise ValueError(f"{where}: kl_cov_ratio must be in (0, 1], got {options.kl_cov_ratio}")
    mask = response_mask
    lp, old, adv = _inputs(where, log_prob, old_log_prob, advantages, mask, is_weights, agg)
    log_ratio = lp - old
    abs_log_ratio = log_ratio.abs()
    ratio = torch.exp(log_ratio)
    loss_plain = -adv * ratio
    loss_penalised = -adv * ratio + options.ppo_kl_coef * abs_log_ratio
    real = mask != 0
    penalised = torch.zeros_like(real)
    with torch.no_grad():
        flat_real = torch.nonzero(real.reshape(-1), as_tuple=True)[0]
        if len(flat_real) > 0:
            adv_real = adv[real].detach().reshape(-1).cpu()
            lp_real = lp[real].detach().reshape(-1).cpu()
            cov = (adv_real - adv_real.mean()) * (lp_real - lp_real.mean())
            k = max(1, int(len(cov) * options.kl_cov_ratio))
            top = torch.topk(cov, k, largest=True).indices.to(flat_real.device)
            penalised.view(-1)[flat_real[top]] = True
    loss_mat = torch.where(penalised, loss_penalised, loss_plain)
    loss = aggregate_loss(weighted(loss_mat, is_weights, mask), mask, agg)
    stats = detached_stats(
        kl_abs=masked_mean(abs_log_ratio, mask), ppo_kl=masked_mean(-log_ratio, mask)
    )
    return loss, stats


@register_policy_loss("geo_mean")
def geo_mean_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    agg: str = "token-mean",
    options: PolicyLossOptions = DEFAULT_OPTIONS,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """GMPO, Geometric-Mean Policy Optimization (Zhao et al. 2025, arXiv:2507.20673).

    The row's ratio is the geometric mean of its token ratios, each clipped in log space:
    with x = log_prob - old_log_prob (not clamped) and sgn = sign(A),
    x' = sgn * min(sgn x, sgn clip(x, -clip_ratio_low, clip_ratio_high)) per token (the clip
    binds only on the side that would raise the objective; x' = 0 where A = 0), then per row
    R_i = exp(sum x' / n_i), A_i = sum A / n_i (means over the row's n_i real tokens: the
    advantage is meant to be the row's, e.g. GRPO's) and loss_i = -A_i R_i. The loss is the
    mean of loss_i over all B rows, as verl: ``agg`` is not used (only checked), and an
    empty row counts as a row whose loss is 0 (unlike ``aggregate_loss``, which skips empty
    rows). The paper uses clip_ratio_low = clip_ratio_high = 0.4 (ratios in
    [e^-0.4, e^0.4]).
    ``clip_ratio_c`` is not used. With ``is_weights`` w, loss_i is multiplied by the row's
    geometric mean exp(sum log(w + 1e-10) / n_i), as verl.

    Stats: ``clipfrac`` / ``clipfrac_lower`` = share of real tokens whose log-ratio is
    outside [-clip_ratio_low, clip_ratio_high] with A > 0 / A < 0, ``ppo_kl`` =
    mean(old_log_prob - log_prob).
    """
    where = "geo_mean_loss"
    _check_nonnegative(where, "log-ratio bounds", options.clip_ratio_low, options.clip_ratio_high)
    mask = response_mask
    lp, old, adv = _inputs(where, log_prob, old_log_prob, advantages, mask, is_weights, agg)
    log_ratio = lp - old
    sgn = torch.sign(adv)
    log_ratio_clipped = log_ratio.clamp(-options.clip_ratio_low, options.clip_ratio_high)
    kept = sgn * torch.minimum(sgn * log_ratio, sgn * log_ratio_clipped)
    n = _row_count(mask)
    row_ratio = torch.exp(select(kept, mask).sum(dim=-1) / n)
    row_adv = adv.sum(dim=-1) / n
    row_loss = -row_adv * row_ratio
    if is_weights is not None:
        log_w = torch.log(select(is_weights.detach(), mask) + GEO_MEAN_IS_EPS)
        row_loss = row_loss * torch.exp(select(log_w, mask).sum(dim=-1) / n)
    loss = row_loss.mean()
    clipped = log_ratio != log_ratio_clipped
    stats = detached_stats(
        clipfrac=masked_mean((clipped & (adv > 0)).float(), mask),
        clipfrac_lower=masked_mean((clipped & (adv < 0)).float(), mask),
        ppo_kl=masked_mean(-log_ratio, mask),
    )
    return loss, stats


def _dppo(
    where: str,
    divergence: str,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    agg: str,
    options: PolicyLossOptions,
    is_weights: torch.Tensor | None,
) -> tuple[torch.Tensor, Stats]:
    """dppo_tv and dppo_kl: the same loss with a different trust region (``divergence``)."""
    low, high = options.clip_ratio_low, options.clip_ratio_high
    _check_nonnegative(where, "divergence thresholds", low, high)
    cap = DPPO_DEFAULT_CLIP_RATIO_C if options.clip_ratio_c is None else options.clip_ratio_c
    if not cap > 0:
        raise ValueError(f"{where}: clip_ratio_c (the ratio's cap) must be > 0, got {cap}")
    mask = response_mask
    lp, old, adv = _inputs(where, log_prob, old_log_prob, advantages, mask, is_weights, agg)
    log_ratio = (lp - old).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    truncated = ratio.clamp(max=cap).detach()
    with torch.no_grad():
        p, p_old = torch.exp(lp), torch.exp(old)
        if divergence == "tv":
            up_ok = p - p_old <= high
            down_ok = p - p_old >= -low
        else:
            eps = BINARY_KL_EPS
            binary_kl = p_old * (old - lp) + (1 - p_old) * torch.log(
                (1.0 - p_old + eps) / (1.0 - p + eps)
            )
            up_ok = (binary_kl <= high) | (p <= p_old)
            down_ok = (binary_kl <= low) | (p >= p_old)
        inside = torch.where(adv > 0, up_ok, down_ok)
    loss_mat = torch.where(inside, -adv * truncated * lp, torch.zeros_like(lp))
    loss = aggregate_loss(weighted(loss_mat, is_weights, mask), mask, agg)
    stats = detached_stats(
        clipfrac=masked_mean((~inside).float(), mask),
        clipfrac_lower=masked_mean(((ratio > cap) & inside).float(), mask),
        ppo_kl=masked_mean(-log_ratio, mask),
    )
    return loss, stats


_DPPO_DOC = """{title} (Divergence PPO, arXiv:2602.04879): a policy gradient through log_prob,
    weighted by the truncated importance ratio, on tokens inside a trust region measured
    by {measure}.

    Per token r = exp(clamp(log_prob - old_log_prob, -20, 20)), p = exp(log_prob),
    p_old = exp(old_log_prob), and loss = -A * sg[min(r, c)] * log_prob where the token is
    inside the region, 0 outside (no gradient), reduced with ``aggregate_loss(..., agg)``.
    Inside: {inside}
    ``clip_ratio_low`` / ``clip_ratio_high`` are the divergence thresholds (not ratio
    ranges). c is ``clip_ratio_c``, truncated importance sampling in place of the dual
    clip (the paper recommends a large cap). verl reads c from its actor config, whose
    ``clip_ratio_c`` is 3.0 unless set, and uses 20.0 when its config has no such key;
    proxima's ``actor.clip_ratio_c`` (3.0 by default) is passed through the same way, and
    ``clip_ratio_c=None`` (``actor.clip_ratio_c=0``, "disabled") gives verl's 20.0.

    Stats: ``clipfrac`` = share of real tokens outside the region, ``clipfrac_lower`` =
    share inside the region whose ratio exceeds c (truncated), ``ppo_kl`` (clamped, as
    vanilla).
    """


@register_policy_loss("dppo_tv")
def dppo_tv_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    agg: str = "token-mean",
    options: PolicyLossOptions = DEFAULT_OPTIONS,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    return _dppo(
        "dppo_tv_loss", "tv", log_prob, old_log_prob, advantages, response_mask, agg, options,
        is_weights,
    )  # fmt: skip


dppo_tv_loss.__doc__ = _DPPO_DOC.format(
    title="DPPO-Binary-TV",
    measure="the change of the sampled token's probability",
    inside="p - p_old <= clip_ratio_high where A > 0, p - p_old >= -clip_ratio_low where A <= 0.",
)


@register_policy_loss("dppo_kl")
def dppo_kl_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    agg: str = "token-mean",
    options: PolicyLossOptions = DEFAULT_OPTIONS,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    return _dppo(
        "dppo_kl_loss", "kl", log_prob, old_log_prob, advantages, response_mask, agg, options,
        is_weights,
    )  # fmt: skip


dppo_kl_loss.__doc__ = _DPPO_DOC.format(
    title="DPPO-Binary-KL",
    measure="the KL divergence of the binary distribution (the sampled token, the rest)",
    inside="with KL = p_old (log p_old - log p) + (1 - p_old) log((1 - p_old + 1e-8) / "
    "(1 - p + 1e-8)): KL <= clip_ratio_high or p <= p_old where A > 0, KL <= clip_ratio_low "
    "or p >= p_old where A <= 0.",
)


@register_policy_loss("dro", options=("dro_beta",))
def dro_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    agg: str = "token-mean",
    options: PolicyLossOptions = DEFAULT_OPTIONS,
    is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, Stats]:
    """DRO, Direct Reward Optimisation (Richemond et al. 2024, arXiv:2405.19107): the policy
    gradient with a quadratic log-ratio penalty, the policy part of DRO's mean-squared
    objective with the old policy as the anchor (as verl):
    loss = -(A * log_prob - dro_beta / 2 * (log_prob - old_log_prob)^2) per token, reduced
    with ``aggregate_loss(..., agg)``. ``dro_beta`` must be > 0 (its config default, 0,
    is refused: set ``actor.policy_loss.dro_beta``). The clip ratios and ``clip_ratio_c``
    are not used.

    Stats: ``ppo_kl`` = mean(old_log_prob - log_prob).
    """
    where = "dro_loss"
    beta = options.dro_beta
    if not beta > 0:
        raise ValueError(
            f"{where}: dro_beta must be > 0, got {beta}; set actor.policy_loss.dro_beta "
            "(the coefficient of the quadratic log-ratio penalty, e.g. 0.05)"
        )
    mask = response_mask
    lp, old, adv = _inputs(where, log_prob, old_log_prob, advantages, mask, is_weights, agg)
    log_ratio = lp - old
    loss_mat = -(lp * adv - 0.5 * beta * log_ratio.square())
    loss = aggregate_loss(weighted(loss_mat, is_weights, mask), mask, agg)
    return loss, detached_stats(ppo_kl=masked_mean(-log_ratio, mask))
