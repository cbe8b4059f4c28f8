"""Writes that a full disk cannot leave cut: `files.write_whole` keeps the folder it
replaces when the writer fails, and `write_error` finds the operating system's error inside
the exceptions of safetensors and torch."""

from __future__ import annotations

import errno
import subprocess
import sys

import pytest

from proxima.files import describe_write_error, write_error, write_whole


def test_write_whole_replaces_folders_and_keeps_the_old_ones_on_an_error(tmp_path):
    (tmp_path / "actor").mkdir()
    (tmp_path / "actor" / "config.json").write_text("old")

    def write(tmp):
        (tmp / "actor").mkdir()
        (tmp / "actor" / "config.json").write_text("new")

    def fails(tmp):
        (tmp / "actor").mkdir()
        (tmp / "actor" / "config.json").write_text("")  # the cut file of a full disk
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(OSError):
        write_whole(tmp_path, fails)
    assert (tmp_path / "actor" / "config.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["actor"]  # no temporary left
    (tmp_path / ".writing.tmp-999999999").mkdir()  # a killed write's: no such process
    write_whole(tmp_path, write)
    assert (tmp_path / "actor" / "config.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["actor"]


# a child with a 4 kB file-size limit writes 64 kB through each library
_LIBRARY_WRITE = """
import resource, sys, torch
from safetensors.torch import save_file
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
from proxima.files import write_error
for write in (lambda: save_file({"w": torch.zeros(16384)}, sys.argv[1] + "/w.safetensors"),
              lambda: torch.save({"w": torch.zeros(16384)}, sys.argv[1] + "/state.pt")):
    try:
        write()
    except Exception as err:
        print(type(err).__name__, write_error(err).errno)
"""


def test_write_error_finds_the_cause_in_safetensors_and_torch(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", _LIBRARY_WRITE, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    assert out[0] == f"SafetensorError {errno.EFBIG}"
    assert out[1] == f"RuntimeError {errno.EIO}"  # torch's message carries no errno
    assert write_error(ValueError("a bug, not a write")) is None
    assert "ulimit -f" in describe_write_error(OSError(errno.EFBIG, "File too large"))
