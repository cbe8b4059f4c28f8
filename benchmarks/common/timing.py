"""Clocks and memory readings: medians over repeats after a warm-up, thread settings for a
child process, peak memory of this process (Linux /proc), and the GPU's queue drained before
a clock is read."""

from __future__ import annotations

import os
import platform
import resource
import statistics
import time
from collections.abc import Callable
from pathlib import Path


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """The median of `repeats` timed calls of `fn` after one untimed warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def median(xs: list[float]) -> float:
    """The median, NaN for no values (a cell whose every iteration failed has none)."""
    return statistics.median(xs) if xs else float("nan")


REPO = Path(__file__).resolve().parents[2]


def repo_env() -> dict[str, str]:
    """This environment with the repository first on the import path, so a child process
    (`proxima train` loading a benchmark's class by file) imports `benchmarks` and this
    checkout's `proxima` wherever it runs."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def thread_env(threads: int) -> dict[str, str]:
    """repo_env() with `threads` math threads (OpenMP, MKL) and no tokenizer threads on top."""
    env = repo_env()
    env.update(
        OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false"
    )
    return env


def status_bytes(field: str) -> int:
    """A field of /proc/self/status (VmRSS, VmHWM, ...) in bytes (Linux only)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status (Linux only)")


def reset_peak() -> None:
    """Sets the kernel's high-water mark of resident memory (VmHWM) to the resident size now,
    so the next reading is the peak of what runs in between."""
    Path("/proc/self/clear_refs").write_text("5")


def maxrss_gb() -> float:
    """Peak resident set size of this process, decimal GB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9


def vmhwm_gb() -> float | None:
    """The same from /proc (the high-water mark of this address space only)."""
    try:
        return status_bytes("VmHWM") / 1e9
    except (OSError, RuntimeError):
        return None


def versions() -> dict[str, str]:
    """Python, torch and transformers versions, and TRL's and accelerate's when installed."""
    import torch
    import transformers

    out = {"python": platform.python_version(), "torch": torch.__version__}
    out["transformers"] = transformers.__version__
    for name in ("trl", "accelerate"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = "not installed"
    return out


def sync(device: str) -> None:
    """Wait for the GPU's queued work before a clock is read (a no-op on the CPU)."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()
