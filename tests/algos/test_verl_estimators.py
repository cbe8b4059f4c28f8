"""Every advantage estimator against verl 0.9.1's own function, on seeded random batches.

Run by ``make test-verl``, which builds ``.venv-verl`` with verl 0.9.1 and sets
``PROXIMA_REQUIRE_VERL=1``: there a verl that does not import is a failure, elsewhere the
file skips itself (verl is not a dependency). The batches have masks with holes, rows with
no real token, groups of one, tied outcomes and group ids that are neither adjacent nor
0..G-1. Compared on real tokens, to 1e-5; proxima's outputs are 0
on masked positions (checked), where verl leaves some values (returns-to-go on holes,
GAE's carried advantage) that no loss reads.

Deliberate differences, by construction of verl's inputs below, each with its reason:
  - proxima ignores whatever lies outside the mask (rewards, values, log-probs: it gets junk
    there, NaN included); verl sums and multiplies whole rows, so verl gets 0 there, as its
    reward manager places scores on real tokens.
  - gdpo's score_components of a row with no real token count as 0 in proxima (its outcome
    is 0 in every estimator); verl reads the component it placed outside that row's mask,
    so verl gets 0 for them.
  - opo: a group whose rows are all empty gets baseline 0 in proxima; verl divides 0 by 0.
    The NaN only lands on masked positions, which are not compared.
  - grpo_passk with a group of one raises ValueError in both (checked), so those batches
    are not compared.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

if os.environ.get("PROXIMA_REQUIRE_VERL"):  # make test-verl: never a silent skip
    import verl.trainer.ppo.core_algos as core
    from omegaconf import OmegaConf
else:
    core = pytest.importorskip("verl.trainer.ppo.core_algos")
    OmegaConf = pytest.importorskip("omegaconf").OmegaConf

from proxima.algos import ADVANTAGE_ESTIMATORS, compute_advantages  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::proxima.algos.SingletonGroupWarning")

CASES = 80
TOL = 1e-5
JUNK = 50.0  # on masked positions of proxima's inputs (NaN for some cases)


def make_case(seed: int) -> dict:
    """One random batch: the inputs of every estimator, proxima's with junk off the mask."""
    gen = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    batch = int(rng.integers(2, 13))
    width = int(rng.integers(1, 8))
    # Group ids drawn from a few arbitrary labels, shuffled: not adjacent, not 0..G-1, some
    # groups of one.
    labels = rng.choice([7, 3, 42, 1000, 5, 99], size=int(rng.integers(1, 5)), replace=False)
    ids = rng.choice(labels, size=batch)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for b in range(batch):
        kind = rng.random()
        if kind < 0.12:
            continue  # a row with no real token
        length = int(rng.integers(1, width + 1))
        mask[b, :length] = 1
        if rng.random() < 0.4:  # holes
            holes = torch.rand(width, generator=gen) < 0.3
            mask[b, holes] = 0
    if int(mask.sum()) < 2:  # verl's whitening needs two real tokens
        mask[0, :] = 1
        mask[-1, :] = 1
        if width == 1 and batch >= 2:
            pass
    real = mask != 0
    # Rewards: continuous, or a discrete score on the last real token (ties within groups).
    if rng.random() < 0.5:
        rewards = torch.randn(batch, width, generator=gen)
    else:
        rewards = torch.zeros(batch, width)
        scores = torch.tensor(rng.choice([0.0, 1.0, 0.5], size=batch), dtype=torch.float32)
        for b in range(batch):
            idx = torch.nonzero(real[b]).flatten()
            if len(idx):
                rewards[b, idx[-1]] = scores[b]
        if rng.random() < 0.5:  # a KL-like term on every token
            rewards = rewards - 0.05 * torch.rand(batch, width, generator=gen)
    values = torch.randn(batch, width, generator=gen)
    # A rollout policy over a 6-token vocabulary: sampled-token log-probs and sum of pi^2.
    probs = torch.softmax(1.5 * torch.randn(batch, width, 6, generator=gen), dim=-1)
    tokens = torch.multinomial(probs.reshape(-1, 6), 1, generator=gen).reshape(batch, width)
    old_logprobs = probs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1).log()
    sum_pi_squared = (probs**2).sum(-1)
    is_weights = torch.rand(batch, width, generator=gen) * 1.5 + 0.5
    n_components = int(rng.integers(1, 4))
    components = torch.tensor(
        rng.choice([0.0, 1.0, 0.25, -1.0], size=(batch, n_components)), dtype=torch.float32
    )
    if rng.random() < 0.5:
        components = components + 0.1 * torch.randn(batch, n_components, generator=gen)
    junk = float("nan") if rng.random() < 0.3 else JUNK
    return {
        "seed": seed,
        "mask": mask,
        "real": real,
        "ids": ids,
        "rewards": rewards * real,  # verl's: 0 off the mask
        "values": values * real,
        "old_logprobs": torch.where(real, old_logprobs, 0.0),
        "sum_pi_squared": torch.where(real, sum_pi_squared, 0.0),
        "is_weights": torch.where(real, is_weights, 0.0),
        "junk": junk,
        "reward_baselines": torch.randn(batch, generator=gen),
        "components": components,
        "weights": [] if rng.random() < 0.5 else rng.uniform(0.2, 2.0, n_components).tolist(),
        "gamma": float(rng.choice([1.0, 0.9, 0.5])),
        "lam": float(rng.choice([1.0, 0.95, 0.3, 0.0])),
        "flag": bool(rng.random() < 0.6),
        "zero_tail": bool(rng.random() < 0.7),
        "use_is": bool(rng.random() < 0.5),
    }


