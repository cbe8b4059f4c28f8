"""Which isolation the sandbox runs under, chosen once per process by a trial run
(`isolation_in_use`), and the command line each one wraps the interpreter in
(`Isolation.command`); what each gives is in the package's docstring."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from dataclasses import dataclass, replace
from pathlib import Path

ISOLATIONS = ("bwrap", "unshare", "none")  # the strongest first
SANDBOX_DIR = "/sandbox"  # the run's folder as the code sees it under bwrap
TRIAL_TIMEOUT_S = 10.0

_CHOOSING = threading.Lock()
_CHOSEN: list[Isolation] = []  # isolation_in_use()'s choice, once made


class SandboxWarning(UserWarning):
    """The sandbox runs with less isolation than bubblewrap gives (said once per process)."""


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

    @property
    def home(self) -> str | None:
        """The run's folder as the code sees it, when it is not where it lies (bwrap)."""
        return SANDBOX_DIR if self.name == "bwrap" else None

    def command(self, folder: str, argv: list[str]) -> list[str]:
        """``argv`` under this isolation; bwrap binds ``folder`` as the writable /sandbox,
        the rest of its root read-only."""
        if self.name == "bwrap":
            ro_root = ["--remount-ro", "/", "--chdir", SANDBOX_DIR]
            return [*self.prefix, "--bind", folder, SANDBOX_DIR, *ro_root, *argv]
        return [*self.prefix, *argv]


def build_isolation(name: str) -> Isolation | None:
    """The isolation ``name`` (one of `ISOLATIONS`) as this machine would run it, untried;
    None when its command is not installed."""
    if name == "none":
        return Isolation("none", ())
    path = shutil.which(name)
    if path is None:
        return None
    return Isolation(name, (path, *(_bwrap_args() if name == "bwrap" else _unshare_args())))


def isolation_in_use() -> Isolation:
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
        if not (path == "/usr" or path.startswith("/usr/")) and not any(
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
        cmd = iso.command(folder, [sys.executable, "-E", "-s", "-B", "-c", "print('ok')"])
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
