"""The model's Python run in a separate process with limits (`run_python`), and its two uses:
the multi-turn environment `PythonEnv` (``rollout.env.cls=proxima.sandbox:PythonEnv``) and the
reward functions `tests_passed` / `all_tests_passed` (``reward.function=proxima.sandbox:...``).

Linux only (namespaces, /proc, Linux's resource limits). A run: a fresh temporary folder
(working directory and HOME, removed afterwards), the code as ``main.py`` there, run by this
interpreter with ``-E -s -B`` (no PYTHON* variables, no user site, no .pyc files), stdin
from the given text or empty, in a session of its own. A short bootstrap (`run._BOOT`) sets
the limits inside the sandboxed interpreter before the code runs: RLIMIT_CPU (``cpu_s``:
SIGXCPU, then SIGKILL a second later), RLIMIT_AS (``memory_mb``: an allocation past it
raises MemoryError), RLIMIT_FSIZE (``file_mb``), RLIMIT_CORE 0 and RLIMIT_NPROC
(``processes`` more than the user runs already: the kernel counts all of a user's processes,
and does not apply the limit to root). The parent reads stdout and stderr as they come,
``output_bytes`` each at most, and kills the whole process group (SIGKILL) when the output
passes that, at ``wall_s``, and after every run (children left behind included).

Isolation, the strongest that works here, chosen once per process by a trial run
(`isolation_in_use`; `run_python` may be given another):

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
