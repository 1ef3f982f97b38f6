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
