"""Drift: the metrics of a whole batch (the same from gathered ranks as from one process),
and the warning that fires on a constructed degenerate run, once per kind, never on a
healthy one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from proxima.algos import dominated, wordless
from proxima.config import Config
from proxima.trainer.drift import (
    PERSIST,
    START_ITERATIONS,
    DriftMonitor,
    batch_drift,
    drift_metrics,
)
from proxima.types import Experience

NO_REFERENCE = {"algorithm.adv_estimator": "grpo", "algorithm.use_kl_in_reward": False}


def _experience(response: torch.Tensor, mask: torch.Tensor, ref: torch.Tensor) -> Experience:
    prompt = torch.full((response.shape[0], 2), 5)
    ids = torch.cat([prompt, response], dim=1)
    attn = torch.cat([torch.ones_like(prompt), mask], dim=1)
    return Experience(
        input_ids=ids,
        attention_mask=attn,
        response_mask=mask,
        old_logprobs=ref,
        ref_logprobs=ref * mask,
    )


class TwoRanks:
    """A Dist of rank 0 whose rank 1 holds `other`'s rows: gather_rows as trainer.dist's
    (rank order, narrower rows padded on the right with 0)."""

    def __init__(self, other: list[torch.Tensor]) -> None:
        self.other = list(other)

    def gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        o = self.other.pop(0)
        width = max(t.shape[1], o.shape[1]) if t.dim() > 1 else None
        if width is not None:
            t, o = (nn.functional.pad(x, [0, width - x.shape[1]]) for x in (t, o))
        return torch.cat([t, o])


def test_degenerate_batch_against_a_healthy_one():
    healthy = torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12]])
    loop = torch.tensor([[3, 3, 3, 3, 3, 3], [3, 3, 3, 3, 3, 3]])
    mask = torch.ones_like(healthy)  # (the texts' words: tests/algos/test_drift.py)
    no = torch.tensor([False, False])
    good = drift_metrics(healthy, mask, no, no)
    bad = drift_metrics(
        loop,
        mask,
        torch.tensor([True, True]),
        torch.tensor([False, True]),
        torch.full((2, 6), -2.0),
    )
    # healthy: no trigram repeats, every uni- and bigram is new
    assert good == {
        "drift/repetition": 0.0,
        "drift/dominated": 0.0,
        "drift/empty": 0.0,
        "drift/distinct_1": 1.0,
        "drift/distinct_2": 1.0,
    }
    # the loop: 4 trigrams per row, 3 repeat -> 3/4; 1 unique unigram of 12, bigram of 10
    assert bad["drift/repetition"] == pytest.approx(3 / 4)
    assert bad["drift/dominated"] == 1.0
    assert bad["drift/empty"] == 0.5
    assert bad["drift/distinct_1"] == pytest.approx(1 / 12)
    assert bad["drift/distinct_2"] == pytest.approx(1 / 10)
    assert bad["drift/ref_logprob"] == pytest.approx(-2.0)


def test_gathered_ranks_give_the_one_process_values():
    r0 = torch.tensor([[1, 2, 1, 2, 1, 2], [4, 4, 4, 0, 0, 0]])
    m0 = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    r1 = torch.tensor([[1, 2, 3, 9], [9, 9, 9, 9]])  # a narrower rank
    m1 = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 1]])
    lp0, lp1 = -torch.rand(2, 6), -torch.rand(2, 4)
    texts0, texts1 = ["a b a b", "x x x"], ["1. 2.", "now now now"]
    whole_ids = torch.cat([r0, nn.functional.pad(r1, [0, 2])])
    whole_mask = torch.cat([m0, nn.functional.pad(m1, [0, 2])])
    whole_lp = torch.cat([lp0 * m0, nn.functional.pad(lp1 * m1, [0, 2])])
    exp0, exp1 = _experience(r0, m0, lp0), _experience(r1, m1, lp1)
    other = [
        exp1.response_ids, dominated(texts1).float(), wordless(texts1).float(), exp1.ref_logprobs
    ]  # fmt: skip
    got = batch_drift(whole_mask, exp0, texts0, TwoRanks(other))
    texts = texts0 + texts1
    one = drift_metrics(whole_ids, whole_mask, dominated(texts), wordless(texts), whole_lp)
    assert got == pytest.approx(one)
    assert got["drift/dominated"] == 0.5  # "x x x" and "now now now"
    assert got["drift/empty"] == 0.25  # "1. 2."


def _run(monitor: DriftMonitor, rows: list[dict]) -> list:
    fired = []
    for i, row in enumerate(rows, start=1):
        fired += monitor.observe(i, row)
    return fired


HEALTHY = {
    "drift/repetition": 0.02,
    "drift/dominated": 0.0,
    "drift/distinct_2": 0.6,
    "actor/entropy": 1.3,
}
# what the real model's collapse looked like: answers of one repeated word, entropy 1.30 ->
# 0.33 (a quarter), the bigrams of the batch mostly the same few
DEGENERATE = {
    "drift/repetition": 0.5,
    "drift/dominated": 0.9,
    "drift/distinct_2": 0.1,
    "actor/entropy": 0.33,
}


def test_a_healthy_run_never_warns():
    noisy = [{k: v * (1 + 0.1 * (-1) ** i) for k, v in HEALTHY.items()} for i in range(50)]
    assert _run(DriftMonitor(Config()), noisy) == []


def test_a_degenerate_run_warns_once_per_kind_with_the_fix():
    cfg = Config().replace(NO_REFERENCE)
    rows = [HEALTHY] * START_ITERATIONS + [DEGENERATE] * (PERSIST + 5)
    monitor = DriftMonitor(cfg)
    fired = _run(monitor, rows)
    assert [w.kind for w in fired] == ["diversity", "repetition", "dominated", "entropy"]
    # each after PERSIST iterations past its threshold, never again
    assert {w.iteration for w in fired} == {START_ITERATIONS + PERSIST}
    assert monitor.warnings == fired
    dom = fired[2]
    assert (dom.start, dom.value, dom.limit) == (0.0, 0.9, 0.25)
    assert "drift/dominated 0.9 is above 0.25" in dom.message
    assert "guard.drift_max_dominated_rise=0.25" in dom.message
    # no reference in this run: the fix is to keep one
    assert "algorithm.use_kl_in_reward=true" in dom.message
    assert "actor.use_kl_loss=true" in dom.message
    assert "actor.optim.lr" in dom.message
    assert "actor.entropy_coef" in fired[3].message
    assert fired[0].to_dict()["metric"] == "drift/distinct_2"


def test_one_noisy_iteration_does_not_warn_and_zero_turns_a_check_off():
    rows = [HEALTHY] * START_ITERATIONS + [DEGENERATE, HEALTHY] * 10
    assert _run(DriftMonitor(Config()), rows) == []
    off = Config().replace({f"guard.{k}": 0.0 for k in (
        "drift_min_distinct_ratio", "drift_max_repetition_rise", "drift_max_dominated_rise",
        "drift_min_entropy_ratio", "drift_max_ref_logprob_drop",
    )})  # fmt: skip
    assert _run(DriftMonitor(off), [HEALTHY] * 3 + [DEGENERATE] * 10) == []


def test_the_reference_likelihood_drop_names_the_kl_coefficient():
    start, drop = {"drift/ref_logprob": -1.0}, {"drift/ref_logprob": -2.5}  # 1.5 nats down
    fired = _run(DriftMonitor(Config()), [start] * 3 + [drop] * PERSIST)
    assert [w.kind for w in fired] == ["reference"]
    assert "algorithm.kl_ctrl.kl_coef (now 0.1)" in fired[0].message
    assert "drift/ref_logprob -2.5 is below -2" in fired[0].message


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    from tests.trainer.nano import nano_files

    return nano_files(tmp_path_factory.mktemp("drift"))


@pytest.mark.parametrize("reference", [True, False])
def test_a_step_logs_drift_and_the_reference_likelihood_with_a_reference(files, reference):
    from tests.trainer.nano import nano_trainer

    extra = [] if reference else ["algorithm.adv_estimator=grpo", "rollout.n=2"]
    extra += [] if reference else ["algorithm.use_kl_in_reward=false"]
    trainer = nano_trainer(files, *extra)
    metrics, ro = trainer.step()
    exp = trainer.make_experience(ro)  # the same batch again: the same reference log-probs
    mask = ro.gen.response_mask
    ref = exp.ref_logprobs if reference else None
    texts = ro.responses
    want = drift_metrics(ro.gen.response_ids, mask, dominated(texts), wordless(texts), ref)
    assert {k: v for k, v in metrics.items() if k.startswith("drift/")} == pytest.approx(want)
    assert ("drift/ref_logprob" in metrics) == reference


def test_evaluation_reports_drift_overall_and_per_source(files, tmp_path):
    import json

    from proxima.trainer.datasets import load_prompts
    from proxima.trainer.evaluate import describe, evaluate
    from tests.trainer.nano import nano_trainer

    rows = [{"prompt": f"{a}+1=", "data_source": "low" if a < 5 else "high"} for a in range(10)]
    (tmp_path / "e.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    trainer = nano_trainer(files)
    cfg, tok = trainer.cfg, trainer.roles.tokenizer
    items = list(load_prompts(cfg, tmp_path / "e.jsonl", tok))

    def zero(prompts, responses, columns, ids, mask):
        return torch.zeros(len(prompts))

    res = evaluate(trainer.roles.actor, tok, items, zero, cfg.rollout, torch.device("cpu"))
    keys = [
        "drift/repetition", "drift/dominated", "drift/empty", "drift/distinct_1", "drift/distinct_2"
    ]  # fmt: skip
    assert all(0.0 <= res[k] <= 1.0 for k in keys) and "drift/ref_logprob" not in res
    for part in res["by_source"].values():  # per source the per-answer shares only
        assert sorted(k for k in part if k.startswith("drift/")) == sorted(keys[:3])
    line = f"greedy: drift: {res['drift/dominated']:.0%} of the answers mostly one word, "
    assert any(x.startswith(line) for x in describe({"greedy": res}))


def test_evaluation_reports_each_reward_source_a_weight_zero_judge_included(files, tmp_path):
    import json

    from proxima.rewards.weighted import WeightedPart, WeightedReward
    from proxima.trainer.datasets import load_prompts
    from proxima.trainer.evaluate import describe, evaluate
    from tests.trainer.nano import nano_trainer

    (tmp_path / "e.jsonl").write_text(
        "".join(json.dumps({"prompt": f"{a}+2="}) + "\n" for a in range(6))
    )
    trainer = nano_trainer(files)
    cfg, tok = trainer.cfg, trainer.roles.tokenizer
    items = list(load_prompts(cfg, tmp_path / "e.jsonl", tok))

    def length(prompts, responses, columns, ids, mask):  # the answers' characters
        return torch.tensor([float(len(r)) for r in responses])

    def judge(prompts, responses, columns, ids, mask):  # 1.0 on every other answer
        return torch.tensor([float(i % 2) for i in range(len(responses))])

    reward = WeightedReward(
        [WeightedPart("length", 0.5, length), WeightedPart("judge", 0.0, judge)]
    )
    res = evaluate(trainer.roles.actor, tok, items, reward, cfg.rollout, torch.device("cpu"))
    chars = [float(len(row[1])) for row in res["samples"]]  # all 6 (samples keeps 8)
    assert res["reward/length"] == pytest.approx(sum(chars) / len(chars))
    assert res["reward/judge"] == pytest.approx(0.5)  # 3 of 6, weight 0 or not
    assert res["mean_reward"] == pytest.approx(0.5 * res["reward/length"])  # the weighted sum
    line = f"greedy: by reward source: length {res['reward/length']:.4f}, judge 0.5000"
    assert line in describe({"greedy": res})
    one = evaluate(trainer.roles.actor, tok, items, length, cfg.rollout, torch.device("cpu"))
    assert not any(k.startswith("reward/") for k in one)  # a single source: nothing to split


def test_curves_put_the_reward_sources_in_one_panel_beside_the_score():
    from types import SimpleNamespace

    from proxima.recipes.ppo import PLOT_KEYS, PPORecipe

    recipe = PPORecipe.__new__(PPORecipe)
    recipe.trainer = SimpleNamespace(roles=SimpleNamespace(reward=lambda *a: None))
    assert recipe._plot_keys() == PLOT_KEYS  # one source: nothing to add
    recipe.trainer.roles.reward = SimpleNamespace(names=["form", "judge"])
    keys = recipe._plot_keys()
    assert keys[:2] == ["score", ("reward sources", ["reward/form", "reward/judge"])]
    drift = ["drift/repetition", "drift/dominated", "drift/empty", "drift/distinct_2"]
    assert ("drift (0-1)", drift) in keys
