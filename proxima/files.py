"""Writing results so that a full disk or a file-size limit (`ulimit -f`) never leaves a cut
file under a real name: a folder is written beside its destination and moved in once whole,
and a failed write is recognised whichever library made it (safetensors and torch report
the operating system's error in their own exception types)."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

DISK_FULL = (errno.ENOSPC, errno.EFBIG, errno.EDQUOT)
FULL_DISK_HINT = "a full disk or a file-size limit (ulimit -f) is the usual cause"
# safetensors: "I/O error: File too large (os error 27)"; torch.save, by where its writer
# stopped: "PytorchStreamWriter failed writing file data/0: file write failed" or
# "[enforce fail at inline_container.cc:672] . unexpected pos 576 vs 534"
_OS_ERROR = re.compile(r"\(os error (\d+)\)")
_TORCH_WRITE = ("PytorchStreamWriter", "inline_container.cc")


def write_error(err: BaseException) -> OSError | None:
    """The operating system's error behind a failed write, or None when `err` is not one:
    an OSError as it is, safetensors' SafetensorError and torch's writer error turned into
    an OSError with the errno their text carries (EIO when it carries none)."""
    if isinstance(err, OSError):
        return err
    text = str(err)
    found = _OS_ERROR.search(text)
    if found and type(err).__name__ == "SafetensorError":
        code = int(found.group(1))
        return OSError(code, os.strerror(code))
    if isinstance(err, RuntimeError) and any(mark in text for mark in _TORCH_WRITE):
        return OSError(errno.EIO, text.splitlines()[0])
    return None


def describe_write_error(err: OSError) -> str:
    """`File too large`, or its text, with the usual cause when the disk is full."""
    text = err.strerror or str(err)
    return f"{text}; {FULL_DISK_HINT}" if err.errno in DISK_FULL else text


def write_whole(dest: str | Path, write: Callable[[Path], None]) -> None:
    """`write(tmp)` fills a hidden folder beside `dest`, whose entries then replace those of
    the same names in `dest` (created if missing), one by one; on any error the temporary
    folder is removed and `dest` keeps what it held. Raises what `write` raised."""
    dest = Path(dest)
    made = not dest.exists()
    for left in dest.glob(".writing.tmp-*"):  # a killed write's (its process is gone)
        pid = left.name.rsplit("-", 1)[-1]
        if pid.isdigit() and not pid_running(int(pid)):
            shutil.rmtree(left, ignore_errors=True)
    tmp = dest / f".writing.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        write(tmp)
        for entry in sorted(tmp.iterdir()):
            replace(entry, dest / entry.name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if made:  # the folder made for this write, left as it was: missing
            with contextlib.suppress(OSError):
                dest.rmdir()
        raise
    shutil.rmtree(tmp, ignore_errors=True)


def replace(src: Path, dest: Path) -> None:
    """Move `src` (a file or a folder) to `dest`, replacing what is there. A folder cannot be
    renamed over a full one, so the old one is renamed away first and removed after."""
    if not dest.is_dir() or dest.is_symlink():
        os.replace(src, dest)
        return
    old = dest.with_name(f".{dest.name}.old-{os.getpid()}")
    shutil.rmtree(old, ignore_errors=True)
    os.replace(dest, old)
    try:
        os.replace(src, dest)
    except OSError:
        with contextlib.suppress(OSError):
            os.replace(old, dest)  # put the old one back
        raise
    shutil.rmtree(old, ignore_errors=True)


def pid_running(pid: int) -> bool:
    """Whether process `pid` is alive (a temporary folder named after it is in use)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
