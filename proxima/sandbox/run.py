"""One run of code in the sandbox (`run_python`): the process, its limits, reading its
output as it comes, and what it came to (`SandboxResult`); see the package's docstring."""

from __future__ import annotations

import json
import os
import re
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from proxima.sandbox.isolation import Isolation, isolation_in_use

# what a run came to; `detail` says more
OUTCOMES = ("ok", "error", "timeout", "memory", "output_limit", "signal", "network")
MAX_STDIN = 65536  # a pipe's buffer: written whole before the output is read
GRACE_S = 0.2  # reading on after a kill, for what a process outside the group still writes
# how a refused or unreachable network shows at the end of a traceback
NETWORK_ERRORS = re.compile(
    r"network access is blocked in the proxima sandbox|Network is unreachable|"
    r"Temporary failure in name resolution|Name or service not known|"
    r"No address associated with hostname|Cannot assign requested address"
)

# Runs first in the sandboxed interpreter: the limits (argv[1], JSON), the network guard
# when no namespace cuts the network, then main.py as __main__.
_BOOT = """\
import json, resource, sys
_limits = json.loads(sys.argv[1])
for _name, _value in _limits["rlimits"].items():
    resource.setrlimit(getattr(resource, _name), (_value[0], _value[1]))
if _limits["guard"]:
    def _guard(event, args):
        if event == "socket.__new__" and args[1] != 1 or event in (
            "socket.getaddrinfo", "socket.gethostbyname", "socket.gethostbyaddr",
            "socket.getnameinfo"):
            raise PermissionError("network access is blocked in the proxima sandbox")
    sys.addaudithook(_guard)
sys.argv = ["main.py"]
with open("main.py", encoding="utf-8") as _f:
    _source = _f.read()
del json, resource, _limits, _f
try:
    exec(compile(_source, "main.py", "exec"), {"__name__": "__main__", "__file__": "main.py"})
except SystemExit:
    raise
except BaseException as _e:  # the traceback from main.py on, without this frame
    import traceback
    traceback.print_exception(type(_e), _e, _e.__traceback__.tb_next)
    sys.exit(1)
"""


@dataclass(frozen=True)
class Limits:
    """What one run may use. ``processes``: how many processes the run may have at once, as
    `Isolation.process_limit` counts them (None: no limit)."""

    wall_s: float = 10.0
    cpu_s: int = 5  # RLIMIT_CPU counts whole seconds
    memory_mb: int = 1024
    output_bytes: int = 64_000  # stdout and stderr, each
    file_mb: int = 64
    processes: int | None = 64

    def __post_init__(self) -> None:
        value = self.wall_s
        if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
            raise ValueError(f"Limits.wall_s={value!r} must be a number of seconds > 0.")
        for name in ("cpu_s", "memory_mb", "output_bytes", "file_mb", "processes"):
            value = getattr(self, name)
            if name == "processes" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{name}={value!r} must be an integer >= 1.")


@dataclass(frozen=True)
class SandboxResult:
    """One run: its ``outcome`` (one of `OUTCOMES`), ``detail`` (the last traceback line, the
    limit passed or the signal), the ``exit_code`` (negative: killed by that signal; None:
    killed by the sandbox), stdout and stderr (cut at the output limit: ``truncated``), the
    wall ``seconds`` it took and the ``isolation`` it ran under (`Isolation.name`)."""

    outcome: str
    detail: str
    exit_code: int | None
    stdout: str
    stderr: str
    truncated: bool
    seconds: float
    isolation: str

    @property
    def ok(self) -> bool:
        return self.outcome == "ok"

    def info(self) -> dict:
        """The run without its output, for a record (samples.jsonl)."""
        info = asdict(self)
        del info["stdout"], info["stderr"]
        return info


