"""Building the vLLM engine leaves the run's random streams alone: vLLM's worker seeds
Python's `random`, numpy and torch with `rollout.vllm.seed` when it starts, and colocated it
starts in the trainer's process, after the trainer seeded them with `trainer.seed`. Without
the engine putting them back, every draw after it (the rollout's per-request seeds among
them) would follow rollout.vllm.seed whatever trainer.seed said.

Its own file: one vLLM engine per module."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from proxima.config import Config
from proxima.rng import seed_everything
from tests.rollout.test_engine_contract import ALPHABET, MAX_NEW, _model

pytestmark = pytest.mark.vllm


def _draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


def test_building_the_engine_keeps_the_trainers_random_streams(tmp_path):
    from proxima.models import build_char_tokenizer
    from proxima.rollout.vllm_engine import VLLMEngine

    tok = build_char_tokenizer(ALPHABET)
    _model(tok, 0).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    cfg = Config().replace(
        {
            "model.actor_path": str(tmp_path),
            "model.dtype": "float32",
            "data.max_prompt_length": 16,
            "rollout.max_response_length": MAX_NEW,
            "rollout.name": "vllm",
            "rollout.vllm.seed": 0,
        }
    )
    seed_everything(1234)
    want = _draws()
    seed_everything(1234)
    engine = VLLMEngine(cfg, tok, torch.device("cpu"))
    try:
        assert _draws() == want
    finally:
        engine.close()