def junked(case: dict, x: torch.Tensor) -> torch.Tensor:
    """x with junk on masked positions: what proxima gets."""
    return torch.where(case["real"], x, case["junk"])


def has_singleton(case: dict) -> bool:
    _, counts = np.unique(case["ids"], return_counts=True)
    return bool((counts == 1).any())


def verl_gdpo(case: dict):
    """verl's gdpo with its per-component path (config keys, non_tensor_batch, batch)."""
    batch, width = case["mask"].shape
    prompt = 2
    keys = [f"c{k}" for k in range(case["components"].shape[1])]
    # verl puts component k at attention_mask[:, prompt:].sum() - 1 and sums the row; a
    # row with no real token would get it at column -1, outside its mask: 0 there (see the
    # module docstring).
    comps = torch.where(case["real"].any(-1, keepdim=True), case["components"], 0.0)
    attention = torch.cat([torch.ones(batch, prompt, dtype=torch.long), case["mask"]], dim=-1)
    config = {"gdpo_reward_keys": keys, "norm_adv_by_std_in_grpo": case["flag"]}
    if case["weights"]:
        config["gdpo_reward_weights"] = case["weights"]
    return core.compute_gdpo_outcome_advantage(
        token_level_rewards=case["rewards"].clone(),
        response_mask=case["mask"],
        index=case["ids"],
        norm_adv_by_std_in_grpo=case["flag"],
        config=OmegaConf.create(config),
        non_tensor_batch={k: comps[:, i].numpy() for i, k in enumerate(keys)},
        batch={
            "prompts": torch.zeros(batch, prompt, dtype=torch.long),
            "attention_mask": attention,
        },
    )


