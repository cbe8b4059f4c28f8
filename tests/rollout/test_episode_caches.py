"""Multi-turn episodes on the hf engine with each episode's KV cache kept between turns
(`HFEngine.session`, `rollout.env.keep_kv_cache`) against the same episodes prefilled whole
at every turn: greedy and seeded sampled episodes are the same tokens, their log-probs and
values within float rounding, with episodes that end at different turns, in several
micro-batches, at the episode budget, and with an engine that samples past the stop string
(the action is cut, the tokens after the cut are never reused); the cache is used (only the
new tokens are prefilled); where it does not apply, the episodes fall back to whole
prefills."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from proxima.config import Config
from proxima.data import PromptItem
from proxima.models import ARCHITECTURES, build_char_tokenizer, build_tiny_model
from proxima.models.critic import PolicyValue
from proxima.rollout.collect import generate_rollout
from proxima.rollout.decode import caches_kept_apply
from proxima.rollout.hf_engine import HFEngine
from proxima.rollout.types import Sampling
from tests.rollout.scripted import spec

pytestmark = pytest.mark.usefixtures("one_thread")

ALPHABET = "0123456789+=xyz"
PROMPTS = ["12+34", "7+8", "99+1", "3+3+3", "5", "64+2", "1+1"]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer(ALPHABET)


def _model(tok, arch: str = "llama"):
    return build_tiny_model(
        arch, tok, "nano", max_positions=96, seed=3, initializer_range=0.3
    ).eval()


@pytest.fixture(scope="module")
def model(tok):
    return _model(tok)


def _items(tok) -> list[PromptItem]:
    """Episodes of 1 to 4 turns (`Varied`), prompts of 1 to 5 tokens."""
    return [
        PromptItem(p, tok(p, add_special_tokens=False)["input_ids"], {"i": i, "turns": 1 + i % 4})
        for i, p in enumerate(PROMPTS)
    ]


def _cfg(keep: bool, **keys):
    env = {"cls": spec("Varied"), "max_turns": 4, "max_turn_tokens": 5}
    env |= {"max_episode_tokens": 24, "turn_stop": ["="], "keep_kv_cache": keep} | keys
    return (
        Config()
        .replace({"rollout.temperature": 0.8, **{f"rollout.env.{k}": v for k, v in env.items()}})
        .rollout
    )


def _episodes(model, tok, keep: bool, seed: int | None = None, micro: int = 3, strings=True, **kw):
    """The rollout of `_items` on an hf engine of `micro` rows a micro-batch (`strings`:
    the engine stops on the turn's stop string itself; else it runs on and the episode cuts
    the action); greedy unless a `seed` is given."""
    engine = HFEngine(model, tok.pad_token_id, micro, tok if strings else None)
    if seed is not None:
        torch.manual_seed(seed)
    values = isinstance(model, PolicyValue)
    greedy = seed is None
    cfg = _cfg(keep, **kw)
    return generate_rollout(
        engine, tok, _items(tok), cfg, CPU, greedy=greedy, n=1, logprobs=True, values=values
    )


def _assert_same(got, want) -> None:
    g, w = got.gen, want.gen
    assert g.input_ids.tolist() == w.input_ids.tolist()
    assert g.response_mask.tolist() == w.response_mask.tolist()
    assert g.stopped.tolist() == w.stopped.tolist()
    assert torch.equal(g.turn_rewards, w.turn_rewards)
    torch.testing.assert_close(g.logprobs, w.logprobs, rtol=0, atol=1e-5)
    if w.values is not None:
        torch.testing.assert_close(g.values, w.values, rtol=0, atol=1e-5)
    assert got.episodes == want.episodes


def _turns(ro) -> list[int]:
    return [len(ep["turns"]) for ep in ro.episodes]


@pytest.mark.parametrize("micro", [2, 7])
def test_greedy_episodes_equal_whole_prefills(model, tok, micro):
    got = _episodes(model, tok, True, micro=micro)
    _assert_same(got, _episodes(model, tok, False, micro=micro))
    assert len(set(_turns(got))) > 2  # episodes end at different turns
    assert any("=" in t["action"] for ep in got.episodes for t in ep["turns"])


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_architecture(tok, arch):
    # rotary positions and absolute ones (gpt2): a kept row's keys are where a whole
    # prefill puts them
    model = _model(tok, arch)
    _assert_same(_episodes(model, tok, True), _episodes(model, tok, False))


def test_sampled_episodes_with_a_seed_are_the_same(model, tok):
    for seed in (0, 1):
        got = _episodes(model, tok, True, seed=seed)
        _assert_same(got, _episodes(model, tok, False, seed=seed))
        assert len(set(_turns(got))) > 1


def test_values_of_an_actor_with_the_critic(model, tok):
    head = nn.Linear(model.config.hidden_size, 1)
    torch.nn.init.normal_(head.weight, std=0.5)
    actor = PolicyValue(model, head).eval()
    got = _episodes(actor, tok, True)
    _assert_same(got, _episodes(actor, tok, False))
    assert bool((got.gen.values != 0).any())


@pytest.mark.parametrize("micro", [1, 3])
def test_actions_cut_after_the_engine_ran_on(model, tok, micro):
    """The engine does not stop on "=" (no tokenizer): it samples on, the episode cuts the
    action after "=", and the tokens sampled after the cut, in the kept cache, are not
    reused (one row a micro-batch: no other row's new tokens cover them)."""
    got = _episodes(model, tok, True, micro=micro, strings=False)
    _assert_same(got, _episodes(model, tok, False, micro=micro, strings=False))
    cut = [t["action"] for ep in got.episodes for t in ep["turns"][:-1] if t["action"][-1:] == "="]
    assert any(len(a) < 5 for a in cut)  # cut before the turn's budget, then continued


def test_the_episode_budget(model, tok):
    """Episodes of at most 9 tokens after the prompt: actions cut at the budget and
    episodes ended by it."""
    got = _episodes(model, tok, True, max_episode_tokens=9)
    _assert_same(got, _episodes(model, tok, False, max_episode_tokens=9))
    assert "max_episode_tokens" in [ep["end"] for ep in got.episodes]


def test_turns_prefill_only_the_new_tokens(model, tok):
    """After the first turn a prefill computes only the last columns of the contexts: as
    many as the row with the most new tokens (its observation and its last action token, at
    most 3 + 1 here; more where a turn was cut at an engine's stop: none here)."""
    widths = {}
    for keep in (True, False):
        shapes = []
        hook = model.model.register_forward_pre_hook(
            lambda m, a, kw, out=shapes: out.append(tuple(kw["input_ids"].shape)),
            with_kwargs=True,
        )
        try:
            _episodes(model, tok, keep, micro=7)
        finally:
            hook.remove()
        widths[keep] = [w for _, w in shapes if w > 1]  # the prefills, one per turn
    assert len(widths[True]) == len(widths[False]) == 4
    assert widths[True][0] == widths[False][0]  # the first turn: the prompts
    assert all(w <= 4 for w in widths[True][1:])
    assert all(w > 6 for w in widths[False][1:])


def test_where_caches_are_not_kept(tok):
    """A generation_config the decode loop does not apply (HF generate serves it), a model
    with sliding-window layers: no session, each turn prefilled whole (as with
    rollout.env.keep_kv_cache=false, the other side of every test above)."""
    model = _model(tok)
    engine = HFEngine(model, tok.pad_token_id, 3, tok)
    session = engine.session()
    ids, mask = torch.tensor([[4, 5]]), torch.ones((1, 2), dtype=torch.long)
    with pytest.raises(ValueError, match="one action per row, not n=2"):
        session.generate([0], ids, mask, Sampling(4, (tok.eos_token_id,), n=2))
    model.generation_config.repetition_penalty = 1.3
    assert engine.session() is None
    ro = generate_rollout(engine, tok, _items(tok), _cfg(True), CPU, greedy=True, n=1)
    assert len(ro.episodes) == len(PROMPTS)
    sliding = build_tiny_model(
        "qwen2", tok, "nano", use_sliding_window=True, sliding_window=4, max_window_layers=0
    )
    assert caches_kept_apply(sliding) == "Qwen2ForCausalLM has sliding-window cache layers"
    assert HFEngine(sliding, tok.pad_token_id, 3, tok).session() is None
