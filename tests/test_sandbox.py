"""The sandbox (`proxima.sandbox`): each way code can misbehave (a syntax error, an
exception, an endless loop, a fork bomb, huge output, 10 GB of memory, a socket) is
contained, named in the result, and the calling process goes on; the isolation in use is
said; the multi-turn environment and the tests reward on tiny cases. Short limits keep it
fast; the isolation-specific cases run under each isolation that works here (bubblewrap,
unshare, none)."""

from __future__ import annotations

import os
import shutil
import time
import warnings

import pytest

from proxima.rewards.function import FunctionReward
from proxima.rollout.environments import load_env_class
from proxima.sandbox import (
    ISOLATIONS,
    CodeTestsReward,
    Limits,
    PythonEnv,
    SandboxWarning,
    build_isolation,
    code_block,
    isolation_in_use,
    run_python,
    trial,
)
from proxima.sandbox import isolation as isolation_module

FAST = Limits(wall_s=3.0, cpu_s=1, memory_mb=512, output_bytes=4000, processes=8)
BOOT_MARK = "import json, resource, sys"  # in the command line of every sandboxed interpreter


def _working(name: str):
    iso = build_isolation(name)
    if iso is None:
        return pytest.param(None, id=name, marks=pytest.mark.skip(f"{name} is not installed"))
    failure = trial(iso)
    if failure is not None:
        return pytest.param(None, id=name, marks=pytest.mark.skip(f"{name} fails: {failure}"))
    return pytest.param(iso, id=name)


ISOLATED = [_working(name) for name in ISOLATIONS]


def _sandboxed_processes() -> int:
    count = 0
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                count += BOOT_MARK.encode() in f.read()
        except OSError:  # not a process, or ended meanwhile
            pass
    return count


def test_ok_run_gives_its_output():
    r = run_python("import sys\nprint(6 * 7)\nprint('warn', file=sys.stderr)", FAST)
    assert (r.outcome, r.exit_code, r.stdout, r.stderr) == ("ok", 0, "42\n", "warn\n")
    assert r.ok and not r.truncated and r.detail == ""
    assert r.isolation == isolation_in_use().name


@pytest.mark.parametrize(
    ("code", "detail"),
    [
        ("def f(:\n", "SyntaxError: invalid syntax"),
        ("x = 1\n1 / 0\n", "ZeroDivisionError: division by zero"),
        ("import sys\nsys.exit(3)\n", "exit status 3"),
    ],
)
def test_bad_code_is_an_error_with_its_last_line(code, detail):
    r = run_python(code, FAST)
    assert (r.outcome, r.detail) == ("error", detail)
    assert r.exit_code == (3 if "exit" in code else 1)


def test_a_signal_is_named():
    r = run_python("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", FAST)
    assert (r.outcome, r.detail, r.exit_code) == ("signal", "killed by SIGSEGV", -11)


def test_an_endless_loop_meets_the_cpu_limit():
    start = time.monotonic()
    r = run_python("while True:\n    pass\n", FAST)
    assert (r.outcome, r.detail, r.exit_code) == ("timeout", "CPU time past 1 s", -24)  # SIGXCPU
    assert time.monotonic() - start < 2.5


def test_a_sleeping_loop_meets_the_wall_limit():
    start = time.monotonic()
    r = run_python("import time\nprint('started', flush=True)\ntime.sleep(60)", Limits(wall_s=0.5))
    assert (r.outcome, r.detail, r.exit_code) == ("timeout", "wall time past 0.5 s", None)
    assert r.stdout == "started\n"  # what it wrote before is kept
    assert 0.5 <= time.monotonic() - start < 1.5


def test_a_fork_bomb_is_contained():
    """Every process forks forever: RLIMIT_NPROC stops it (not for root: then the wall time's
    kill of the whole group does, or bubblewrap's PID namespace); nothing is left after."""
    bomb = (
        "import os\nrefused = False\nwhile True:\n    try:\n        os.fork()\n"
        "    except OSError:\n        if not refused:\n            print('refused', flush=True)\n"
        "        refused = True\n"
    )
    start = time.monotonic()
    r = run_python(bomb, Limits(wall_s=0.5, cpu_s=1, processes=8))
    assert r.outcome == "timeout"
    assert time.monotonic() - start < 3.0
    if os.geteuid() != 0:
        assert "refused\n" in r.stdout  # RLIMIT_NPROC at work
    deadline = time.monotonic() + 5.0
    while _sandboxed_processes() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _sandboxed_processes() == 0


def test_huge_output_is_cut_while_read():
    """10 GB of output would take minutes: the run is killed at the limit, the output kept
    is exactly the limit."""
    start = time.monotonic()
    r = run_python("while True:\n    print('x' * 1000)\n", FAST)
    assert (r.outcome, r.detail, r.exit_code) == ("output_limit", "output past 4000 bytes", None)
    assert r.truncated and len(r.stdout) == 4000 and set(r.stdout) == {"x", "\n"}
    assert time.monotonic() - start < 2.0


def test_ten_gigabytes_is_a_memory_outcome():
    r = run_python("block = bytearray(10 * 2**30)\n", FAST)
    assert (r.outcome, r.detail) == ("memory", "MemoryError (memory limit 512 MB)")


@pytest.mark.parametrize("iso", ISOLATED)
def test_the_network_is_out_of_reach(iso):
    """A namespace leaves no interface up; without one the audit hook refuses the socket."""
    r = run_python(
        "import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)", FAST, isolation=iso
    )
    assert r.outcome == "network"
    if iso.name == "none":
        assert r.detail == "PermissionError: network access is blocked in the proxima sandbox"
    else:
        assert r.detail == "OSError: [Errno 101] Network is unreachable"


