"""The one kind of error the command reports as a single line (no traceback)."""

from __future__ import annotations


class CliError(Exception):
    """A mistake in what the user asked for; printed as ``error: <message>``.

    Example:
        >>> str(CliError("no such model directory: ./x"))
        'no such model directory: ./x'
    """


def parse_size(text: str, option: str = "size") -> int:
    """Bytes from ``"512MB"``, ``"2GiB"``, ``"1.5GB"`` or a plain number (``option`` names it in errors).

    Example:
        >>> parse_size("1.5KB"), parse_size("2GiB"), parse_size("100")
        (1500, 2147483648, 100)
    """
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    raw = text.strip().upper().replace(" ", "")
    number = raw.rstrip("KMGTIB")
    unit = raw[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or value < 0:
        raise CliError(f"{option}: cannot read the size {text!r}; write e.g. 512MB, 2GiB or 1000000 (bytes)")
    return int(value * units[unit])