def run_both(name: str, case: dict):
    """(proxima (adv, ret), verl (adv, ret), compare returns?) for estimator `name`."""
    r, m, ids = case["rewards"], case["mask"], case["ids"]
    pr = junked(case, r)
    gids = torch.tensor(ids)
    cfg = OmegaConf.create(
        {"gamma": case["gamma"], "norm_adv_by_std_in_grpo": case["flag"], "lam": case["lam"]}
    )
    otb = {
        "old_logprobs": junked(case, case["old_logprobs"]),
        "sum_pi_squared": junked(case, case["sum_pi_squared"]),
        "is_weights": junked(case, case["is_weights"]) if case["use_is"] else None,
    }
    if name == "gae":
        ours = compute_advantages(
            "gae",
            pr,
            m,
            values=junked(case, case["values"]),
            gamma=case["gamma"],
            lam=case["lam"],
            whiten_advantages=True,
        )
        theirs = core.compute_gae_advantage_return(
            r.clone(), case["values"].clone(), m, case["gamma"], case["lam"]
        )
        return ours, theirs
    if name == "reinforce_plus_plus":
        ours = compute_advantages(name, pr, m, gamma=case["gamma"])
        return ours, core.compute_reinforce_plus_plus_outcome_advantage(r.clone(), m, config=cfg)
    if name == "remax":
        ours = compute_advantages(name, pr, m, reward_baselines=case["reward_baselines"])
        theirs = core.compute_remax_outcome_advantage(
            r.clone(), case["reward_baselines"].clone(), m, config=cfg
        )
        return ours, theirs
    if name in ("grpo", "grpo_vectorized", "grpo_passk"):
        ours = compute_advantages(name, pr, m, group_ids=gids, norm_adv_by_std_in_grpo=case["flag"])
        fn = core.get_adv_estimator_fn(name)
        return ours, fn(r.clone(), m, ids, norm_adv_by_std_in_grpo=case["flag"], config=cfg)
    if name == "gdpo":
        comps = case["components"].clone()
        comps[~case["real"].any(-1)] = 7.0  # ignored by proxima (row with no real token)
        ours = compute_advantages(
            name,
            pr,
            m,
            group_ids=gids,
            score_components=comps,
            norm_adv_by_std_in_grpo=case["flag"],
            gdpo_reward_weights=case["weights"],
        )
        return ours, verl_gdpo(case)
    if name in ("optimal_token_baseline", "tir_optimal_token_baseline"):
        ours = compute_advantages(
            name, pr, m, group_ids=gids, handle_zero_tail=case["zero_tail"], **otb
        )
        theirs = core.get_adv_estimator_fn(name)(
            token_level_rewards=r.clone(),
            response_mask=m,
            index=ids,
            old_log_probs=case["old_logprobs"].clone(),
            sum_pi_squared=case["sum_pi_squared"].clone(),
            rollout_is_weights=case["is_weights"].clone() if case["use_is"] else None,
            handle_zero_tail=case["zero_tail"],
        )
        return ours, theirs
    # rloo, rloo_vectorized, reinforce_plus_plus_baseline, opo, gpg
    ours = compute_advantages(name, pr, m, group_ids=gids)
    return ours, core.get_adv_estimator_fn(name)(r.clone(), m, index=ids, config=cfg)


def max_diff_on_real(ours: torch.Tensor, theirs: torch.Tensor, real: torch.Tensor) -> float:
    assert torch.all(ours[~real] == 0), "proxima leaves a value on a masked position"
    if not real.any():
        return 0.0
    return float((ours[real].double() - theirs.float()[real].double()).abs().max())


