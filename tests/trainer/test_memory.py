"""The memory plan's arithmetic (parameter, optimizer, KV-cache and logits bytes of a given
config, by hand), its trace of the activations autograd keeps (against the same count on
real tensors), and where its figures go in a plan."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig

from proxima.algos import logprobs_from_logits
from proxima.config import ConfigError, load_config
from proxima.rollout.plan import ScoringPlan
from proxima.trainer import memory
from proxima.trainer.memory import CUDA_CONTEXT, GiB, MemoryPlan, check_memory, plan_memory
from proxima.trainer.model_sizes import (
    count_parameters,
    kv_cache_bytes,
    logits_bytes,
    lora_parameters,
    model_shape,
    saved_activation_bytes,
)

pytestmark = pytest.mark.usefixtures("one_thread")

# hidden 64, 2 layers, 4 heads of 16, 2 KV heads, MLP 128, vocabulary 100, untied head
LLAMA = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=100,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)
# per layer: q 64x64 = 4096, k and v 64x32 = 2048 each, o 4096, gate/up/down 3 x 64x128 =
# 24576, two RMSNorms 128 -> 36992; embeddings 100x64 = 6400, final norm 64
BACKBONE = 6400 + 2 * 36992 + 64  # 80448
CAUSAL_LM = BACKBONE + 6400  # + the LM head: 86848
VALUE = BACKBONE + 64 + 1  # + Linear(64, 1) with bias (token classification)
REWARD = BACKBONE + 64  # + Linear(64, 1) without bias (sequence classification)


@pytest.fixture
def llama(tmp_path):
    folder = tmp_path / "llama"
    LlamaConfig(**LLAMA).save_pretrained(folder)  # config.json only: nothing else is read
    return str(folder)


def _cfg(folder: str, *extra: str):
    return load_config(
        None,
        [
            "task.name=",
            f"model.actor_path={folder}",
            "data.train_path=prompts.jsonl",  # named only: the plan reads no data
            "reward.function=rewards.py:fn",
            "data.max_prompt_length=16",
            "data.train_batch_size=8",
            "rollout.n=1",
            "rollout.max_response_length=8",
            "rollout.micro_batch_size=8",
            "actor.ppo_mini_batch_size=8",
            "actor.ppo_micro_batch_size=4",
            "critic.ppo_mini_batch_size=8",
            "critic.ppo_micro_batch_size=4",
            "algorithm.adv_estimator=gae",
            *extra,
        ],
    )


def test_parameters_counted_exactly_from_the_config(llama):
    assert count_parameters(llama, "causal_lm") == CAUSAL_LM
    assert count_parameters(llama, "value") == VALUE
    assert count_parameters(llama, "reward") == REWARD
    # and as the model built for real counts them
    real = AutoModelForCausalLM.from_config(LlamaConfig(**LLAMA))
    assert sum(p.numel() for p in real.parameters()) == CAUSAL_LM


def test_lora_adapters_counted_per_targeted_linear(llama):
    # r x (in + out): q (64+64), k and v (64+32), o (64+64), gate and up (64+128), down
    # (128+64) -> 4 x (128 + 96 + 96 + 128 + 192 * 3) = 4096 per layer, 2 layers
    assert lora_parameters(llama, "causal_lm", 4, ()) == 8192
    assert lora_parameters(llama, "causal_lm", 4, ("q_proj", "v_proj")) == 2 * 4 * (128 + 96)


def test_kv_cache_and_logits_bytes(llama):
    cfg = _cfg(llama)
    shape = model_shape(llama, "causal_lm", torch.float32, "all", cfg)
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.vocab) == (2, 2, 16, 100)
    # 8 rows x 24 positions x 2 layers x (K, V) x 2 KV heads x 16 x 4 bytes
    assert kv_cache_bytes(8, 24, shape, 4) == 8 * 24 * 2 * 2 * 2 * 16 * 4 == 98304
    # [4, 11, 100] float32 logits 17,600 + the [4, 10, 100] scaled copy 16,000 + two
    # log-softmax chunks of the 40 rows (under 2**24 elements) 2 x 16,000
    assert logits_bytes(4, 10, 100) == 17600 + 16000 + 32000
    # bf16 logits: half of the raw ones, the float32 copies as before
    assert logits_bytes(4, 10, 100, bf16=True) == 8800 + 16000 + 32000


def test_plan_roles_weights_grads_and_adamw(llama):
    plan = plan_memory(_cfg(llama), torch.device("cpu"), baseline=0)
    assert plan.roles["actor"] == {
        "weights": 4 * CAUSAL_LM,
        "grads": 4 * CAUSAL_LM,
        "optimizer": 2 * 4 * CAUSAL_LM,  # AdamW's exp_avg and exp_avg_sq in float32
    }
    assert plan.roles["reference"] == {"weights": 4 * CAUSAL_LM}
    assert plan.roles["critic"] == {
        "weights": 4 * VALUE,
        "grads": 4 * VALUE,
        "optimizer": 8 * VALUE,
    }
    assert plan.held["actor optimizer"] == 8 * CAUSAL_LM
    assert plan.phases["generate"]["kv cache"] == 8 * 24 * 2 * 2 * 2 * 16 * 4
    assert set(plan.phases) == {"generate", "score", "update actor", "update critic"}
    # scoring: the larger of a layer's intermediates (8 rows x 24 tokens x (3 x 128 MLP +
    # 6 x 64) floats) and the logits (logits_bytes(8, 8, 100) = 105,600)
    assert plan.phases["score"] == {"actor forward": 8 * 24 * (3 * 128 + 6 * 64) * 4}
    assert plan.peak == max(plan.phase_total(p) for p in plan.phases)


def test_the_teacher_is_counted_and_its_pass_planned(llama, tmp_path, monkeypatch):
    # a teacher of the same shape but a vocabulary of 5000: its logits are the largest
    # scoring tensor; weights 5000 x 64 (embeddings) + 2 layers + norm + 5000 x 64 (head)
    teacher = tmp_path / "teacher"
    LlamaConfig(**{**LLAMA, "vocab_size": 5000}).save_pretrained(teacher)
    extra = (f"model.teacher_path={teacher}", "algorithm.adv_estimator=distill")
    plan = plan_memory(_cfg(llama, *extra), torch.device("cpu"), baseline=0)
    weights = 4 * (5000 * 64 + 2 * 36992 + 64 + 5000 * 64)
    assert plan.roles["teacher"] == {"weights": weights}
    assert plan.held["teacher weights"] == weights
    assert "reference" not in plan.roles and "critic" not in plan.roles  # distill alone
    assert plan.phases["score"] == {"teacher logits": logits_bytes(8, 8, 5000)}
    assert "  teacher       : weights 3 MiB" in plan.describe()  # 2,856,192 bytes
    # offloaded: the teacher joins the scoring phase only
    off = _gpu_plan(monkeypatch, llama, 2**40, *extra, "model.offload=trained")
    assert "teacher weights" not in off.held
    assert off.phases["score"]["teacher weights"] == weights
    assert all("teacher weights" not in off.phases[p] for p in ("generate", "update actor"))


def test_engine_log_probs_spare_the_actors_scoring_pass(llama):
    """Old log-probs from the engine: phase 3 runs no actor pass, so the plan counts none
    (at a 262k vocabulary its logits are the largest tensor of a run); the actor is counted
    where it is the LoRA reference (adapters off) or gives the old log-probs."""
    grpo = ("algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=false")
    engine = ScoringPlan("engine", "", "", "auto: exact here")
    actor = ScoringPlan("actor", "", "", "rollout.old_logprobs=recompute")
    forward = {"actor forward": 8 * 24 * (3 * 128 + 6 * 64) * 4}
    cpu = torch.device("cpu")
    assert plan_memory(_cfg(llama, *grpo), cpu, baseline=0, scoring=engine).phases["score"] == {}
    assert (
        plan_memory(_cfg(llama, *grpo), cpu, baseline=0, scoring=actor).phases["score"] == forward
    )
    assert plan_memory(_cfg(llama, *grpo), cpu, baseline=0).phases["score"] == forward  # unknown
    lora_kl = _cfg(llama, "algorithm.adv_estimator=grpo", "model.lora_rank=4")
    with_ref = ScoringPlan("engine", "", "k1", "auto: exact here")
    assert plan_memory(lora_kl, cpu, baseline=0, scoring=with_ref).phases["score"] == forward
    # the update is planned whatever phase 3 runs
    plan = plan_memory(_cfg(llama, *grpo), cpu, baseline=0, scoring=engine)
    assert set(plan.phases) == {"generate", "score", "update actor"}
    assert "(no pass: the engine's log-probs, no other model)" in plan.describe()


def test_scoring_under_a_token_budget(llama):
    # 48 tokens a pass, as one row: 48 x (3 x 128 + 6 x 64) floats, whatever the row count
    plan = plan_memory(
        _cfg(llama, "rollout.max_tokens_per_micro=48"), torch.device("cpu"), baseline=0
    )
    assert plan.phases["score"] == {"actor forward": 48 * (3 * 128 + 6 * 64) * 4}
    # a budget above the batch's tokens (8 rows x 24) counts the batch: 192 tokens
    plan = plan_memory(
        _cfg(llama, "rollout.max_tokens_per_micro=4096"), torch.device("cpu"), baseline=0
    )
    assert plan.phases["score"] == {"actor forward": 192 * (3 * 128 + 6 * 64) * 4}


def test_plan_under_lora_and_mixed_precision(llama):
    cfg = _cfg(llama, "model.lora_rank=4", "model.critic_lora=true")
    plan = plan_memory(cfg, torch.device("cpu"), baseline=0)
    assert plan.roles["actor"]["weights"] == 4 * (CAUSAL_LM + 8192)
    assert plan.roles["actor"]["optimizer"] == 8 * 8192  # the adapters only
    assert "reference" not in plan.roles  # the actor with its adapters off
    assert plan.roles["critic"]["weights"] == 4 * (VALUE + 8192)
    assert plan.roles["critic"]["optimizer"] == 8 * (8192 + 65)  # adapters + the value head
    bf16 = plan_memory(_cfg(llama, "model.mixed_precision=bf16"), torch.device("cpu"), baseline=0)
    assert bf16.roles["reference"] == {"weights": 2 * CAUSAL_LM}  # frozen roles in bf16


def test_plan_fsdp2_shards_model_states(llama, monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cfg = _cfg(llama, "trainer.strategy=fsdp2")
    plan = plan_memory(cfg, torch.device("cpu"), world=2, baseline=0)
    assert plan.roles["actor"]["weights"] == 4 * CAUSAL_LM // 2
    assert plan.roles["actor"]["optimizer"] == 8 * CAUSAL_LM // 2
    assert plan.processes == 2 and plan.needed == 2 * plan.peak


def _real_saved_bytes(model, ids, response, temperature):
    """Bytes of the storages autograd saves, the model's own (its weights) left out."""
    seen = {}
    own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())}

    def pack(t):
        if t.untyped_storage().data_ptr() not in own:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    mask = torch.ones_like(ids)
    mask[0, :2] = 0  # a left-padded row, as in a rollout: the attention takes the mask
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=False,
            logits_to_keep=response + 1,
        )
        logits = out.logits[:, -response - 1 : -1] / temperature
        logprobs_from_logits(logits, ids[:, -response:]).sum()
    return sum(seen.values())


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_traced_activations_match_a_real_forward(arch, tmp_path):
    """The fake-tensor trace counts what autograd keeps on real tensors, within 2%, beyond the
    weights (saved by reference, counted once as weights); gradient checkpointing keeps far
    less."""
    if arch == "llama":
        config = LlamaConfig(**LLAMA)
    else:
        config = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=100, n_positions=64)
    config.save_pretrained(tmp_path)
    rows, length, response = 4, 24, 8
    traced = saved_activation_bytes(
        str(tmp_path), "causal_lm", rows, length, response, temperature=0.7
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).train()
    ids = torch.randint(0, 100, (rows, length))
    real = _real_saved_bytes(model, ids, response, 0.7)
    assert traced == pytest.approx(real, rel=0.02)
    kept = saved_activation_bytes(
        str(tmp_path), "causal_lm", rows, length, response, checkpointing=True, temperature=0.7
    )
    assert kept < 0.6 * traced


