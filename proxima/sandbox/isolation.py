"""Which isolation the sandbox runs under, chosen once per process by a trial run
(`isolation_in_use`), and the command line each one wraps the interpreter in
(`Isolation.command`); what each gives is in the package's docstring."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path

ISOLATIONS = ("bwrap", "unshare", "none")  # the strongest first
SANDBOX_DIR = "/sandbox"  # the run's folder as the code sees it in a namespace
TRIAL_TIMEOUT_S = 10.0
NOBODY = 65534  # the user the code runs as in a namespace when the caller is root
HELPERS = 2  # processes of the isolation counted with the code's in its user namespace
_DEVICES = ("null", "zero", "full", "random", "urandom")  # the nodes of the code's /dev

_CHOOSING = threading.Lock()
_CHOSEN: list[Isolation] = []  # isolation_in_use()'s choice, once made


class SandboxWarning(UserWarning):
    """The sandbox runs without namespaces, containing little (said once per process)."""


@dataclass(frozen=True)
class Isolation:
    """How runs are isolated here: ``name`` (bwrap, unshare or none), the command that wraps
    the interpreter, and ``missing``: what is not contained and how to get it, in one
    paragraph (None when nothing is missing)."""

    name: str
    prefix: tuple[str, ...]
    missing: str | None = None

    @property
    def network_cut(self) -> bool:
        """True when a namespace cuts the network; False: the audit hook guards it."""
        return self.name != "none"

    @property
    def home(self) -> str | None:
        """The run's folder as the code sees it, when it is not where it lies."""
        return None if self.name == "none" else SANDBOX_DIR

    @property
    def as_nobody(self) -> bool:
        """The code runs as `NOBODY`: the caller is root and a namespace holds the run."""
        return self.name != "none" and os.geteuid() == 0

    def prepare(self, folder: str) -> None:
        """Make the run's ``folder`` and its files the code's user's (and the folder searchable
        by all: bubblewrap enters it as root before the code becomes `NOBODY`, without the
        capability that passes over permissions)."""
        if self.as_nobody:
            for entry in os.scandir(folder):  # main.py: readable whatever the umask
                os.chown(entry.path, NOBODY, NOBODY)
            os.chown(folder, NOBODY, NOBODY)
            os.chmod(folder, 0o711)

    def command(self, folder: str, argv: list[str]) -> list[str]:
        """``argv`` under this isolation, ``folder`` its writable working folder."""
        if self.name == "bwrap":
            ro_root = ["--remount-ro", "/", "--chdir", SANDBOX_DIR]
            drop = _drop_privileges() if self.as_nobody else []
            return [*self.prefix, "--bind", folder, SANDBOX_DIR, *ro_root, *drop, *argv]
        if self.name == "unshare":
            script = _new_root_script(folder)
            return [*self.prefix, "/bin/sh", "-c", script, "sandbox", *_drop_privileges(), *argv]
        return [*self.prefix, *argv]

    def process_limit(self, processes: int) -> int | None:
        """RLIMIT_NPROC for a run of at most ``processes`` processes. The kernel counts all
        the processes of the code's user (in a user namespace of its own, only that
        namespace's, which holds `HELPERS` more) and never limits root."""
        if self.as_nobody:
            return processes_of(NOBODY) + processes
        if os.geteuid() == 0:
            return None
        if self.name == "none":
            return processes_of(os.geteuid()) + processes
        return processes + HELPERS


def build_isolation(name: str) -> Isolation | None:
    """The isolation ``name`` (one of `ISOLATIONS`) as this machine would run it, untried;
    None when a command it needs is not installed."""
    if name == "none":
        return Isolation("none", ())
    if _not_installed(name):
        return None
    path = shutil.which(name)
    if name == "bwrap":
        return Isolation(name, (path, *_bwrap_args()))
    # unshare killed with the thread that started it (bubblewrap's --die-with-parent), and
    # with it the whole run (--kill-child)
    setpriv = shutil.which("setpriv")
    return Isolation(name, (setpriv, "--pdeathsig=KILL", path, *_unshare_args()))


def _not_installed(name: str) -> list[str]:
    """The commands isolation ``name`` needs that are not installed: setpriv (util-linux)
    drops the privileges under unshare, and root's under bubblewrap."""
    needs = [name] + (["setpriv"] if name == "unshare" or os.geteuid() == 0 else [])
    return [command for command in needs if shutil.which(command) is None]


def isolation_in_use() -> Isolation:
    """The strongest isolation that works on this machine, found by a trial run of each
    once per process (the first caller's; the others, in other threads, wait for it); warns
    once when some containment is missing."""
    with _CHOOSING:
        if not _CHOSEN:
            _CHOSEN.append(_choose())
        return _CHOSEN[0]


def _choose() -> Isolation:
    failures = []
    for name in ISOLATIONS[:-1]:
        iso = build_isolation(name)
        failure = trial(iso) if iso else " and ".join(_not_installed(name)) + " not installed"
        if failure is None:
            return iso
        failures.append(f"{name}: {failure}")
    chosen = Isolation("none", (), _NONE_MISSING.format(why="; ".join(failures)))
    warnings.warn(chosen.missing, SandboxWarning, stacklevel=3)
    return chosen


_NONE_MISSING = (
    "proxima.sandbox: no namespace can be made here ({why}), so the code runs as this user "
    "with nothing contained but its limits: it can kill the caller and this user's other "
    "processes, read their environment (/proc/PID/environ), read and write whatever this "
    "user may (the root user: everything, /etc/shadow included, and no process limit), "
    "leave processes behind (setsid), reach Unix sockets; an audit hook in Python refuses "
    "other sockets, which code going around Python escapes. Install bubblewrap "
    "(Debian/Ubuntu: apt-get install bubblewrap) or allow namespaces (user namespaces "
    "for a user other than root: sysctl kernel.unprivileged_userns_clone=1; in a "
    "container: run it with --privileged or a seccomp profile that allows unshare)."
)


