"""When the rollout engine is not the trainer: how far its log-probs are from the trainer's,
and the importance weights and rejection masks that correct for it.

A rollout engine (vLLM) samples token a_t from its own distribution mu (its numerics, its
top-k / top-p renormalisation), while PPO's ratio uses the trainer's pi_old computed on the
same weights. The gap is measured every iteration (`logprob_diff`, verl's
`training/rollout_probs_diff_*`, verl PR 2953; TRL issue 6789; `mismatch_stats`) and can be
corrected in two ways that combine, as verl's rollout correction does (verl PR 3984,
`rollout_is` and `rollout_rs`; Liu, Li et al. 2025, "When Speed Kills Stability",
https://richardli.xyz/rl-collapse):

- truncated importance sampling (TIS; Yao et al. 2025, "Your Efficient RL Framework
  Secretly Brings You Off-Policy RL Training", https://fengyao.notion.site/off-policy-rl):
  the policy-gradient term of token t is weighted by w_t = min(pi_old(a_t) / mu(a_t), cap),
  treated as a constant (`truncated_is_weights`);
- rejection: the tokens (token level) or whole sequences (sequence level: the product of
  the ratios; geometric: their geometric mean) whose ratio lies outside [lower, upper] get
  weight 0, the others keep their weight (`rejection_mask`).

Together they give the masked importance sampling of TRL (`vllm_importance_sampling_mode=
sequence_mask`, TRL PR 4530) and IcePop (Ring-1T, arXiv:2510.18855): the weight is the
ratio inside the band, 0 outside (docs/algorithms.md, "Rollout correction").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ._checks import check_same_shape, select
from .masked import masked_mean

LOG_RATIO_BOUND = 20.0  # exp(20) ~ 5e8: far beyond any cap, finite in float32
IS_LEVELS = ("token", "sequence")
REJECTION_LEVELS = ("token", "sequence", "geometric")
# The upper bound of each rejection level when none is given. Token and sequence: verl's
# rollout_rs_threshold falls back to its IS threshold, 2.0. Geometric: verl's Geo-RS preset
# (RolloutCorrectionConfig.decoupled_geo_rs) uses 1.001, the geometric mean of per-token
# ratios being close to 1 even where their product is far from it.
REJECTION_THRESHOLDS = {"token": 2.0, "sequence": 2.0, "geometric": 1.001}


def _check_cap(where: str, cap: float) -> None:
    if not cap >= 1:
        raise ValueError(
            f"{where}: cap must be >= 1 (weights above it are truncated), got {cap}; verl's "
            "default is 2.0"
        )


def _check_band(where: str, level: str, lower: float, upper: float) -> None:
    if not 0 < lower < 1 < upper < math.inf:
        raise ValueError(
            f"{where}: the band [lower, upper] = [{lower}, {upper}] must hold the on-policy "
            "ratio 1 (0 < lower < 1 < upper), or the tokens of an engine that matches the "
            f"trainer would be rejected; verl's default for {level} is upper="
            f"{REJECTION_THRESHOLDS[level]}, lower=1/upper"
        )


def logprob_diff(
    rollout_logprobs: torch.Tensor, old_logprobs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """|rollout_logprobs - old_logprobs| over real response tokens, all [B, T].

    Returns detached 0-dim ``mean`` and ``max`` (0 when the mask is empty).
    """
    check_same_shape(
        "logprob_diff",
        rollout_logprobs=rollout_logprobs,
        old_logprobs=old_logprobs,
        response_mask=response_mask,
    )
    diff = select((rollout_logprobs - old_logprobs).abs(), response_mask).detach().float()
    top = diff.amax() if diff.numel() else diff.new_zeros(())
    return {"mean": masked_mean(diff, response_mask), "max": top}


def truncated_is_weights(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    cap: float = 2.0,
    level: str = "token",
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated importance weights min(pi_old / mu, cap), detached, 0 on padding.

    old_logprobs (trainer, pi_old), rollout_logprobs (engine, mu), response_mask: [B, T].
    level ``token``: w_t = min(exp(old_t - rollout_t), cap) for each token; ``sequence``:
    one weight per row, min(exp(sum_t (old_t - rollout_t)), cap), on each of its tokens.
    Log-ratios are clamped to [-20, 20] before exp. Returns (weights [B, T] float32, stats)
    with 0-dim detached ``is_weight_mean`` (after truncation, over real tokens) and
    ``is_truncated_frac`` (share of real tokens whose weight hit the cap).
    """
    check_same_shape(
        "truncated_is_weights",
        old_logprobs=old_logprobs,
        rollout_logprobs=rollout_logprobs,
        response_mask=response_mask,
    )
    _check_cap("truncated_is_weights", cap)
    if level not in IS_LEVELS:
        raise ValueError(f"truncated_is_weights: level must be one of {IS_LEVELS}, got {level!r}")
    log_ratio = select(
        old_logprobs.detach().float() - rollout_logprobs.detach().float(), response_mask
    )
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)
    raw = torch.exp(log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND))
    weights = select(raw.clamp(max=cap), response_mask)
    stats = {
        "is_weight_mean": masked_mean(weights, response_mask),
        "is_truncated_frac": masked_mean((raw >= cap).float(), response_mask),
    }
    return weights, stats