def test_check_memory_names_the_peak_and_the_keys():
    plan = MemoryPlan("cpu", baseline=100, available=10 * 2**20)
    plan.held = {"baseline": 100, "actor weights": 2**30}
    plan.phases = {"update actor": {"activations": 3 * 2**30}, "generate": {"kv cache": 2**20}}
    with pytest.raises(ConfigError) as err:
        check_memory(plan, "error")
    message = str(err.value)
    assert "update actor" in message and "activations 3.00 GiB" in message
    assert "10 MiB" in message and "model.gradient_checkpointing=true" in message
    assert "trainer.memory_check=warn" in message
    assert check_memory(plan, "warn") == message
    assert check_memory(plan, "off") is None
    plan.available = 2**40
    assert check_memory(plan, "error") is None


def test_a_cpu_plan_on_glibc_malloc_says_what_to_do(llama, monkeypatch):
    from proxima import allocator

    monkeypatch.setattr(allocator.sys, "platform", "linux")
    monkeypatch.setattr(allocator, "active", lambda: "system malloc")
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: None)
    notes = plan_memory(_cfg(llama), torch.device("cpu"), baseline=0).notes
    assert any("glibc's malloc keeps memory" in n and "apt install libtcmalloc" in n for n in notes)
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: "/lib/libtcmalloc_minimal.so.4")
    notes = plan_memory(_cfg(llama), torch.device("cpu"), baseline=0).notes
    assert any("unset PROXIMA_ALLOCATOR to run on the tcmalloc installed" in n for n in notes)
    monkeypatch.setattr(allocator, "active", lambda: "tcmalloc")
    notes = plan_memory(_cfg(llama), torch.device("cpu"), baseline=0).notes
    assert not any("malloc" in n for n in notes)


