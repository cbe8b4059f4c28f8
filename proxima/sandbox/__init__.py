"""The model's Python run in a separate process with limits (`run_python`), and its two uses:
the multi-turn environment `PythonEnv` (``rollout.env.cls=proxima.sandbox:PythonEnv``) and the
reward functions `tests_passed` / `all_tests_passed` (``reward.function=proxima.sandbox:...``).

Linux only (namespaces, /proc, Linux's resource limits). A run: a fresh temporary folder
(working directory and HOME, removed afterwards), the code as ``main.py`` there, run by this
interpreter with ``-E -s -B`` (no PYTHON* variables, no user site, no .pyc files) in a small
environment of its own (none of the caller's variables), stdin from the given text or
empty, in a session of its own. A short bootstrap (`run._BOOT`) sets the limits inside the
sandboxed interpreter before the code runs: RLIMIT_CPU (``cpu_s``: SIGXCPU, then SIGKILL a
second later), RLIMIT_AS (``memory_mb``: an allocation past it raises MemoryError),
RLIMIT_FSIZE (``file_mb``), RLIMIT_CORE 0 and RLIMIT_NPROC (``processes``,
`Isolation.process_limit`). The parent reads stdout and stderr as they come,
``output_bytes`` each at most, and kills the whole process group (SIGKILL) when the output
passes that, at ``wall_s``, and after every run.

Isolation, the strongest that works here, chosen once per process by a trial run
(`isolation_in_use`; `run_python` may be given another). ``bwrap`` (bubblewrap) and
``unshare`` (util-linux, with a shell script of mounts) contain the same:

- a new root holding only the system's and Python's folders, read-only, the run's folder
  (``/sandbox``, the only writable one), a private /tmp, a minimal /dev and the /proc of
  the run's own PID namespace: nothing else of the machine (the caller's folders, /etc/shadow,
  /run and the Unix sockets there) is in sight;
- new network (no interface up: no network, no abstract Unix socket of the machine's), PID
  (no other process can be signalled or read; every process of the run dies with it, one
  that called setsid included, and with the caller), IPC and UTS namespaces;
- no capability; when the caller is root, the code runs as nobody (65534), so that file
  permissions and RLIMIT_NPROC bind it (a user other than root runs the code in a user
  namespace of its own, where RLIMIT_NPROC counts the run's processes only).

``none`` (no namespace can be made) contains only the limits: its warning
(`SandboxWarning`, once) names what is left open and how to close it; an audit hook in the
sandboxed interpreter refuses sockets other than AF_UNIX and name lookups, which code that
goes around Python (ctypes, a subprocess) escapes.

Modules: `isolation` (the choice and the command lines), `run` (one run: `run_python`,
`Limits`, `SandboxResult`), `uses` (`PythonEnv`, `CodeTestsReward`).
"""

from proxima.sandbox.isolation import (
    ISOLATIONS,
    Isolation,
    SandboxWarning,
    build_isolation,
    isolation_in_use,
    trial,
)
from proxima.sandbox.run import OUTCOMES, Limits, SandboxResult, run_python
from proxima.sandbox.uses import (
    CodeTestsReward,
    PythonEnv,
    all_tests_passed,
    code_block,
    tests_passed,
)

__all__ = [
    "ISOLATIONS",
    "OUTCOMES",
    "CodeTestsReward",
    "Isolation",
    "Limits",
    "PythonEnv",
    "SandboxResult",
    "SandboxWarning",
    "all_tests_passed",
    "build_isolation",
    "code_block",
    "isolation_in_use",
    "run_python",
    "tests_passed",
    "trial",
]
