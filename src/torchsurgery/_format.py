"""Readable sizes for messages, tables and hints."""

from __future__ import annotations


def human_bytes(nbytes: float, *, binary: bool = False) -> str:
    """``1536`` -> ``"1.5 KiB"`` (binary) or ``"1.5 KB"`` (decimal).

    Example:
        >>> human_bytes(1536, binary=True), human_bytes(2_500_000), human_bytes(12)
        ('1.5 KiB', '2.5 MB', '12 B')
    """
    step, units = (1024, ("B", "KiB", "MiB", "GiB", "TiB")) if binary else (1000, ("B", "KB", "MB", "GB", "TB"))
    value = float(nbytes)
    for unit in units[:-1]:
        if value < step:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= step
    return f"{value:.1f} {units[-1]}"
