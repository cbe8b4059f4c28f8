"""Differential test: every loss in POLICY_LOSSES against verl 0.9.1's function of the same
name (``verl.trainer.ppo.core_algos``), loss, gradient d loss / d log_prob and stats, on
seeded random cases in every aggregation mode verl accepts.

Runs only where verl imports (``make test-verl`` builds ``.venv-verl`` and runs this file).
Cases: random [B, T] with 1 <= B <= 5 and 1 <= T <= 9, masks with holes and empty rows (never
an empty batch), log-probs from -1e-6 (p within 1e-6 of 1) to about -250, log-ratios from 0
(exact ties, ratio 1) to +60 (past the +-20 clamp, still finite after exp in float32) and
below -200 (ratio 0), advantages per token or per row with exact zeros,
is_weights with zeros or None, each loss's options and clip ranges varied.

Left out on purpose (each documented in the loss's docstring, and checked below where it
can be):
  - an all-empty mask: verl gives NaN (0 / 0) in token-mean and the seq-mean modes, proxima
    gives 0 with an EmptyMaskWarning (``test_empty_batch_is_the_deliberate_difference``);
  - vanilla with ``clip_ratio_c=None`` (dual clip off): verl cannot turn it off; compared
    with verl at a cap so large it never binds;
  - NaN / inf on padding, which verl multiplies into NaN: padding here holds finite values
    (proxima's own tests cover non-finite padding);
  - clip_cov cutting a token whose loss overflowed to inf (verl: inf * 0 = NaN, proxima: 0):
    not generated (log-ratios stay below float32's exp overflow at 88.7).
"""

from __future__ import annotations

import itertools
import math
import warnings

import pytest
import torch

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
actor_config = pytest.importorskip("verl.workers.config.actor")
omegaconf = pytest.importorskip("omegaconf")

from proxima.algos import (  # noqa: E402
    AGG_MODES,
    POLICY_LOSSES,
    EmptyMaskWarning,
    PolicyLossOptions,
)

CASES_PER_MODE = 24
RTOL = 1e-5

# proxima's stat name -> verl's metric for the same quantity, per loss; verl metrics not
# listed must be a constant 0 ("for compatibility"), which proxima leaves out.
STAT_NAMES = {
    "vanilla": {
        "clipfrac": "actor/pg_clipfrac",
        "ppo_kl": "actor/ppo_kl",
        "clipfrac_lower": "actor/pg_clipfrac_lower",
    },
    "gspo": {"clipfrac": "actor/pg_clipfrac", "ppo_kl": "actor/ppo_kl"},
    "sapo": {"ppo_kl": "actor/ppo_kl"},
    "cispo": {"clipfrac": "actor/pg_clipfrac", "ppo_kl": "actor/ppo_kl"},
    "gpg": {},
    "clip_cov": {"clipfrac": "actor/pg_clipfrac", "ppo_kl": "actor/ppo_kl"},
    "kl_cov": {"kl_abs": "actor/ppo_kl"},
    "geo_mean": {
        "clipfrac": "actor/pg_clipfrac",
        "ppo_kl": "actor/ppo_kl",
        "clipfrac_lower": "actor/pg_clipfrac_lower",
    },
    "dppo_tv": {
        "clipfrac": "actor/pg_clipfrac",
        "ppo_kl": "actor/ppo_kl",
        "clipfrac_lower": "actor/pg_clipfrac_lower",
    },
    "dro": {"ppo_kl": "actor/ppo_kl"},
}
STAT_NAMES["dppo_kl"] = STAT_NAMES["dppo_tv"]

