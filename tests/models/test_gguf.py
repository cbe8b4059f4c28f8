"""GGUF in and out on tiny local models: the rotary row order by hand, a llama folder written
as GGUF and read back by transformers (logits, tokenizer, chat template), imported back into
a folder, model paths that name a .gguf file, and the errors for files proxima cannot read."""

from __future__ import annotations

import pytest
import torch

gguf = pytest.importorskip("gguf")

from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from proxima.config import load_config  # noqa: E402
from proxima.models import gguf as G  # noqa: E402
from proxima.models.tiny import init_model  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

TEXT = "the cat sat on the mat, 12 times!\nÉté naïve <s> ok"
TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tiny llama with grouped-query attention (4 heads, 2 KV heads), tied embeddings, a
    byte-level BPE and a chat template."""
    root = tmp_path_factory.mktemp("gguf")
    text = root / "text.txt"
    text.write_text((TEXT + " the quick brown fox jumps over the lazy dog\n") * 50)
    folder = init_model(
        root / "llama",
        text_file=text,
        vocab_size=300,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        seed=3,
    )
    tok = AutoTokenizer.from_pretrained(folder)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)
    return folder


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_interleave_rotary_by_hand():
    # one head of head_dim 4 over hidden 1: HF rows [a0 a1 | b0 b1] pair a_i with b_i;
    # llama.cpp wants the pairs adjacent: [a0 b0 a1 b1]
    w = torch.tensor([[0.0], [1.0], [10.0], [11.0]])
    assert G.interleave_rotary(w, 1).flatten().tolist() == [0.0, 10.0, 1.0, 11.0]
    # two heads: each head on its own
    w2 = torch.arange(8.0).reshape(8, 1)
    assert G.interleave_rotary(w2, 2).flatten().tolist() == [0, 2, 1, 3, 4, 6, 5, 7]


def test_tensor_names():
    assert G.gguf_tensor_name("model.layers.7.self_attn.k_proj.weight") == "blk.7.attn_k.weight"
    assert G.gguf_tensor_name("model.embed_tokens.weight") == "token_embd.weight"
    with pytest.raises(G.GGUFError, match="no GGUF name"):
        G.gguf_tensor_name("model.layers.0.self_attn.q_proj.bias")


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_export_reads_back_with_transformers(llama, tmp_path, dtype):
    out = G.export_gguf(llama, tmp_path / "m.gguf", dtype)
    model = AutoModelForCausalLM.from_pretrained(llama)
    tok = AutoTokenizer.from_pretrained(llama)
    back = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=out.name, dtype=torch.float32)
    back_tok = AutoTokenizer.from_pretrained(tmp_path, gguf_file=out.name)
    assert back_tok(TEXT)["input_ids"] == tok(TEXT)["input_ids"]
    assert back_tok.decode(tok(TEXT)["input_ids"]) == TEXT
    assert back_tok.chat_template == TEMPLATE
    assert back.config.num_key_value_heads == 2 and back.config.tie_word_embeddings
    ids = torch.tensor([tok(TEXT)["input_ids"]])
    a, b = _logits(model, ids), _logits(back, ids)
    if dtype == "f32":
        assert torch.equal(a, b)
    else:  # the weights rounded to float16: within its relative precision (2^-11)
        assert not torch.equal(a, b)
        assert (a - b).abs().max() < 2e-3 * a.abs().max()


def test_export_refuses(llama, tmp_path):
    (tmp_path / "taken.gguf").write_bytes(b"x")
    with pytest.raises(G.GGUFError, match="exists"):
        G.export_gguf(llama, tmp_path / "taken.gguf")
    gpt2 = init_model(tmp_path / "gpt2", arch="gpt2", size="nano", alphabet="abc ")
    with pytest.raises(G.GGUFError, match="llama-architecture.*`gpt2`.*convert_hf_to_gguf"):
        G.export_gguf(gpt2, tmp_path / "g.gguf")
    with pytest.raises(G.GGUFError, match="one of f16, f32"):
        G.export_gguf(llama, tmp_path / "q.gguf", "q4_0")


def test_export_refuses_another_architecture_before_loading_it(tmp_path):
    """A Gemma 3 folder holding only its config.json: refused from the config alone, naming the
    architecture and what is written, before any weight is read."""
    from transformers import Gemma3TextConfig

    Gemma3TextConfig(num_hidden_layers=2, hidden_size=64, vocab_size=128).save_pretrained(tmp_path)
    with pytest.raises(G.GGUFError, match=r"llama-architecture models \(SmolLM2.*`gemma3_text`"):
        G.export_gguf(tmp_path, tmp_path / "g.gguf")
    assert not (tmp_path / "g.gguf").exists()


def test_turn_format_for_a_file_without_a_chat_template(llama):
    """A Gemma file without a template gets Gemma's turns; its generation stops at a turn's
    end as well as at EOS. A tokenizer with a template of its own keeps it."""
    from transformers import AutoTokenizer, GenerationConfig

    tok = AutoTokenizer.from_pretrained(llama)
    tok.add_tokens(["<start_of_turn>", "<end_of_turn>"], special_tokens=True)
    tok.bos_token = "<start_of_turn>"  # any special token: the template writes bos_token first
    tok.chat_template = None
    model = type("M", (), {"generation_config": GenerationConfig(eos_token_id=1)})()
    G._add_turn_format(model, tok, "gemma3")
    messages = [
        {"role": "system", "content": "S."},
        {"role": "user", "content": " a \n"},
        {"role": "assistant", "content": "b"},
    ]
    text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<start_of_turn><start_of_turn>user\nS.\n\na<end_of_turn>\n"
        "<start_of_turn>model\nb<end_of_turn>\n<start_of_turn>model\n"
    )
    assert model.generation_config.eos_token_id == [1, tok.convert_tokens_to_ids("<end_of_turn>")]
    kept = "{{ messages[0]['content'] }}"
    tok.chat_template = kept
    G._add_turn_format(model, tok, "gemma3")
    assert tok.chat_template == kept


def test_character_tokenizer_exports(tmp_path):
    """proxima's character tokenizer (a BPE without merges) numbers its tokens the same in
    the file: the default example's actor can be exported."""
    folder = init_model(tmp_path / "char", size="nano", alphabet="0123456789+= ")
    out = G.export_gguf(folder, tmp_path / "c.gguf", "f32")
    tok = AutoTokenizer.from_pretrained(folder)
    back = AutoTokenizer.from_pretrained(tmp_path, gguf_file=out.name)
    for text in ("37+48=85", "1 2 3"):
        assert back(text)["input_ids"] == tok(text)["input_ids"]


