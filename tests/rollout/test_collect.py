"""Rollout collection: masks end at the first EOS, pads after it, groups of n samples, the
no-stop penalty, stop ids; and the Experience container's select / split / to.

The sampler is made uniform over the vocabulary (lm_head weights zeroed), so EOS comes with
probability 1/V per step: with a fixed seed some responses stop early and some run to the
length limit. Oracles are plain Python loops over the generated ids.
"""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch

from proxima.algos import shape_rewards
from proxima.config import RolloutConfig
from proxima.data import PromptItem
from proxima.models import build_char_tokenizer, build_tiny_model
from proxima.rewards import FunctionReward
from proxima.rollout.collect import Rollout, cat_rollouts, collect, select_groups, stop_token_ids
from proxima.rollout.types import Generation
from proxima.types import Experience

ALPHABET = "abc"  # V = 4 special + 3 = 7: P(EOS) = 1/7 per step, P(no stop in 6) = 0.40
PROMPTS = ["ab", "c", "abca", "b"]
MAX_LEN = 6


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(ALPHABET)


@pytest.fixture(scope="module")
def uniform_actor(tok):
    model = build_tiny_model("llama", tok, "nano", max_positions=32, seed=0)
    with torch.no_grad():
        model.lm_head.weight.zero_()  # every logit 0: a uniform sampler
    return model


def _items(tok) -> list[PromptItem]:
    return [
        PromptItem(text=p, ids=tok(p, add_special_tokens=False)["input_ids"], columns={"tag": i})
        for i, p in enumerate(PROMPTS)
    ]


def length_reward(prompts, responses, tag):
    """Score = response length in characters + 10 x the prompt's tag column."""
    return [len(r) + 10 * t for r, t in zip(responses, tag, strict=True)]


@pytest.fixture(scope="module")
def rollout(tok, uniform_actor):
    cfg = RolloutConfig(
        n=3, max_response_length=MAX_LEN, no_stop_penalty=-0.5, micro_batch_size=5
    )  # 12 sequences in chunks of 5, 5, 2
    torch.manual_seed(0)
    return collect(
        uniform_actor, tok, _items(tok), FunctionReward(length_reward), cfg, torch.device("cpu")
    )


def _first_eos(row: list[int], eos: int) -> int | None:
    return row.index(eos) if eos in row else None


def test_response_mask_ends_at_first_eos_and_pads_after(rollout, tok):
    gen = rollout.gen
    r = gen.response_mask.shape[1]
    assert r <= MAX_LEN and gen.input_ids.shape == gen.attention_mask.shape
    stopped = []
    for row, mask in zip(gen.response_ids.tolist(), gen.response_mask.tolist(), strict=True):
        stop = _first_eos(row, tok.eos_token_id)
        stopped.append(stop is not None)
        n_real = stop + 1 if stop is not None else r  # the EOS itself is a response token
        assert mask == [1] * n_real + [0] * (r - n_real)
        assert row[n_real:] == [tok.pad_token_id] * (r - n_real)
    # the fixed seed must exercise both kinds of rows, else the checks above prove little
    assert any(stopped) and not all(stopped)
    assert gen.stopped.tolist() == stopped
    assert torch.equal(gen.attention_mask[:, -r:], gen.response_mask)


def test_prompts_left_padded_and_grouped(rollout, tok):
    gen, r = rollout.gen, rollout.gen.response_mask.shape[1]
    assert rollout.group_ids.tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3]
    assert rollout.prompts == [p for p in PROMPTS for _ in range(3)]
    assert rollout.columns == {"tag": [i for i in range(4) for _ in range(3)]}
    for row, prompt in enumerate(rollout.prompts):
        ids = gen.input_ids[row, :-r].tolist()
        mask = gen.attention_mask[row, :-r].tolist()
        want = tok(prompt, add_special_tokens=False)["input_ids"]
        pad = len(ids) - len(want)
        assert ids == [tok.pad_token_id] * pad + want and mask == [0] * pad + [1] * len(want)


def test_scores_raw_and_no_stop_penalty_only_without_stop(rollout, tok):
    gen = rollout.gen
    decoded = tok.batch_decode(gen.response_ids, skip_special_tokens=True)
    assert rollout.responses == decoded
    tags = rollout.columns["tag"]
    raw = [len(resp) + 10 * t for resp, t in zip(decoded, tags, strict=True)]
    assert rollout.scores.tolist() == pytest.approx(raw)  # the reward source's own output
    assert rollout.scores.dtype == torch.float32
    # the penalty is reward shaping (phase 4): it lands on rows that never stopped
    want = [s - (0.0 if stop else 0.5) for s, stop in zip(raw, gen.stopped.tolist(), strict=True)]
    mask = gen.response_mask
    shaped, _ = shape_rewards(
        rollout.scores,
        gen.stopped,
        torch.zeros(mask.shape),
        mask,
        kl_coef=0.0,
        clip_reward_value=None,
        no_stop_penalty=RolloutConfig(no_stop_penalty=-0.5).no_stop_penalty,
    )
    assert shaped.sum(-1).tolist() == pytest.approx(want)


def test_greedy_samples_of_a_group_are_identical(tok, uniform_actor):
    cfg = RolloutConfig(n=3, max_response_length=4, micro_batch_size=64)
    ro = collect(
        uniform_actor,
        tok,
        _items(tok)[:2],
        FunctionReward(length_reward),
        cfg,
        torch.device("cpu"),
        greedy=True,
        n=2,
    )
    assert ro.group_ids.tolist() == [0, 0, 1, 1]  # the n argument overrides cfg.n
    ids = ro.gen.input_ids
    assert torch.equal(ids[0], ids[1]) and torch.equal(ids[2], ids[3])


