"""The `proxima` command re-executes itself once on tcmalloc where it is installed: the
conditions (Linux, the system's malloc, not switched off, not tried already), what the new
process gets (LD_PRELOAD, the marker, the same command line), and a real re-execution where
the library is installed."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from proxima import allocator


def test_the_library_is_found_in_the_system_folders(tmp_path):
    assert allocator.find_tcmalloc((str(tmp_path),)) is None
    (tmp_path / "libtcmalloc.so.4").write_bytes(b"")
    assert allocator.find_tcmalloc((str(tmp_path),)) == str(tmp_path / "libtcmalloc.so.4")
    (tmp_path / "libtcmalloc_minimal.so.4").write_bytes(b"")  # the minimal one first
    assert allocator.find_tcmalloc((str(tmp_path),)).endswith("libtcmalloc_minimal.so.4")


@pytest.fixture
def execs(monkeypatch):
    """Calls of os.execve (none really made), with tcmalloc 'installed' and this process on
    the system's malloc."""
    calls = []
    monkeypatch.setattr(allocator.os, "execve", lambda *a: calls.append(a))
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: "/lib/libtcmalloc_minimal.so.4")
    monkeypatch.setattr(allocator, "active", lambda: "system malloc")
    monkeypatch.setattr(allocator.sys, "platform", "linux")
    for name in (allocator.SWITCH, allocator.TRIED, "LD_PRELOAD"):
        monkeypatch.delenv(name, raising=False)
    return calls


def test_the_command_is_run_again_on_tcmalloc(execs, monkeypatch):
    monkeypatch.setenv("LD_PRELOAD", "/lib/other.so")
    monkeypatch.setattr(allocator.sys, "orig_argv", ["python", "-m", "proxima", "train"])
    allocator.preload()
    ((path, argv, env),) = execs
    assert path == sys.executable and argv == ["python", "-m", "proxima", "train"]
    assert env["LD_PRELOAD"] == "/lib/libtcmalloc_minimal.so.4 /lib/other.so"
    assert env[allocator.TRIED] == "1"


@pytest.mark.parametrize(
    "case", ["switched off", "tried already", "not installed", "another allocator", "macOS"]
)
def test_no_re_execution_where_it_does_not_apply(execs, monkeypatch, case):
    if case == "switched off":
        monkeypatch.setenv(allocator.SWITCH, "system")
    elif case == "tried already":
        monkeypatch.setenv(allocator.TRIED, "1")
    elif case == "not installed":
        monkeypatch.setattr(allocator, "find_tcmalloc", lambda: None)
    elif case == "another allocator":
        monkeypatch.setattr(allocator, "active", lambda: "jemalloc")
    else:
        monkeypatch.setattr(allocator.sys, "platform", "darwin")
    allocator.preload()
    assert execs == []


def test_a_failed_re_execution_goes_on(execs, monkeypatch):
    def fails(*args):
        raise OSError(8, "Exec format error")

    monkeypatch.setattr(allocator.os, "execve", fails)
    allocator.preload()  # returns: the command runs on the system's malloc


@pytest.mark.skipif(allocator.find_tcmalloc() is None, reason="tcmalloc is not installed")
def test_a_real_process_runs_again_on_tcmalloc():
    code = "from proxima.allocator import preload, active; preload(); print(active())"
    env = {k: v for k, v in os.environ.items() if k not in (allocator.TRIED, "LD_PRELOAD")}
    env.pop(allocator.SWITCH, None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.stdout.strip() == "tcmalloc", out.stderr
    off = {**env, allocator.SWITCH: "system"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=off)
    assert out.stdout.strip() == "system malloc", out.stderr


def test_a_warning_reads_as_one_line_of_the_command():
    from proxima.cli import _warning_line
    from proxima.trainer.checks import VocabularyGapWarning

    assert _warning_line("a tracker failed", UserWarning, "proxima/x.py", 3) == (
        "warning: a tracker failed\n"
    )
    assert _warning_line("gap", VocabularyGapWarning, "x.py", 1) == (
        "warning: gap (VocabularyGapWarning)\n"
    )
