"""Rollout: response mask after stop tokens; generation chunks; left-padding invariance."""

import pytest
import torch

from proxima.models import build_char_tokenizer, build_tiny_model
from proxima.rollout.hf_engine import HFEngine, response_mask_after_stop
from proxima.rollout.types import Sampling


def test_mask_keeps_tokens_through_first_stop():
    # rows: stop at t=1; no stop; stop at t=0 then junk; two stop ids, second one first
    ids = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 9, 9, 9], [5, 3, 2, 0]])
    mask, stopped = response_mask_after_stop(ids, [2, 3])
    assert mask.tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0], [1, 1, 0, 0]]
    assert stopped.tolist() == [True, False, True, True]


def test_mask_when_pad_equals_eos():
    # pad id == eos id == 2: everything after the first 2 is padding and masked
    ids = torch.tensor([[4, 4, 2, 2, 2]])
    mask, stopped = response_mask_after_stop(ids, [2])
    assert mask.tolist() == [[1, 1, 1, 0, 0]] and stopped.tolist() == [True]


# the decode loop, and HF generate; seeds whose greedy answer runs past 4 tokens
@pytest.mark.parametrize("arch, seed", [("llama", 1), ("gpt2", 2)])
def test_the_models_generation_config_eos_ends_a_response(arch, seed):
    """An end-of-turn id the model's generation_config lists beside EOS (Gemma 3's
    `<end_of_turn>`, added on import) ends a response as HF `generate` and vLLM end it,
    without `rollout.stop_token_ids`."""
    tok = build_char_tokenizer("abcdefgh ")
    model = build_tiny_model(arch, tok, "nano", max_positions=64, seed=seed, initializer_range=0.5)
    model.generation_config.eos_token_id = None
    engine = HFEngine(model, tok.pad_token_id, micro_batch_size=4)
    prompt = torch.tensor([tok.encode("abc")])
    sampling = Sampling(max_new_tokens=12, stop_ids=(tok.eos_token_id,), greedy=True)
    free = engine.generate(prompt, torch.ones_like(prompt), sampling)
    tokens = free.input_ids[0, prompt.shape[1] :].tolist()
    end = tokens[2]  # the 3rd greedy token becomes an end of turn
    assert end not in (tok.eos_token_id, tok.pad_token_id) and free.response_mask[0].sum() > 4
    model.generation_config.eos_token_id = [tok.eos_token_id, end]
    ended = engine.generate(prompt, torch.ones_like(prompt), sampling)
    cut = tokens.index(end) + 1  # the first time the model says it
    assert ended.input_ids[0, prompt.shape[1] :].tolist() == tokens[:cut]
    assert ended.response_mask[0].tolist() == [1] * cut
    assert ended.stopped.tolist() == [True]
