"""Multi-turn episodes on each real engine (hf; vLLM under the `vllm` marker): greedy episodes
of both engines are the same tokens (turn stops at the string "=", observations appended,
their mask 0); sampled episodes' engine log-probs at action tokens equal the trainer's
forward pass over the whole episode (float32)."""

from __future__ import annotations

import pytest
import torch

from proxima.config import Config
from proxima.data import PromptItem
from proxima.models import build_char_tokenizer, build_tiny_model
from proxima.rollout.collect import generate_rollout
from proxima.rollout.experience import sequence_logprobs
from proxima.rollout.hf_engine import HFEngine
from tests.rollout.scripted import spec

ALPHABET = "0123456789+=xyz"
PROMPTS = ["12+34", "7+8", "99+1", "3+3+3"]
LOGPROB_TOL = 1e-4  # as the engine contract: float32 on both sides


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    tok = build_char_tokenizer(ALPHABET)
    model = build_tiny_model(
        "llama",
        tok,
        "nano",
        max_positions=64,
        seed=0,
        num_attention_heads=1,
        num_key_value_heads=1,
        tie_word_embeddings=True,
        initializer_range=0.3,
    ).eval()
    folder = tmp_path_factory.mktemp("episode-model")
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    cfg = Config().replace(
        {
            "model.actor_path": str(folder),
            "model.dtype": "float32",
            "data.max_prompt_length": 16,
            "rollout.env.cls": spec("Never"),
            "rollout.env.max_turns": 3,
            "rollout.env.max_turn_tokens": 6,
            "rollout.env.max_episode_tokens": 30,
            "rollout.env.turn_stop": ["="],
            "rollout.temperature": 0.9,
        }
    )
    items = [PromptItem(p, tok(p, add_special_tokens=False)["input_ids"]) for p in PROMPTS]
    return tok, model, cfg, items


def _engine(name: str, setup):
    tok, model, cfg, _ = setup
    if name == "hf":
        return HFEngine(model, tok.pad_token_id, 3, tok)
    from proxima.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(cfg.replace({"rollout.name": "vllm"}), tok, torch.device("cpu"))
    from proxima.models.saving import export_weights

    engine.update_weights(export_weights(model), 0)
    return engine


ENGINES = ["hf", pytest.param("vllm", marks=pytest.mark.vllm)]


@pytest.fixture(scope="module", params=ENGINES)
def engine(request, setup):
    return _engine(request.param, setup)


def test_greedy_episodes_match_hf(engine, setup):
    tok, model, cfg, items = setup
    cpu = torch.device("cpu")
    ref = generate_rollout(model, tok, items, cfg.rollout, cpu, greedy=True, n=1)
    got = generate_rollout(engine, tok, items, cfg.rollout, cpu, greedy=True, n=1)
    assert got.gen.response_ids.tolist() == ref.gen.response_ids.tolist()
    assert got.gen.response_mask.tolist() == ref.gen.response_mask.tolist()
    for ep in got.episodes:  # an action that holds "=" ends there
        for turn in ep["turns"]:
            action = turn["action"]
            assert "=" not in action or action.index("=") == len(action) - 1, action
    assert int((got.gen.response_mask == 0).sum()) > 0  # observations are there, masked


def test_sampled_logprobs_equal_trainer(engine, setup):
    tok, model, cfg, items = setup
    torch.manual_seed(0)
    ro = generate_rollout(engine, tok, items, cfg.rollout, torch.device("cpu"), n=2, logprobs=True)
    g = ro.gen
    trainer = sequence_logprobs(model, g, cfg.rollout.temperature, 8)
    torch.testing.assert_close(g.logprobs, trainer, rtol=0, atol=LOGPROB_TOL)
    real = g.attention_mask[:, -g.response_mask.shape[1] :] == 1
    observation = real & (g.response_mask == 0)
    assert (g.response_ids[observation] == tok.convert_tokens_to_ids("z")).all()