def test_rollout_workers_counted_where_they_hold_memory(llama, monkeypatch):
    # on a CPU: the shared box and each forked worker's copy of the actor's weights
    ahead = ("rollout.max_staleness=1", "rollout.workers=2")
    plan = plan_memory(_cfg(llama, *ahead), torch.device("cpu"), baseline=0)
    assert plan.held["rollout workers"] == 3 * 4 * CAUSAL_LM
    # on a GPU: each spawned worker on this device, with its weights, its generation (8 rows
    # of 24 tokens: the generate phase) and a CUDA context; the box is in host memory
    monkeypatch.setattr(memory, "device_available", lambda device: (80 * GiB, 80 * GiB))
    gpu = torch.device("cuda", 0)
    plan = plan_memory(_cfg(llama, *ahead), gpu, baseline=0)
    generate = sum(plan.phases["generate"].values())
    one = 4 * CAUSAL_LM + generate + CUDA_CONTEXT
    assert plan.held["rollout workers"] == 2 * one  # both share the actor's GPU (default)
    split = plan_memory(_cfg(llama, *ahead, "rollout.devices=[cuda:1, cuda:0]"), gpu, baseline=0)
    assert split.held["rollout workers"] == one  # worker 1 only: devices[1 mod 2]
    away = plan_memory(_cfg(llama, *ahead, "rollout.devices=[cuda:1]"), gpu, baseline=0)
    assert "rollout workers" not in away.held