def rejection_mask(
    old_logprobs: torch.Tensor,
    rollout_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    level: str = "token",
    upper: float | None = None,
    lower: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Which tokens keep their place in the policy loss: 1 where the ratio pi_old / mu lies
    in [lower, upper] (bounds included), 0 where it does not and on padding (verl's
    `rollout_rs`).

    old_logprobs (trainer, pi_old), rollout_logprobs (engine, mu), response_mask: [B, T].
    The ratio is, by level: ``token``, each token's exp(old_t - rollout_t); ``sequence``,
    the row's product exp(sum_t (old_t - rollout_t)), the whole row kept or rejected;
    ``geometric``, the row's geometric mean exp(mean_t (old_t - rollout_t)), over its real
    tokens. Compared in log space in float32 (log lower <= log-ratio <= log upper, the bounds
    rounded to float32 as the log-ratios are), so no ratio overflows; a NaN log-prob on a
    real token rejects it. ``upper`` None:
    REJECTION_THRESHOLDS[level]; ``lower`` None: 1 / upper (verl's defaults). The band must
    hold the on-policy ratio 1: 0 < lower < 1 < upper.

    Returns (keep [B, T] float32, detached, stats) with 0-dim ``rejected_token_frac`` (share
    of real tokens rejected) and ``rejected_seq_frac`` (share of rows with a real token that
    lost at least one; verl's rollout_rs_masked_fraction / rollout_rs_seq_masked_fraction),
    both 0 for an empty mask.
    """
    check_same_shape(
        "rejection_mask",
        old_logprobs=old_logprobs,
        rollout_logprobs=rollout_logprobs,
        response_mask=response_mask,
    )
    if level not in REJECTION_LEVELS:
        raise ValueError(f"rejection_mask: level must be one of {REJECTION_LEVELS}, got {level!r}")
    upper = REJECTION_THRESHOLDS[level] if upper is None else upper
    lower = 1.0 / upper if lower is None else lower
    _check_band("rejection_mask", level, lower, upper)
    real = response_mask != 0
    log_ratio = select(
        old_logprobs.detach().float() - rollout_logprobs.detach().float(), response_mask
    )
    if level == "sequence":
        log_ratio = log_ratio.sum(dim=-1, keepdim=True).expand_as(log_ratio)
    elif level == "geometric":
        log_ratio = masked_mean(log_ratio, response_mask, dim=-1)[:, None].expand_as(log_ratio)
    inside = (log_ratio >= math.log(lower)) & (log_ratio <= math.log(upper))
    rejected = real & ~inside
    rows = real.any(dim=-1)
    stats = {
        "rejected_token_frac": masked_mean(rejected.float(), response_mask),
        "rejected_seq_frac": rejected.any(dim=-1).sum().float() / rows.sum().clamp(min=1),
    }
    return (real & inside).float(), stats


@dataclass(frozen=True)
class RolloutCorrection:
    """The two corrections of a run, chosen apart as in verl (`rollout_is` and `rollout_rs`)
    and multiplied: weight = TIS weight (1 when `level` is empty) x rejection mask (1 when
    `rejection` is empty).

    `level` (TIS): "", token or sequence, truncated at `cap` (`truncated_is_weights`).
    `rejection`: "", token, sequence or geometric, in the band [`lower`, `upper`]
    (`rejection_mask`); `upper` 0 = REJECTION_THRESHOLDS[rejection], `lower` 0 = 1 / upper,
    verl's defaults. TRL's `sequence_mask` (its default, PR 4530) is level=sequence and
    rejection=sequence with cap = upper = 3 (and a `lower` near 0: TRL has none); IcePop is
    level=token and rejection=token with cap = upper = 5, lower = 0.5.
    """

    level: str = ""
    cap: float = 2.0
    rejection: str = ""
    upper: float = 0.0
    lower: float = 0.0

    def __post_init__(self) -> None:
        if self.level not in ("", *IS_LEVELS):
            raise ValueError(f"RolloutCorrection: level must be '' or one of {IS_LEVELS}")
        if self.rejection not in ("", *REJECTION_LEVELS):
            raise ValueError(
                f"RolloutCorrection: rejection must be '' or one of {REJECTION_LEVELS}"
            )
        if self.level:
            _check_cap("RolloutCorrection", self.cap)
        if self.rejection:
            _check_band("RolloutCorrection", self.rejection, *self.band)

    @property
    def active(self) -> bool:
        return bool(self.level or self.rejection)

    @property
    def band(self) -> tuple[float, float]:
        """(lower, upper) of the rejection, the defaults resolved."""
        upper = self.upper or REJECTION_THRESHOLDS[self.rejection]
        return (self.lower or 1.0 / upper), upper

    def weights(
        self,
        old_logprobs: torch.Tensor,
        rollout_logprobs: torch.Tensor,
        response_mask: torch.Tensor,
    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """The policy loss's per-token weights [B, T] float32 (detached, 0 on padding), None
        when neither correction is on, and their stats: with `level`, ``is_weight_mean`` (of
        the final weights over real tokens, rejected ones counting 0) and
        ``is_truncated_frac`` (of `truncated_is_weights`); with `rejection`,
        ``rejected_token_frac`` and ``rejected_seq_frac`` (of `rejection_mask`)."""
        if not self.active:
            return None, {}
        weights = select(torch.ones_like(old_logprobs, dtype=torch.float32), response_mask)
        stats: dict[str, torch.Tensor] = {}
        if self.level:
            weights, stats = truncated_is_weights(
                old_logprobs, rollout_logprobs, response_mask, self.cap, self.level
            )
        if self.rejection:
            lower, upper = self.band
            keep, rejected = rejection_mask(
                old_logprobs, rollout_logprobs, response_mask, self.rejection, upper, lower
            )
            weights = weights * keep
            stats.update(rejected)
        if self.level:
            stats["is_weight_mean"] = masked_mean(weights, response_mask)
        return weights, stats


def mismatch_stats(
    old_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor
) -> dict[str, torch.Tensor]:
    """How far the engine's distribution mu is from the trainer's pi_old on the sampled
    tokens, beside `logprob_diff`; all [B, T] inputs, float64 0-dim detached results.

    With x_t = old_t - rollout_t = log(pi_old / mu) on real tokens:
    ``kl_k3`` = mean over real tokens of exp(x) - 1 - x, the k3 estimator of KL(mu ||
    pi_old) from samples of mu (verl's rollout_corr/k3_kl), x clamped to [-20, 20];
    ``seq_logratio_mean`` / ``seq_logratio_abs_max`` = the mean / largest |.| over rows
    with a real token of the row's sum of x, the log of the sequence-level ratio. All 0 for
    an empty mask.
    """
    check_same_shape(
        "mismatch_stats",
        old_logprobs=old_logprobs,
        rollout_logprobs=rollout_logprobs,
        response_mask=response_mask,
    )
    x = select(old_logprobs.detach().double() - rollout_logprobs.detach().double(), response_mask)
    x = x.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    rows = (response_mask != 0).any(dim=-1)
    seq = x.sum(dim=-1)[rows]
    return {
        "kl_k3": masked_mean(torch.expm1(x) - x, response_mask),
        "seq_logratio_mean": seq.mean() if seq.numel() else x.new_zeros(()),
        "seq_logratio_abs_max": seq.abs().amax() if seq.numel() else x.new_zeros(()),
    }
