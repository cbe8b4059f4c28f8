"""GGUF files in and out.

In: transformers reads a GGUF file (llama.cpp's single-file format) through the `gguf`
package and dequantises its tensors; `import_gguf` writes the result as a plain Hugging Face
folder (safetensors, tokenizer with its chat template, generation config), so that every
later run loads a folder. A file without a chat template gets its architecture's turn format
where proxima knows it (`TURN_FORMATS`: Gemma 3). A model path that names a `.gguf` file is
imported once into a cache folder (`cached_import`, `resolve_gguf_paths`) and the run reads
that folder: every check and loader downstream sees an ordinary folder.

Out: `export_gguf` writes a Llama-architecture folder (a trained actor) as an f16 or f32 GGUF
file for llama.cpp and Ollama. The layout is llama.cpp's: tensor names `blk.N.attn_q` ...,
the query and key rows of each head interleaved for its rotary embedding (the inverse of the
permutation transformers undoes when it reads a llama GGUF), 1-d tensors kept in float32,
the byte-level BPE vocabulary as `tokenizer.ggml.*` metadata.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from proxima.files import describe_write_error, write_error

SUFFIX = ".gguf"
MAGIC = b"GGUF"
CACHE_ENV = "PROXIMA_CACHE"  # the cache root; default ~/.cache/proxima
INSTALL = "pip install gguf"
EXPORT_TYPES = ("f16", "f32")


class GGUFError(ValueError):
    """A GGUF file proxima cannot read or a folder it cannot write as one: the message names
    the cause and the fix."""


def is_gguf(path: str | Path) -> bool:
    return str(path).lower().endswith(SUFFIX)


def _require_gguf():
    try:
        import gguf
    except ImportError:
        raise GGUFError(
            f"reading or writing GGUF files needs the `gguf` package: {INSTALL} "
            "(or `pip install 'proxima[gguf]'`)."
        ) from None
    return gguf


@dataclass(frozen=True)
class GGUFHeader:
    """What a GGUF file says about itself, read without its tensor data."""

    architecture: str
    name: str
    tensor_types: dict[str, int]  # quantisation type name -> number of tensors
    tokenizer_model: str | None


def read_header(path: str | Path) -> GGUFHeader:
    gguf = _require_gguf()
    reader = gguf.GGUFReader(str(path))

    def field(key: str):
        f = reader.fields.get(key)
        return f.contents() if f is not None else None

    types: dict[str, int] = {}
    for t in reader.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
    return GGUFHeader(
        architecture=field("general.architecture") or "?",
        name=field("general.name") or Path(path).stem,
        tensor_types=types,
        tokenizer_model=field("tokenizer.ggml.model"),
    )


def _readable_types() -> set[str]:
    """The tensor types the `gguf` package dequantises (the plain float types and every
    quantisation it implements)."""
    quants = _require_gguf().quants
    implemented = {q.name for q in getattr(quants, "_type_traits", {})}
    return implemented | {"F32", "F16", "BF16", "F64", "I8", "I16", "I32", "I64"}


def gguf_problem(path: str | Path) -> str | None:
    """Why `path` cannot be read as a model (the cause and the fix), or None. Reads only the
    header: the architecture must be one transformers builds from GGUF and every tensor's
    type one the `gguf` package dequantises."""
    p = Path(path)
    if not p.is_file():
        return f"{p} is not a file"
    with p.open("rb") as f:
        if f.read(4) != MAGIC:
            return f"{p} is not a GGUF file (it does not start with the GGUF magic bytes)"
    try:
        _require_gguf()
    except GGUFError as err:
        return str(err)
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    try:
        header = read_header(p)
    except (ValueError, IndexError, OverflowError, struct.error) as err:
        # the reader maps the file and cuts it into the arrays its header describes: a cut
        # file fails in numpy or struct, whichever part it reaches first
        cause = f"{type(err).__name__}: {str(err).rstrip('.')}"
        return (
            f"{p} is truncated or damaged: its {p.stat().st_size} bytes do not hold the "
            f"header and tensors it describes ({cause}). Copy or download the file again "
            "(a download that stopped early leaves such a file)."
        )
    arch = header.architecture
    if arch not in GGUF_SUPPORTED_ARCHITECTURES:
        return (
            f"{p} holds a `{arch}` model, an architecture transformers cannot build from GGUF "
            f"(it reads: {', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))}); convert the "
            "original checkpoint to a Hugging Face folder instead, or upgrade transformers."
        )
    unreadable = sorted(set(header.tensor_types) - _readable_types())
    if unreadable:
        return (
            f"{p} stores tensors as {', '.join(unreadable)}, which the installed `gguf` package "
            "cannot dequantise; upgrade it (`pip install -U gguf`) or use a file quantised "
            "otherwise (Q4_0, Q4_1, Q5_*, Q8_0, the K-quants, F16 and F32 are readable)."
        )
    return None


def check_gguf(path: str | Path, key: str) -> None:
    problem = gguf_problem(path)
    if problem:
        raise GGUFError(f"`{key}`: {problem}")


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32):
    """(model, tokenizer) from a GGUF file: the model dequantised to `dtype` and rebuilt as
    an ordinary (unquantised) transformers model, so that it saves and trains like any."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    p = Path(path)
    folder, name = str(p.parent), p.name
    architecture = read_header(p).architecture
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    settings = loaded.config.to_dict()
    settings.pop("quantization_config", None)
    settings.pop("_name_or_path", None)
    model_type = settings.pop("model_type")
    config = AutoConfig.for_model(model_type, **settings)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    missing, _ = model.load_state_dict(loaded.state_dict(), strict=False)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
        missing = [n for n in missing if n != "lm_head.weight"]
    if missing:
        raise GGUFError(f"{p}: the GGUF file gave no values for {', '.join(missing[:5])}")
    model.generation_config = loaded.generation_config
    model.eval()
    tokenizer = _fit_tokenizer(tokenizer, config.vocab_size)
    _add_turn_format(model, tokenizer, architecture)
    return model, tokenizer


