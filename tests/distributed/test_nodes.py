"""Several nodes, simulated on this machine: two `torchrun --nnodes 2 --node_rank {0,1}
--rdzv-backend c10d` launches (one process each) train into one run folder and resume from
it; a node that does not see the run folder rank 0 created stops the run, naming the fix."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from proxima.config import ConfigError
from proxima.recipes.common import RUN_MARKER, check_shared_run_dir
from tests.distributed.conftest import ROOT


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(args: list[str], run_id: str) -> None:
    """Both nodes' torchrun at once, rendezvous on a free local port; both must succeed."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("RANK", None), env.pop("WORLD_SIZE", None)
    procs = [
        subprocess.Popen(
            [
                sys.executable, "-m", "torch.distributed.run", "--nnodes", "2",
                "--node_rank", str(node), "--nproc_per_node", "1", "--rdzv-backend", "c10d",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", run_id,
                "-m", "proxima", "train", *args,
            ],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for node in (0, 1)
    ]  # fmt: skip
    try:
        outs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:  # a hung node is not left behind
            p.kill()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-4000:]


@pytest.mark.dist
@pytest.mark.slow
def test_two_nodes_train_into_one_run_folder_and_resume(make_model, fast_overrides, tmp_path):
    model = make_model("llama")
    first, resumed = tmp_path / "first", tmp_path / "resumed"
    _two_nodes([*fast_overrides(model, first, 2, "trainer.threads=1")], "nodes-a")
    rows = [json.loads(x) for x in (first / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "score" in r] == [1, 2]
    assert json.loads((first / "summary.json").read_text())["world_size"] == 2
    assert not (first / RUN_MARKER).exists() and not first.with_name("first-2").exists()
    args = fast_overrides(model, resumed, 3, "trainer.threads=1", f"trainer.resume_from={first}")
    _two_nodes(args, "nodes-b")
    rows = [json.loads(x) for x in (resumed / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "score" in r] == [3]


class _Rank1:
    """Rank 1 of 2, as the check sees it: rank 0's token arrives by broadcast."""

    active, is_main, rank, world_size = True, False, 1, 2

    def broadcast_object(self, obj):
        return "rank-0-token"

    def agree(self, fn, what):
        return fn()


def test_a_node_that_does_not_see_the_run_folder_is_named(tmp_path):
    # the folder exists on this "node" but holds no token from rank 0 (a node-local disk)
    with pytest.raises(ConfigError, match="does not see the run folder .* must share"):
        check_shared_run_dir(tmp_path, _Rank1())
    (tmp_path / RUN_MARKER).write_text("rank-0-token")  # a shared folder: rank 0's token
    check_shared_run_dir(tmp_path, _Rank1())
