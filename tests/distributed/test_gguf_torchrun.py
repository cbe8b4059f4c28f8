"""A `.gguf` actor under `torchrun --nproc_per_node 2`: the two processes import the file
into the cache once (the second waits on the import's lock, then reads the folder the first
wrote) and train it as one job."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("gguf")

from proxima.cli import main  # noqa: E402
from proxima.models.gguf import CACHE_ENV  # noqa: E402
from tests.distributed.conftest import torchrun  # noqa: E402

pytestmark = [pytest.mark.dist, pytest.mark.slow]


def test_two_processes_import_a_gguf_actor_once_and_train_it(
    make_model, fast_overrides, tmp_path, monkeypatch
):
    cache = tmp_path / "cache"
    monkeypatch.setenv(CACHE_ENV, str(cache))  # torchrun's processes inherit it
    file = tmp_path / "m.gguf"
    assert main(["export", str(make_model("llama")), "--gguf", str(file), "--type", "f32"]) == 0
    out = tmp_path / "run"
    proc = torchrun(["-m", "proxima", "train", *fast_overrides(file, out, 2)])
    assert os.environ[CACHE_ENV] == str(cache)
    folders = [p for p in (cache / "gguf").iterdir() if p.is_dir()]
    assert len(folders) == 1 and (folders[0] / "config.json").is_file()  # imported once
    assert proc.stdout.count("importing") == 1  # by one process; the other waited
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["iterations"] == 2
    assert summary["config"]["model"]["actor_path"] == str(folders[0])
    assert (out / "actor" / "config.json").is_file()