# Each loss's own options, drawn per case (the first is the config default).
OPTION_CHOICES = {
    "sapo": {"tau_pos": [1.0, 0.5, 2.0], "tau_neg": [1.05, 0.7, 3.0]},
    "clip_cov": {
        "clip_cov_ratio": [0.0002, 0.1, 0.4, 2.0],
        "clip_cov_lb": [1.0, 0.05, -0.5],
        "clip_cov_ub": [5.0, 1.5, 50.0],
    },
    "kl_cov": {"kl_cov_ratio": [0.0002, 0.2, 0.6, 1.0], "ppo_kl_coef": [0.1, 1.0, 0.0]},
    "dro": {"dro_beta": [0.05, 1.0, 0.3]},
}
CLIP_C_CHOICES = {"vanilla": [3.0, 1.5, 10.0], "dppo_tv": [3.0, None, 1.2, 50.0]}
CLIP_C_CHOICES["dppo_kl"] = CLIP_C_CHOICES["dppo_tv"]


def verl_function(name):
    return core_algos.get_policy_loss_fn(name)


def verl_config(name, agg, low, high, clip_c, options):
    """verl's actor config for one case (no global batch info: agg_loss stays local)."""
    if clip_c is None:
        # dppo's default: a config without clip_ratio_c gives verl's 20.0
        return omegaconf.OmegaConf.create(
            {
                "clip_ratio": low,
                "clip_ratio_low": low,
                "clip_ratio_high": high,
                "loss_agg_mode": agg,
                "global_batch_info": {},
            }
        )
    loss_options = {k: v for k, v in options.items() if k not in ("tau_pos", "tau_neg")}
    return actor_config.ActorConfig(
        strategy="fsdp",
        rollout_n=1,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=low,
        clip_ratio_low=low,
        clip_ratio_high=high,
        clip_ratio_c=clip_c,
        loss_agg_mode=agg,
        tau_pos=options.get("tau_pos", 1.0),
        tau_neg=options.get("tau_neg", 1.05),
        policy_loss=actor_config.PolicyLossConfig(loss_mode=name, **loss_options),
        global_batch_info={},
    )


def random_case(seed: int, name: str):
    """One random case: tensors and the loss's settings."""
    g = torch.Generator().manual_seed(seed)

    def pick(choices):
        return choices[int(torch.randint(len(choices), (), generator=g))]

    b, t = int(torch.randint(1, 6, (), generator=g)), int(torch.randint(1, 10, (), generator=g))
    mask = (torch.rand(b, t, generator=g) < pick([0.5, 0.8, 1.0])).float()
    if b > 1 and torch.rand((), generator=g) < 0.4:
        mask[int(torch.randint(b, (), generator=g))] = 0.0  # an empty row
    if mask.sum() == 0:
        mask[int(torch.randint(b, (), generator=g)), int(torch.randint(t, (), generator=g))] = 1
    old = -torch.rand(b, t, generator=g).pow(2) * pick([1e-6, 0.5, 3.0, 10.0, 60.0])
    scale = pick([0.0, 1e-6, 0.01, 0.2, 1.0, 5.0, 25.0, 60.0])
    log_prob = -(old + scale * torch.randn(b, t, generator=g)).abs()
    if torch.rand((), generator=g) < 0.3:  # some exact ties: ratio exactly 1
        tie = torch.rand(b, t, generator=g) < 0.4
        log_prob = torch.where(tie, old, log_prob)
    if torch.rand((), generator=g) < 0.2:  # tokens the policy is sure of: p = 1 exactly
        log_prob = torch.where(torch.rand(b, t, generator=g) < 0.3, 0.0, log_prob)
    if torch.rand((), generator=g) < 0.3:  # quantised log-probs: ties in the covariance
        log_prob, old = (log_prob * 2).round() / 2, (old * 2).round() / 2
    if torch.rand((), generator=g) < 0.5:  # one advantage per row (GRPO-like)
        adv = torch.randn(b, 1, generator=g).expand(b, t).clone()
    else:
        adv = torch.randn(b, t, generator=g) * pick([1.0, 3.0])
    adv = torch.where(torch.rand(b, t, generator=g) < 0.15, torch.zeros(()), adv)
    is_weights = None
    if torch.rand((), generator=g) < 0.5:
        is_weights = torch.rand(b, t, generator=g) * 2
        is_weights = torch.where(torch.rand(b, t, generator=g) < 0.1, 0.0, is_weights)
    low, high = pick([(0.2, 0.2), (0.1, 0.28), (0.4, 0.4), (0.0003, 0.0004)])
    clip_c = pick(CLIP_C_CHOICES.get(name, [3.0]))
    options = {k: pick(v) for k, v in OPTION_CHOICES.get(name, {}).items()}
    return (log_prob, old, adv, mask, is_weights), (low, high, clip_c, options)


