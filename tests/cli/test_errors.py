"""The command's own error and its reading of sizes."""

from __future__ import annotations

import pytest

from torchsurgery.cli.errors import CliError, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("100", 100), ("0", 0), ("512MB", 512 * 10**6), ("512mb", 512 * 10**6), ("1.5GB", 15 * 10**8),
        ("2GiB", 2 * 2**30), ("64 KiB", 64 * 1024), ("1TB", 10**12), ("3B", 3), (" 7 MiB ", 7 * 2**20),
    ],
)
def test_sizes_in_decimal_and_binary_units(text: str, expected: int) -> None:
    assert parse_size(text, "--budget") == expected


@pytest.mark.parametrize("text", ["lots", "-1MB", "12XB", "", "MB", "1.2.3GB"])
def test_unreadable_sizes_name_the_option_and_the_forms_it_takes(text: str) -> None:
    with pytest.raises(CliError) as refused:
        parse_size(text, "--budget")
    assert str(refused.value) == f"--budget: cannot read the size {text!r}; write e.g. 512MB, 2GiB or 1000000 (bytes)"
    assert not isinstance(refused.value, (ValueError, TypeError))  # the command reports it; nothing else catches it
