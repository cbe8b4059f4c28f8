"""Run by torchrun (2 ranks): the gradients of every loss aggregation mode for the actor and
the actor with a value head on its backbone, under DDP and FSDP2, on multi-turn episodes
(`common.episode_batch`: observation tokens in the middle of each row, masked), each rank
holding its half of the global batch. Rank 0 saves them to the path given as argument."""

from __future__ import annotations

import os
import sys
import warnings

import torch

from proxima.trainer.dist import init, shutdown
from tests.distributed.common import MODES, episode_batch, mini_batch_grads, models

warnings.filterwarnings("ignore", message=".*returned a view tensor.*")
torch.set_num_threads(1)
out: dict = {}
for strategy in ("ddp", "fsdp2"):
    device = torch.device("cpu")
    dist = init(strategy, "auto", 120, device)
    exp = episode_batch(models()[0])
    half = exp.batch_size // dist.world_size
    mine = exp.select(list(range(dist.rank * half, (dist.rank + 1) * half)))
    for mode in MODES:
        for role in ("actor", "shared"):
            grads = mini_batch_grads(models()[0], role, mode, mine, dist, dist.world_size, device)
            out[(strategy, role, mode)] = grads
if dist.is_main and int(os.environ["RANK"]) == 0:
    torch.save(out, sys.argv[1])
shutdown(finished=True)  # every rank returned: meet before the teardown
# the results are written: skip the interpreter's finalisation, where a model still bound to
# the process group can take gloo's threads down with it (rank 1 aborted once in ~10 runs on
# one busy core: "terminate called without an active exception")
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
