"""What the benchmarks print about the machine they ran on."""

from __future__ import annotations

import contextlib
import platform


def cpu_name() -> str:
    """The CPU model from /proc/cpuinfo, or the architecture where that is unavailable."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512_vbmi", "avx512vbmi", "avx512_bf16", "avx512_fp16",
          "amx_bf16", "asimd", "sve", "bf16")


def cpu_flags() -> str:
    """The vector features the narrow kernel's build can use, from /proc/cpuinfo ('' where unknown)."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith(("flags", "Features")):
                have = set(line.split(":", 1)[1].split())
                return " ".join(flag for flag in _FLAGS if flag in have)
    return ""


def describe(threads: int) -> str:
    """One line: the CPU model, its vector features and the thread count the figures were taken with."""
    return f"{cpu_name()} [{cpu_flags()}], {threads} threads"