def test_import_round_trip(llama, tmp_path):
    """export -> import gives a plain folder whose model equals the GGUF load and the
    original, with the tokenizer, chat template and pad token kept."""
    file = G.export_gguf(llama, tmp_path / "m.gguf", "f32")
    folder = G.import_gguf(file, tmp_path / "imported")
    assert (folder / "model.safetensors").is_file() and (
        folder / "generation_config.json"
    ).is_file()
    model = AutoModelForCausalLM.from_pretrained(folder)
    assert "quantization_config" not in model.config.to_dict()
    tok = AutoTokenizer.from_pretrained(folder)
    assert tok.chat_template == TEMPLATE and tok.pad_token == "<pad>"
    assert len(tok) == len(AutoTokenizer.from_pretrained(llama)) == model.config.vocab_size
    ids = torch.tensor([tok(TEXT)["input_ids"]])
    original = AutoModelForCausalLM.from_pretrained(llama)
    loaded, _ = G.load_gguf(file)
    assert torch.equal(_logits(model, ids), _logits(original, ids))
    assert torch.equal(_logits(model, ids), _logits(loaded, ids))
    with pytest.raises(G.GGUFError, match="not an empty folder"):
        G.import_gguf(file, folder)


def test_unreadable_files_named(tmp_path):
    text = tmp_path / "notes.gguf"
    text.write_text("hello")
    assert "not a GGUF file" in G.gguf_problem(text)
    assert "is not a file" in G.gguf_problem(tmp_path / "missing.gguf")
    w = gguf.GGUFWriter(tmp_path / "odd.gguf", "nosucharch")
    w.add_tensor("x", torch.zeros(2).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    problem = G.gguf_problem(tmp_path / "odd.gguf")
    assert "`nosucharch` model" in problem and "transformers cannot build" in problem
    with pytest.raises(G.GGUFError, match="`model.actor_path`: .*nosucharch"):
        G.cached_import(tmp_path / "odd.gguf", "model.actor_path")


@pytest.mark.parametrize("keep", [20, 0.5])  # inside the header; inside the tensors
def test_truncated_files_named_before_loading(llama, tmp_path, keep, capsys):
    from proxima.cli import main

    whole = G.export_gguf(llama, tmp_path / "whole.gguf", "f32").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(whole[: keep if isinstance(keep, int) else int(len(whole) * keep)])
    assert "cut.gguf is truncated or damaged" in G.gguf_problem(cut)
    assert "Copy or download the file again" in G.gguf_problem(cut)
    for argv in (["chat", str(cut), "--prompt", "hi"], ["import", str(cut), "--out", "x"]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert f"`{argv[0]}" in err and "is truncated or damaged" in err
        assert "Traceback" not in err


def test_unwritable_destinations_named_before_the_work(llama, tmp_path, monkeypatch, capsys):
    """A destination under a file (as /sys, or a read-only place, refuses writes), named by
    its flag or variable before any model loads; a missing folder is created."""
    from proxima.cli import main

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    file = G.export_gguf(llama, tmp_path / "m.gguf", "f32")
    assert main(["export", str(llama), "--gguf", str(blocker / "m.gguf")]) == 2
    assert f"--gguf {blocker / 'm.gguf'}: {blocker} is a file" in capsys.readouterr().err
    assert main(["import", str(file), "--out", str(blocker / "m")]) == 2
    assert f"--out {blocker / 'm'}: {blocker} is a file" in capsys.readouterr().err
    assert main(["export", str(llama), "--gguf", str(tmp_path / "new" / "m.gguf")]) == 0
    assert (tmp_path / "new" / "m.gguf").is_file()
    monkeypatch.setenv(G.CACHE_ENV, str(blocker / "cache"))
    with pytest.raises(G.GGUFError, match=f"`model.actor_path`: .*{G.CACHE_ENV} to a writable"):
        G.cached_import(file, "model.actor_path")


def test_a_full_disk_during_export_names_the_file_and_leaves_none(llama, tmp_path):
    import resource
    import subprocess
    import sys

    def cap() -> None:  # the GGUF file of the tiny llama is larger than 4 kB
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    out = tmp_path / "m.gguf"
    argv = [sys.executable, "-m", "proxima.cli", "export", str(llama), "--gguf", str(out)]
    proc = subprocess.run(argv, capture_output=True, text=True, preexec_fn=cap)
    assert proc.returncode == 2, proc.stderr
    assert f"cannot write {out} (File too large; a full disk" in proc.stderr
    assert list(tmp_path.iterdir()) == []  # no cut file, no temporary one


def test_model_paths_resolve_to_a_cached_import(llama, tmp_path, monkeypatch):
    monkeypatch.setenv(G.CACHE_ENV, str(tmp_path / "cache"))
    file = G.export_gguf(llama, tmp_path / "m.gguf", "f32")
    cfg = load_config(
        None,
        [f"model.actor_path={file}", "data.train_path=p.jsonl", "reward.function=r.py:f"],
        command="train",
    )
    assert G.gguf_keys(cfg) == {"model.actor_path": str(file)}
    resolved = G.resolve_gguf_paths(cfg)
    folder = resolved.model.actor_path
    assert folder.startswith(str(tmp_path / "cache" / "gguf" / "m-"))
    stamp = (G.cached_folder(file) / "model.safetensors").stat().st_mtime_ns
    again = G.resolve_gguf_paths(cfg)  # reused, not imported again
    assert again.model.actor_path == folder
    assert (G.cached_folder(file) / "model.safetensors").stat().st_mtime_ns == stamp
    assert G.resolve_gguf_paths(resolved) is resolved  # nothing left to resolve
    # a teacher (on-policy distillation) given as the file: the same import, the same folder
    teacher = cfg.replace({"model.teacher_path": str(file)})
    assert G.gguf_keys(teacher)["model.teacher_path"] == str(file)
    assert G.resolve_gguf_paths(teacher).model.teacher_path == folder