# Gemma's turn format (https://ai.google.dev/gemma/docs/core/prompt-structure): a turn is
# `<start_of_turn>ROLE\n...<end_of_turn>\n` with the roles `user` and `model`; Gemma has no
# system role, so a system message opens the first user turn, followed by a blank line.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(prefix='') %}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set ns.prefix = m['content'] + '\n\n' %}"
    "{% else %}"
    "{{ '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\n' }}"
    "{{ ns.prefix + m['content'] | trim + '<end_of_turn>\n' }}"
    "{% set ns.prefix = '' %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
# architecture -> (chat template, the token that ends a turn), for GGUF files that carry no
# template of their own (llama.cpp's converter copies one only when the source folder has it)
TURN_FORMATS = {"gemma3": (GEMMA_CHAT_TEMPLATE, "<end_of_turn>")}


def _add_turn_format(model, tokenizer, architecture: str) -> None:
    """Give a tokenizer without a chat template its architecture's turn format, and make the
    model's generation stop at the end of a turn as well as at EOS (an answer ends with the
    turn, not with the document)."""
    if tokenizer.chat_template or architecture not in TURN_FORMATS:
        return
    template, end_of_turn = TURN_FORMATS[architecture]
    tokenizer.chat_template = template
    end = tokenizer.convert_tokens_to_ids(end_of_turn)
    gen = model.generation_config
    eos = gen.eos_token_id if isinstance(gen.eos_token_id, list) else [gen.eos_token_id]
    gen.eos_token_id = [i for i in eos if i is not None] + [end]