def _gpu_plan(monkeypatch, llama, free: int, *extra: str):
    """The plan on a GPU with `free` bytes free (torch.cuda.mem_get_info, faked)."""
    from proxima.trainer import memory

    monkeypatch.setattr(memory, "device_available", lambda device: (free, 2 * free))
    return plan_memory(_cfg(llama, *extra), torch.device("cuda", 0))


def test_an_offloaded_plan_holds_in_each_phase_what_it_uses(llama, monkeypatch):
    extra = ("model.offload=trained", "reward.function=", f"reward.model_path={llama}")
    plan = _gpu_plan(monkeypatch, llama, 2**40, *extra)
    assert plan.offload
    assert plan.held == {"baseline": 0, "runtime": 0, "actor weights": 4 * CAUSAL_LM}
    assert set(plan.phases) == {"generate", "reward", "score", "update actor", "update critic"}
    assert not any("weights" in k or "optimizer" in k for k in plan.phases["generate"])
    # the reward model's forward (8 rows of reward.batch_size 8 x 24 tokens) in its own phase
    assert plan.phases["reward"] == {
        "reward weights": 4 * REWARD,
        "reward forward": 8 * 24 * (3 * 128 + 6 * 64) * 4,
    }
    assert plan.phases["score"] == {
        "reference weights": 4 * CAUSAL_LM,
        "critic weights": 4 * VALUE,
        "actor forward": 8 * 24 * (3 * 128 + 6 * 64) * 4,
    }
    update = plan.phases["update actor"]
    assert update["actor optimizer"] == 8 * CAUSAL_LM and update["critic optimizer"] == 8 * VALUE
    assert update["critic weights"] == 4 * VALUE and "reference weights" not in update
    assert any("peak" in n and "without offloading" in n for n in plan.notes)
    kl = _gpu_plan(monkeypatch, llama, 2**40, *extra, "actor.use_kl_loss=true")
    assert kl.phases["update actor"]["reference weights"] == 4 * CAUSAL_LM


