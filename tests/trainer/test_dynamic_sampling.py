"""DAPO's dynamic sampling (`algorithm.filter_groups`): constant groups are dropped, more
prompts generated until the batch is full, the accounting is exact, the batch keeps its
shape; and the overlong penalty and mask_truncated reach the scores and the loss mask."""

from __future__ import annotations

import copy

import pytest
import torch

from proxima.rng import seed_everything
from tests.e2e.rewards_fixture import fn
from tests.trainer.nano import REWARD, nano_files, nano_trainer


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    return nano_files(tmp_path_factory.mktemp("dapo"))


def _informative(batch) -> list[bool]:
    return [int(item.text[0]) % 2 == 0 for item in batch]


def test_dynamic_sampling_fills_the_batch_with_informative_groups(files):
    trainer = nano_trainer(
        files,
        f"reward.function={REWARD}:even_first_digit_varies",
        "algorithm.adv_estimator=grpo",
        "rollout.n=2",
        "algorithm.filter_groups=true",
        "algorithm.max_gen_batches=10",
    )
    # the prompt batches the loader will hand out, read from a copy of it
    loader = copy.deepcopy(trainer.loader)
    kept, rounds = [], 0
    while len(kept) < 8:
        batch = next(loader)
        rounds += 1
        kept += [it.text for it, ok in zip(batch, _informative(batch), strict=True) if ok]
    metrics, ro = trainer.step()
    assert metrics["dapo/gen_batches"] == rounds > 1
    assert metrics["dapo/groups_generated"] == 8 * rounds
    assert metrics["dapo/groups_kept"] == 8
    assert metrics["dapo/groups_filled"] == 0
    # the batch: the first 8 informative prompts, in order, two samples each, scores 0 and 1
    assert ro.prompts == [p for p in kept[:8] for _ in range(2)]
    assert ro.group_ids.tolist() == [g for g in range(8) for _ in range(2)]
    assert ro.scores.tolist() == [0.0, 1.0] * 8
    assert ro.gen.input_ids.shape[0] == 16
    # the next iteration starts after the prompts this one consumed
    assert trainer.loader.state_dict() == loader.state_dict()


def test_a_batch_still_short_after_max_gen_batches_is_filled_with_dropped_groups(files):
    trainer = nano_trainer(
        files,
        f"reward.function={REWARD}:even_first_digit_varies",
        "algorithm.adv_estimator=grpo",
        "rollout.n=2",
        "algorithm.filter_groups=true",
        "algorithm.max_gen_batches=1",
    )
    batch = next(copy.deepcopy(trainer.loader))
    good = sum(_informative(batch))
    metrics, ro = trainer.step()
    assert metrics["dapo/gen_batches"] == 1
    assert metrics["dapo/groups_kept"] == good
    assert metrics["dapo/groups_filled"] == 8 - good
    # informative groups first, then the dropped ones that fill the batch
    order = [it.text for it, ok in zip(batch, _informative(batch), strict=True) if ok]
    order += [it.text for it, ok in zip(batch, _informative(batch), strict=True) if not ok]
    assert ro.prompts[::2] == order


def test_no_group_informative_runs_every_round_and_still_trains(files, capsys):
    trainer = nano_trainer(
        files,
        f"reward.function={REWARD}:constant",
        "algorithm.adv_estimator=grpo",
        "rollout.n=2",
        "algorithm.filter_groups=true",
        "algorithm.max_gen_batches=3",
    )
    metrics, ro = trainer.step()
    assert metrics["dapo/gen_batches"] == 3
    assert metrics["dapo/groups_generated"] == 24
    assert (metrics["dapo/groups_kept"], metrics["dapo/groups_filled"]) == (0, 8)
    assert len(ro.prompts) == 16
    said = capsys.readouterr().err
    assert "dapo: 3 batch(es), 24 groups, and in every group all samples scored the same" in said
    trainer.step()  # said once
    assert "dapo:" not in capsys.readouterr().err