def _fit_tokenizer(tokenizer, vocab_size: int):
    """`tokenizer` without the added tokens numbered past the model's vocabulary. transformers'
    GPT-2 tokenizer adds its default `<|endoftext|>` to a vocabulary that lacks it (proxima's
    own tokenizers, exported), a token the model has no embedding for."""
    if len(tokenizer) <= vocab_size:
        return tokenizer
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    spec["added_tokens"] = [a for a in spec["added_tokens"] if a["id"] < vocab_size]
    specials = {
        name: getattr(tokenizer, name)
        for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        if getattr(tokenizer, name) is not None
    }
    fitted = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(json.dumps(spec)),
        chat_template=tokenizer.chat_template,
        **specials,
    )
    if len(fitted) > vocab_size:
        raise GGUFError(f"the GGUF file's tokenizer has {len(fitted)} tokens for {vocab_size} ids")
    return fitted


def _write_folder(model, tokenizer, out: Path, source: Path) -> None:
    gen = model.generation_config  # saved with the model
    if gen.pad_token_id is None and tokenizer.pad_token_id is not None:
        gen.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    (out / "proxima_import.json").write_text(
        json.dumps({"source": str(source), "bytes": source.stat().st_size}, indent=1) + "\n"
    )


def import_gguf(path: str | Path, out: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write the GGUF file `path` as a Hugging Face folder `out` (which must not hold a
    model). The folder appears whole or not at all: it is written beside `out` and renamed."""
    src, out = Path(path), Path(out)
    check_gguf(src, "import")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise GGUFError(f"{out} exists and is not an empty folder; choose another --out.")
    model, tokenizer = load_gguf(src, dtype)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        _write_folder(model, tokenizer, tmp, src)
        if out.exists():  # the empty folder the user made for it
            out.rmdir()
        tmp.rename(out)
    except Exception as err:
        raise _unwritten(out, err) from err
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _unwritten(out: Path, err: Exception) -> Exception:
    """A failed write of `out` as a GGUFError naming it (a full disk, a file-size limit);
    any other error as it is."""
    cause = write_error(err)
    if cause is None:
        return err
    return GGUFError(
        f"cannot write {out} ({describe_write_error(cause)}); the partial write was removed"
    )


def cache_root() -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "proxima")


def cached_folder(path: str | Path) -> Path:
    """Where `cached_import` keeps the folder of `path`: one per file, its name from the
    file's absolute path, size and modification time (a changed file is imported again)."""
    p = Path(path).resolve()
    st = p.stat()
    key = hashlib.sha256(f"{p}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:12]
    return cache_root() / "gguf" / f"{p.stem}-{key}"


def cached_import(path: str | Path, key: str = "model path") -> Path:
    """The Hugging Face folder of the GGUF file `path`, imported on first use (in float32:
    each run casts to its own dtype when it loads) and reused after. Processes that start
    together (torchrun) import it once: the others wait on a lock."""
    check_gguf(path, key)
    folder = cached_folder(path)
    try:  # the lock file is the first write: a cache that cannot be written stops here
        folder.parent.mkdir(parents=True, exist_ok=True)
        lock = open(folder.with_name(folder.name + ".lock"), "w")  # noqa: SIM115
    except OSError as err:
        raise GGUFError(
            f"`{key}`: {path} is imported once into the cache {cache_root()}, which cannot "
            f"be written ({err.strerror or err}); set {CACHE_ENV} to a writable folder, or "
            f"import the file yourself (`proxima import {path} --out DIR`) and give DIR."
        ) from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "config.json").is_file():
            print(f"`{key}`: importing {path} into {folder} (once; later runs reuse it)")
            import_gguf(path, folder)
    return folder


def gguf_keys(cfg) -> dict[str, str]:
    """The config's model paths that name a GGUF file: key -> path. Reward sources given as
    a list are named `reward.sources[i].model_path`."""
    found = {
        key: getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1])
        for key in (
            "model.actor_path",
            "model.reference_path",
            "model.teacher_path",
            "model.critic_path",
        )
    }
    found["reward.model_path"] = cfg.reward.model_path
    for i, source in enumerate(cfg.reward.sources or ()):
        if isinstance(source, dict) and source.get("model_path"):
            found[f"reward.sources[{i}].model_path"] = source["model_path"]
    return {k: v for k, v in found.items() if v and is_gguf(v)}