def close(ours, ref, what):
    scale = max(1.0, float(ref.detach().abs().max())) if ref.numel() else 1.0
    torch.testing.assert_close(
        ours.detach().double(),
        ref.detach().double(),
        rtol=RTOL,
        atol=RTOL * scale,
        msg=lambda m: f"{what}: {m}",
    )
    diff = (ours.detach().double() - ref.detach().double()).abs()
    return float((diff / ref.detach().double().abs().clamp(min=scale)).max()) if diff.numel() else 0


def run_both(name, agg, seed):
    (log_prob, old, adv, mask, w), (low, high, clip_c, options) = random_case(seed, name)
    ours_lp = log_prob.clone().requires_grad_(True)
    verl_lp = log_prob.clone().requires_grad_(True)
    torch.manual_seed(seed)  # clip_cov draws from torch's default generator, as verl
    ours = PolicyLossOptions(
        clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=clip_c, **options
    )
    loss, stats = POLICY_LOSSES[name](ours_lp, old, adv, mask, agg, ours, w)
    config = verl_config(name, agg, low, high, clip_c, options)
    torch.manual_seed(seed)
    ref, metrics = verl_function(name)(
        old, verl_lp, adv, mask, loss_agg_mode=agg, config=config, rollout_is_weights=w
    )
    loss.backward()
    ref.backward()
    where = f"{name} agg={agg} seed={seed}"
    worst = close(loss, ref, f"{where}: loss")
    worst = max(worst, close(ours_lp.grad, verl_lp.grad, f"{where}: gradient"))
    names = STAT_NAMES[name]
    for ours_name, verl_name in names.items():
        assert math.isclose(
            float(stats[ours_name]), metrics[verl_name], rel_tol=1e-5, abs_tol=1e-6
        ), f"{where}: {ours_name} {float(stats[ours_name])} vs {verl_name} {metrics[verl_name]}"
    for verl_name, value in metrics.items():
        if verl_name not in names.values():
            assert value == 0.0, f"{where}: verl's {verl_name} is {value}, not 0"
    return worst


@pytest.mark.filterwarnings("ignore::proxima.algos.EmptyMaskWarning")
@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_matches_verl(name):
    """CASES_PER_MODE random cases in each of verl's 5 aggregation modes (sapo and geo_mean
    ignore the mode in verl too)."""
    assert name in core_algos.POLICY_LOSS_REGISTRY, f"{name} is not a verl loss"
    worst = 0.0
    for agg, i in itertools.product(AGG_MODES, range(CASES_PER_MODE)):
        seed = 1000 * AGG_MODES.index(agg) + i + 7919 * sorted(POLICY_LOSSES).index(name)
        worst = max(worst, run_both(name, agg, seed))
    print(f"{name}: {len(AGG_MODES) * CASES_PER_MODE} cases, max relative difference {worst:.2e}")


def test_every_verl_loss_is_registered():
    """verl's registry, less ``bypass_mode`` (a dispatcher verl's trainer installs in its
    rollout-correction bypass mode, not a loss of its own: ppo_clip is vanilla)."""
    assert set(core_algos.POLICY_LOSS_REGISTRY) - {"bypass_mode"} == set(POLICY_LOSSES)