def test_overlong_penalty_and_mask_truncated(files):
    # responses of 6 tokens at most, buffer 4: a response of L tokens loses (L - 2) / 4
    trainer = nano_trainer(
        files,
        f"reward.function={REWARD}:constant",
        "reward.overlong_buffer_len=4",
        "reward.overlong_penalty_factor=1.0",
        "rollout.mask_truncated=true",
    )
    seen = {}
    update = trainer.update

    def spy(exp):
        seen["mask"], seen["stopped"] = exp.response_mask.clone(), exp.stopped.clone()
        return update(exp)

    trainer.update = spy
    metrics, ro = trainer.step()
    lengths = ro.gen.response_mask.sum(1).float()
    expected = 1.0 - ((lengths - 2) / 4).clamp(min=0)
    assert torch.equal(ro.scores, expected)
    assert metrics["overlong_penalty_mean"] == pytest.approx(float((expected - 1).mean()))
    # truncated responses (no stop token) are out of the loss; the others keep their mask
    stopped = seen["stopped"]
    assert stopped.any() and not stopped.all(), "the case needs both kinds of response"
    assert not seen["mask"][~stopped].any()
    assert torch.equal(
        seen["mask"][stopped], ro.gen.response_mask[stopped.to(ro.gen.response_mask.device)]
    )


def _sources(first: str) -> str:
    """Two reward sources: `first` and the share of sevens, standardised on its own."""
    return (
        f"reward.sources=[{{name: first, function: '{REWARD}:{first}'}}, "
        f"{{name: sevens, function: '{REWARD}:fn', weight: 0.5, normalize: true}}]"
    )


def _steps(files, iterations: int, *extra: str) -> list[tuple[dict, object]]:
    torch.set_num_threads(1)
    trainer = nano_trainer(files, "reward.function=", "algorithm.adv_estimator=grpo", *extra)
    seed_everything(0)  # both runs sample from the same random stream
    try:
        return [trainer.step() for _ in range(iterations)]
    finally:
        trainer.close()


def _comparable(metrics: dict) -> dict:
    """The metrics but the wall-clock ones (a source's seconds too) and dynamic sampling's."""
    timed = ("time/", "tokens_per_s", "dapo/")
    return {k: v for k, v in metrics.items() if not (k.startswith(timed) or k.endswith("/seconds"))}


def test_dynamic_sampling_that_keeps_every_group_trains_as_without_it_beside_reward_sources(files):
    # every group varies (one sample of each scores 1 on `first`): dynamic sampling keeps
    # the one batch it generated, so each iteration is the unfiltered run's, per-source
    # metrics and each source's standardisation included
    common = ("rollout.n=2", _sources("first_sample_correct"))
    plain = _steps(files, 2, *common)
    dapo = _steps(files, 2, *common, "algorithm.filter_groups=true", "algorithm.max_gen_batches=3")
    for (m_plain, ro_plain), (m_dapo, ro_dapo) in zip(plain, dapo, strict=True):
        assert m_dapo["dapo/gen_batches"] == 1
        assert {"reward/first", "reward/sevens"} <= m_dapo.keys()
        assert _comparable(m_dapo) == _comparable(m_plain)
        assert torch.equal(ro_dapo.score_components, ro_plain.score_components)


def test_dynamic_sampling_carries_each_sources_score_of_the_kept_groups(files):
    [(metrics, ro)] = _steps(
        files,
        1,
        "rollout.n=2",
        _sources("even_first_digit_varies"),
        "algorithm.filter_groups=true",
        "algorithm.max_gen_batches=10",
    )
    assert metrics["dapo/gen_batches"] > 1 and metrics["dapo/groups_kept"] == 8
    assert ro.score_components is not None and ro.score_components.shape == (16, 2)
    first, sevens = ro.score_components[:, 0], ro.score_components[:, 1]
    # each row's own score from each source, whichever round it came from
    assert torch.equal(sevens, torch.tensor(fn(ro.prompts, ro.responses)))
    odd = torch.tensor([int(p[0]) % 2 == 1 for p in ro.prompts])
    assert (first[odd] == 0.5).all() and set(first[~odd].tolist()) <= {0.0, 1.0}
    assert torch.equal(ro.scores, first + 0.5 * sevens)  # the batch's scores are their sum
    assert metrics["reward/first"] == pytest.approx(float(first.mean()))
    assert metrics["reward/sevens"] == pytest.approx(float(sevens.mean()))