def test_stop_token_ids():
    with_eos = SimpleNamespace(eos_token_id=2)
    assert stop_token_ids(with_eos, RolloutConfig()) == [2]
    assert stop_token_ids(with_eos, RolloutConfig(stop_token_ids=[5, 2, 7])) == [2, 5, 7]
    no_eos = SimpleNamespace(eos_token_id=None)
    assert stop_token_ids(no_eos, RolloutConfig(stop_token_ids=[9])) == [9]
    with pytest.raises(ValueError, match="stop_token_ids"):
        stop_token_ids(no_eos, RolloutConfig())


# --------------------------------------------------------------------------- Experience


def _experience(b: int = 5, p: int = 2, r: int = 3) -> Experience:
    ids = torch.arange(b * (p + r)).reshape(b, p + r)
    per_token = lambda k: torch.full((b, r), float(k)) + torch.arange(b).unsqueeze(1)  # noqa: E731
    return Experience(
        input_ids=ids,
        attention_mask=torch.ones_like(ids),
        response_mask=torch.ones(b, r, dtype=torch.long),
        old_logprobs=per_token(0),
        ref_logprobs=per_token(100),
        values=per_token(200),
        scores=torch.arange(b).float(),
        group_ids=torch.arange(b),
    )


def test_experience_select_keeps_rows_and_shapes():
    exp = _experience()
    sub = exp.select([3, 0])
    assert sub.batch_size == 2 and sub.prompt_length == 2
    assert sub.input_ids.tolist() == [exp.input_ids[3].tolist(), exp.input_ids[0].tolist()]
    assert sub.values[:, 0].tolist() == [203.0, 200.0] and sub.scores.tolist() == [3.0, 0.0]
    assert sub.response_ids.shape == (2, 3)
    assert sub.advantages is None and sub.returns is None  # unset fields stay unset


def test_experience_split_and_to():
    exp = _experience()
    parts = exp.split(2)
    assert [x.batch_size for x in parts] == [2, 2, 1]
    for name in ("input_ids", "old_logprobs", "ref_logprobs", "values", "scores", "group_ids"):
        joined = torch.cat([getattr(x, name) for x in parts])
        assert torch.equal(joined, getattr(exp, name)), name
    moved = exp.to("cpu")
    assert moved.input_ids.shape == exp.input_ids.shape and moved.advantages is None
    assert torch.equal(moved.old_logprobs, exp.old_logprobs)


def _full_rollout(b: int = 4, p: int = 2, r: int = 3) -> Rollout:
    """A rollout of `b` rows (two groups) with every field set, each row's values distinct."""
    ids = torch.arange(b * (p + r)).reshape(b, p + r)
    per_token = torch.arange(b * r).float().reshape(b, r)
    gen = Generation(
        **{f.name: per_token + k for k, f in enumerate(dataclasses.fields(Generation))},
    )
    gen = dataclasses.replace(gen, input_ids=ids, attention_mask=torch.ones_like(ids))
    per_row = torch.arange(b)
    ro = Rollout(
        gen=gen,
        prompts=[f"p{i}" for i in range(b)],
        responses=[f"r{i}" for i in range(b)],
        columns={"answer": [f"a{i}" for i in range(b)], "n": list(range(b))},
        group_ids=per_row // 2,
        scores=per_row.float(),
        reward_baselines=per_row.float() + 10,
        score_components=torch.stack([per_row.float(), per_row.float() * 2], dim=1),
        episodes=[{"turns": i} for i in range(b)],
        versions=per_row + 100,
    )
    unset = [f.name for f in dataclasses.fields(ro) if getattr(ro, f.name) is None]
    assert not unset, f"set every field of Rollout here so the tests below cover it: {unset}"
    return ro


def _rows_of(value, index: list[int]):
    """What row selection must give for one field: its rows `index`, compared as lists."""
    if isinstance(value, torch.Tensor):
        return value[index].tolist()
    if isinstance(value, list):
        return [value[i] for i in index]
    if isinstance(value, dict):
        return {k: _rows_of(v, index) for k, v in value.items()}
    return {f.name: _rows_of(getattr(value, f.name), index) for f in dataclasses.fields(value)}


def _as_lists(value):
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {k: _as_lists(v) for k, v in value.items()}
    if dataclasses.is_dataclass(value):
        return {f.name: _as_lists(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return value


def test_rollout_rows_keeps_every_field():
    ro = _full_rollout()
    picked = ro.rows(torch.tensor([3, 0, 2]))
    for f in dataclasses.fields(Rollout):
        got = _as_lists(getattr(picked, f.name))
        assert got == _rows_of(getattr(ro, f.name), [3, 0, 2]), f.name


def test_select_groups_keeps_every_field_and_renumbers_the_groups():
    ro = _full_rollout()
    picked = select_groups(ro, [1])  # rows 2 and 3
    assert picked.group_ids.tolist() == [0, 0]
    for f in dataclasses.fields(Rollout):
        if f.name != "group_ids":
            got = _as_lists(getattr(picked, f.name))
            assert got == _rows_of(getattr(ro, f.name), [2, 3]), f.name


def test_cat_rollouts_keeps_every_field():
    ro = _full_rollout()
    joined = cat_rollouts([select_groups(ro, [0]), select_groups(ro, [1])], 0)
    assert joined.group_ids.tolist() == [0, 0, 1, 1]  # each part's groups after the last's
    for f in dataclasses.fields(Rollout):
        assert _as_lists(getattr(joined, f.name)) == _as_lists(getattr(ro, f.name)), f.name


def test_the_data_path_containers_are_built_by_keyword():
    ro = _full_rollout()
    with pytest.raises(TypeError):
        Rollout(ro.gen, ro.prompts, ro.responses, ro.columns, ro.group_ids)
