"""The model's Python run in a separate process with limits (`run_python`), and its two uses:
the multi-turn environment `PythonEnv` (``rollout.env.cls=proxima.sandbox:PythonEnv``) and the
reward functions `tests_passed` / `all_tests_passed` (``reward.function=proxima.sandbox:...``).

A run: a fresh temporary folder (working directory and HOME, removed afterwards), the code
as ``main.py`` there, run by this interpreter with ``-E -s -B`` (no PYTHON* variables, no
user site, no .pyc files), stdin from the given text or empty, in a session of its own. A
short bootstrap (`_BOOT`) sets the limits inside the sandboxed interpreter before the code
runs: RLIMIT_CPU (``cpu_s``: SIGXCPU, then SIGKILL a second later), RLIMIT_AS
(``memory_mb``: an allocation past it raises MemoryError), RLIMIT_FSIZE (``file_mb``),
RLIMIT_CORE 0 and RLIMIT_NPROC (``processes`` more than the user runs already: the kernel
counts all of a user's processes, and does not apply the limit to root). The parent reads
stdout and stderr as they come, ``output_bytes`` each at most, and kills the whole process
group (SIGKILL) when the output passes that, at ``wall_s``, and after every run (children
left behind included).

Isolation, the strongest that works here, chosen once per process by a trial run
(`isolation`):

- ``bwrap`` (bubblewrap): a new root holding only the system's and Python's folders,
  read-only, the run's folder (``/sandbox``, the only writable one) and a private /tmp; new
  network (no interface up), PID, IPC, UTS and user namespaces; every process of the run
  dies with it, even one that left the process group.
- ``unshare`` (util-linux): a new network namespace (and a user namespace when not root);
  the files are those this user sees.
- ``none``: an audit hook in the sandboxed interpreter refuses sockets other than AF_UNIX and
  name lookups; code that goes around Python (ctypes, a subprocess such as curl) is not
  stopped, and files are those this user sees.

The last two warn once (`SandboxWarning`) naming what is missing and how to install it.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ISOLATIONS = ("bwrap", "unshare", "none")  # the strongest first
# what a run came to; `detail` says more
OUTCOMES = ("ok", "error", "timeout", "memory", "output_limit", "signal", "network")
SANDBOX_DIR = "/sandbox"  # the run's folder as the code sees it under bwrap
TRIAL_TIMEOUT_S = 10.0
MAX_STDIN = 65536  # a pipe's buffer: written whole before the output is read
GRACE_S = 0.2  # reading on after a kill, for what a process outside the group still writes
# how a refused or unreachable network shows at the end of a traceback
NETWORK_ERRORS = re.compile(
    r"network access is blocked in the proxima sandbox|Network is unreachable|"
    r"Temporary failure in name resolution|Name or service not known|"
    r"No address associated with hostname|Cannot assign requested address"
)
CODE_BLOCK = re.compile(r"```(?:python|py)[ \t]*\n(.*?)```", re.DOTALL)

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


_CHOOSING = threading.Lock()
_CHOSEN: list[Isolation] = []  # isolation()'s choice, once made


class SandboxWarning(UserWarning):
    """The sandbox runs with less isolation than bubblewrap gives (said once per process)."""


@dataclass(frozen=True)
class Limits:
    """What one run may use. ``processes``: how many more processes than the user already
    runs (None: no limit; not enforced for root)."""

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


@dataclass(frozen=True)
class Isolation:
    """How runs are isolated here: ``name`` (bwrap, unshare or none), the command that wraps
    the interpreter, and ``missing``: one line naming what is missing and how to get it
    (None under bwrap)."""

    name: str
    prefix: tuple[str, ...]
    missing: str | None = None

    @property
    def network_cut(self) -> bool:
        """True when a namespace cuts the network; False: the audit hook guards it."""
        return self.name != "none"


def build_isolation(name: str) -> Isolation | None:
    """The isolation ``name`` (one of `ISOLATIONS`) as this machine would run it, untried;
    None when its command is not installed."""
    if name == "none":
        return Isolation("none", ())
    path = shutil.which(name)
    if path is None:
        return None
    return Isolation(name, (path, *(_bwrap_args() if name == "bwrap" else _unshare_args())))


def isolation() -> Isolation:
    """The strongest isolation that works on this machine, found by a trial run of each
    once per process (the first caller's; the others, in other threads, wait for it); warns
    once when it is not bubblewrap."""
    with _CHOOSING:
        if not _CHOSEN:
            _CHOSEN.append(_choose())
        return _CHOSEN[0]


def _choose() -> Isolation:
    bwrap = build_isolation("bwrap")
    failure = trial(bwrap) if bwrap else None
    if bwrap and failure is None:
        return bwrap
    if bwrap:
        why = f"bubblewrap (`bwrap`) is installed but fails here ({failure}; user namespaces off?)"
    else:
        why = "bubblewrap (`bwrap`) is not installed (Debian/Ubuntu: apt-get install bubblewrap)"
    unshare = build_isolation("unshare")
    if unshare and trial(unshare) is None:
        chosen = replace(
            unshare,
            missing=f"proxima.sandbox: no filesystem isolation: {why}; a network namespace by "
            "`unshare`, files as this user sees them.",
        )
    else:
        chosen = Isolation(
            "none",
            (),
            f"proxima.sandbox: no filesystem or network isolation: {why}, and `unshare` "
            "(util-linux) cannot make namespaces here; sockets are refused by an audit hook "
            "in Python only, files are as this user sees them.",
        )
    warnings.warn(chosen.missing, SandboxWarning, stacklevel=3)
    return chosen


def _bwrap_args() -> tuple[str, ...]:
    """A root of the system's folders and Python's, read-only; the run's folder writable."""
    args = ["--unshare-all", "--die-with-parent", "--dev", "/dev", "--proc", "/proc"]
    args += ["--tmpfs", "/tmp"]
    for path in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc/alternatives"):
        if os.path.islink(path):  # merged /usr: /bin -> usr/bin
            args += ["--symlink", os.readlink(path), path]
        elif os.path.exists(path):
            args += ["--ro-bind", path, path]
    for path in ("/etc/ld.so.cache", "/etc/localtime"):
        args += ["--ro-bind-try", path, path]
    for path in _python_folders():
        args += ["--ro-bind", path, path]
    return tuple(args)


def _python_folders() -> list[str]:
    """The folders this interpreter needs (its prefixes, the folder of its binary), outermost
    only."""
    found = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    found.add(str(Path(sys.executable).resolve().parent))
    found = {os.path.realpath(p) for p in found} | found
    kept: list[str] = []
    for path in sorted(found, key=len):
        if not path.startswith("/usr") and not any(
            path == k or path.startswith(k.rstrip("/") + "/") for k in kept
        ):
            kept.append(path)
    return kept


def _unshare_args() -> tuple[str, ...]:
    user = () if os.geteuid() == 0 else ("--user", "--map-root-user")
    # no PID namespace: the code would be its init, which ignores SIGXCPU and SIGSEGV
    return (*user, "--net")


def trial(iso: Isolation) -> str | None:
    """None when ``print('ok')`` runs under ``iso``, else why not (its last line)."""
    with tempfile.TemporaryDirectory(prefix="proxima-sandbox-") as folder:
        cmd = _wrapped(iso.prefix, folder, [sys.executable, "-E", "-s", "-B", "-c", "print('ok')"])
        try:
            done = subprocess.run(
                cmd, cwd=folder, capture_output=True, text=True, timeout=TRIAL_TIMEOUT_S
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"{type(exc).__name__}: {exc}"
    if done.returncode == 0 and done.stdout.strip() == "ok":
        return None
    lines = done.stderr.strip().splitlines()
    return lines[-1] if lines else f"exit status {done.returncode}"


def _wrapped(prefix: tuple[str, ...], folder: str, command: list[str]) -> list[str]:
    """``command`` under ``prefix``; bwrap binds ``folder`` as the writable /sandbox, the
    rest of its root read-only."""
    if prefix and Path(prefix[0]).name == "bwrap":
        ro_root = ["--remount-ro", "/", "--chdir", SANDBOX_DIR]
        return [*prefix, "--bind", folder, SANDBOX_DIR, *ro_root, *command]
    return [*prefix, *command]


def run_python(code: str, limits: Limits = Limits(), stdin: str = "") -> SandboxResult:
    """Run ``code`` as a script in the sandbox (see the module's docstring), ``stdin`` its
    input (at most `MAX_STDIN` bytes: written before the output is read); whatever the code
    does, a limit passed included, is in the result, never raised."""
    if len(stdin.encode()) > MAX_STDIN:
        raise ValueError(f"run_python: stdin holds more than {MAX_STDIN} bytes (a pipe's buffer).")
    iso = isolation()
    start = time.monotonic()
    # a process that left the group (setsid) may still write there: never an error of ours
    with tempfile.TemporaryDirectory(
        prefix="proxima-sandbox-", ignore_cleanup_errors=True
    ) as folder:
        Path(folder, "main.py").write_text(code, encoding="utf-8")
        boot = {"rlimits": _rlimits(limits), "guard": not iso.network_cut}
        command = [sys.executable, "-E", "-s", "-B", "-X", "utf8", "-c", _BOOT, json.dumps(boot)]
        proc = subprocess.Popen(
            _wrapped(iso.prefix, folder, command),
            cwd=folder,
            env=_environment(SANDBOX_DIR if iso.name == "bwrap" else folder),
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


def _rlimits(limits: Limits) -> dict[str, tuple[int, int]]:
    rlimits = {
        "RLIMIT_CPU": (limits.cpu_s, limits.cpu_s + 1),
        "RLIMIT_AS": (limits.memory_mb << 20,) * 2,
        "RLIMIT_FSIZE": (limits.file_mb << 20,) * 2,
        "RLIMIT_CORE": (0, 0),
    }
    if limits.processes is not None and os.geteuid() != 0:
        n = _processes_of(os.geteuid()) + limits.processes
        rlimits["RLIMIT_NPROC"] = (n, n)
    return rlimits


def _processes_of(uid: int) -> int:
    """How many processes ``uid`` runs now (RLIMIT_NPROC counts them all)."""
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                count += entry.stat().st_uid == uid
            except OSError:  # ended meanwhile
                pass
    return count


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
    ``cpu_s`` seconds is the CPU limit's hard kill; under bwrap an exit status 128 + n is
    signal n, as bwrap reports a killed child)."""
    out = read.out.decode("utf-8", "replace")
    err = read.err.decode("utf-8", "replace")
    lines = err.strip().splitlines()
    last = lines[-1] if lines else ""
    signum = -code if code < 0 else None
    if iso.name == "bwrap" and 128 < code < 128 + 65:
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


def code_block(text: str) -> str | None:
    """The last ```python (or ```py) fenced block of ``text``, or None."""
    blocks = CODE_BLOCK.findall(text)
    return blocks[-1] if blocks else None


class PythonEnv:
    """A multi-turn environment (``rollout.env.cls=proxima.sandbox:PythonEnv``): an action
    with a ```python block runs its last one in the sandbox and is answered with its output
    (stdout, then stderr, at most ``max_observation_chars``, and the outcome when it is not
    ok) as a ```output block; an action without one ends the episode. Every turn's reward
    is 0 (score the episode with a reward source, e.g. `tests_passed`, or subclass); the
    turn's record keeps the run's `SandboxResult.info` as its ``info``. Subclass to change
    ``limits`` or ``max_observation_chars``."""

    limits = Limits(wall_s=5.0, cpu_s=5)
    max_observation_chars = 2000

    def __init__(self, row: dict) -> None:
        self.row = row

    def step(self, action: str) -> tuple[str | None, float, bool, dict]:
        code = code_block(action)
        if code is None:
            return None, 0.0, True, {}
        result = run_python(code, self.limits)
        return self.observation(result), 0.0, False, {"sandbox": result.info()}

    def observation(self, result: SandboxResult) -> str:
        text = result.stdout + result.stderr
        if len(text) > self.max_observation_chars:
            text = text[: self.max_observation_chars] + f"\n... ({len(text)} characters)"
        if not result.ok:
            text += f"\n[{result.outcome}: {result.detail}]"
        return f"\n```output\n{text.strip()}\n```\n"


class CodeTestsReward:
    """A reward function (``reward.function=proxima.sandbox:tests_passed``): each response's
    code (its last ```python block, or the whole response when it has none) runs in a
    sandbox of its own, followed by the row's ``tests`` (a list of Python statements, e.g.
    asserts, or one string with one per line), each test on its own; the score is the share
    of tests that pass (``all_or_nothing``: 1 when all do, else 0). Up to ``workers``
    sandboxes run at once. A test passes when it runs without an exception after the code;
    the code runs with ``__name__ == "solution"`` (its ``if __name__ == "__main__":`` part
    does not run). Tests that ran before a limit was passed still count. A test's pass is
    printed with a random token the script does not hold, so code that prints passes scores
    nothing; code that digs the token out of the interpreter (its frames) could still forge
    them: the sandbox contains code, it does not make tests tamper-proof."""

    def __init__(
        self, limits: Limits = Limits(), all_or_nothing: bool = False, workers: int = 4
    ) -> None:
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
            raise ValueError(f"CodeTestsReward: workers={workers!r} must be an integer >= 1.")
        self.limits, self.all_or_nothing, self.workers = limits, all_or_nothing, workers

    def __call__(self, prompts: list[str], responses: list[str], tests: list) -> list[float]:
        with ThreadPoolExecutor(self.workers, thread_name_prefix="sandbox") as pool:
            return list(pool.map(self.score, responses, tests))

    def score(self, response: str, tests: list[str] | str) -> float:
        """One response's score against its tests."""
        tests = tests.splitlines() if isinstance(tests, str) else list(tests)
        tests = [t for t in tests if t.strip()]
        if not tests:
            raise ValueError("CodeTestsReward: a row has no tests; give each row a `tests` list.")
        code = code_block(response) or response
        token = os.urandom(16).hex()  # not in the script: printing "... pass" does not count
        result = run_python(_harness(code, tests), self.limits, stdin=token + "\n")
        passed = sum(line == f"{token} pass" for line in result.stdout.splitlines())
        if self.all_or_nothing:
            return float(passed == len(tests))
        return passed / len(tests)


def _harness(code: str, tests: list[str]) -> str:
    """A script that reads the pass token from stdin (before the code could read it), runs
    ``code``, then each test, printing ``<token> pass`` for each one that raised nothing."""
    return (
        "import sys\n"
        "_token = sys.stdin.readline().strip()\n"
        "_ns = {'__name__': 'solution'}\n"
        f"exec(compile({code!r}, 'solution.py', 'exec'), _ns)\n"
        f"for _i, _test in enumerate({tests!r}):\n"
        "    try:\n"
        "        exec(compile(_test, f'test {_i}', 'exec'), _ns)\n"
        "    except Exception as _e:\n"
        "        print(f'test {_i} failed: {type(_e).__name__}: {_e}', file=sys.stderr)\n"
        "    else:\n"
        "        print(_token, 'pass', flush=True)\n"
    )


tests_passed = CodeTestsReward()
all_tests_passed = CodeTestsReward(all_or_nothing=True)
