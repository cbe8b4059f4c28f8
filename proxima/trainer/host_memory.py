"""The memory this machine has left: the CPU's (MemAvailable, or less under a cgroup limit),
this process's resident set and its peak, a CUDA device's free and total bytes."""

from __future__ import annotations

from pathlib import Path

import torch


def cpu_available() -> int | None:
    """Bytes this process may still take: MemAvailable, or less under a cgroup limit."""
    found = []
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                found.append(int(line.split()[1]) * 1024)
    except OSError:
        pass
    for limit, usage in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        (
            "/sys/fs/cgroup/memory/memory.limit_in_bytes",
            "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        ),
    ):
        try:
            cap = Path(limit).read_text().strip()
            if cap != "max" and int(cap) < 2**60:
                found.append(int(cap) - int(Path(usage).read_text()))
                break
        except (OSError, ValueError):
            continue
    return min(found) if found else None


def _status(field: str) -> int:
    """A field of /proc/self/status in bytes, 0 where /proc is missing."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def resident_bytes() -> int:
    """This process's resident memory now (VmRSS), 0 where /proc is missing."""
    return _status("VmRSS")


def peak_bytes(device: torch.device) -> int:
    """The run's measured peak, what the memory plan predicts: the device memory torch
    allocated at most on a CUDA device, else this process's peak resident set (VmHWM; 0
    where /proc is missing)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _status("VmHWM")


def device_available(device: torch.device) -> tuple[int | None, int | None]:
    """(free, total) bytes of a CUDA device; (None, None) elsewhere."""
    if device.type != "cuda":
        return None, None
    free, total = torch.cuda.mem_get_info(device)
    return free, total
