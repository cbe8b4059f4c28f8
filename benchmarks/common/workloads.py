"""The PPO workloads every system is timed on: model sizes, batch shapes and the settings
shared by proxima, TRL and the floor (bench_vs_trl.py, bench_memory_plan.py,
bench_generation.py --w3)."""

from __future__ import annotations

from dataclasses import dataclass

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


def llama_config(w: Workload, max_positions: int, **extra):
    """A transformers LlamaConfig of the workload's shape (untied embeddings, Llama's
    default), for the scripts that time a model built in memory rather than the saved one."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=w.vocab,
        hidden_size=w.hidden,
        num_hidden_layers=w.layers,
        num_attention_heads=w.heads,
        num_key_value_heads=w.kv_heads or w.heads,
        intermediate_size=w.intermediate,
        max_position_embeddings=max_positions,
        **extra,
    )


def llama_params(w: Workload, vocab: int, lm_head: bool = True) -> int:
    """Parameters of a Llama with untied embeddings (lm_head=False: a 1-label score head)."""
    attn = 4 * w.hidden * w.hidden  # q, k, v, o without bias (as many KV heads as heads)
    mlp = 3 * w.hidden * w.intermediate
    layer = attn + mlp + 2 * w.hidden  # two RMSNorm weights
    head = vocab * w.hidden if lm_head else w.hidden
    return vocab * w.hidden + w.layers * layer + w.hidden + head
