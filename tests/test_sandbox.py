"""The sandbox (`proxima.sandbox`): each way code can misbehave (a syntax error, an
exception, an endless loop, a fork bomb, huge output, 10 GB of memory, a socket) is
contained, named in the result, and the calling process goes on; each way out of the
sandbox (killing the caller or another process, reading the caller's environment, writing
outside its folder, reading /etc/shadow, leaving a process behind, reaching a Unix socket or
the network) is closed under every isolation with namespaces that works here (bubblewrap,
unshare), tried from a trainer process of its own that must survive it; the isolation in use
is said; the multi-turn environment and the tests reward on tiny cases. Short limits keep it
fast.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

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
# the escapes: "none" contains none of them (its warning names each)
CONTAINED = [*ISOLATED[:-1], pytest.param(None, id="none", marks=pytest.mark.skip("no namespace"))]


def _processes_with(mark: str) -> int:
    """How many processes on the machine hold ``mark`` in their command line."""
    count = 0
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                count += mark.encode() in f.read()
        except OSError:  # not a process, or ended meanwhile
            pass
    return count


def _gone(mark: str, within_s: float = 3.0) -> bool:
    deadline = time.monotonic() + within_s
    while _processes_with(mark) and time.monotonic() < deadline:
        time.sleep(0.05)
    return _processes_with(mark) == 0


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


@pytest.mark.parametrize("iso", ISOLATED)
def test_a_signal_is_named(iso):
    r = run_python("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)", FAST, isolation=iso)
    assert (r.outcome, r.detail, r.exit_code) == ("signal", "killed by SIGSEGV", -11)


@pytest.mark.parametrize("iso", ISOLATED)
def test_an_endless_loop_meets_the_cpu_limit(iso):
    """A wall time far off: on a loaded machine one second of CPU takes several."""
    r = run_python("while True:\n    pass\n", Limits(wall_s=30, cpu_s=1), isolation=iso)
    assert (r.outcome, r.detail, r.exit_code) == ("timeout", "CPU time past 1 s", -24)  # SIGXCPU


@pytest.mark.parametrize("iso", ISOLATED)
def test_a_sleeping_loop_meets_the_wall_limit(iso):
    start = time.monotonic()
    code = "import time\nprint('started', flush=True)\ntime.sleep(60)"
    r = run_python(code, Limits(wall_s=0.5), isolation=iso)
    assert (r.outcome, r.detail, r.exit_code) == ("timeout", "wall time past 0.5 s", None)
    assert r.stdout == "started\n"  # what it wrote before is kept
    assert 0.5 <= time.monotonic() - start < 1.5


@pytest.mark.parametrize("iso", ISOLATED)
def test_a_fork_bomb_is_contained(iso):
    """Every process forks forever: RLIMIT_NPROC stops it (under "none" not for root: then the
    wall time's kill of the whole group does); nothing is left after."""
    bomb = (
        "import os\nrefused = False\nwhile True:\n    try:\n        os.fork()\n"
        "    except OSError:\n        if not refused:\n            print('refused', flush=True)\n"
        "        refused = True\n"
    )
    # a memory limit of this test's own: its bytes in the command line mark the run's processes
    limits = Limits(wall_s=0.5, cpu_s=1, processes=8, memory_mb=512 + secrets.randbelow(10**6))
    start = time.monotonic()
    r = run_python(bomb, limits, isolation=iso)
    assert r.outcome == "timeout"
    assert time.monotonic() - start < 3.0
    if iso.name != "none" or os.geteuid() != 0:
        assert "refused\n" in r.stdout  # RLIMIT_NPROC at work
    assert _gone(str(limits.memory_mb << 20))


@pytest.mark.parametrize("iso", ISOLATED)
def test_huge_output_is_cut_while_read(iso):
    """10 GB of output would take minutes: the run is killed at the limit, the output kept
    is exactly the limit."""
    start = time.monotonic()
    r = run_python("while True:\n    print('x' * 1000)\n", FAST, isolation=iso)
    assert (r.outcome, r.detail, r.exit_code) == ("output_limit", "output past 4000 bytes", None)
    assert r.truncated and len(r.stdout) == 4000 and set(r.stdout) == {"x", "\n"}
    assert time.monotonic() - start < 2.0


@pytest.mark.parametrize("iso", ISOLATED)
def test_ten_gigabytes_is_a_memory_outcome(iso):
    r = run_python("block = bytearray(10 * 2**30)\n", FAST, isolation=iso)
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
    """The code runs in an empty folder of its own, gone after the run; in a namespace the
    caller's folders are not there at all and the rest is read-only."""
    code = (
        "import os\nprint(os.listdir('.'), os.getcwd())\nopen('out.txt', 'w').write('x')\n"
        f"open({str(tmp_path / 'outside.txt')!r}, 'w').write('x')\n"
    )
    r = run_python(code, FAST, isolation=iso)
    listed, cwd = r.stdout.split("] ")
    assert listed == "['main.py'"
    if iso.name == "none":
        assert r.outcome == "ok"
        assert not os.path.exists(cwd.strip())
        return
    assert cwd.strip() == "/sandbox"
    assert r.outcome == "error" and r.detail.startswith("FileNotFoundError")
    assert not (tmp_path / "outside.txt").exists()
    r = run_python("import sys\nopen(sys.prefix + '/x', 'w')", FAST, isolation=iso)
    assert r.detail.startswith("OSError: [Errno 30] Read-only file system")


@pytest.mark.parametrize("iso", ISOLATED)
def test_a_child_left_behind_is_killed(iso):
    """A child that outlives the script (and holds its stdout) is killed with its group."""
    code = "import os, time\nif os.fork() == 0:\n    time.sleep(60)\nprint('parent done')\n"
    start = time.monotonic()
    r = run_python(code, FAST, isolation=iso)
    assert (r.outcome, r.stdout) == ("ok", "parent done\n")
    assert time.monotonic() - start < 2.0


# A trainer of its own for each escape, so that one that works kills it rather than the
# tests: it runs the code through PythonEnv (or tests_passed) under the isolation named,
# CALLER in the code standing for its pid, and prints the turn's record.
TRAINER = """\
import json, os, sys
from proxima.sandbox import PythonEnv, build_isolation, tests_passed
from proxima.sandbox import isolation
isolation._CHOSEN.append(build_isolation(sys.argv[1]))
code = sys.argv[3].replace("CALLER", str(os.getpid()))
if sys.argv[2] == "env":
    obs, _, _, info = PythonEnv({}).step("```python\\n" + code + "\\n```")
    print(json.dumps({"obs": obs, **info["sandbox"]}))
else:
    print(json.dumps({"score": tests_passed([""], [code], [["assert True"]])[0]}))
"""
SECRET = "proxima-test-secret-" + secrets.token_hex(8)


def _trainer(iso, code: str, use: str = "env") -> dict:
    """The record of a trainer's turn running ``code``; the trainer must have lived to say it."""
    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "PYTHONPATH": root, "PROXIMA_TEST_SECRET": SECRET}
    done = subprocess.run(
        [sys.executable, "-c", TRAINER, iso.name, use, code],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, f"the trainer died ({done.returncode}): {done.stderr}"
    record = json.loads(done.stdout)
    assert SECRET not in done.stdout
    return record


def _sleeper(before_exec: str) -> tuple[str, str]:
    """A mark and code that becomes (after ``before_exec``) a process holding the mark in its
    command line, which only the code puts together: the trainer's own does not hold it."""
    head, tail = "proxima-escape-", secrets.token_hex(8)
    code = (
        f"import os, sys\n{before_exec}"
        f"os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(30)', "
        f"{head!r} + {tail!r}])\n"
    )
    return head + tail, code


@pytest.mark.parametrize("iso", CONTAINED)
def test_the_caller_cannot_be_killed(iso):
    """Neither by its pid nor as the parent: the trainer goes on, the turn is a named failure
    (as the reward's is a score of 0)."""
    record = _trainer(iso, "import os\nos.kill(CALLER, 9)")
    assert (record["outcome"], record["detail"]) == (
        "error",
        "ProcessLookupError: [Errno 3] No such process",
    )
    record = _trainer(iso, "import os, time\nos.kill(os.getppid(), 9)\ntime.sleep(0.5)\n1/0")
    assert record["outcome"] == "error"  # killing its namespace's init is refused or ignored
    assert _trainer(iso, "import os\nos.kill(CALLER, 9)", use="reward") == {"score": 0.0}


@pytest.mark.parametrize("iso", CONTAINED)
def test_another_process_cannot_be_killed(iso):
    other = subprocess.Popen(["sleep", "30"])
    try:
        record = _trainer(iso, f"import os\nos.kill({other.pid}, 9)")
        assert record["detail"] == "ProcessLookupError: [Errno 3] No such process"
        assert other.poll() is None
    finally:
        other.kill()
        other.wait()


@pytest.mark.parametrize("iso", CONTAINED)
def test_the_callers_environment_is_out_of_reach(iso):
    """Its own environment holds none of the caller's variables; /proc has no other process's."""
    code = (
        "import glob, os\nprint(dict(os.environ))\n"
        "for path in glob.glob('/proc/*/environ'):\n"
        "    try:\n        print(open(path).read())\n    except OSError:\n        pass\n"
        "print(open('/proc/CALLER/environ').read())"
    )
    record = _trainer(iso, code)  # the secret in none of what came back: _trainer's check
    assert record["outcome"] == "error" and "FileNotFoundError" in record["detail"]


@pytest.mark.parametrize("iso", CONTAINED)
def test_nothing_is_written_outside_its_folder(iso, tmp_path):
    """/tmp is the run's own (gone with it), the caller's folders are not there, the system's
    are read-only."""
    mark = f"proxima-escape-{secrets.token_hex(8)}"
    code = (
        f"open('/tmp/{mark}', 'w').write('x')\nprint('private /tmp')\n"
        f"open({str(tmp_path / mark)!r}, 'w').write('x')"
    )
    record = _trainer(iso, code)
    assert record["outcome"] == "error" and "FileNotFoundError" in record["detail"]
    assert not Path("/tmp", mark).exists() and not (tmp_path / mark).exists()
    record = _trainer(iso, "open('/usr/proxima-escape', 'w')")
    assert "Read-only file system" in record["detail"]


@pytest.mark.parametrize("iso", CONTAINED)
def test_etc_shadow_is_out_of_reach(iso):
    """Not in the code's view; a root caller's code runs as nobody besides."""
    record = _trainer(iso, "import os\nprint(os.getuid())\nprint(open('/etc/shadow').read())")
    assert record["outcome"] == "error" and "FileNotFoundError" in record["detail"]
    if os.geteuid() == 0:
        assert record["obs"].startswith("\n```output\n65534\n")


@pytest.mark.parametrize("iso", CONTAINED)
def test_a_process_that_left_the_session_dies_with_the_run(iso):
    """setsid takes a child out of the run's process group, not out of its PID namespace."""
    mark, code = _sleeper("if os.fork() == 0:\n    os.setsid()\n    ")
    code += "print('left one behind')"
    record = _trainer(iso, code)
    assert record["outcome"] == "ok"
    assert _gone(mark)


@pytest.mark.parametrize("iso", CONTAINED)
def test_a_run_dies_with_its_caller(iso):
    """A trainer killed mid-run (no one left to enforce the wall time) takes the run along."""
    mark, code = _sleeper("")
    root = str(Path(__file__).resolve().parents[1])
    trainer = subprocess.Popen(
        [sys.executable, "-c", TRAINER, iso.name, "env", code],
        env={**os.environ, "PYTHONPATH": root},
        stdout=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10.0
        while not _processes_with(mark) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _processes_with(mark), "the run did not start"
    finally:
        trainer.kill()
        trainer.wait()
    assert _gone(mark)


@pytest.mark.parametrize("iso", CONTAINED)
def test_unix_sockets_outside_are_out_of_reach(iso, tmp_path):
    """A path (in the caller's folders, hidden) and an abstract name (another network
    namespace's)."""
    name = f"proxima-escape-{secrets.token_hex(8)}"
    listeners = []
    for address in (str(tmp_path / "s"), "\0" + name):
        listener = socket.socket(socket.AF_UNIX)
        listener.bind(address)
        listener.listen()
        listener.setblocking(False)
        listeners.append(listener)
    code = (
        "import socket\nfor address in ({path!r}, {abstract!r}):\n"
        "    try:\n        socket.socket(socket.AF_UNIX).connect(address)\n"
        "    except OSError as e:\n        print(type(e).__name__)\n    else:\n"
        "        print('connected')"
    ).format(path=str(tmp_path / "s"), abstract="\0" + name)
    try:
        record = _trainer(iso, code)
        assert "connected" not in record["obs"]
        for listener in listeners:
            with pytest.raises(BlockingIOError):
                listener.accept()
    finally:
        for listener in listeners:
            listener.close()


def test_the_isolation_in_use_is_said(monkeypatch):
    """Without bubblewrap and unshare one warning names what is left open and how to close
    it."""
    monkeypatch.setattr(shutil, "which", lambda name: None)
    monkeypatch.setattr(isolation_module, "_CHOSEN", [])  # not chosen yet
    with pytest.warns(SandboxWarning) as seen:
        iso = isolation_in_use()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert isolation_in_use() is iso  # decided once, said once
    assert iso.name == "none" and not iso.network_cut
    assert len(seen) == 1 and str(seen[0].message) == iso.missing
    assert "(bwrap: bwrap " in iso.missing  # (and setpriv, for root)
    assert "; unshare: unshare and setpriv not installed)" in iso.missing
    assert "it can kill the caller" in iso.missing
    assert "apt-get install bubblewrap" in iso.missing


@pytest.mark.parametrize("iso", ISOLATED[1:2])
def test_unshare_stands_in_for_bubblewrap_unsaid(iso, monkeypatch):
    """unshare contains what bubblewrap does: chosen without a warning when bwrap is missing."""
    which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name: None if name == "bwrap" else which(name))
    monkeypatch.setattr(isolation_module, "_CHOSEN", [])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert isolation_in_use().name == "unshare" and isolation_in_use().missing is None


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