def _view() -> list[tuple[str, str]]:
    """What the code sees of the machine, read-only: the system's folders and Python's
    (kind, path) with kind ``dir``, ``file`` (bound when it exists) or ``symlink``."""
    view: list[tuple[str, str]] = []
    for path in ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/etc/alternatives"):
        if os.path.islink(path):  # merged /usr: /bin -> usr/bin
            view.append(("symlink", path))
        elif os.path.exists(path):
            view.append(("dir", path))
    view += [("file", path) for path in ("/etc/ld.so.cache", "/etc/localtime")]
    view += [("dir", path) for path in _python_folders()]
    return view


def _bwrap_args() -> tuple[str, ...]:
    """A root of `_view`, a minimal /dev, the PID namespace's /proc, a private /tmp; every
    namespace new (no network: no interface up), the run killed with its caller."""
    # root makes the namespaces without a user namespace, where it could not become NOBODY
    spaces = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts"]
    spaces += ["--unshare-cgroup-try"] + (["--unshare-user"] if os.geteuid() != 0 else [])
    args = [*spaces, "--die-with-parent", "--dev", "/dev", "--proc", "/proc"]
    args += ["--perms", "1777", "--tmpfs", "/tmp"]
    # the folders above the bound ones open to the code's user (bubblewrap makes them 0700)
    above = {str(parent) for _, path in _view() for parent in Path(path).parents}
    for path in sorted(above - {"/"}):
        args += ["--perms", "0755", "--dir", path]
    for kind, path in _view():
        if kind == "symlink":
            args += ["--symlink", os.readlink(path), path]
        else:
            args += ["--ro-bind-try" if kind == "file" else "--ro-bind", path, path]
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
    # root needs no user namespace to mount; any other user makes one and is root there
    user = () if os.geteuid() == 0 else ("--user", "--map-root-user")
    # the PID namespace's init is the shell of _new_root_script, the code its child (an
    # init ignores the signals it has no handler for: SIGXCPU would not stop the code);
    # --kill-child: the namespace goes when unshare is killed
    spaces = ("--net", "--pid", "--kill-child", "--mount", "--ipc", "--uts")
    return (*user, *spaces)


def _drop_privileges() -> list[str]:
    """setpriv: no capability left, none to gain (no-new-privs); the root user becomes
    `NOBODY` (no supplementary group), which the files' permissions and the process limit
    bind."""
    drop = ["setpriv", "--no-new-privs", "--bounding-set=-all", "--inh-caps=-all"]
    if os.geteuid() == 0:
        drop[1:1] = [f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    return drop


def _new_root_script(folder: str) -> str:
    """A shell script that, in fresh mount and PID namespaces, builds the root `_bwrap_args`
    gives on a tmpfs (``folder/.root`` its mount point: a folder no other path hides),
    switches to it and runs its arguments as its child, exiting with their status (128 +
    N: killed by signal N)."""
    q = shlex.quote
    r = q(folder + "/.root")
    lines = [
        "set -e; umask 022",  # the folders made open to the code's user
        "caller_path=$PATH; PATH=/usr/sbin:/usr/bin:/sbin:/bin",
        f"mkdir {r}",
        f"mount -t tmpfs -o mode=0755,nosuid,nodev tmpfs {r}",
        # /tmp first: Python's folders may lie under it
        f"mkdir {r}/tmp; mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs {r}/tmp",
    ]
    for kind, path in _view():
        p, target = q(path), r + q(path)
        if kind == "symlink":
            lines.append(f"ln -s {q(os.readlink(path))} {target}")
        elif kind == "dir":
            lines.append(f"mkdir -p {target}; mount --bind -o ro {p} {target}")
        else:
            lines.append(
                f"if [ -f {p} ]; then mkdir -p $(dirname {target}); touch {target};"
                f" mount --bind -o ro {p} {target}; fi"
            )
    lines += [
        f"mkdir -p {r}{SANDBOX_DIR} {r}/proc {r}/dev {r}/.old",
        f"mount --bind {q(folder)} {r}{SANDBOX_DIR}",
        f"mount -t proc -o ro,nosuid,nodev,noexec proc {r}/proc",
        f"mount -t tmpfs -o mode=0755,nosuid tmpfs {r}/dev",
        f"for d in {' '.join(_DEVICES)}; do",
        f"  touch {r}/dev/$d; mount --bind /dev/$d {r}/dev/$d",
        "done",
        f"mkdir {r}/dev/shm; mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs {r}/dev/shm",
        f"ln -s /proc/self/fd {r}/dev/fd",
        f"cd {r}; pivot_root . .old; umount -l /.old; rmdir /.old {SANDBOX_DIR}/.root",
        "mount -o remount,bind,ro /",
        f"cd {SANDBOX_DIR}; unset OLDPWD; PATH=$caller_path; set +e",
        '"$@"',
        "exit $?",
    ]
    return "\n".join(lines)


def trial(iso: Isolation) -> str | None:
    """None when ``print('ok')`` runs under ``iso``, else why not (its last line)."""
    with tempfile.TemporaryDirectory(prefix="proxima-sandbox-") as folder:
        iso.prepare(folder)
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


def processes_of(uid: int) -> int:
    """How many processes ``uid`` runs now (RLIMIT_NPROC counts them all)."""
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                count += entry.stat().st_uid == uid
            except OSError:  # ended meanwhile
                pass
    return count