WHITENED = {"gae", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gdpo"}
# Whitening multiplies x - mean by rsqrt(var + 1e-8). When var is not far above 1e-8 (the
# values to whiten nearly equal, e.g. every group tied up to GRPO's eps), verl's float32
# rounding of x (1e-7 relative) is magnified up to 1e4 times, so two correct
# implementations differ by up to ~1e-3 there. Such a batch is recognised by its whitened
# output, whose std is sqrt(var / (var + 1e-8)) < 0.99999 (var < 5e-4), and compared to
# ILL_TOL; those batches are counted and reported.
ILL_TOL = 1e-2


def ill_conditioned(name: str, adv: torch.Tensor, real: torch.Tensor) -> bool:
    if name not in WHITENED or int(real.sum()) < 2:
        return False
    return float(adv[real].double().std()) < 0.99999


# proxima's own estimators, under names verl does not have (algos/advantages.py says why)
PROXIMA_ONLY = {"distill"}
VERL_NAMES = sorted(set(ADVANTAGE_ESTIMATORS) - PROXIMA_ONLY)


def test_every_verl_estimator_name_is_registered():
    missing = [e.value for e in core.AdvantageEstimator if e.value not in ADVANTAGE_ESTIMATORS]
    assert not missing
    assert set(VERL_NAMES) == set(core.ADV_ESTIMATOR_REGISTRY)
    assert not PROXIMA_ONLY & set(core.ADV_ESTIMATOR_REGISTRY)


@pytest.mark.parametrize("name", VERL_NAMES)
def test_matches_verl_on_random_batches(name):
    compared, worst, ill, ill_worst = 0, 0.0, 0, 0.0
    for seed in range(CASES):
        case = make_case(seed)
        if name == "grpo_passk" and has_singleton(case):
            with pytest.raises(ValueError, match="at least 2 responses"):
                run_both(name, case)
            continue
        (adv, ret), (verl_adv, verl_ret) = run_both(name, case)
        real = case["real"]
        returns_diff = max_diff_on_real(ret, verl_ret, real)
        if name in ("gae", "reinforce_plus_plus"):  # returns before whitening
            assert returns_diff < TOL, f"{name}, seed {seed}: returns differ by {returns_diff}"
        diff = max_diff_on_real(adv, verl_adv, real)
        if ill_conditioned(name, adv, real):
            assert diff < ILL_TOL, f"{name}, seed {seed}: max |proxima - verl| = {diff:.3g}"
            ill, ill_worst = ill + 1, max(ill_worst, diff)
            continue
        diff = max(diff, returns_diff)
        assert diff < TOL, f"{name}, seed {seed}: max |proxima - verl| = {diff:.3g}"
        compared, worst = compared + 1, max(worst, diff)
    print(
        f"\n{name}: {compared} batches within {TOL} of verl, max |diff| {worst:.2e}"
        + (f"; {ill} near-constant whitening batches, max |diff| {ill_worst:.2e}" if ill else "")
    )
    assert compared >= CASES // 4


def test_gae_without_whitening_matches_verl_returns_minus_values():
    # verl's compute_gae_advantage_return always whitens; its returns are the unwhitened
    # advantages plus the values, so returns - values is what whiten_advantages=False gives.
    worst = 0.0
    for seed in range(CASES):
        case = make_case(seed)
        adv, ret = compute_advantages(
            "gae",
            junked(case, case["rewards"]),
            case["mask"],
            values=junked(case, case["values"]),
            gamma=case["gamma"],
            lam=case["lam"],
        )
        _, verl_ret = core.compute_gae_advantage_return(
            case["rewards"], case["values"], case["mask"], case["gamma"], case["lam"]
        )
        worst = max(worst, max_diff_on_real(adv, verl_ret - case["values"], case["real"]))
        worst = max(worst, max_diff_on_real(ret, verl_ret, case["real"]))
    assert worst < TOL


@pytest.mark.parametrize(
    "alias, verl_name", [("grpo_vectorized", "grpo"), ("grpo", "grpo_vectorized")]
)
def test_grpo_vectorized_is_grpo_in_verl_too(alias, verl_name):
    # The alias is only right if verl's two functions agree: check them against each other
    # through proxima's one function.
    for seed in range(CASES):
        case = make_case(seed)
        adv, _ = compute_advantages(
            alias,
            junked(case, case["rewards"]),
            case["mask"],
            group_ids=torch.tensor(case["ids"]),
            norm_adv_by_std_in_grpo=case["flag"],
        )
        verl_adv, _ = core.get_adv_estimator_fn(verl_name)(
            case["rewards"], case["mask"], case["ids"], norm_adv_by_std_in_grpo=case["flag"]
        )
        assert max_diff_on_real(adv, verl_adv, case["real"]) < TOL


def test_gdpo_without_components_matches_verl_fallback():
    # No score_components: the summed token rewards are the one component (verl without
    # gdpo_reward_keys in its config).
    for seed in range(CASES):
        case = make_case(seed)
        adv, _ = compute_advantages(
            "gdpo",
            junked(case, case["rewards"]),
            case["mask"],
            group_ids=torch.tensor(case["ids"]),
            norm_adv_by_std_in_grpo=case["flag"],
        )
        verl_adv, _ = core.compute_gdpo_outcome_advantage(
            case["rewards"], case["mask"], case["ids"], norm_adv_by_std_in_grpo=case["flag"]
        )
        tol = ILL_TOL if ill_conditioned("gdpo", adv, case["real"]) else TOL
        assert max_diff_on_real(adv, verl_adv, case["real"]) < tol, seed


def test_rows_with_no_real_token_count_in_groups_as_in_verl():
    # Group 0: rows 0, 1 real (outcomes 1 and 3) and row 2 empty: a member with outcome 0,
    # so the mean is 4/3, not 2 (the gap proxima had before).
    rewards = torch.tensor([[1.0, 0.0], [3.0, 0.0], [0.0, 0.0]])
    mask = torch.tensor([[1, 0], [1, 0], [0, 0]])
    ids = np.array([0, 0, 0])
    for name in ("grpo", "rloo", "reinforce_plus_plus_baseline", "opo", "gpg", "gdpo"):
        ours, _ = compute_advantages(name, rewards, mask, group_ids=torch.tensor(ids))
        theirs, _ = core.get_adv_estimator_fn(name)(rewards, mask, index=ids, config=None)
        assert max_diff_on_real(ours, theirs, mask != 0) < TOL, name