def resolve_gguf_paths(cfg):
    """`cfg` with every model path that names a GGUF file replaced by its imported folder
    (`cached_import`); `cfg` itself when none does."""
    keys = gguf_keys(cfg)
    if not keys:
        return cfg
    changes: dict = {}
    sources = [dict(s) if isinstance(s, dict) else s for s in (cfg.reward.sources or ())]
    for key, path in keys.items():
        folder = str(cached_import(path, key))
        if key.startswith("reward.sources["):
            sources[int(key[len("reward.sources[") :].split("]")[0])]["model_path"] = folder
        else:
            changes[key] = folder
    if sources and any(k.startswith("reward.sources[") for k in keys):
        changes["reward.sources"] = sources
    return cfg.replace(changes)


# ---- out: a llama folder as a GGUF file -------------------------------------------------

_LAYER_TENSORS = {  # HF name inside model.layers.N -> llama.cpp name inside blk.N
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
_TOP_TENSORS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_tensor_name(hf_name: str) -> str:
    """llama.cpp's name of a Llama parameter."""
    if hf_name in _TOP_TENSORS:
        return _TOP_TENSORS[hf_name]
    parts = hf_name.split(".")
    if parts[:2] == ["model", "layers"] and ".".join(parts[3:]) in _LAYER_TENSORS:
        return f"blk.{parts[2]}.{_LAYER_TENSORS['.'.join(parts[3:])]}"
    raise GGUFError(f"no GGUF name for the parameter {hf_name} of a llama model")


def interleave_rotary(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """A query or key projection [heads * head_dim, hidden] with each head's rows in
    llama.cpp's rotary order: HF rotates the two halves of a head (rows i and i + d/2 form a
    pair), llama.cpp adjacent rows (2i and 2i + 1). Row (h, j, i) of the [heads, 2, d/2] view
    moves to (h, i, j)."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, 2, rows // heads // 2, *weight.shape[1:])
        .transpose(1, 2)
        .reshape(weight.shape)
    )


def _byte_spelling(token: str, alphabet: set[str], table: dict[int, str]) -> str:
    """A token in the byte-level alphabet (as GPT-2 spells bytes): itself when it is already
    written in it, else its UTF-8 bytes spelled one by one."""
    return token if set(token) <= alphabet else "".join(table[b] for b in token.encode())


def tokenizer_metadata(tokenizer) -> dict:
    """The `tokenizer.ggml.*` fields of a BPE tokenizer: tokens in id order (in the
    byte-level alphabet), their types (3 = control for special tokens, 1 = normal), the
    merges, the special ids and the chat template."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model = spec["model"]
    if model.get("type") != "BPE":
        raise GGUFError(
            f"the tokenizer is a {model.get('type')} model; GGUF export writes BPE tokenizers "
            "(GPT-2 / Llama-3 / SmolLM style, and proxima's character tokenizer)."
        )
    vocab = dict(model["vocab"])
    for added in spec.get("added_tokens", []):
        vocab.setdefault(added["content"], added["id"])
    size = max(vocab.values()) + 1
    by_id = {i: t for t, i in vocab.items()}
    if len(by_id) != size:
        raise GGUFError(f"the tokenizer's ids are not contiguous ({len(by_id)} for {size} ids)")
    table = bytes_to_unicode()
    alphabet = set(table.values())
    special = {a["content"] for a in spec.get("added_tokens", []) if a.get("special")}
    tokens = [
        by_id[i] if by_id[i] in special else _byte_spelling(by_id[i], alphabet, table)
        for i in range(size)
    ]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    ids = {
        name: getattr(tokenizer, f"{name}_token_id", None) for name in ("bos", "eos", "unk", "pad")
    }
    return {
        "tokens": tokens,
        "types": [3 if by_id[i] in special else 1 for i in range(size)],
        "merges": merges,
        "ids": ids,
        "chat_template": tokenizer.chat_template
        if isinstance(tokenizer.chat_template, str)
        else None,
        "add_bos": bool(getattr(tokenizer, "add_bos_token", False)),
    }


def _llama_config_problem(config) -> str | None:
    if config.model_type != "llama":
        return (
            f"GGUF export writes llama-architecture models (SmolLM2, Llama 2 and 3, proxima's "
            f"tiny models); this one is `{config.model_type}`. Export it with llama.cpp's own "
            "converter (convert_hf_to_gguf.py) instead."
        )
    for name in ("attention_bias", "mlp_bias"):
        if getattr(config, name, False):
            return f"GGUF export writes llama models without biases; this one sets {name}"
    rope = getattr(config, "rope_scaling", None) or {}
    if rope and rope.get("rope_type", "default") != "default":
        return f"GGUF export writes the default rotary embedding; this one uses {rope}"
    return None


def export_gguf(folder: str | Path, out: str | Path, dtype: str = "f16") -> Path:
    """Write the Llama folder `folder` (a model and its tokenizer) as the GGUF file `out`:
    2-d weights in `dtype` (f16 or f32), 1-d ones in f32. Refuses an existing `out`."""
    gguf = _require_gguf()
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder, out = Path(folder), Path(out)
    if dtype not in EXPORT_TYPES:
        raise GGUFError(f"--type {dtype}: GGUF export writes one of {', '.join(EXPORT_TYPES)}")
    if out.exists():
        raise GGUFError(f"{out} exists; choose another file name (nothing is overwritten).")
    problem = _llama_config_problem(AutoConfig.from_pretrained(folder))
    if problem:  # before the weights load: a refusal costs nothing
        raise GGUFError(f"{folder}: {problem}")
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    config = model.config
    meta = tokenizer_metadata(AutoTokenizer.from_pretrained(folder))
    writer = gguf.GGUFWriter(None, "llama")
    _write_llama_metadata(writer, config, meta, dtype)
    for name, tensor in _gguf_tensors(model, dtype):
        writer.add_tensor(name, tensor)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        writer.write_header_to_file(tmp)
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        tmp.rename(out)
    except Exception as err:
        raise _unwritten(out, err) from err
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _write_llama_metadata(writer, config, meta: dict, dtype: str) -> None:
    from gguf import LlamaFileType

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_name(Path(str(config.name_or_path or "model")).name or "model")
    writer.add_file_type(LlamaFileType.MOSTLY_F16 if dtype == "f16" else LlamaFileType.ALL_F32)
    writer.add_vocab_size(config.vocab_size)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads or config.num_attention_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(head_dim)
    theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
    writer.add_rope_freq_base(float(theta or getattr(config, "rope_theta", 10000.0)))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(meta["tokens"])
    writer.add_token_types(meta["types"])
    if meta["merges"]:
        writer.add_token_merges(meta["merges"])
    else:  # an empty array is not written; readers then derive merges from scores (none)
        writer.add_token_scores([-float(i) for i in range(len(meta["tokens"]))])
    adders = {
        "bos": writer.add_bos_token_id,
        "eos": writer.add_eos_token_id,
        "unk": writer.add_unk_token_id,
        "pad": writer.add_pad_token_id,
    }
    for name, token_id in meta["ids"].items():
        if token_id is not None:
            adders[name](token_id)
    writer.add_add_bos_token(meta["add_bos"])
    if meta["chat_template"]:
        writer.add_chat_template(meta["chat_template"])


def _gguf_tensors(model, dtype: str):
    """(llama.cpp name, numpy array) for every parameter; the tied output head is left out
    (a file without `output.weight` ties it again)."""
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    tied = getattr(config, "tie_word_embeddings", False)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and tied:
            continue
        t = tensor.detach().float()
        if name.endswith("q_proj.weight"):
            t = interleave_rotary(t, heads)
        elif name.endswith("k_proj.weight"):
            t = interleave_rotary(t, kv_heads or heads)
        array = t.numpy()
        if dtype == "f16" and t.dim() > 1:
            array = array.astype("float16")
        yield gguf_tensor_name(name), array
