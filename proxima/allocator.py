"""The memory allocator under the command: tcmalloc when it is installed (Linux).

glibc's malloc keeps much of the memory a PyTorch process frees on the CPU: after the first
large blocks are freed it serves tensors of a few MiB from its heap, where freed blocks lie
between live ones and are neither reused whole nor given back. At SmolLM2-135M with LoRA
(16 rows of 144 tokens) one training micro-batch then takes the process to 6.4 GiB where
tcmalloc (or jemalloc) stays at 4.3 GiB, which is what the memory plan counts (measured in
docs/real-models.md). So `proxima`, started as a command, re-executes itself once with
tcmalloc preloaded (LD_PRELOAD) when the library is installed (`apt install
libtcmalloc-minimal4`), as PyTorch's CPU launcher (`torch.backends.xeon.run_cpu`) and
vLLM's CPU backend advise. `PROXIMA_ALLOCATOR=system` keeps the system's malloc. Imports
nothing from proxima.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

SWITCH = "PROXIMA_ALLOCATOR"  # "system": leave the allocator alone
TRIED = "PROXIMA_ALLOCATOR_TRIED"  # set before re-executing: never twice
LIBRARIES = ("libtcmalloc_minimal.so.4", "libtcmalloc.so.4")
FOLDERS = (
    "/usr/lib/x86_64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/usr/lib64",
    "/usr/lib",
    "/usr/local/lib",
)
KNOWN = ("tcmalloc", "jemalloc", "mimalloc")


def find_tcmalloc(folders: tuple[str, ...] = FOLDERS) -> str | None:
    """The path of an installed tcmalloc library, or None."""
    for folder in folders:
        for name in LIBRARIES:
            path = Path(folder) / name
            if path.is_file():
                return str(path)
    return None


def active() -> str:
    """The allocator this process runs on: tcmalloc, jemalloc or mimalloc when one is
    loaded, else "system malloc" (glibc's on Linux)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return "system malloc"
    return next((name for name in KNOWN if f"lib{name}" in maps), "system malloc")


def preload() -> None:
    """Re-execute this command with tcmalloc preloaded, when it runs on Linux on the system's
    malloc, tcmalloc is installed and `PROXIMA_ALLOCATOR` is not `system`; else return. The
    process keeps its id, arguments and environment (torchrun's workers too)."""
    env = os.environ
    if not sys.platform.startswith("linux") or env.get(SWITCH) == "system" or env.get(TRIED):
        return
    library = find_tcmalloc()
    if library is None or active() != "system malloc":
        return
    preloaded = " ".join(p for p in (library, env.get("LD_PRELOAD", "")) if p)
    argv = getattr(sys, "orig_argv", None) or [sys.executable, *sys.argv]
    try:
        os.execve(sys.executable, argv, {**env, "LD_PRELOAD": preloaded, TRIED: "1"})
    except OSError:  # could not re-execute: go on with the system's malloc
        return