def run_python(
    code: str,
    limits: Limits | None = None,
    stdin: str = "",
    isolation: Isolation | None = None,
) -> SandboxResult:
    """Run ``code`` as a script in the sandbox (see the package's docstring) within
    ``limits`` (default: `Limits()`), ``stdin`` its input (at most `MAX_STDIN` bytes: written
    before the output is read), under ``isolation`` (default: `isolation_in_use()`); whatever
    the code does, a limit passed included, is in the result, never raised."""
    if len(stdin.encode()) > MAX_STDIN:
        raise ValueError(f"run_python: stdin holds more than {MAX_STDIN} bytes (a pipe's buffer).")
    limits, iso = limits or Limits(), isolation or isolation_in_use()
    start = time.monotonic()
    # a process that left the group (setsid) may still write there: never an error of ours
    with tempfile.TemporaryDirectory(
        prefix="proxima-sandbox-", ignore_cleanup_errors=True
    ) as folder:
        Path(folder, "main.py").write_text(code, encoding="utf-8")
        iso.prepare(folder)
        boot = {"rlimits": _rlimits(limits, iso), "guard": not iso.network_cut}
        argv = [sys.executable, "-E", "-s", "-B", "-X", "utf8", "-c", _BOOT, json.dumps(boot)]
        proc = subprocess.Popen(
            iso.command(folder, argv),
            cwd=folder,
            env=_environment(iso.home or folder),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        try:
            read = _read(proc, stdin.encode(), limits, start + limits.wall_s)
        finally:
            _kill_group(proc.pid)
            proc.wait()
    seconds = time.monotonic() - start
    return _result(proc.returncode, read, limits, iso, seconds)


def _rlimits(limits: Limits, iso: Isolation) -> dict[str, tuple[int, int]]:
    rlimits = {
        "RLIMIT_CPU": (limits.cpu_s, limits.cpu_s + 1),
        "RLIMIT_AS": (limits.memory_mb << 20,) * 2,
        "RLIMIT_FSIZE": (limits.file_mb << 20,) * 2,
        "RLIMIT_CORE": (0, 0),
    }
    n = None if limits.processes is None else iso.process_limit(limits.processes)
    if n is not None:
        rlimits["RLIMIT_NPROC"] = (n, n)
    return rlimits


def _environment(home: str) -> dict[str, str]:
    """A small environment: no variable of the caller's (tokens, keys) reaches the code;
    ``home`` (the run's folder as the code sees it) is HOME and TMPDIR."""
    bin_dir = str(Path(sys.executable).parent)
    return {
        "PATH": f"{bin_dir}:/usr/local/bin:/usr/bin:/bin",
        "HOME": home,
        "TMPDIR": home,
        "LANG": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


@dataclass
class _Read:
    """What the parent read of a run: each stream's bytes, whether one passed the output
    limit, whether the wall time ran out."""

    out: bytearray
    err: bytearray
    truncated: bool = False
    timed_out: bool = False


def _read(proc: subprocess.Popen, stdin: bytes, limits: Limits, deadline: float) -> _Read:
    """Feed ``stdin``, then read stdout and stderr as they come until both end, one passes
    ``limits.output_bytes`` or ``deadline`` passes (never more than the limit is kept)."""
    _feed(proc, stdin)
    read = _Read(bytearray(), bytearray())
    ended = False  # the script ended while a child of it held the pipes
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ, read.out)
        sel.register(proc.stderr, selectors.EVENT_READ, read.err)
        while sel.get_map() and not read.truncated:
            left = deadline - time.monotonic()
            if left <= 0:
                read.timed_out = not ended
                break
            events = sel.select(min(left, 0.1))
            if not events and not ended and proc.poll() is not None:
                _kill_group(proc.pid)  # the children left behind; read what they wrote
                ended, deadline = True, min(deadline, time.monotonic() + GRACE_S)
            for key, _ in events:
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                room = limits.output_bytes - len(key.data)
                key.data.extend(chunk[:room])
                read.truncated |= len(chunk) > room
    return read


def _feed(proc: subprocess.Popen, data: bytes) -> None:
    """Write ``data`` to the run's stdin and close it (a script that does not read it gets a
    broken pipe, ignored)."""
    try:
        if data:
            proc.stdin.write(data)
        proc.stdin.close()
    except BrokenPipeError:
        pass


def _kill_group(pid: int) -> None:
    """SIGKILL to the run's process group (the session's leader has its pid)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):  # gone already
        pass


def _result(
    code: int, read: _Read, limits: Limits, iso: Isolation, seconds: float
) -> SandboxResult:
    """The outcome of a run from how it ended and its stderr's last line (a SIGKILL after
    ``cpu_s`` seconds is the CPU limit's hard kill; in a namespace an exit status 128 + n
    is signal n, as bwrap and the shell of unshare's root report a killed child)."""
    out = read.out.decode("utf-8", "replace")
    err = read.err.decode("utf-8", "replace")
    lines = err.strip().splitlines()
    last = lines[-1] if lines else ""
    signum = -code if code < 0 else None
    if iso.name != "none" and 128 < code < 128 + 65:
        signum = code - 128
    if signum is not None:
        code = -signum
    if read.truncated:
        outcome, detail, code = "output_limit", f"output past {limits.output_bytes} bytes", None
    elif read.timed_out:
        outcome, detail, code = "timeout", f"wall time past {limits.wall_s:g} s", None
    elif signum == signal.SIGXCPU or (signum == signal.SIGKILL and seconds >= limits.cpu_s):
        outcome, detail = "timeout", f"CPU time past {limits.cpu_s} s"
    elif signum is not None:
        outcome, detail = "signal", f"killed by {_signal_name(signum)}"
    elif code == 0:
        outcome, detail = "ok", ""
    elif last.startswith("MemoryError"):
        outcome, detail = "memory", f"{last} (memory limit {limits.memory_mb} MB)"
    elif NETWORK_ERRORS.search(last):
        outcome, detail = "network", last
    else:
        outcome, detail = "error", last or f"exit status {code}"
    return SandboxResult(outcome, detail, code, out, err, read.truncated, seconds, iso.name)


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