@pytest.mark.parametrize("iso", ISOLATED)
def test_a_fresh_folder_removed_after(iso, tmp_path):
    """The code runs in an empty folder of its own, gone after the run; under bubblewrap the
    caller's folders are not there at all (a private /tmp) and the rest is read-only."""
    code = (
        "import os\nprint(os.listdir('.'), os.getcwd())\nopen('out.txt', 'w').write('x')\n"
        f"open({str(tmp_path / 'outside.txt')!r}, 'w').write('x')\n"
    )
    r = run_python(code, FAST, isolation=iso)
    listed, cwd = r.stdout.split("] ")
    assert listed == "['main.py'"
    if iso.name == "bwrap":
        assert cwd.strip() == "/sandbox"
        assert r.outcome == "error" and r.detail.startswith("FileNotFoundError")
        assert not (tmp_path / "outside.txt").exists()
        r = run_python("import sys\nopen(sys.prefix + '/x', 'w')", FAST, isolation=iso)
        assert r.detail.startswith("OSError: [Errno 30] Read-only file system")
    else:
        assert r.outcome == "ok"
        assert not os.path.exists(cwd.strip())


@pytest.mark.parametrize("iso", ISOLATED)
def test_a_child_left_behind_is_killed(iso):
    """A child that outlives the script (and holds its stdout) is killed with its group."""
    code = "import os, time\nif os.fork() == 0:\n    time.sleep(60)\nprint('parent done')\n"
    start = time.monotonic()
    r = run_python(code, FAST, isolation=iso)
    assert (r.outcome, r.stdout) == ("ok", "parent done\n")
    assert time.monotonic() - start < 2.0


def test_the_isolation_in_use_is_said(monkeypatch):
    """Without bubblewrap (and without unshare) one warning names what is missing and how
    to install it."""
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(isolation_module, "_CHOSEN", [])  # not chosen yet
    with pytest.warns(SandboxWarning) as seen:
        iso = isolation_in_use()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert isolation_in_use() is iso  # decided once, said once
    assert iso.name == "none" and not iso.network_cut
    assert len(seen) == 1 and str(seen[0].message) == iso.missing
    assert "bubblewrap (`bwrap`) is not installed (Debian/Ubuntu: apt-get install bubblewrap)" in (
        iso.missing
    )


def test_limits_are_checked():
    with pytest.raises(ValueError, match=r"Limits.memory_mb=0 must be an integer >= 1"):
        Limits(memory_mb=0)
    with pytest.raises(ValueError, match=r"Limits.wall_s=-1 must be a number of seconds > 0"):
        Limits(wall_s=-1)


def test_code_block_takes_the_last_python_block():
    text = "try\n```python\nprint(1)\n```\nthen\n```py\nprint(2)\n```\n```output\n2\n```"
    assert code_block(text) == "print(2)\n"
    assert code_block("no code here") is None


def test_python_env_answers_with_the_output():
    env = PythonEnv({"prompt": "compute"})
    obs, reward, done, info = env.step("Let me see.\n```python\nprint(2 ** 10)\n```\n")
    assert (obs, reward, done) == ("\n```output\n1024\n```\n", 0.0, False)
    assert info["sandbox"]["outcome"] == "ok" and info["sandbox"]["exit_code"] == 0
    obs, _, _, info = env.step("```python\n1/0\n```")
    assert obs == (
        "\n```output\nTraceback (most recent call last):\n"
        '  File "main.py", line 1, in <module>\n    1/0\n    ~^~\n'
        "ZeroDivisionError: division by zero\n\n[error: ZeroDivisionError: division by zero]\n```\n"
    )
    assert info["sandbox"]["outcome"] == "error"
    assert env.step("The answer is 1024.") == (None, 0.0, True, {})
    assert load_env_class("proxima.sandbox:PythonEnv") is PythonEnv  # passes the start-up check


RESPONSES = [
    "```python\ndef add(a, b):\n    return a + b\n```",  # passes both
    "def add(a, b):\n    return a - b\n",  # no block: the whole text; passes the second only
    # the second test never ends: the first, passed before the timeout, counts
    "```python\nimport time\ndef add(a, b):\n"
    "    if b == 0:\n        time.sleep(60)\n    return a + b\n```",
    "```python\nprint('x pass')\ndef add(a, b):\n    return 0\n```",  # forges nothing
]
TESTS = [["assert add(1, 2) == 3", "assert add(2, 0) == 2"]] * 4


def test_tests_reward_scores_the_share_of_tests_passed():
    fraction = CodeTestsReward(Limits(wall_s=1.0), workers=4)
    start = time.monotonic()
    assert fraction(["p"] * 4, RESPONSES, TESTS) == [1.0, 0.5, 0.5, 0.0]
    assert time.monotonic() - start < 2.5  # side by side: one timeout's worth


def test_all_tests_passed_as_a_reward_function():
    """Named as `reward.function`: the `tests` column reaches it (a string: one test per
    line), the other columns do not; all or nothing."""
    source = FunctionReward.from_spec("proxima.sandbox:all_tests_passed")
    tests = "assert add(1, 2) == 3\nassert add(2, 0) == 2"
    columns = {"tests": [tests, tests], "answer": ["3", "3"]}
    assert source(["p", "p"], RESPONSES[:2], columns).tolist() == [1.0, 0.0]