def test_auto_offloads_only_a_run_that_would_not_fit(llama, monkeypatch):
    whole = _gpu_plan(monkeypatch, llama, 2**40)
    assert not whole.offload and whole.peak_phase == "update actor"
    assert any(n.startswith("model.offload=trained would hold: generate") for n in whole.notes)
    offloaded = _gpu_plan(monkeypatch, llama, 2**40, "model.offload=trained")
    assert offloaded.peak < whole.peak
    plan = _gpu_plan(monkeypatch, llama, offloaded.peak)  # fits only offloaded
    assert plan.offload and plan.peak == offloaded.peak
    assert any(n.startswith("model.offload=auto: offloading") for n in plan.notes)
    assert check_memory(plan) is None
    plan = _gpu_plan(monkeypatch, llama, offloaded.peak - 1)  # not even then: the error stays
    assert plan.offload
    with pytest.raises(ConfigError, match="the memory plan predicts a peak"):
        check_memory(plan)
    none = _gpu_plan(monkeypatch, llama, offloaded.peak, "model.offload=none")
    assert not none.offload and not any("offload" in n for n in none.notes)


def test_offload_plans_nothing_where_it_does_not_apply(llama, monkeypatch):
    cpu = plan_memory(_cfg(llama), torch.device("cpu"), baseline=0)  # auto on a CPU
    assert not cpu.offload and not any("offload" in n for n in cpu.notes)
    stale = _gpu_plan(monkeypatch, llama, 1, "rollout.max_staleness=1")
    assert not stale.offload  # the phases overlap: auto leaves the run as it is


def test_peak_bytes_is_the_resident_high_water_mark_on_a_cpu():
    from proxima.trainer.host_memory import peak_bytes, resident_bytes

    cpu = torch.device("cpu")
    before = peak_bytes(cpu)
    assert before >= resident_bytes() > 0
    big = torch.ones(64 * 2**20 // 4 + before // 4)  # more than the peak so far: a new peak
    assert peak_bytes(cpu) >= big.numel() * 4
    del big
    assert peak_bytes(cpu) >= resident_bytes()  # the mark stays after the memory is freed


def test_disk_need_counts_the_trained_models_and_their_adamw_state(llama, tmp_path, monkeypatch):
    """The end of a run writes each trained model once (actor/, the critic's) and a
    checkpoint of them with AdamW's two states; the reference is not written."""
    need = memory.disk_need(_cfg(llama))
    assert need == {"models": 4 * (CAUSAL_LM + VALUE), "checkpoint": 3 * 4 * (CAUSAL_LM + VALUE)}
    lora = memory.disk_need(_cfg(llama, "model.lora_rank=4", "algorithm.adv_estimator=grpo"))
    # LoRA: the merged model in full and the adapters (actor_adapter/), AdamW's states of
    # the adapters only (no critic)
    adapters = 4 * 8192
    models = 4 * CAUSAL_LM + adapters
    assert lora == {"models": models, "checkpoint": models + 2 * adapters}
    total = 4 * 4 * (CAUSAL_LM + VALUE)
    assert memory.disk_problem(_cfg(llama), tmp_path / "new" / "run") is None
    usage = type("usage", (), {"free": total - 1})
    monkeypatch.setattr(memory.shutil, "disk_usage", lambda path: usage)
    problem = memory.disk_problem(_cfg(llama), tmp_path / "new" / "run")
    assert f"{tmp_path / 'new' / 'run'}" in problem and "trainer.output_dir" in problem
    usage.free = total
    assert memory.disk_problem(_cfg(llama), tmp_path) is None


def test_an_update_with_shared_prompts_plans_one_packed_row(llama):
    # 2 prompts x 4 samples, one mini-batch of all 8, micro-batches of 4: each micro-batch
    # one prompt (16 tokens) once and its 4 answers (8 tokens each) in a row of 48
    shared = ["rollout.n=4", "data.train_batch_size=2", "model.packing=true"]
    cfg = _cfg(llama, *shared)
    plan = plan_memory(cfg, torch.device("cpu"), baseline=0)
    t = cfg.rollout.temperature
    want = saved_activation_bytes(llama, "causal_lm", 1, 48, 32, temperature=t)
    assert plan.phases["update actor"]["activations"] == want
    critic = saved_activation_bytes(llama, "value", 1, 48, 32)
    assert plan.phases["update critic"]["activations"] == critic
    assert any("each prompt once" in n for n in plan.notes)
    padded = saved_activation_bytes(llama, "causal_lm", 4, 24, 8, temperature=t)
    assert want < padded
    # a mini-batch of half the rows (shuffled) may split a prompt's samples: padded rows
    for extra in ("actor.ppo_mini_batch_size=4", "model.packing=false"):
        plan = plan_memory(_cfg(llama, *shared, extra), torch.device("cpu"), baseline=0)
        assert plan.phases["update actor"]["activations"] == padded