def test_clip_cov_cuts_some_tokens_in_the_random_cases():
    """The clip_cov comparisons are only worth something if tokens get cut."""
    cut = 0
    for seed in range(200):
        (lp, old, adv, mask, w), (low, high, _, options) = random_case(seed, "clip_cov")
        torch.manual_seed(seed)
        ours = PolicyLossOptions(clip_ratio_low=low, clip_ratio_high=high, **options)
        _, stats = POLICY_LOSSES["clip_cov"](lp, old, adv, mask, options=ours)
        cut += float(stats["clipfrac"]) > 0
    assert cut >= 20


def test_vanilla_without_dual_clip_is_verl_with_a_cap_that_never_binds():
    for seed in range(40):
        (lp, old, adv, mask, w), (low, high, _, _) = random_case(seed, "vanilla")
        lp.requires_grad_(True)
        ours = PolicyLossOptions(clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=None)
        loss, _ = POLICY_LOSSES["vanilla"](lp, old, adv, mask, options=ours)
        (grad,) = torch.autograd.grad(loss, lp)
        config = verl_config("vanilla", "token-mean", low, high, 1e30, {})
        ref, _ = verl_function("vanilla")(old, lp, adv, mask, config=config)
        (ref_grad,) = torch.autograd.grad(ref, lp)
        close(loss, ref, f"seed {seed}: loss")
        close(grad, ref_grad, f"seed {seed}: gradient")


@pytest.mark.parametrize("name", ["dppo_kl", "dppo_tv"])
def test_dppo_near_certain_tokens(name):
    """p = 1 against p_old from 0.5 to 1 - 1e-4: dppo_kl's binary KL crosses its threshold
    there, where the 1e-8 inside its log decides (random cases rarely land there)."""
    old = torch.linspace(math.log(0.5), -1e-4, 400).reshape(8, 50)
    lp = torch.zeros_like(old, requires_grad=True)
    adv = torch.ones_like(old)
    adv[::2] = -1.0
    mask = torch.ones_like(old)
    ours = PolicyLossOptions(clip_ratio_low=0.1, clip_ratio_high=0.2)
    loss, stats = POLICY_LOSSES[name](lp, old, adv, mask, options=ours)
    (grad,) = torch.autograd.grad(loss, lp)
    verl_lp = lp.detach().clone().requires_grad_(True)
    ref, metrics = verl_function(name)(
        old, verl_lp, adv, mask, config=verl_config(name, "token-mean", 0.1, 0.2, 3.0, {})
    )
    (ref_grad,) = torch.autograd.grad(ref, verl_lp)
    close(loss, ref, "loss")
    close(grad, ref_grad, "gradient")
    assert 0 < float(stats["clipfrac"]) < 1  # the region's edge is inside the grid
    assert math.isclose(float(stats["clipfrac"]), metrics["actor/pg_clipfrac"], rel_tol=1e-6)


@pytest.mark.parametrize("name", sorted(POLICY_LOSSES))
def test_empty_batch_is_the_deliberate_difference(name):
    """All-empty mask: proxima 0 (zero gradient, a warning); verl NaN in token-mean and the
    seq-mean modes (0 / 0), except geo_mean and token-sum, which give 0 in verl too."""
    (lp, old, adv, _, _), (low, high, clip_c, options) = random_case(3, name)
    mask = torch.zeros_like(lp)
    for agg in AGG_MODES:
        lp_ours = lp.clone().requires_grad_(True)
        with pytest.warns(EmptyMaskWarning):
            ours = PolicyLossOptions(
                clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=clip_c, **options
            )
            loss, _ = POLICY_LOSSES[name](lp_ours, old, adv, mask, agg, ours)
        loss.backward()
        assert float(loss.detach()) == 0.0 and not lp_ours.grad.any()
        config = verl_config(name, agg, low, high, clip_c, options)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref, _ = verl_function(name)(old, lp, adv, mask, loss_agg_mode=agg, config=config)
        verl_agg = "seq-mean-token-mean" if name == "sapo" else agg
        if name == "geo_mean" or verl_agg == "token-sum":
            assert float(ref) == 0.0
        else:
            assert math.isnan(float(ref))
