"""`proxima chat`, `proxima import` and `proxima export`: a trained model tried by hand, and
models moved in and out of llama.cpp's GGUF format.

`chat` answers one prompt (`--prompt`) or runs a small loop reading prompts from standard
input, with the model's chat template (a model without one gets the bare prompt), greedy
unless `--temperature` is set; each answer is printed as it is generated. The model is a
Hugging Face folder, a run folder (its `actor/`) or a GGUF file.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch

from proxima.config import ConfigError
from proxima.config.roles import policy_folder
from proxima.data.prompts import UnknownCharactersWarning, unknown_pieces
from proxima.models.gguf import (
    GGUFError,
    check_gguf,
    export_gguf,
    import_gguf,
    is_gguf,
    load_gguf,
)
from proxima.recipes.common import writable_file, writable_place


def model_folder(path: str | Path) -> Path:
    """The model folder `path` names: the trained actor of a run folder (`actor/`; the run
    folder's own config.json is proxima's), else itself when it holds a model (config.json)."""
    p = Path(policy_folder(str(path)))
    if (p / "config.json").is_file():
        return p
    raise GGUFError(
        f"{p} holds no model: give a Hugging Face folder (with config.json), a run folder "
        "(with actor/), or a .gguf file."
    )


def load_for_chat(path: str | Path):
    """(model, tokenizer) in float32 from a folder, a run folder or a GGUF file."""
    if is_gguf(path):
        check_gguf(path, "chat MODEL")  # what import and train check before loading
        return load_gguf(path)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = model_folder(path)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder)


def prompt_ids(tokenizer, prompt: str, system: str | None) -> torch.Tensor:
    """[1, T] ids of `prompt` as the model expects it: through its chat template (with
    `system` as the system message when given) and the generation prompt, or as bare text."""
    if tokenizer.chat_template:
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt})
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    else:
        text = prompt
    return tokenizer(text, return_tensors="pt", add_special_tokens=False)["input_ids"]


def answer(model, tokenizer, prompt: str, system=None, max_new_tokens=256, temperature=0.0):
    """The model's answer to `prompt`, printed to stdout as it is generated, and returned."""
    from transformers import TextStreamer

    _warn_unknown(tokenizer, prompt)
    ids = prompt_ids(tokenizer, prompt, system)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    sampling = {"temperature": temperature} if temperature > 0 else {}
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=temperature > 0,
            pad_token_id=pad,
            streamer=streamer,
            **sampling,
        )
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def _warn_unknown(tokenizer, prompt: str) -> None:
    """A warning when the tokenizer has no token for some of the prompt's characters: the
    model would read its unknown token instead, silently."""
    if tokenizer.unk_token_id is None:
        return
    pieces = [p for p in dict.fromkeys(unknown_pieces(prompt, tokenizer)) if p]
    if pieces:
        shown = ", ".join(repr(p) for p in pieces[:8])
        warnings.warn(
            UnknownCharactersWarning(
                f"the prompt holds characters the tokenizer has no token for ({shown}); "
                f"the model reads {tokenizer.unk_token!r} in their place"
            ),
            stacklevel=3,
        )


def check_options(prompt: str | None, max_new_tokens: int, temperature: float) -> None:
    """The flags of `chat`, checked before the model loads."""
    if prompt is not None and not prompt.strip():
        raise ConfigError(
            "--prompt is empty: give the text to answer, or leave --prompt out to type "
            "prompts one per line."
        )
    if not temperature >= 0:  # also NaN
        raise ConfigError(
            f"--temperature {temperature}: must be 0 (greedy: the likeliest token each "
            "step) or above (sampling; 0.7 is common)."
        )
    if max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens {max_new_tokens}: must be at least 1.")


def chat(path, prompt=None, system=None, max_new_tokens=256, temperature=0.0, seed=0) -> int:
    check_options(prompt, max_new_tokens, temperature)
    torch.manual_seed(seed)
    model, tokenizer = load_for_chat(path)
    if prompt is not None:
        answer(model, tokenizer, prompt, system, max_new_tokens, temperature)
        return 0
    interactive = sys.stdin.isatty()
    if interactive:
        print("type a prompt and Enter (an empty line or Ctrl-D ends)")
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        if not line.strip():
            return 0
        answer(model, tokenizer, line.rstrip("\n"), system, max_new_tokens, temperature)


def import_model(path: str, out: str, dtype: str = "float32") -> Path:
    writable_place(out, "--out")  # before the work, not after it
    folder = import_gguf(path, out, getattr(torch, dtype))
    print(f"wrote {folder}: a Hugging Face folder (train it with model.actor_path={folder})")
    return folder


def export_model(path: str, out: str, dtype: str = "f16") -> Path:
    writable_file(out, "--gguf")  # before the work, not after it
    file = export_gguf(model_folder(path), out, dtype)
    size = file.stat().st_size / 2**20
    print(f"wrote {file} ({size:.1f} MiB, {dtype}): run it with llama.cpp or Ollama")
    return file
