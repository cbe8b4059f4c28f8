"""Run by torchrun (2 ranks): the gradients of every loss aggregation mode for the actor, the
critic and the actor with a value head on its backbone, under DDP and FSDP2, each rank
holding its half of the global batch. Rank 0 saves them to the path given as the first
argument; a second argument `cuda` runs on the GPUs (rank % GPU count, so ranks may share one)
with NCCL or the backend named third (gloo on the CPU otherwise); a fourth names the strategies
(default ddp,fsdp2,ddp+tokens,fsdp2+tokens; `+tokens`: micro-batches by a token budget,
`ppo_max_tokens_per_micro`, whose counts differ between the ranks; `+packed`: the passes
through packed rows, `model.packing`; `+shared`: rows in pairs of one prompt's samples,
in micro-batches of 2 sorted by length with a prompt's samples together, laid once)."""

from __future__ import annotations

import os
import sys
import warnings

import torch

from proxima.trainer.dist import init, shutdown
from proxima.types import SORTED
from tests.distributed.common import MODES, global_batch, mini_batch_grads, models

warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
torch.set_num_threads(1)
out: dict = {}
cuda = sys.argv[2:3] == ["cuda"]
backend = sys.argv[3] if len(sys.argv) > 3 else "auto"
DEFAULT = ["ddp", "fsdp2", "ddp+tokens", "fsdp2+tokens"]
strategies = sys.argv[4].split(",") if len(sys.argv) > 4 else DEFAULT
for strategy in strategies:
    rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    name, *options = strategy.split("+")
    micro_tokens = 12 if "tokens" in options else 0  # rank 0: 3 micro-batches, rank 1: 2
    micro_tokens = SORTED if "shared" in options else micro_tokens
    dist = init(name, backend, 120, device)
    actor, _ = models()
    exp = global_batch(actor, shared="shared" in options)
    half = exp.batch_size // dist.world_size
    mine = exp.select(list(range(dist.rank * half, (dist.rank + 1) * half)))
    for mode in MODES:
        for role in ("actor", "critic", "shared"):
            model = models()[1 if role == "critic" else 0]
            grads = mini_batch_grads(
                model,
                role,
                mode,
                mine,
                dist,
                dist.world_size,
                device,
                micro_tokens,
                packed="packed" in options,
            )
            out[(strategy, role, mode)] = grads
if dist.is_main:
    torch.save(out, sys.argv[1])
shutdown(finished=True)  # every rank returned: meet before the teardown
# the results are written: skip the interpreter's finalisation, where a model still bound to
# the process group can take gloo's threads down with it (rank 1 aborted once in ~10 runs on
# one busy core: "terminate called without an active exception")
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
